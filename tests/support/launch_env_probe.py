"""Test target for `launch/tpu.sh` (SCALERL_MAIN_MODULE=launch_env_probe, tests/support on PYTHONPATH):
prints the `jax.distributed.initialize` arguments this process would take, and its command line."""

import json
import os
import sys

from scalerl_jax.distributed.launch_env import distributed_init_kwargs

print("PROBE", json.dumps({"kwargs": distributed_init_kwargs(os.environ), "argv": sys.argv[1:]}))
