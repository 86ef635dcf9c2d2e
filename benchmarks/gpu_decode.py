"""Decode throughput and HBM-roofline fraction of the sampler on one accelerator, counting only live KV.

Random weights of a preset (default llama3.1-8b, bf16 body with the fp32 LM head at the recipe's
`head_precision` 'bf16x3', as the generator runs it), `--slots` decode slots all busy: prompts of
`--prompt_len` tokens prefilled, budgets long enough that no slot finishes while timed (the slots
are long-lived: they sit at live length ~prompt_len; the default 7,936 is about a recipe slot's
mean live length, prompt 2,048 + half of an ~11k completion, and keeps the 'xla' kernel's window,
a power of two, at 8,192 for the whole run). All slots share one length, so this does not show the
'xla' kernel's cost under staggered lengths, where its window follows the longest slot. The KV
cache is paged (`--page_size`, `--num_pages`) and decode attention runs with `--decode_kernel`
('xla' blockwise over the pages below the chunk's window, 'pallas' the paged kernel over each
slot's live pages, 'auto').
Times `--chunks` chunks of `--chunk_size` decode steps after a warm-up chunk that compiles (steps
and tokens are read from the slots' positions on the device), and reports per slot count:

  tokens/s          = tokens emitted / time
  step time         = time / decode steps
  weights / step    = all params except the embedding table, of which only `slots` rows are read
                      (a tied table is read whole as the head)
  live KV / step    = K and V of the positions each slot attends to: a slot feeding position p
                      reads keys 0..p, so p + 1 tokens x kv_bytes_per_token; summed over the slots
                      and timed steps from the device's positions before and after, divided by the
                      steps. Dead cache (pages past a slot's length, idle slots) is NOT counted.
  HBM fraction      = (weights + live KV) per step / step time / peak HBM bandwidth
                      (`hardware.facts`: H200 4.8 TB/s, H100 SXM 3.35 TB/s; `--peak_tbs` overrides).
Goal: >= 50% at 64 slots, max_len 16,384.

`--num_pages -1` (default) sizes the shared pool for this run's live tokens: slots x
ceil((prompt_len + budget + 1) / page_size) pages, budget = chunk_size x (chunks + 2) (64 slots x
16k tokens without paging would not fit one H200 next to the weights); 0 is the engine's default
(never short: slots x ceil(max_len / page_size)).

  source launch/xla_flags_gpu.sh
  python benchmarks/gpu_decode.py --slots 64 --decode_kernel xla
  python benchmarks/gpu_decode.py --slots 64 --decode_kernel pallas
  # CPU smoke run:
  python benchmarks/gpu_decode.py --preset tiny-llama --slots 4 --prompt_len 8 --max_len 64 \\
      --page_size 4 --chunk_size 4 --chunks 2 --decode_kernel xla --peak_tbs 0.05
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import numpy as np
from flax import nnx

from scalerl_jax.hardware.facts import facts_for_device_kind
from scalerl_jax.models import Transformer, get_preset
from scalerl_jax.models.memory import kv_bytes_per_token
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig, Request


# jax.Device aliases a class of jaxlib's compiled _jax module, which ships no type stubs.
def peak_tbs(device: jax.Device, override: float | None) -> float:  # pyright: ignore[reportInvalidTypeForm]
    if override:
        return override
    kind = getattr(device, "device_kind", "")
    facts = facts_for_device_kind(kind)  # data-sheet bandwidth, hardware.facts
    if facts is not None:
        return facts.hbm_bytes_per_s / 1e12
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


def live_keys_read(positions_before: np.ndarray, positions_after: np.ndarray) -> int:
    """Keys attended over the steps that moved each slot from p0 to p1: sum_{p=p0}^{p1-1} (p + 1)."""
    p0 = positions_before.astype(np.int64)
    p1 = positions_after.astype(np.int64)
    return int(np.sum((p1 * (p1 + 1) - p0 * (p0 + 1)) // 2))


def random_params(config):
    """Random weights created on the device by a jitted constructor (never on the host)."""
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[0]
    params = jax.jit(lambda: nnx.split(Transformer(config, rngs=nnx.Rngs(0)))[1])()
    return graphdef, params


def decode_budget(args: argparse.Namespace) -> int:
    """Tokens each request may generate: the warm-up and timed chunks plus one spare chunk."""
    budget = args.chunk_size * (args.chunks + 2)
    if args.prompt_len + budget + 1 > args.max_len:
        raise ValueError(f"--prompt_len {args.prompt_len} + {budget} decode tokens exceed --max_len {args.max_len}")
    return budget


def pool_pages(args: argparse.Namespace, slots: int) -> int:
    """--num_pages, or for -1 the pages this run's live tokens need (module docstring)."""
    if args.num_pages >= 0:
        return args.num_pages
    return slots * math.ceil((args.prompt_len + decode_budget(args) + 1) / args.page_size)


