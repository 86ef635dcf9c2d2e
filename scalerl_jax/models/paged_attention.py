"""Ragged paged decode attention: a Pallas kernel that reads only each slot's live KV pages.

Layout (the engine's paged KV cache):
  k_pages, v_pages  [L, N, P, K, D]  L layers, a shared pool of N pages of P tokens, K kv heads, head_dim D
  page_table        int32 [S, M]      slot s's token at position p is row p % P of page page_table[s, p // P]
  lengths           int32 [S]         slot s attends to positions 0 .. lengths[s]-1 (0: idle, output 0)
  q                 [S, H, D]         one query token per slot, RoPE applied; H = K * G, head h uses kv head h // G

For slot s and query head h (kv head k = h // G), with x_p = q[s, h] . K[p] / sqrt(D) over the live
positions p < lengths[s]:  out[s, h] = sum_p softmax(x)_p V[p]  (0 when lengths[s] == 0).

Kernel: grid (S, K); program (s, k) holds the G query heads of kv head k (padded to >= 16 rows, a
power of two, for the tensor-core dot) and walks the slot's pages in blocks of `pages_per_block`
pages (B = pages_per_block * P tokens), ceil(lengths[s] / B) blocks, a trip count read at run time.
Per block, in float32 (online softmax, Milakov & Gimelshein 2018):
  m' = max(m, max_p x_p),  l' = l e^(m - m') + sum_p e^(x_p - m'),  a' = a e^(m - m') + sum_p e^(x_p - m') V[p]
and out = a / l at the end. Positions >= lengths[s] in the last block get x = -inf and V = 0, so stale
rows of a live page (or NaN in them) cannot leak into the output. Table entries past the slot's live
pages are never read: page indices are clamped to the slot's last live page, which the same block has
just read (a cache hit on GPU), and those positions are masked. The layer is picked inside the kernel
from the stacked pool (`layer` is a traced scalar, the layer-scan index): no layer or pool is copied.

Verified here (CPU, no GPU lent): values in `interpret=True` mode against an fp64 numpy reference
(tests/unit/models/test_paged_attention.py), and that the kernel lowers to Triton IR for the 'cuda' platform
(`jax.jit(...).trace(...).lower(lowering_platforms=('cuda',))`, which runs the Pallas->Triton
lowering on CPU) with the pool passed to the Triton custom call as is. NOT verified (no GPU): the
Triton IR compiling to PTX, numerics and speed on a GPU, whether XLA keeps the pool in place around
the custom call inside the engine's layer scan, and the shape limits (`triton_shape_problems`)
beyond what the Triton lowering itself checks. No split over the sequence (flash-decoding): one
program per (slot, kv head), so few slots x kv heads under-fill the GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

GPU_PLATFORMS = ("gpu", "cuda")
MIN_DOT_DIM = 16  # Triton's tl.dot needs every dimension >= 16.


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def padded_query_rows(group_size: int) -> int:
    """Query rows per program: the G heads sharing a kv head, padded to a power of two >= 16."""
    return max(MIN_DOT_DIM, 1 << (group_size - 1).bit_length())


def triton_shape_problems(*, head_dim: int, page_size: int, pages_per_block: int) -> str | None:
    """Why the Triton kernel cannot take these shapes ('; '-joined), or None when it can.

    Triton tensors must have power-of-two dimensions and its dot needs every dimension >= 16, so
    head_dim, page_size and pages_per_block must be powers of two, head_dim >= 16 and
    page_size * pages_per_block >= 16.
    """
    problems = []
    if not (_is_power_of_two(head_dim) and head_dim >= MIN_DOT_DIM):
        problems.append(f"head_dim={head_dim} must be a power of two >= {MIN_DOT_DIM}")
    if not _is_power_of_two(page_size):
        problems.append(f"page_size={page_size} must be a power of two")
    if not _is_power_of_two(pages_per_block):
        problems.append(f"pages_per_block={pages_per_block} must be a power of two")
    if page_size * pages_per_block < MIN_DOT_DIM:
        problems.append(f"page_size*pages_per_block={page_size * pages_per_block} must be >= {MIN_DOT_DIM}")
    return "; ".join(problems) or None


def paged_attention_supported(platform: str, *, head_dim: int, page_size: int, pages_per_block: int) -> bool:
    """True when the compiled kernel runs on `platform` ('gpu'/'cuda': Triton) with these shapes.

    CPU and TPU have no compiled kernel here (CPU can run it with `interpret=True`, for tests).
    """
    return (
        platform in GPU_PLATFORMS
        and triton_shape_problems(head_dim=head_dim, page_size=page_size, pages_per_block=pages_per_block) is None
    )


def block_table_columns(block: jax.Array, live_pages: jax.Array, pages_per_block: int) -> jax.Array:
    """Page-table columns read for `block`: block * pages_per_block + i, clamped to live_pages - 1.

    Over blocks 0 .. ceil(live_pages / pages_per_block) - 1 this reads every live column and no
    column >= live_pages, so table entries past the slot's live pages are never read; the clamped
    (repeated) last live page is masked by position.
    """
    columns = block * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
    return jnp.minimum(columns, live_pages - 1)


def _paged_decode_kernel(
    layer_ref,
    lengths_ref,
    page_table_ref,
    q_ref,
    k_pages_ref,
    v_pages_ref,
    o_ref,
    *,
    pages_per_block: int,
    scale: float,
):
    """One (slot, kv head) program: online softmax over the slot's live pages, block by block."""
    slot, kv_head = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    page_size = k_pages_ref.shape[2]
    head_dim = k_pages_ref.shape[4]
    block_tokens = pages_per_block * page_size
    length = jnp.minimum(lengths_ref[slot], page_table_ref.shape[1] * page_size)
    live_pages = pl.cdiv(length, page_size)
    num_blocks = pl.cdiv(length, block_tokens)

    q = q_ref[...]  # [rows, D]
    rows = q.shape[0]

    def attend_block(block, carry):
        running_max, running_sum, acc = carry
        pages = page_table_ref[slot, block_table_columns(block, live_pages, pages_per_block)]
        k = k_pages_ref[layer, pages, :, kv_head, :].reshape(block_tokens, head_dim)
        v = v_pages_ref[layer, pages, :, kv_head, :].reshape(block_tokens, head_dim)
        positions = block * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
        live = positions < length  # [B]
        scores = (
            lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
            )
            * scale
        )  # [rows, B]
        scores = jnp.where(live[None, :], scores, -jnp.inf)
        new_max = jnp.maximum(running_max, scores.max(axis=1))
        correction = jnp.exp(running_max - new_max)
        weights = jnp.exp(scores - new_max[:, None])
        v = jnp.where(live[:, None], v, jnp.zeros_like(v))
        weighted_v = lax.dot_general(
            weights.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
        return (new_max, running_sum * correction + weights.sum(axis=1), acc * correction[:, None] + weighted_v)

    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    _, total, acc = lax.fori_loop(0, num_blocks, attend_block, init)
    safe_total = jnp.where(total > 0, total, 1.0)
    o_ref[...] = jnp.where(total[:, None] > 0, acc / safe_total[:, None], 0.0).astype(o_ref.dtype)


def _check_shapes(q, k_pages, v_pages, page_table, lengths) -> None:
    """ValueError naming the argument whose shape does not fit the paged layout."""
    if k_pages.ndim != 5 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"paged_decode_attention: k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be [L, N, P, K, D]"
        )
    _, _, _, num_kv_heads, head_dim = k_pages.shape
    if q.ndim != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(
            f"paged_decode_attention: q {q.shape} must be [S, H, D={head_dim}] with H a "
            f"multiple of the {num_kv_heads} kv heads"
        )
    num_slots = q.shape[0]
    if page_table.ndim != 2 or page_table.shape[0] != num_slots:
        raise ValueError(f"paged_decode_attention: page_table {page_table.shape} must be [S={num_slots}, M]")
    if lengths.shape != (num_slots,):
        raise ValueError(f"paged_decode_attention: lengths {lengths.shape} must be [S={num_slots}]")


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    layer: jax.Array | int,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    pages_per_block: int = 8,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention of one query token per slot over that slot's live paged keys: [S, H, D] in q.dtype.

    See the module docstring for the layout and the math. `layer` is an int32 scalar in [0, L) (may be
    traced; not range-checked on device); lengths[s] must not exceed M * P (positions past the table
    are not attended). Raises ValueError for
    shapes that do not fit the layout, or (when not `interpret`) that the Triton kernel cannot take.
    Compiled, it runs on GPU only (`paged_attention_supported`); on CPU pass `interpret=True`.
    """
    _check_shapes(q, k_pages, v_pages, page_table, lengths)
    _, _, page_size, num_kv_heads, head_dim = k_pages.shape
    if not interpret:
        problems = triton_shape_problems(head_dim=head_dim, page_size=page_size, pages_per_block=pages_per_block)
        if problems:
            raise ValueError(
                f"paged_decode_attention: {problems} for the Triton kernel (interpret=True takes any shape)"
            )
    num_slots, num_heads, _ = q.shape
    group = num_heads // num_kv_heads
    rows = padded_query_rows(group)
    grouped_q = q.reshape(num_slots, num_kv_heads, group, head_dim)
    grouped_q = jnp.pad(grouped_q, ((0, 0), (0, 0), (0, rows - group), (0, 0)))

    def whole(array):
        return pl.BlockSpec(array.shape, lambda s, k, _ndim=array.ndim: (0,) * _ndim)

    per_program = pl.BlockSpec((None, None, rows, head_dim), lambda s, k: (s, k, 0, 0))
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    lengths = lengths.astype(jnp.int32)
    page_table = page_table.astype(jnp.int32)
    kernel = functools.partial(_paged_decode_kernel, pages_per_block=pages_per_block, scale=1.0 / math.sqrt(head_dim))
    out = pl.pallas_call(
        kernel,
        grid=(num_slots, num_kv_heads),
        in_specs=[whole(layer), whole(lengths), whole(page_table), per_program, whole(k_pages), whole(v_pages)],
        out_specs=per_program,
        out_shape=jax.ShapeDtypeStruct(grouped_q.shape, q.dtype),
        interpret=interpret,
        # Triton: this jax lowers GPU pallas_call to Mosaic GPU unless Triton params are given.
        compiler_params=pltriton.CompilerParams(),
        name="paged_decode_attention",
    )(layer, lengths, page_table, grouped_q, k_pages, v_pages)
    return out[:, :, :group, :].reshape(num_slots, num_heads, head_dim)
