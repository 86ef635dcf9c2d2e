"""CPU speed of the jitted train step: remat policies side by side, scan vs unrolled compile time.

Part 1 (throughput): one small Llama-shaped model, the same batch, remat 'none' (baseline) vs
the other policies; median step time over repeats after warm-up; prints train tokens/s,
achieved model GFLOP/s (scalerl_jax.train.flops) and the ratio to the baseline.
Part 2 (compile): a deeper model, layers unrolled (baseline) vs `lax.scan` over stacked layers;
trace + lower + compile wall time of the whole step (median over repeats) and the ratio.

  .venv/bin/python benchmarks/bench_train_step.py [--seq_len 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
from flax import nnx

from scalerl_jax.models import Transformer, get_preset
from scalerl_jax.train import (
    OptimizerConfig,
    TrainStep,
    TrainStepConfig,
    create_train_state,
    make_optimizer,
    make_train_step,
    synthetic_train_batch,
    train_step_flops,
)


def small_config(args, **overrides):
    fields = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=args.hidden // 4,
        max_position_embeddings=max(512, args.seq_len),
    )
    return get_preset("tiny-llama", **{**fields, **overrides})


def build(config, args):
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    optimizer = make_optimizer(OptimizerConfig())
    step = make_train_step(
        graphdef, optimizer, TrainStepConfig(num_microbatches=args.microbatches, logprob_chunk_size=128)
    )
    batch = synthetic_train_batch(
        batch_size=args.batch,
        seq_len=args.seq_len,
        prompt_len=args.seq_len // 4,
        vocab_size=config.vocab_size,
        group_size=2,
    )
    batch = jax.device_put(batch)
    assert isinstance(step, TrainStep)  # sort_by_length is off
    return step, create_train_state(params, optimizer), batch


def interleaved_step_seconds(configs, args) -> list[list[float]]:
    """Step wall times per config, measured round-robin (one step of each per round) so that a
    change of machine load hits every config alike."""
    runs = [build(config, args) for config in configs]
    steps = [step for step, _, _ in runs]
    states = [state for _, state, _ in runs]
    batches = [batch for _, _, batch in runs]
    for i, (step, batch) in enumerate(zip(steps, batches)):
        for _ in range(args.warmup):
            states[i], metrics = step(states[i], batch)
        jax.block_until_ready(metrics)
    times: list[list[float]] = [[] for _ in configs]
    for _ in range(args.repeats):
        for i, (step, batch) in enumerate(zip(steps, batches)):
            start = time.perf_counter()
            states[i], metrics = step(states[i], batch)
            jax.block_until_ready(metrics)
            times[i].append(time.perf_counter() - start)
    assert all(step.num_traces == 1 for step in steps)  # no recompilation in steady state
    return times


def compile_seconds(config, args) -> list[float]:
    times = []
    for _ in range(args.compile_repeats):
        step, state, batch = build(config, args)
        start = time.perf_counter()
        step.lower(state, batch).compile()
        times.append(time.perf_counter() - start)
    return times


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--remat",
        default="none,full,dots_with_no_batch_dims",
        help="comma-separated policies; the first is the baseline",
    )
    parser.add_argument("--compile_layers", type=int, default=16)
    parser.add_argument("--compile_repeats", type=int, default=2)
    args = parser.parse_args()
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform} x{len(jax.devices())}; "
        f"batch {args.batch} x {args.seq_len} tokens, {args.microbatches} microbatches"
    )

    tokens = args.batch * args.seq_len
    print(f"\n[throughput] hidden {args.hidden}, {args.layers} layers, scan over layers")
    policies = args.remat.split(",")
    configs = [small_config(args, remat_policy=policy) for policy in policies]
    all_times = interleaved_step_seconds(configs, args)
    baseline = statistics.median(all_times[0])
    for policy, config, times in zip(policies, configs, all_times):
        median = statistics.median(times)
        gflops = train_step_flops(config, args.batch, args.seq_len) / median / 1e9
        print(
            f"  remat={policy:<26} {median * 1e3:8.1f} ms/step  {tokens / median:9.0f} tokens/s  "
            f"{gflops:6.2f} model GFLOP/s  speed vs {policies[0]}: {baseline / median:.2f}x"
        )

    print(f"\n[compile] {args.compile_layers} layers, trace+lower+compile of the whole step")
    unrolled = statistics.median(
        compile_seconds(small_config(args, num_layers=args.compile_layers, scan_layers=False), args)
    )
    scanned = statistics.median(
        compile_seconds(small_config(args, num_layers=args.compile_layers, scan_layers=True), args)
    )
    print(f"  unrolled {unrolled:7.2f} s   scan {scanned:7.2f} s   scan speed-up {unrolled / scanned:.2f}x")


if __name__ == "__main__":
    main()
