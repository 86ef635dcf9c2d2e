#!/usr/bin/env bash
# Runs the RL job on this host: one process with every local accelerator, or N cooperating
# processes (jax.distributed, multi-controller) for multi-process development and tests.
#
# Usage: launch/local.sh [N] CONFIG WORKDIR [--config.overrides...]
#   launch/local.sh configs/tiny.py runs/tiny                      one process (all local GPUs)
#   CPU_DEVICES=2 launch/local.sh 2 configs/tiny.py runs/tiny      2 CPU processes x 2 devices
# With a leading integer N, starts N processes with SCALERL_DISTRIBUTED=1 and an explicit
# coordinator (a free port on 127.0.0.1), process count and id (see
# scalerl_jax/distributed/launch_env.py); prefixes each output line with "[pI] "; waits for all
# and exits non-zero if any exits non-zero. Once one process fails, the others get GRACE_S
# seconds (default 90) to notice and stop before they are terminated, so a peer hung in a
# collective cannot keep the launcher alive. Ctrl-C or SIGTERM passes SIGTERM to every process:
# the leader stops them all at one step with a checkpoint (the same command resumes); whatever is
# still running STOP_S seconds later (default 600) is killed; the launcher exits 130 / 143.
#
# Environment: CPU_DEVICES=D runs on the CPU (JAX_PLATFORMS=cpu) with D devices per process;
# GRACE_S as above; PYTHON (default REPO/.venv/bin/python); SCALERL_MAIN_MODULE, the module run
# with `python -m` (default scalerl_jax.main; tests substitute a small one).
# On GPUs, install with the CUDA plugin first: .venv/bin/pip install -c constraints.txt -e '.[cuda]'.
set -euo pipefail
USAGE="usage: launch/local.sh [N] CONFIG WORKDIR [overrides...]"
NUM_PROCESSES=
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then
  NUM_PROCESSES=$1
  shift
  (( NUM_PROCESSES >= 1 )) || { echo "local.sh: N must be at least 1, got $NUM_PROCESSES" >&2; exit 2; }
fi
CONFIG=${1:?$USAGE}
WORKDIR=${2:?$USAGE}
shift 2
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
MODULE=${SCALERL_MAIN_MODULE:-scalerl_jax.main}
GRACE_S=${GRACE_S:-90}
STOP_S=${STOP_S:-600}
if [[ -n "${CPU_DEVICES:-}" ]]; then
  export JAX_PLATFORMS=cpu
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${CPU_DEVICES}"
elif command -v nvidia-smi >/dev/null 2>&1; then
  source "$REPO/launch/xla_flags_gpu.sh"
fi
COMMAND=("$PYTHON" -u -m "$MODULE" --config="$CONFIG" --workdir="$WORKDIR" "$@")
if [[ -z "$NUM_PROCESSES" ]]; then
  exec "${COMMAND[@]}"
fi

# A port that is free now (the OS picks it; process 0 binds it moments later).
PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export SCALERL_DISTRIBUTED=1 SCALERL_COORDINATOR="127.0.0.1:$PORT" SCALERL_NUM_PROCESSES="$NUM_PROCESSES"

pids=()
for ((i = 0; i < NUM_PROCESSES; i++)); do
  # The process's own pid goes into pids (its output passes through sed to get the prefix).
  SCALERL_PROCESS_ID=$i "${COMMAND[@]}" > >(sed -u "s/^/[p$i] /") 2>&1 &
  pids[i]=$!
done

running() {  # pids of the processes not yet reaped
  local pid
  for pid in "${pids[@]}"; do
    if [[ -n "$pid" ]]; then echo "$pid"; fi
  done
}

stop_all() {  # TERM, then KILL whatever is left ${1:-10} s later
  local left
  left=$(running)
  [[ -z "$left" ]] && return 0
  kill -TERM $left 2>/dev/null || true
  for _ in $(seq "${1:-10}"); do
    sleep 1
    left=$(for pid in $left; do if kill -0 "$pid" 2>/dev/null; then echo "$pid"; fi; done)
    [[ -z "$left" ]] && return 0
  done
  kill -KILL $left 2>/dev/null || true
}

on_signal() {  # $1: signal name, $2: exit status
  echo "local.sh: SIG$1 received: SIGTERM to every process (the run stops at one step with a checkpoint; killed after ${STOP_S} s)" >&2
  stop_all "$STOP_S"
  exit "$2"
}
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM

status=0
deadline=
while [[ -n "$(running)" ]]; do
  for i in "${!pids[@]}"; do
    pid=${pids[i]}
    [[ -z "$pid" ]] && continue
    kill -0 "$pid" 2>/dev/null && continue
    code=0
    wait "$pid" || code=$?
    pids[i]=
    if (( code != 0 )); then
      echo "local.sh: process $i exited with status $code" >&2
      (( status == 0 )) && status=$code
      [[ -z "$deadline" ]] && deadline=$((SECONDS + GRACE_S)) &&
        echo "local.sh: stopping the others in ${GRACE_S} s unless they exit first" >&2
    fi
  done
  if [[ -n "$deadline" ]] && (( SECONDS >= deadline )) && [[ -n "$(running)" ]]; then
    echo "local.sh: terminating processes still running $GRACE_S s after a failure: $(running | tr '\n' ' ')" >&2
    stop_all
    for i in "${!pids[@]}"; do
      [[ -n "${pids[i]}" ]] && { wait "${pids[i]}" 2>/dev/null || true; pids[i]=; }
    done
  fi
  sleep 1
done
wait  # the output filters
exit "$status"
