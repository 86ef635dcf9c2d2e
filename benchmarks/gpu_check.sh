#!/usr/bin/env bash
# GPU check of the long-sequence paths on one H200, within 10 minutes. Stages, each under `timeout`:
#   env            jax devices and nvidia-smi
#   paged_attention Pallas paged decode attention vs an XLA reference on random paged inputs (8B heads, 16k)
#   decode_xla     8B-shaped decode, 64 slots, max_len 16384, decode_kernel xla: HBM fraction on weights + live KV
#   decode_pallas  the same with decode_kernel pallas
#   mfu            train-step MFU with the recipe's settings on an 8B-shaped slice (4 layers)
#   decode_scaling benchmarks/bench_decode_scaling.py (step time vs max_len at the same live length)
# A failing stage is reported loudly (FAILED, its log's tail) and the next one runs; the script exits 1
# if any stage failed. Logs, JSON results and summary.txt go to OUT_DIR.
#
#   benchmarks/gpu_check.sh [OUT_DIR]                      # default: $OUT, else ./gpu_check_out
#   PYTHON=/path/to/python benchmarks/gpu_check.sh DIR      # a python with jax[cuda] (default: python)
#   GPU_CHECK_SMOKE=1 benchmarks/gpu_check.sh DIR           # CPU smoke run: the same stages at tiny shapes
# GPU_CHECK_BUDGET_S (default 570) caps the whole run: a stage gets min(its limit, time left) and is
# skipped (and counted as failed) when under 15 s remain.
set -u

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python="${PYTHON:-python}"
smoke="${GPU_CHECK_SMOKE:-0}"
budget="${GPU_CHECK_BUDGET_S:-570}"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if [[ "$smoke" != 1 ]]; then
  source launch/xla_flags_gpu.sh
fi

started=$(date +%s)
stages=()
failed=()
summary="$out/summary.txt"
: > "$summary"

# stage NAME LIMIT_S COMMAND...: run COMMAND under timeout, log to OUT/NAME.log, record the result.
stage() {
  local name=$1 limit=$2
  shift 2
  stages+=("$name")
  local left=$((budget - ($(date +%s) - started)))
  if ((left < 15)); then
    echo "!!! STAGE $name SKIPPED: ${left} s of the ${budget} s budget left" | tee -a "$summary"
    failed+=("$name")
    return
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (timeout ${limit} s): $*"
  local begin=$(date +%s) rc=0
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1 || rc=$?
  local seconds=$(($(date +%s) - begin))
  tail -n 4 "$out/$name.log"
  if ((rc == 0)); then
    echo "--- $name ok (${seconds} s)" | tee -a "$summary"
  else
    local why="exit $rc"
    ((rc == 124 || rc == 137)) && why="timed out after ${limit} s"
    echo "!!! STAGE $name FAILED ($why, ${seconds} s); log: $out/$name.log" | tee -a "$summary"
    failed+=("$name")
  fi
}

if [[ "$smoke" == 1 ]]; then
  stage env 60 "$python" -c "import jax; print(jax.__version__, jax.devices())"
  stage paged_attention 120 "$python" benchmarks/gpu_paged_check.py --slots 4 --max_len 64 --page_size 4 \
    --heads 4 --kv_heads 2 --head_dim 16 --pages_per_block 2 --dtype float32 --repeats 1
  for kernel in xla pallas; do  # on CPU the engine runs the Pallas kernel in interpret mode
    stage "decode_$kernel" 120 "$python" benchmarks/gpu_decode.py --preset tiny-llama --slots 4 --prompt_len 8 \
      --max_len 64 --page_size 4 --chunk_size 4 --chunks 2 --decode_kernel "$kernel" --peak_tbs 0.05 \
      --out "$out/decode_$kernel.json"
  done
  stage mfu 120 "$python" benchmarks/gpu_mfu.py --preset tiny-llama --layers 0 --seq_len 64 \
    --seqs_per_device 2 --prompt_len 16 --steps 2 --warmup 1 --peak_tflops 1
  stage decode_scaling 240 "$python" benchmarks/bench_decode_scaling.py --repeats 1 --skip_generation
else
  stage env 30 bash -c "nvidia-smi; \"$python\" -c 'import jax; print(jax.__version__, jax.devices())'"
  stage paged_attention 90 "$python" benchmarks/gpu_paged_check.py
  for kernel in xla pallas; do
    stage "decode_$kernel" 140 "$python" benchmarks/gpu_decode.py --slots 64 --max_len 16384 --prompt_len 7936 \
      --page_size 16 --decode_kernel "$kernel" --out "$out/decode_$kernel.json"
  done
  stage mfu 120 "$python" benchmarks/gpu_mfu.py --layers 4 --seq_len 16384 --seqs_per_device 4
  stage decode_scaling 80 "$python" benchmarks/bench_decode_scaling.py
fi

echo "=== results"
for name in "${stages[@]}"; do
  [[ -f "$out/$name.log" ]] || continue
  grep -E "max \||xla / pallas|HBM fraction|MFU|live window|baseline\)|t\(4096\)" "$out/$name.log" |
    sed "s/^/$name: /" | tee -a "$summary"
done
echo "=== $(($(date +%s) - started)) s in all; failed stages: ${failed[*]:-none}" | tee -a "$summary"
((${#failed[@]} == 0))
