"""Pallas vs XLA paged decode attention on the same random paged inputs, and both vs a dense reference (GPU check).

Inputs follow the engine's paged layout: pools k/v [L, N, P, K, D], a shuffled page table
[S, M] (slot s's position t lives in page page_table[s, t // P], row t % P; entries past a slot's
pages point out of range, N, and must never be read), ragged lengths [S] including 0 (idle slot:
output 0), 1, a page boundary and the maximum M * P, and one query token per slot q [S, H, D]
(H = K * G). The two kernels the engine selects by `EngineConfig.decode_kernel`:
`paged_attention.paged_decode_attention` ('pallas') and `layers.paged_decode_attention_xla`
('xla', blockwise over the pages below window = max_len) run on a nonzero `layer` (the other layer
holds garbage). The dense reference gathers every slot's pages into a [S, M * P, K, D] array and
takes a float32 masked softmax over keys t < lengths[s] with scale 1 / sqrt(D) (plain XLA ops,
independent of both). Checks max |pallas - xla| and each against the reference with a per-dtype
tolerance (exit 1 on a mismatch), then times the three (median of `--repeats`) and reports the
achieved bandwidth on the live K/V bytes a kernel must read (sum of lengths x K x D x 2 x dtype
bytes).

  python benchmarks/gpu_paged_check.py                 # GPU: 64 slots, 8B-shaped heads, up to 16k
  # CPU smoke run (Pallas interpret mode):
  python benchmarks/gpu_paged_check.py --slots 4 --max_len 64 --page_size 4 --heads 4 --kv_heads 2 \\
      --head_dim 16 --pages_per_block 2 --dtype float32 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from scalerl_jax.models.layers import paged_decode_attention_xla
from scalerl_jax.models.paged_attention import paged_decode_attention

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def random_paged_inputs(args: argparse.Namespace, rng: np.random.Generator):
    """q, k_pages, v_pages [2, N, P, K, D] (layer 0 garbage), page_table [S, M], lengths [S]."""
    s, p, k, d = args.slots, args.page_size, args.kv_heads, args.head_dim
    pages_per_slot = args.max_len // p
    lengths = rng.integers(1, args.max_len + 1, s)
    lengths[:4] = (0, 1, p, args.max_len)[: min(4, s)]
    live_pages = -(-lengths // p)
    num_pages = int(live_pages.sum()) + 1
    order = rng.permutation(num_pages)
    page_table = np.full((s, pages_per_slot), num_pages, np.int32)  # out of range past the live pages
    offset = 0
    for slot, count in enumerate(live_pages):
        page_table[slot, :count] = order[offset : offset + count]
        offset += count
    dtype = jnp.dtype(args.dtype)
    key_q, key_k, key_v = jax.random.split(jax.random.key(args.seed), 3)
    shape = (2, num_pages, p, k, d)
    k_pages = jax.random.normal(key_k, shape, dtype)
    v_pages = jax.random.normal(key_v, shape, dtype)
    q = jax.random.normal(key_q, (s, args.heads, d), dtype)
    return q, k_pages, v_pages, jnp.asarray(page_table), jnp.asarray(lengths, jnp.int32)


def reference_attention(q, k_pages, v_pages, layer, page_table, lengths):
    """Dense gather of each slot's pages, then a float32 masked softmax (module docstring)."""
    slots, heads, dim = q.shape
    num_pages, page_size, kv_heads = k_pages.shape[1:4]
    table = jnp.clip(page_table, 0, num_pages - 1)
    k = k_pages[layer][table].reshape(slots, -1, kv_heads, dim).astype(jnp.float32)
    v = v_pages[layer][table].reshape(slots, -1, kv_heads, dim).astype(jnp.float32)
    grouped = q.astype(jnp.float32).reshape(slots, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("skgd,stkd->skgt", grouped, k) / np.sqrt(dim)
    live = jnp.arange(k.shape[1])[None, :] < lengths[:, None]
    scores = jnp.where(live[:, None, None], scores, -jnp.inf)
    probs = jnp.where(live[:, None, None], jax.nn.softmax(scores, axis=-1), 0.0)
    out = jnp.einsum("skgt,stkd->skgd", probs, v)
    return out.reshape(slots, heads, dim).astype(q.dtype)


def median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--max_len", type=int, default=16384)
    parser.add_argument("--page_size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--pages_per_block", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(TOLERANCE))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.max_len % args.page_size:
        raise ValueError(f"--max_len {args.max_len} must be a multiple of --page_size {args.page_size}")

    interpret = jax.default_backend() == "cpu"
    q, k_pages, v_pages, page_table, lengths = random_paged_inputs(args, np.random.default_rng(args.seed))
    layer = jnp.int32(1)
    kernels = {
        "pallas": jax.jit(
            lambda *a: paged_decode_attention(*a, pages_per_block=args.pages_per_block, interpret=interpret)
        ),
        "xla": jax.jit(
            lambda *a: paged_decode_attention_xla(*a, window=args.max_len, pages_per_block=args.pages_per_block)
        ),
        "reference": jax.jit(reference_attention),
    }
    inputs = (q, k_pages, v_pages, layer, page_table, lengths)
    outputs = {name: np.asarray(fn(*inputs), np.float32) for name, fn in kernels.items()}
    tolerance = TOLERANCE[args.dtype]
    print(
        f"{jax.devices()[0].device_kind}: {args.slots} slots, lengths {int(lengths.min())}..{int(lengths.max())} "
        f"(sum {int(lengths.sum()):,}), H {args.heads} K {args.kv_heads} D {args.head_dim}, page {args.page_size}, "
        f"{args.dtype}, pallas interpret={interpret}; tolerance {tolerance:g}"
    )
    ok = True
    for a, b in (("pallas", "xla"), ("pallas", "reference"), ("xla", "reference")):
        error = float(np.max(np.abs(outputs[a] - outputs[b])))
        ok &= error <= tolerance
        print(f"  max |{a} - {b}| = {error:.3g} -> {'OK' if error <= tolerance else 'MISMATCH'}")
    idle = np.asarray(lengths) == 0
    for name in ("pallas", "xla"):
        if np.any(outputs[name][idle] != 0):
            ok = False
            print(f"  MISMATCH: {name} gives nonzero output for an idle slot (length 0)")
    live_bytes = int(lengths.sum()) * args.kv_heads * args.head_dim * 2 * jnp.dtype(args.dtype).itemsize
    seconds = {name: median_seconds(lambda fn=fn: fn(*inputs), args.repeats) for name, fn in kernels.items()}
    print(
        "  "
        + ", ".join(f"{name} {1e3 * t:.3f} ms ({live_bytes / t / 1e9:.0f} GB/s)" for name, t in seconds.items())
        + f" on {live_bytes / 1e9:.3f} GB of live K/V (median of {args.repeats}); xla / pallas = "
        f"{seconds['xla'] / seconds['pallas']:.2f}x"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