def measure(args: argparse.Namespace, config, graphdef, params, slots: int, peak: float) -> dict:
    num_pages = pool_pages(args, slots)
    engine = Engine(
        graphdef,
        config,
        EngineConfig(
            num_slots=slots,
            max_len=args.max_len,
            chunk_size=args.chunk_size,
            prefill_chunk=args.prompt_len,
            max_prefill_rows=min(slots, args.prefill_rows),
            page_size=args.page_size,
            num_pages=num_pages,
            decode_kernel=args.decode_kernel,
        ),
    )
    batcher = ContinuousBatcher(engine, params)
    rng = np.random.default_rng(0)
    budget = decode_budget(args)
    for i in range(slots):
        batcher.add_request(
            Request(i, rng.integers(0, config.vocab_size, args.prompt_len).tolist(), budget, seed=i, temperature=1.0)
        )
    start = time.perf_counter()
    batcher.run_chunk()  # prefill + first chunk (compiles)
    jax.block_until_ready(batcher._state)
    compile_and_first = time.perf_counter() - start
    positions_before = np.asarray(batcher._state.positions)
    start = time.perf_counter()
    for _ in range(args.chunks):
        batcher.run_chunk()
    jax.block_until_ready(batcher._state)
    seconds = time.perf_counter() - start
    positions_after = np.asarray(batcher._state.positions)
    advanced = positions_after - positions_before  # an active slot moves one position per step
    tokens, steps = int(advanced.sum()), int(advanced.max())
    if tokens != slots * steps:
        print(f"WARNING: {tokens} tokens in {steps} steps x {slots} slots: some slot was idle while timed")
    if engine.compile_counts["generate"] > 1:
        print(
            f"WARNING: generate compiled {engine.compile_counts['generate']} times: a decode window "
            "changed while timed, so the timing includes a compile"
        )
    step_time = seconds / steps
    weights = weight_bytes_read(params, config, slots)
    live_kv = live_keys_read(positions_before, positions_after) * kv_bytes_per_token(config) / steps
    return {
        "slots": slots,
        "max_len": args.max_len,
        "prompt_len": args.prompt_len,
        "page_size": args.page_size,
        "num_pages": num_pages,
        "decode_kernel": args.decode_kernel,
        "steps": steps,
        "tokens_per_s": tokens / seconds,
        "step_ms": 1e3 * step_time,
        "weights_gb_per_step": weights / 1e9,
        "live_kv_gb_per_step": live_kv / 1e9,
        "hbm_fraction_live": (weights + live_kv) / step_time / (peak * 1e12),
        "pool_gb": num_pages * args.page_size * kv_bytes_per_token(config) / 1e9,
        "first_chunk_s_incl_compile": compile_and_first,
        "compiles": dict(engine.compile_counts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--preset", default="llama3.1-8b")
    parser.add_argument("--dtype", default=None, help="override the preset's dtype")
    parser.add_argument("--head_precision", default="bf16x3", help="the recipe's FP32-head algorithm")
    parser.add_argument("--attention_impl", default="auto", help="prefill attention (auto: cuDNN on GPU)")
    parser.add_argument("--slots", default="64", help="comma-separated slot counts")
    parser.add_argument("--prompt_len", type=int, default=7936)
    parser.add_argument("--max_len", type=int, default=16384)
    parser.add_argument("--page_size", type=int, default=16)
    parser.add_argument(
        "--num_pages", type=int, default=-1, help="KV pool pages; -1: sized for this run's live tokens; 0: never short"
    )
    parser.add_argument("--decode_kernel", default="auto", choices=("auto", "xla", "pallas"))
    parser.add_argument("--chunk_size", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--prefill_rows", type=int, default=8)
    parser.add_argument("--peak_tbs", type=float, default=None, help="peak HBM TB/s override")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    overrides = {"head_precision": args.head_precision, "attention_impl": args.attention_impl}
    if args.dtype:
        overrides["dtype"] = args.dtype
    config = get_preset(args.preset, **overrides)
    device = jax.devices()[0]
    peak = peak_tbs(device, args.peak_tbs)
    graphdef, params = random_params(config)
    print(
        f"{args.preset}: {config.num_params() / 1e9:.2f}B params, dtype {config.dtype}, fp32 head "
        f"{config.fp32_head} ({config.head_precision}); device {device.device_kind}, peak {peak} TB/s; "
        f"weights {nbytes(params) / 1e9:.2f} GB; KV {kv_bytes_per_token(config):,} B/token; "
        f"decode_kernel {args.decode_kernel}, page_size {args.page_size}"
    )
    results = []
    for slots in (int(s) for s in args.slots.split(",")):
        result = measure(args, config, graphdef, params, slots, peak)
        results.append(result)
        print(
            f"slots {slots:4d}: {result['tokens_per_s']:10.1f} tokens/s, step {result['step_ms']:.2f} ms, "
            f"read/step weights {result['weights_gb_per_step']:.2f} GB + live KV "
            f"{result['live_kv_gb_per_step']:.2f} GB -> HBM fraction (live KV) "
            f"{result['hbm_fraction_live']:.1%} (goal >= 50%); pool {result['num_pages']} pages "
            f"({result['pool_gb']:.1f} GB); first chunk incl. compile "
            f"{result['first_chunk_s_incl_compile']:.1f} s"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    assert all(math.isfinite(r["tokens_per_s"]) for r in results)


if __name__ == "__main__":
    main()
