"""Decode cost against max_len: does a step follow the live tokens or the cache length?

1. Step time at the same live length (prompt `--live` tokens, one chunk of decode steps) with
   max_len 256 and 4096, for the engine's live window and, as the in-process baseline, the same
   engine with the window pinned to max_len (`min_decode_window=max_len`: attention over every
   cache position, as before the live window). Goal: windowed t(4096) / t(256) <= 1.3.
2. Wall time to generate L = max_len - prompt tokens in every slot, max_len 1024 vs 4096, live
   window. Goal: t(4096) / t(1024) <= 5 (4 would be linear; attention over max_len is ~16).
Medians over `--repeats` runs after a warm-up that compiles every shape (one generate per window).

  .venv/bin/python benchmarks/bench_decode_scaling.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from scalerl_jax.models import Transformer, get_preset
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig, Request
from scalerl_jax.sampler.engine import host_settings


def make_engine(graphdef, config, args, max_len: int, *, full_window: bool) -> Engine:
    return Engine(
        graphdef,
        config,
        EngineConfig(
            num_slots=args.slots,
            max_len=max_len,
            chunk_size=args.chunk,
            max_prefill_rows=args.slots,
            prefill_chunk=16,
            min_decode_window=max_len if full_window else args.min_window,
        ),
    )


def step_seconds(engine: Engine, params, prompts: np.ndarray, repeats: int) -> float:
    """Median seconds per decode step of one chunk started at live length prompts.shape[1]."""
    slots = prompts.shape[0]
    settings = host_settings(
        seeds=np.zeros(slots),
        streams=np.arange(slots),
        max_new_tokens=np.full(slots, 10**6),
        temperature=np.ones(slots),
        stop_tokens=np.full((slots, engine.config.max_stop_tokens), -1),
        interrupt=np.zeros(slots, bool),
    )
    times = []
    for _ in range(repeats + 1):  # the first run compiles
        state = engine.start_prompts(params, engine.init_decode_state(), range(slots), prompts.tolist(), settings)
        jax.block_until_ready(state)
        start = time.perf_counter()
        state, result = engine.generate(params, state)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / int(result.steps))
    return statistics.median(times[1:])


def generation_seconds(engine: Engine, params, prompts: np.ndarray, repeats: int) -> float:
    """Median wall seconds to fill every slot's cache: max_len - prompt tokens each, temperature 1."""
    new_tokens = engine.config.max_len - prompts.shape[1] - 1
    times = []
    for _ in range(repeats + 1):  # the first run compiles every window
        batcher = ContinuousBatcher(engine, params)
        for i, prompt in enumerate(prompts):
            batcher.add_request(Request(i, prompt.tolist(), new_tokens, seed=i, temperature=1.0))
        start = time.perf_counter()
        done = batcher.drain()
        times.append(time.perf_counter() - start)
        assert all(len(c.tokens) == new_tokens for c in done)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--live", type=int, default=190, help="prompt length for the step-time test")
    parser.add_argument("--min_window", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gen_repeats", type=int, default=3)
    parser.add_argument("--skip_generation", action="store_true")
    args = parser.parse_args()

    config = get_preset(args.model, max_position_embeddings=4096)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    live_prompts = rng.integers(0, config.vocab_size, (args.slots, args.live))

    print(f"{args.model}, {args.slots} slots, chunk {args.chunk}, backend {jax.default_backend()}")
    print(f"\n1. decode step at live length ~{args.live + args.chunk // 2} (median of {args.repeats})")
    print(f"{'attention':<22}{'max_len 256 ms':>16}{'max_len 4096 ms':>17}{'4096/256':>10}")
    for name, full_window in (("live window", False), ("max_len (baseline)", True)):
        ms = [
            1e3
            * step_seconds(
                make_engine(graphdef, config, args, max_len, full_window=full_window),
                params,
                live_prompts,
                args.repeats,
            )
            for max_len in (256, 4096)
        ]
        print(f"{name:<22}{ms[0]:>16.3f}{ms[1]:>17.3f}{ms[1] / ms[0]:>10.2f}")

    if args.skip_generation:
        return
    print(f"\n2. generate max_len - 16 tokens in every slot, live window (median of {args.gen_repeats})")
    prompts = rng.integers(0, config.vocab_size, (args.slots, 16))
    seconds = {
        max_len: generation_seconds(
            make_engine(graphdef, config, args, max_len, full_window=False), params, prompts, args.gen_repeats
        )
        for max_len in (1024, 4096)
    }
    print(f"{'max_len':<10}{'seconds':>10}{'ms/step':>10}")
    for max_len, value in seconds.items():
        print(f"{max_len:<10}{value:>10.2f}{1e3 * value / (max_len - 17):>10.3f}")
    print(f"t(4096) / t(1024) = {seconds[4096] / seconds[1024]:.2f}  (goal <= 5; linear = 4)")


if __name__ == "__main__":
    main()
