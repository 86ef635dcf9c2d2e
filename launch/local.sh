#!/usr/bin/env bash
# One host, one process, every local accelerator (or N fake CPU devices with CPU_DEVICES=N).
# Usage: launch/local.sh configs/tiny.py runs/tiny [--config.overrides...]
# On GPUs, install with the CUDA plugin first: .venv/bin/pip install -e '.[cuda]'.
set -euo pipefail
CONFIG=${1:?usage: launch/local.sh CONFIG WORKDIR [overrides...]}
WORKDIR=${2:?usage: launch/local.sh CONFIG WORKDIR [overrides...]}
shift 2
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n "${CPU_DEVICES:-}" ]]; then
  export JAX_PLATFORMS=cpu
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${CPU_DEVICES}"
elif command -v nvidia-smi >/dev/null 2>&1; then
  source "$REPO/launch/xla_flags_gpu.sh"
fi
exec "$REPO/.venv/bin/python" -m scalerl_jax.main --config="$CONFIG" --workdir="$WORKDIR" "$@"
