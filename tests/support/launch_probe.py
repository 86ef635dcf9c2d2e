"""Test target for tests/e2e/test_launch_processes.py: start JAX as `main` does, then print what this process sees.

Run as `python -m launch_probe --config=CONFIG --workdir=DIR` (tests/support on PYTHONPATH), alone or
through `launch/local.sh N` with SCALERL_MAIN_MODULE=launch_probe. Prints one line
`PROBE {json}` with the process index and count, local and global device counts, a value gathered
from every process over the CPU collectives, and the options JAX would hand the CUDA plugin
(`visible_devices` there is what restricts a GPU process to some of its node's GPUs).
PROBE_INIT=jax_default replaces `main.start` with JAX's own detection (`jax.distributed.initialize()`).
PROBE_FAIL=crash|exit makes process 1 die (SIGKILL) or exit with status 3 after start-up, while the
others wait for a key that never comes (bounded at 110 s), as a peer blocked in a collective would.
"""

import json
import os
import signal
import sys

import jax
import numpy as np
from absl import app
from jax._src import distributed, xla_bridge
from jax.experimental import multihost_utils

from scalerl_jax.cli import train as scalerl_main

NEVER_SET_KEY_WAIT_MS = 110_000


def _start(config) -> None:
    if os.environ.get("PROBE_INIT") == "jax_default":
        jax.config.update("jax_num_cpu_devices", config.mesh.cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(initialization_timeout=60)
    else:
        scalerl_main.start(config)


def probe(argv):
    del argv
    _start(scalerl_main._CONFIG.value)
    gathered = multihost_utils.process_allgather(np.array([10 + jax.process_index()], np.int32))
    report = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": len(jax.local_devices()),
        "global_devices": jax.device_count(),
        "gathered": np.asarray(gathered).ravel().tolist(),
        "cuda_options": xla_bridge._options_from_jax_configs("cuda"),
    }
    print("PROBE " + json.dumps(report), flush=True)
    failure = os.environ.get("PROBE_FAIL")
    if failure and jax.process_index() == 1:
        if failure == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(3)
    if failure:
        client = distributed.global_state.client
        assert client is not None  # _start initialized jax.distributed
        client.blocking_key_value_get("probe/never_set", NEVER_SET_KEY_WAIT_MS)


if __name__ == "__main__":
    app.run(probe)
