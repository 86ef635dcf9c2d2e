"""Decode throughput and HBM-bandwidth fraction of the sampler on one accelerator (GPU script).

Random weights of a preset (default llama3.1-8b in bf16 with the fp32 LM head, as the generator
runs in the recipe), `--slots` decode slots all busy (prompts of `--prompt_len` tokens prefilled,
budgets long enough that no slot finishes while timed), sampling at temperature 1. Times
`--chunks` jitted chunks of `--chunk_size` decode steps each (after a warm-up chunk that
compiles) and reports per configuration:

  tokens/s          = slots * steps / time
  step time         = time / steps
  bytes read / step = weights (all params except the embedding table, of which only `slots`
                      rows are read; a tied table is read whole as the head)
                      + KV cache bytes the attention reads. Our attention masks a fixed
                      [max_len] cache, so it reads all max_len entries of every slot
                      ("kv_read"); the live part (entries <= each slot's position,
                      "kv_live") is reported too.
  HBM fraction      = bytes read per step / step time / peak HBM bandwidth
                      (H200 4.8 TB/s, H100 SXM 3.35 TB/s; `--peak_tbs` overrides).
Target: >= 50% at 64+ slots (weights + kv_read).

  python benchmarks/gpu_decode.py --slots 64,128
  # CPU smoke run:
  python benchmarks/gpu_decode.py --preset tiny-llama --slots 4 --prompt_len 8 --max_len 64 \\
      --chunk_size 4 --chunks 2 --peak_tbs 0.05
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scalerl_jax.models import Transformer, get_preset
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig, Request

# Peak HBM bandwidth in TB/s by device-kind substring (NVIDIA data sheets); first match wins.
PEAK_HBM_TBS = (("H100 PCIe", 2.0), ("H200", 4.8), ("GH200", 4.0), ("H100", 3.35),
                ("B200", 8.0), ("A100", 2.0))


def peak_tbs(device: jax.Device, override: float | None) -> float:
    if override:
        return override
    kind = getattr(device, "device_kind", "")
    for name, tbs in PEAK_HBM_TBS:
        if name in kind:
            return tbs
    raise ValueError(f"unknown peak HBM bandwidth for device kind {kind!r}: pass --peak_tbs")


def nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def weight_bytes_read(params, config, slots: int) -> int:
    """Bytes of weights read per decode step (see module docstring)."""
    total = nbytes(params)
    if not config.tie_word_embeddings:
        table = jax.tree.leaves(params["embed_tokens"])[0]
        total -= table.size * table.dtype.itemsize
        total += slots * table.shape[1] * table.dtype.itemsize
    return total


def kv_bytes_per_token(config) -> int:
    """K and V bytes of one token over all layers (body dtype)."""
    itemsize = jnp.dtype(config.dtype).itemsize
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


def random_params(config):
    """Random weights created on the device by a jitted constructor (never on the host)."""
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[0]
    params = jax.jit(lambda: nnx.split(Transformer(config, rngs=nnx.Rngs(0)))[1])()
    return graphdef, params


def measure(args: argparse.Namespace, config, graphdef, params, slots: int, peak: float) -> dict:
    engine = Engine(graphdef, config, EngineConfig(
        num_slots=slots, max_len=args.max_len, chunk_size=args.chunk_size,
        min_prefill_bucket=args.prompt_len, max_prefill_rows=min(slots, args.prefill_rows)))
    batcher = ContinuousBatcher(engine, params)
    rng = np.random.default_rng(0)
    budget = args.max_len - args.prompt_len - 1
    needed = args.chunk_size * (args.chunks + 1)
    if budget < needed:
        raise ValueError(f"--max_len {args.max_len} leaves {budget} tokens; the run needs {needed}")
    for i in range(slots):
        batcher.add_request(Request(i, rng.integers(0, config.vocab_size, args.prompt_len).tolist(),
                                    budget, seed=i, temperature=1.0))
    start = time.perf_counter()
    batcher.run_chunk()  # prefill + first chunk (compiles)
    jax.block_until_ready(batcher._state)
    compile_and_first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.chunks):
        batcher.run_chunk()
    jax.block_until_ready(batcher._state)
    seconds = time.perf_counter() - start
    steps = args.chunks * args.chunk_size
    step_time = seconds / steps
    weights = weight_bytes_read(params, config, slots)
    per_token = kv_bytes_per_token(config)
    kv_read = slots * args.max_len * per_token
    mean_position = args.prompt_len + args.chunk_size * (1 + args.chunks / 2)
    kv_live = int(slots * mean_position * per_token)
    bandwidth = peak * 1e12
    return {
        "slots": slots, "max_len": args.max_len, "prompt_len": args.prompt_len,
        "tokens_per_s": slots * steps / seconds, "step_ms": 1e3 * step_time,
        "weights_gb": weights / 1e9, "kv_read_gb": kv_read / 1e9, "kv_live_gb": kv_live / 1e9,
        "hbm_fraction": (weights + kv_read) / step_time / bandwidth,
        "hbm_fraction_live_kv": (weights + kv_live) / step_time / bandwidth,
        "first_chunk_s_incl_compile": compile_and_first,
        "compiles": dict(engine.compile_counts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama3.1-8b")
    parser.add_argument("--dtype", default=None, help="override the preset's dtype")
    parser.add_argument("--slots", default="64,128", help="comma-separated slot counts")
    parser.add_argument("--prompt_len", type=int, default=1024)
    parser.add_argument("--max_len", type=int, default=2048)
    parser.add_argument("--chunk_size", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--prefill_rows", type=int, default=8)
    parser.add_argument("--peak_tbs", type=float, default=None, help="peak HBM TB/s override")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    overrides = {"dtype": args.dtype} if args.dtype else {}
    config = get_preset(args.preset, **overrides)
    device = jax.devices()[0]
    peak = peak_tbs(device, args.peak_tbs)
    graphdef, params = random_params(config)
    print(f"{args.preset}: {config.num_params() / 1e9:.2f}B params, dtype {config.dtype}, fp32 head "
          f"{config.fp32_head}; device {device.device_kind}, peak {peak} TB/s; weights "
          f"{nbytes(params) / 1e9:.2f} GB")
    results = []
    for slots in (int(s) for s in args.slots.split(",")):
        result = measure(args, config, graphdef, params, slots, peak)
        results.append(result)
        print(f"slots {slots:4d}: {result['tokens_per_s']:10.1f} tokens/s, step "
              f"{result['step_ms']:.2f} ms, read/step weights {result['weights_gb']:.2f} GB + KV "
              f"{result['kv_read_gb']:.2f} GB (live {result['kv_live_gb']:.2f} GB) -> HBM fraction "
              f"{result['hbm_fraction']:.1%} (live-KV basis {result['hbm_fraction_live_kv']:.1%}); "
              f"first chunk incl. compile {result['first_chunk_s_incl_compile']:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    assert all(math.isfinite(r["tokens_per_s"]) for r in results)


if __name__ == "__main__":
    main()
