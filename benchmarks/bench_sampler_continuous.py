"""Continuous vs static batching on long-tailed completion lengths (same engine, same process).

Completion lengths are drawn lognormal (as RL completion lengths are: most short, a few very
long) and imposed as per-request budgets (a random model has no natural stopping point).
- continuous: every request queued at once; finished slots are refilled at each chunk boundary.
- static: requests go in groups of `num_slots`; a group is prefilled together and the next group
  starts only when its longest member is done (pad-to-longest: short members' slots idle).
Both use the same compiled engine; the measure is generated tokens per second of wall time,
median over `--repeats` runs, after a warm-up that compiles every shape.

  .venv/bin/python benchmarks/bench_sampler_continuous.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from flax import nnx

from scalerl_jax.models import Transformer, get_preset
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig, Request


def make_requests(args: argparse.Namespace, vocab: int) -> list[Request]:
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(
        np.round(rng.lognormal(np.log(args.median_len), args.sigma, args.num_requests)), 1, args.max_new
    ).astype(int)
    prompts = rng.integers(0, vocab, (args.num_requests, args.prompt_len))
    return [Request(i, prompts[i].tolist(), int(lengths[i]), seed=i, temperature=1.0) for i in range(args.num_requests)]


def run_continuous(engine: Engine, params, requests: list[Request]) -> ContinuousBatcher:
    batcher = ContinuousBatcher(engine, params)
    for request in requests:
        batcher.add_request(request)
    batcher.drain()
    return batcher


def run_static(engine: Engine, params, requests: list[Request]) -> ContinuousBatcher:
    batcher = ContinuousBatcher(engine, params)
    slots = engine.config.num_slots
    for start in range(0, len(requests), slots):
        for request in requests[start : start + slots]:
            batcher.add_request(request)
        batcher.drain()
    return batcher


def tokens_per_second(run, engine, params, requests, repeats: int) -> tuple[float, int, float]:
    """Median tokens/s, tokens generated, and slot utilization (tokens / slot-steps run)."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        stats = run(engine, params, requests).stats()
        tokens = int(stats["sampler/generated_tokens"])
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates), tokens, tokens / stats["sampler/slot_steps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--preset", default="tiny-llama")
    parser.add_argument("--num_requests", type=int, default=256)
    parser.add_argument("--num_slots", type=int, default=16)
    parser.add_argument("--chunk_size", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--median_len", type=float, default=24.0)
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of lengths")
    parser.add_argument("--max_new", type=int, default=480)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    config = get_preset(args.preset)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    engine = Engine(
        graphdef,
        config,
        EngineConfig(
            num_slots=args.num_slots,
            max_len=args.prompt_len + args.max_new,
            chunk_size=args.chunk_size,
            prefill_chunk=args.prompt_len,
            max_prefill_rows=args.num_slots,
        ),
    )
    requests = make_requests(args, config.vocab_size)
    lengths = np.array([r.max_new_tokens for r in requests])
    print(
        f"{args.num_requests} requests, {args.num_slots} slots, chunk {args.chunk_size}; lengths "
        f"lognormal: mean {lengths.mean():.1f}, median {np.median(lengths):.0f}, "
        f"p90 {np.percentile(lengths, 90):.0f}, max {lengths.max()}"
    )
    for run in (run_continuous, run_static):  # warm-up: compile every prefill row count
        run(engine, params, requests)
    continuous, tokens_c, use_c = tokens_per_second(run_continuous, engine, params, requests, args.repeats)
    static, tokens_s, use_s = tokens_per_second(run_static, engine, params, requests, args.repeats)
    assert tokens_c == tokens_s == lengths.sum()
    print(f"continuous batching: {continuous:10.1f} tokens/s, slot utilization {use_c:.1%}")
    print(f"static batching:     {static:10.1f} tokens/s, slot utilization {use_s:.1%}")
    print(f"ratio continuous/static: {continuous / static:.2f}x (target >= 2x); compiles {engine.compile_counts}")


if __name__ == "__main__":
    main()
