#!/usr/bin/env bash
# ScaleRL on a Cloud TPU VM slice: the same command on every TPU VM (worker) of the slice, one
# process per worker holding all of its chips (jax.distributed multi-controller: a v5p-128 slice is
# 16 workers x 4 chips = 16 processes, 64 devices).
# Usage, from a machine with gcloud:
#   gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all --command="cd scalerl_jax && \
#     launch/tpu.sh configs/scalerl_8b.py /mnt/shared/runs/scalerl_8b --config.model.checkpoint=/mnt/shared/models/Llama-3.1-8B"
# Install once on every worker (libtpu from PyPI):
#   python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e '.[tpu]'
# WORKDIR, the checkpoint and the data must be on storage every worker sees (e.g. a Filestore or
# gcsfuse mount): process 0 writes the run's outputs, and every trainer process writes its part of
# each checkpoint. Before launching, check that every program fits the slice's HBM without a TPU:
#   python -m scalerl_jax.cli.compile_check --config=configs/scalerl_8b.py --target=v5p:4x4x4 [overrides]
# A single-host TPU VM (v5e-8, v6e-8) needs no launcher: run main as on one GPU node.
# PYTHON (default REPO/.venv/bin/python) and SCALERL_MAIN_MODULE (default scalerl_jax.main) as in
# launch/local.sh.
set -euo pipefail

CONFIG=${1:?usage: launch/tpu.sh CONFIG WORKDIR [overrides...]}
WORKDIR=${2:?usage: launch/tpu.sh CONFIG WORKDIR [overrides...]}
shift 2

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
MODULE=${SCALERL_MAIN_MODULE:-scalerl_jax.main}

# `auto`: jax.distributed.initialize() reads the coordinator, the number of workers and this
# worker's id from the TPU metadata (scalerl_jax/distributed/launch_env.py); each process logs
# "process i of N, local devices [...], global device count M".
export SCALERL_DISTRIBUTED=auto
exec "$PYTHON" -u -m "$MODULE" --config="$CONFIG" --workdir="$WORKDIR" "$@"
