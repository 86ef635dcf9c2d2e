"""MFU of the RL train step on the accelerators present (ready to run when a GPU is lent).

Runs the real jitted step (chunked fp32-head log-probs, CISPO loss, microbatched gradients,
AdamW with fp32 master weights) on random weights of a preset, at `--seq_len` tokens per
sequence (default 8,192), all devices in one FSDP mesh (1, n, 1). Reports the median step time,
train tokens/s, achieved model TFLOP/s per device and MFU against the device's peak dense bf16
FLOP/s. Model FLOPs per token (scalerl_jax/train/flops.py):

    6 N + 6 L h e (T + 1),   N = L (2 d h e + 2 d k e + 3 d f) + d V

(N the weights used in matmuls, incl. the LM head; the attention term counts the causal half of
QK^T and AV, forward + backward; recomputation under remat is NOT counted).

`--preset auto` takes llama3.1-8b when its training state (about 20 bytes per parameter: bf16
params and grads, fp32 master, fp32 Adam moments, fp32 grad accumulator) fits in 85% of the
devices' memory, else llama3.2-1b (one H100/H200). Target: >= 45% MFU on one H100/H200.

  source launch/xla_flags_gpu.sh
  python benchmarks/gpu_mfu.py --preset auto --seq_len 8192 --seqs_per_device 8
  # Each microbatch holds one sequence per device (microbatches = seqs_per_device). If memory
  # runs out (e.g. 8B on 80 GB cards), try --remat dots_with_no_batch_dims or --remat full.
  # CPU smoke run: python benchmarks/gpu_mfu.py --preset tiny-llama --seq_len 64 \
  #     --seqs_per_device 2 --prompt_len 16 --attention_impl xla --steps 2 --peak_tflops 1
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from scalerl_jax.models import Transformer, get_preset, make_mesh, param_shardings
from scalerl_jax.train import (OptimizerConfig, TrainStepConfig, init_train_state, make_optimizer,
                               make_train_step, synthetic_train_batch, train_step_flops)

# Peak dense (no sparsity) bf16 tensor-core TFLOP/s by device kind substring, from NVIDIA's
# data sheets; the first match wins, so more specific names come first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.1),
)
BYTES_PER_PARAM_TRAINING = 2 + 2 + 4 + 8 + 4  # params, grads, fp32 master, Adam m+v, accumulator


def peak_tflops(device: jax.Device) -> float | None:
  kind = getattr(device, "device_kind", "")
  for name, tflops in PEAK_BF16_TFLOPS:
    if name in kind:
      return tflops
  return None


def device_memory_bytes(device: jax.Device) -> int | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return None if not stats else stats.get("bytes_limit")


def choose_preset(requested: str, devices) -> str:
  if requested != "auto":
    return requested
  memory = device_memory_bytes(devices[0])
  need = BYTES_PER_PARAM_TRAINING * get_preset("llama3.1-8b").num_params() / len(devices)
  if memory is not None and need < 0.85 * memory:
    return "llama3.1-8b"
  return "llama3.2-1b"


def init_params(config, mesh):
  """Random params created directly on their rule shardings (never whole on one device)."""
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(abstract)
  shardings = param_shardings(abstract_params, mesh)
  create = jax.jit(lambda: nnx.split(Transformer(config, rngs=nnx.Rngs(0)))[1],
                   out_shardings=shardings)
  return graphdef, create()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="auto")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--seq_len", type=int, default=8192)
  parser.add_argument("--prompt_len", type=int, default=1024)
  parser.add_argument("--seqs_per_device", type=int, default=8,
                      help="sequences per device per step, one per device in each microbatch")
  parser.add_argument("--remat", default="none")
  parser.add_argument("--attention_impl", default="cudnn")
  parser.add_argument("--logprob_chunk", type=int, default=1024)
  parser.add_argument("--steps", type=int, default=8, help="timed steps")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--peak_tflops", type=float, default=None,
                      help="per-device peak; default from the device kind")
  args = parser.parse_args()

  devices = jax.devices()
  batch_size = args.seqs_per_device * len(devices)
  preset = choose_preset(args.preset, devices)
  config = get_preset(preset, dtype=args.dtype, remat_policy=args.remat, scan_layers=True,
                      attention_impl=args.attention_impl, fp32_head=True)
  peak = args.peak_tflops or peak_tflops(devices[0])
  print(f"jax {jax.__version__}; {len(devices)} x {devices[0].device_kind}; peak bf16 "
        f"{peak} TFLOP/s per device; preset {preset} ({config.num_params():,} params), "
        f"dtype {args.dtype}, remat {args.remat}, attention {args.attention_impl}; "
        f"{batch_size} x {args.seq_len} tokens per step in {args.seqs_per_device} microbatches")

  mesh = make_mesh((1, -1, 1), devices=devices)
  graphdef, params = init_params(config, mesh)
  optimizer = make_optimizer(OptimizerConfig())
  state, shardings = init_train_state(params, optimizer, mesh=mesh)
  step = make_train_step(graphdef, optimizer,
                         TrainStepConfig(num_microbatches=args.seqs_per_device,
                                         logprob_chunk_size=args.logprob_chunk),
                         mesh=mesh, state_shardings=shardings)
  batch = synthetic_train_batch(batch_size=batch_size, seq_len=args.seq_len,
                                prompt_len=args.prompt_len, vocab_size=config.vocab_size,
                                group_size=2)
  batch = jax.device_put(batch, step.batch_sharding)

  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  print(f"compile {time.perf_counter() - start:.1f} s")
  memory = compiled.memory_analysis()
  if memory is not None:
    total = sum(getattr(memory, f, 0) for f in ("argument_size_in_bytes", "output_size_in_bytes",
                                                 "temp_size_in_bytes")) - getattr(
                                                     memory, "alias_size_in_bytes", 0)
    print(f"per-device memory (XLA): temp {memory.temp_size_in_bytes / 2**30:.2f} GiB, "
          f"arguments {memory.argument_size_in_bytes / 2**30:.2f} GiB, total ~{total / 2**30:.2f} GiB")

  for _ in range(args.warmup):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(args.steps):
    begin = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - begin)
  if step.num_traces != 1:
    print(f"WARNING: the step was traced {step.num_traces} times")
  if float(metrics["train/finite"]) != 1.0:
    print("WARNING: non-finite loss or gradient")

  median = statistics.median(times)
  flops = train_step_flops(config, batch_size, args.seq_len)
  tflops_per_device = flops / median / len(devices) / 1e12
  tokens = batch_size * args.seq_len
  print(f"step {median * 1e3:.1f} ms (median of {len(times)}, min {min(times) * 1e3:.1f}); "
        f"{tokens / median:,.0f} train tokens/s; model FLOPs/step {flops:.3e}")
  mfu = f"{100 * tflops_per_device / peak:.1f}%" if peak else "n/a (pass --peak_tflops)"
  print(f"achieved {tflops_per_device:.1f} TFLOP/s per device; MFU {mfu}")
  print(f"loss {float(metrics['train/loss']):.4f}, grad norm {float(metrics['train/grad_norm']):.3f}")


if __name__ == "__main__":
  main()
