"""MFU of the RL train step with the recipe's settings on an 8B-shaped slice (GPU script).

Runs the real jitted step (chunked fp32-head log-probs, CISPO loss, microbatched gradients,
AdamW with fp32 master weights) on random weights of a preset cut to `--layers` layers (default
llama3.1-8b dims with 4 layers, so params, grads and optimizer state fit one H200), at
`--seq_len` tokens per sequence (default 16,384, the recipe's longest), all devices in one FSDP
mesh (1, n, 1), with the recipe's model settings (recipes.scalerl_8b(): remat policy, attention_impl
'auto' = cuDNN flash attention on GPU, head_precision 'bf16x3', bf16 body, logprob chunk). Reports
the median step time, train tokens/s, achieved model TFLOP/s per device and MFU against the
device's peak dense bf16 FLOP/s (train/flops.py). Model FLOPs per token:

    6 N + 6 L h e (T + 1),   N = L (2 d h e + 2 d k e + 3 d f) + d V

(N the weights used in matmuls, incl. the LM head; the attention term counts the causal half of
QK^T and AV, forward + backward; recomputation under remat is NOT counted, and the bf16x3 head,
three bf16 passes on tensor cores, counts once). With few layers the head is a large share of N
(printed): the slice's MFU is a lower bound of the full 32-layer model's. Goal: >= 40% on one H200.

  source launch/xla_flags_gpu.sh
  python benchmarks/gpu_mfu.py --layers 4 --seq_len 16384 --seqs_per_device 4
  # Each microbatch holds one sequence per device (microbatches = seqs_per_device).
  # CPU smoke run: python benchmarks/gpu_mfu.py --preset tiny-llama --layers 0 --seq_len 64 \
  #     --seqs_per_device 2 --prompt_len 16 --steps 2 --warmup 1 --peak_tflops 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
from flax import nnx

from scalerl_jax.config import recipes
from scalerl_jax.models import Transformer, get_preset, make_mesh, param_shardings
from scalerl_jax.models.layers import resolve_attention_impl
from scalerl_jax.train import (
    OptimizerConfig,
    TrainStep,
    TrainStepConfig,
    init_train_state,
    make_optimizer,
    make_train_step,
    synthetic_train_batch,
    train_step_flops,
)
from scalerl_jax.train.flops import matmul_params, peak_bf16_flops_per_s, train_flops_per_token


def init_params(config, mesh):
    """Random params created directly on their rule shardings (never whole on one device)."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract)
    shardings = param_shardings(abstract_params, mesh)
    create = jax.jit(lambda: nnx.split(Transformer(config, rngs=nnx.Rngs(0)))[1], out_shardings=shardings)
    return graphdef, create()


def main():
    model = recipes.scalerl_8b().model
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", default=model.preset)
    parser.add_argument("--layers", type=int, default=4, help="layers of the slice; 0 = the preset's")
    parser.add_argument("--dtype", default=model.dtype)
    parser.add_argument("--seq_len", type=int, default=16384)
    parser.add_argument("--prompt_len", type=int, default=2048)
    parser.add_argument(
        "--seqs_per_device",
        type=int,
        default=4,
        help="sequences per device per step, one per device in each microbatch",
    )
    parser.add_argument("--remat", default=model.remat_policy)
    parser.add_argument("--attention_impl", default=model.attention_impl)
    parser.add_argument("--head_precision", default=model.head_precision)
    parser.add_argument("--logprob_chunk", type=int, default=model.logprob_chunk)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak_tflops", type=float, default=None, help="per-device peak; default from the device kind")
    args = parser.parse_args()

    devices = jax.devices()
    batch_size = args.seqs_per_device * len(devices)
    overrides = dict(
        dtype=args.dtype,
        remat_policy=args.remat,
        scan_layers=True,
        fp32_head=True,
        attention_impl=args.attention_impl,
        head_precision=args.head_precision,
    )
    if args.layers:
        overrides["num_layers"] = args.layers
    config = get_preset(args.preset, **overrides)
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else peak_bf16_flops_per_s(devices[0].device_kind)
    platform = devices[0].platform
    head_share = 6 * config.hidden_size * config.vocab_size / train_flops_per_token(config, args.seq_len)
    print(
        f"jax {jax.__version__}; {len(devices)} x {devices[0].device_kind}; peak bf16 "
        f"{peak_flops and peak_flops / 1e12} TFLOP/s per device; {args.preset} with {config.num_layers} "
        f"layers ({config.num_params():,} params, {matmul_params(config):,} in matmuls), dtype {args.dtype}, "
        f"remat {args.remat}, attention {args.attention_impl} -> {resolve_attention_impl(config, platform)} "
        f"on {platform}, head {args.head_precision}; {batch_size} x {args.seq_len} tokens per step in "
        f"{args.seqs_per_device} microbatches; LM head = {head_share:.0%} of model FLOPs"
    )

    mesh = make_mesh((1, -1, 1), devices=devices)
    graphdef, params = init_params(config, mesh)
    optimizer = make_optimizer(OptimizerConfig())
    state, shardings = init_train_state(params, optimizer, mesh=mesh)
    step = make_train_step(
        graphdef,
        optimizer,
        TrainStepConfig(num_microbatches=args.seqs_per_device, logprob_chunk_size=args.logprob_chunk),
        mesh=mesh,
        state_shardings=shardings,
    )
    assert isinstance(step, TrainStep)  # sort_by_length is off: one jitted program to lower
    batch = synthetic_train_batch(
        batch_size=batch_size,
        seq_len=args.seq_len,
        prompt_len=args.prompt_len,
        vocab_size=config.vocab_size,
        group_size=2,
    )
    batch = jax.device_put(batch, step.batch_sharding)

    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    print(f"compile {time.perf_counter() - start:.1f} s")
    memory = compiled.memory_analysis()
    if memory is not None:
        total = sum(
            getattr(memory, f, 0) for f in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")
        ) - getattr(memory, "alias_size_in_bytes", 0)
        print(
            f"per-device memory (XLA): temp {memory.temp_size_in_bytes / 2**30:.2f} GiB, "
            f"arguments {memory.argument_size_in_bytes / 2**30:.2f} GiB, total ~{total / 2**30:.2f} GiB"
        )

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
    print(
        f"step {median * 1e3:.1f} ms (median of {len(times)}, min {min(times) * 1e3:.1f}); "
        f"{tokens / median:,.0f} train tokens/s; model FLOPs/step {flops:.3e}"
    )
    mfu = f"{1e14 * tflops_per_device / peak_flops:.1f}% (goal >= 40%)" if peak_flops else "n/a (pass --peak_tflops)"
    print(f"achieved {tflops_per_device:.1f} TFLOP/s per device; MFU {mfu}")
    print(f"loss {float(metrics['train/loss']):.4f}, grad norm {float(metrics['train/grad_norm']):.3f}")


if __name__ == "__main__":
    main()
