"""Paged decode attention (Pallas, interpret mode on CPU) against an fp64 numpy reference.

The reference assembles each slot's keys and values position by position from the page table
(page_table[s, p // P], row p % P) and computes softmax(q.K / sqrt(D)) V in float64.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalerl_jax.models.paged_attention import (
    block_table_columns,
    paged_attention_supported,
    paged_decode_attention,
    triton_shape_problems,
)

PAGE = 4  # P tokens per page
TABLE_PAGES = 8  # M page-table columns per slot -> at most 32 tokens
POOL_PAGES = 32  # N pages in the shared pool
HEAD_DIM = 16
PAGES_PER_BLOCK = 2  # B = 8 tokens per block
# idle, one token, exactly one page, exactly one block, mid-page, the maximum (M * P)
LENGTHS = np.array([0, 1, PAGE, PAGE * PAGES_PER_BLOCK, 13, TABLE_PAGES * PAGE], np.int32)
TOLERANCE = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2}  # measured max errors: 2e-7, 5e-3


def paged_layout(rng, *, num_layers, num_kv_heads, lengths=LENGTHS):
    """Random pool, shuffled page tables and garbage everywhere the kernel must not look.

    Live pages are drawn without replacement from a shuffled pool (non-contiguous, shared).
    Every pool row that is not a live position of some slot is NaN in every layer (dead rows of a
    slot's last page, unowned pages); table entries past a slot's live pages are garbage: out of
    range (N, -1, 10**6) or unowned NaN pages.
    """
    shape = (num_layers, POOL_PAGES, PAGE, num_kv_heads, HEAD_DIM)
    k_pages = np.full(shape, np.nan, np.float32)
    v_pages = np.full(shape, np.nan, np.float32)
    live_pages = -(-lengths // PAGE)
    pool_order = rng.permutation(POOL_PAGES)
    owned, unowned = pool_order[: live_pages.sum()], pool_order[live_pages.sum() :]
    garbage = np.concatenate([[POOL_PAGES, -1, 10**6], unowned])
    page_table = rng.choice(garbage, size=(len(lengths), TABLE_PAGES)).astype(np.int32)
    start = 0
    for slot, (length, count) in enumerate(zip(lengths, live_pages)):
        page_table[slot, :count] = owned[start : start + count]
        start += count
        for position in range(length):
            page, row = page_table[slot, position // PAGE], position % PAGE
            k_pages[:, page, row] = rng.standard_normal((num_layers, num_kv_heads, HEAD_DIM))
            v_pages[:, page, row] = rng.standard_normal((num_layers, num_kv_heads, HEAD_DIM))
    return k_pages, v_pages, page_table


def reference_attention(q, k_pages, v_pages, layer, page_table, lengths):
    """fp64 decode attention, keys gathered position by position from the page table."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    num_slots, num_heads, head_dim = q.shape
    group = num_heads // k_pages.shape[3]
    out = np.zeros_like(q)
    for slot in range(num_slots):
        for head in range(num_heads):
            positions = range(lengths[slot])
            if not positions:
                continue
            keys = np.stack([k_pages[layer, page_table[slot, p // PAGE], p % PAGE, head // group] for p in positions])
            values = np.stack([v_pages[layer, page_table[slot, p // PAGE], p % PAGE, head // group] for p in positions])
            scores = keys @ q[slot, head] / np.sqrt(head_dim)
            weights = np.exp(scores - scores.max())
            out[slot, head] = weights / weights.sum() @ values
    return out


def as_dtype(x, dtype):
    """x rounded to `dtype` (what the kernel sees), for both the kernel and the reference."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_matches_fp64_reference_with_garbage_outside_live_pages(dtype, num_heads, num_kv_heads):
    rng = np.random.default_rng(0)
    layer = 1
    k_pages, v_pages, page_table = paged_layout(rng, num_layers=2, num_kv_heads=num_kv_heads)
    k_pages[0] = v_pages[0] = np.nan  # the other layer: garbage
    q = rng.standard_normal((len(LENGTHS), num_heads, HEAD_DIM)).astype(np.float32)
    q, k_pages, v_pages = (as_dtype(x, dtype) for x in (q, k_pages, v_pages))

    attend = jax.jit(lambda *args: paged_decode_attention(*args, pages_per_block=PAGES_PER_BLOCK, interpret=True))
    out = attend(
        jnp.asarray(q, dtype),
        jnp.asarray(k_pages, dtype),
        jnp.asarray(v_pages, dtype),
        jnp.int32(layer),
        page_table,
        LENGTHS,
    )

    assert out.dtype == dtype and out.shape == q.shape
    expected = reference_attention(q, k_pages, v_pages, layer, page_table, LENGTHS)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=TOLERANCE[dtype], rtol=0)
    assert not np.asarray(out[0]).any()  # idle slot: zeros


def test_layer_index_traced_in_a_scan_selects_each_layer():
    rng = np.random.default_rng(1)
    num_layers, num_heads, num_kv_heads = 3, 4, 2
    k_pages, v_pages, page_table = paged_layout(rng, num_layers=num_layers, num_kv_heads=num_kv_heads)
    q = rng.standard_normal((len(LENGTHS), num_heads, HEAD_DIM)).astype(np.float32)

    arrays = [jnp.asarray(x) for x in (q, k_pages, v_pages, page_table, LENGTHS)]

    def per_layer(_, layer):
        q, k_pages, v_pages, page_table, lengths = arrays
        return None, paged_decode_attention(
            q, k_pages, v_pages, layer, page_table, lengths, pages_per_block=PAGES_PER_BLOCK, interpret=True
        )

    _, outs = jax.jit(lambda: jax.lax.scan(per_layer, None, jnp.arange(num_layers)))()

    for layer in range(num_layers):
        expected = reference_attention(q, k_pages, v_pages, layer, page_table, LENGTHS)
        np.testing.assert_allclose(np.asarray(outs[layer], np.float64), expected, atol=TOLERANCE[jnp.float32], rtol=0)


@pytest.mark.parametrize("pages_per_block", [1, 4, 8])
def test_block_sizes_agree_with_reference(pages_per_block):
    rng = np.random.default_rng(2)
    k_pages, v_pages, page_table = paged_layout(rng, num_layers=1, num_kv_heads=1)
    q = rng.standard_normal((len(LENGTHS), 2, HEAD_DIM)).astype(np.float32)
    out = paged_decode_attention(
        jnp.asarray(q),
        jnp.asarray(k_pages),
        jnp.asarray(v_pages),
        0,
        jnp.asarray(page_table),
        jnp.asarray(LENGTHS),
        pages_per_block=pages_per_block,
        interpret=True,
    )
    expected = reference_attention(q, k_pages, v_pages, 0, page_table, LENGTHS)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=TOLERANCE[jnp.float32], rtol=0)


@pytest.mark.parametrize("pages_per_block", [1, 2, 3, 8])
@pytest.mark.parametrize("live_pages", [1, 2, 5, 8, 9])
def test_block_columns_cover_exactly_the_live_table_entries(live_pages, pages_per_block):
    """The kernel's page-table reads: every live column, never one past the live pages.

    (Interpret mode clamps out-of-range gathers and the kernel masks dead positions, so the
    values test above cannot see a read past the live pages; this checks the indices themselves.)
    """
    num_blocks = -(-live_pages // pages_per_block)
    columns = np.concatenate(
        [
            np.asarray(block_table_columns(jnp.int32(block), jnp.int32(live_pages), pages_per_block))
            for block in range(num_blocks)
        ]
    )
    assert set(columns.tolist()) == set(range(live_pages))
    positions = np.arange(num_blocks * pages_per_block)
    # each live column is read at its own position; clamped repeats only after the live pages
    np.testing.assert_array_equal(columns[:live_pages], positions[:live_pages])


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,dtype",
    [(8, 2, 64, jnp.bfloat16), (32, 8, 128, jnp.bfloat16), (4, 4, 128, jnp.float32)],
    ids=["gqa-d64-bf16", "llama8b-heads-bf16", "mha-d128-f32"],
)
def test_lowers_to_one_triton_call_on_the_whole_pool(num_heads, num_kv_heads, head_dim, dtype):
    """Pallas -> Triton IR lowering for CUDA runs on CPU: the kernel lowers, and the stacked pool
    reaches the Triton custom call as the jitted function's own arguments (no slice or copy)."""
    num_slots, page, table_pages, pool_pages, layers = 4, 16, 8, 64, 3
    pool = jax.ShapeDtypeStruct((layers, pool_pages, page, num_kv_heads, head_dim), dtype)
    lowered = (
        jax.jit(paged_decode_attention)
        .trace(
            jax.ShapeDtypeStruct((num_slots, num_heads, head_dim), dtype),
            pool,
            pool,
            jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((num_slots, table_pages), jnp.int32),
            jax.ShapeDtypeStruct((num_slots,), jnp.int32),
        )
        .lower(lowering_platforms=("cuda",))
    )
    main_body = lowered.as_text().split("func.func public @main")[1].split("func.func")[0]
    lines = main_body.splitlines()[1:]
    calls = [line for line in lines if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "@__gpu$xla.gpu.triton" in calls[0]
    assert f"grid_x = {num_slots} " in calls[0] and f"grid_y = {num_kv_heads} " in calls[0]
    pool_uses = [line for line in lines if re.search(r"%arg[12]\b", line)]  # k_pages, v_pages
    assert pool_uses == calls


def _problems(**shape: int) -> str:
    problems = triton_shape_problems(**shape)
    assert problems is not None, shape
    return problems


def test_shape_limits_of_the_triton_kernel():
    assert paged_attention_supported("gpu", head_dim=128, page_size=16, pages_per_block=8)
    assert not paged_attention_supported("cpu", head_dim=128, page_size=16, pages_per_block=8)
    assert not paged_attention_supported("tpu", head_dim=128, page_size=16, pages_per_block=8)
    assert triton_shape_problems(head_dim=128, page_size=16, pages_per_block=8) is None
    assert "head_dim=80" in _problems(head_dim=80, page_size=16, pages_per_block=8)
    assert "head_dim=8" in _problems(head_dim=8, page_size=16, pages_per_block=8)
    assert "page_size=12" in _problems(head_dim=64, page_size=12, pages_per_block=8)
    assert "pages_per_block=3" in _problems(head_dim=64, page_size=16, pages_per_block=3)
    assert "page_size*pages_per_block=8" in _problems(head_dim=64, page_size=4, pages_per_block=2)


def test_bad_shapes_raise_naming_the_argument():
    q = jnp.zeros((2, 4, 16))
    pool = jnp.zeros((1, 8, 4, 2, 16))
    table, lengths = jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="q"):
        paged_decode_attention(jnp.zeros((2, 3, 16)), pool, pool, 0, table, lengths, interpret=True)
    with pytest.raises(ValueError, match="v_pages"):
        paged_decode_attention(q, pool, pool[:, :4], 0, table, lengths, interpret=True)
    with pytest.raises(ValueError, match="page_table"):
        paged_decode_attention(q, pool, pool, 0, table[:1], lengths, interpret=True)
    with pytest.raises(ValueError, match="lengths"):
        paged_decode_attention(q, pool, pool, 0, table, lengths[:1], interpret=True)
    with pytest.raises(ValueError, match="Triton"):  # compiled kernel: page_size*pages_per_block < 16
        paged_decode_attention(q, pool, pool, 0, table, lengths, pages_per_block=2)
