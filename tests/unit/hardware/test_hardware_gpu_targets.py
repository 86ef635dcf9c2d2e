"""The packaged GPU target descriptions are accepted by XLA: a deviceless CUDA topology built from each
describes 8 devices of the expected kind, and a sharded jit compiles against them.

Needs a Python with jax[cuda12] (the CUDA plugin compiles; no GPU is used): $SCALERL_CUDA_PYTHON, by
default /work/gpuvenv/bin/python. Skipped where there is none."""

import json
import os
import pathlib
import subprocess

import pytest

from scalerl_jax.hardware import facts as hw

CUDA_PYTHON = os.environ.get("SCALERL_CUDA_PYTHON", "/work/gpuvenv/bin/python")

# Run by CUDA_PYTHON with the target description's path: builds an 8-GPU topology from it, compiles
# tanh(a @ b).sum() with a [1024, 512] bf16 sharded over the 8 devices by rows and b [512, 256] bf16
# replicated, and prints what the devices report and the compiled memory analysis as JSON.
CHECK = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

topology = topologies.get_topology_desc(platform="cuda", topology="1x1x8", target_config=open(sys.argv[1]).read())
devices = topology.devices
mesh = Mesh(np.array(devices), ("x",))
a = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("x", None)))
b = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
stats = jax.jit(lambda a, b: jnp.tanh(a @ b).sum()).lower(a, b).compile().memory_analysis()
print(json.dumps({
    "kinds": sorted({d.device_kind for d in devices}),
    "platforms": sorted({d.platform for d in devices}),
    "count": len(devices),
    "argument_bytes": stats.argument_size_in_bytes,
    "output_bytes": stats.output_size_in_bytes,
}))
"""


def _cuda_python_or_skip() -> str:
    if not pathlib.Path(CUDA_PYTHON).exists():
        pytest.skip(f"no jax[cuda12] Python at {CUDA_PYTHON} (set SCALERL_CUDA_PYTHON)")
    probe = subprocess.run([CUDA_PYTHON, "-c", "import jax_cuda12_plugin"], capture_output=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"{CUDA_PYTHON} cannot import jax_cuda12_plugin (jax[cuda12] not installed there)")
    return CUDA_PYTHON


@pytest.mark.slow
@pytest.mark.parametrize("target, kind", [("h100", "NVIDIA H100 80GB HBM3"), ("h200", "NVIDIA H200")])
def test_gpu_target_description_compiles_deviceless(target, kind, tmp_path):
    python = _cuda_python_or_skip()
    config = tmp_path / "target.txtpb"
    config.write_text(hw.gpu_target_config_text(hw.facts_for_target(target)))
    # JAX_PLATFORMS=cpu: the compile must not look for a GPU.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [python, "-c", CHECK, str(config)], capture_output=True, text=True, timeout=600, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["kinds"] == [kind] and report["platforms"] == ["gpu"] and report["count"] == 8
    assert hw.facts_for_device_kind(kind) is hw.facts_for_target(target)
    # Per device: a's row shard 1024 / 8 x 512 x 2 B = 131,072 B plus the replicated b 512 x 256 x 2 B
    # = 262,144 B; the output is one bf16 scalar, 2 B.
    assert report["argument_bytes"] == 131_072 + 262_144
    assert report["output_bytes"] == 2
