"""CPU benchmark: compile time of scanned vs unrolled layers, and step time of remat policies.

    .venv/bin/python benchmarks/bench_model_compile.py [--layers 16] [--repeats 3]

Measures `jit(grad(sum of sequence log-probs))` of a small Llama-shaped model, all in this process:
  1. lower+compile seconds with `scan_layers=True` vs False (median over fresh compiles), ratio;
  2. forward+backward seconds per step (median over repeats after a warm-up call) and tokens/s for
     remat policies none / full / dots_with_no_batch_dims, ratios against none.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scalerl_jax.models import Transformer, get_preset, init_transformer, sequence_logprobs


def _loss_fn(graphdef):
    def loss(params, tokens):
        return jnp.sum(sequence_logprobs(nnx.merge(graphdef, params), tokens, chunk_size=128))

    return jax.grad(loss)


def compile_seconds(config, tokens, repeats: int) -> float:
    """Median lower+compile time of the gradient step (a fresh jit each time, so nothing is cached)."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.jit(_loss_fn(graphdef)).lower(params, tokens).compile()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_seconds(config, tokens, repeats: int) -> float:
    """Median wall time of one compiled forward+backward step."""
    graphdef, params = nnx.split(init_transformer(config))
    step = jax.jit(_loss_fn(graphdef))
    jax.block_until_ready(step(params, tokens))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(params, tokens))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = get_preset(
        "tiny-llama",
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_heads=8,
        num_kv_heads=2,
        head_dim=args.hidden // 8,
    )
    tokens = jax.ShapeDtypeStruct((args.batch, args.seq_len), jnp.int32)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; {args.layers} layers, hidden {args.hidden}, "
        f"{base.num_params():,} params, batch {args.batch} x {args.seq_len} tokens"
    )

    scan = compile_seconds(base.replace(scan_layers=True), tokens, args.repeats)
    unrolled = compile_seconds(base.replace(scan_layers=False), tokens, args.repeats)
    print(f"compile (grad step): scan {scan:.2f} s, unrolled {unrolled:.2f} s, unrolled/scan = {unrolled / scan:.2f}x")

    concrete = jnp.asarray(np.random.RandomState(0).randint(0, base.vocab_size, (args.batch, args.seq_len)))
    baseline = None
    for policy in ("none", "full", "dots_with_no_batch_dims"):
        seconds = step_seconds(base.replace(remat_policy=policy), concrete, args.repeats)
        baseline = baseline or seconds
        print(
            f"remat {policy:<24} step {seconds * 1e3:8.1f} ms  {args.batch * args.seq_len / seconds:9.0f} tokens/s"
            f"  time / none = {seconds / baseline:.2f}x"
        )


if __name__ == "__main__":
    main()
