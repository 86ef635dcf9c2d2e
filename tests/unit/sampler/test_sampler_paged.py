"""Paged KV cache: page bookkeeping, attention over pages, a short pool, no compile and
no host read on the decode path after warm-up, no page moved between devices.

References: page counts worked out by hand, a float64 numpy attention that assembles each slot's
keys from its page table, the same requests on a fully provisioned pool, XLA's own compile events
(`jax.monitoring`), and the collectives of the compiled sharded program.
"""

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scalerl_jax.models import Transformer, get_preset, make_mesh, param_shardings
from scalerl_jax.models.layers import grouped_paged_attention, paged_decode_attention_xla
from scalerl_jax.models.sharding import use_mesh_rules
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig, Request
from scalerl_jax.sampler.pages import PageTable, pages_for

CONFIG = get_preset("tiny-llama", initializer_range=0.15)


@pytest.fixture(scope="module")
def params():
    return nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))


def test_page_table_grows_releases_and_reports_shortfall_per_group():
    table = PageTable(num_slots=4, groups=2, pages_per_group=5, page_size=4, pages_per_slot=3)
    assert pages_for(9, 4) == 3 and pages_for(8, 4) == 2 and pages_for(0, 4) == 0
    assert table.grow(0, 9)  # 3 pages of group 0
    assert table.held.tolist() == [3, 0, 0, 0] and table.free_pages(0) == 2 and table.free_pages(1) == 5
    assert sorted(table.table[0].tolist()) == sorted(set(table.table[0].tolist()))  # distinct pages
    assert not table.grow(1, 12)  # slot 1 is in group 0 too: needs 3, 2 are free; nothing taken
    assert table.held[1] == 0 and table.free_pages(0) == 2
    assert table.grow(2, 12) and table.free_pages(1) == 2  # group 1 is separate
    assert table.shortfall({0: 12, 1: 8}) == {}  # slot 0 needs 3 - 3 = 0 more, slot 1 needs 2: 2 free
    assert table.shortfall({0: 12, 1: 12, 3: 8}) == {0: 1}  # slot 1 needs 3 of group 0's 2 free; slot 3
    table.release(0)  # (group 1) needs 2 of 2 free
    assert table.free_pages(0) == 5 and table.held[0] == 0 and (table.table[0] == 5).all()
    assert table.shortfall({0: 12, 1: 8}) == {}
    with pytest.raises(ValueError, match="split into 3"):
        PageTable(num_slots=4, groups=3, pages_per_group=5, page_size=4, pages_per_slot=3)
    with pytest.raises(ValueError, match="num_pages"):
        PageTable(num_slots=4, groups=1, pages_per_group=2, page_size=4, pages_per_slot=3)


def reference_paged(q, k_pages, v_pages, layer, table, lengths):
    """float64: slot b attends to keys s < lengths[b], key s read from page table[b, s // P], row s % P."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k_pages[layer], v_pages[layer]))
    slots, heads, dim = q.shape
    page_size, group = k.shape[1], heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(slots):
        if not lengths[b]:
            continue
        keys = np.stack([k[table[b, s // page_size], s % page_size] for s in range(lengths[b])])
        values = np.stack([v[table[b, s // page_size], s % page_size] for s in range(lengths[b])])
        for h in range(heads):
            scores = keys[:, h // group] @ q[b, h] / np.sqrt(dim)
            weights = np.exp(scores - scores.max())
            out[b, h] = weights @ values[:, h // group] / weights.sum()
    return out


@pytest.mark.parametrize("window,pages_per_block", [(32, 2), (32, 3), (24, 8)])
def test_paged_attention_matches_float64_reference(window, pages_per_block):
    """Shuffled, non-contiguous pages of a shared pool; lengths 0, 1, a page boundary, the window;
    page ids past each length are garbage (out of range or another slot's) and never count."""
    rng = np.random.default_rng(1)
    layers, pages, page_size, kv_heads, heads, dim, slots = 3, 60, 4, 2, 6, 8, 5
    k_pages = rng.normal(size=(layers, pages, page_size, kv_heads, dim)).astype(np.float32)
    v_pages = rng.normal(size=(layers, pages, page_size, kv_heads, dim)).astype(np.float32)
    q = rng.normal(size=(slots, heads, dim)).astype(np.float32)
    lengths = np.array([0, 1, 8, window, 13], np.int32)
    table = rng.permutation(pages)[: slots * 10].reshape(slots, 10).astype(np.int32)
    for b, length in enumerate(lengths):
        table[b, pages_for(length, page_size) :] = rng.choice([pages, 0, 3], size=10 - pages_for(length, page_size))
    got = paged_decode_attention_xla(
        jnp.asarray(q),
        jnp.asarray(k_pages),
        jnp.asarray(v_pages),
        1,
        jnp.asarray(table),
        jnp.asarray(lengths),
        window=window,
        pages_per_block=pages_per_block,
    )
    want = reference_paged(q, k_pages, v_pages, 1, table, lengths)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


def test_grouped_attention_reads_each_slot_from_its_own_group():
    """Two page groups: slots 0-1 index group 0's pages, slots 2-3 group 1's (same page ids)."""
    rng = np.random.default_rng(2)
    k_pool = rng.normal(size=(1, 2, 6, 4, 1, 8)).astype(np.float32)
    v_pool = rng.normal(size=(1, 2, 6, 4, 1, 8)).astype(np.float32)
    q = rng.normal(size=(4, 2, 8)).astype(np.float32)
    table = np.array([[0, 1], [2, 3], [0, 1], [5, 4]], np.int32)
    lengths = np.array([7, 5, 7, 8], np.int32)
    got = grouped_paged_attention(
        jnp.asarray(q),
        jnp.asarray(k_pool),
        jnp.asarray(v_pool),
        0,
        jnp.asarray(table),
        jnp.asarray(lengths),
        window=8,
        pages_per_block=1,
        kernel="xla",
    )
    for b in range(4):
        group = b // 2
        want = reference_paged(
            q[b : b + 1], k_pool[:, group], v_pool[:, group], 0, table[b : b + 1], lengths[b : b + 1]
        )
        np.testing.assert_allclose(np.asarray(got[b : b + 1]), want, atol=1e-5, rtol=0)


def requests(count, *, max_new):
    rng = np.random.default_rng(3)
    return [Request(i, rng.integers(0, CONFIG.vocab_size, 5 + 3 * i).tolist(), max_new, seed=i) for i in range(count)]


def drain(engine, params, reqs):
    batcher = ContinuousBatcher(engine, params, seed=7)
    for request in reqs:
        batcher.add_request(request)
    return {c.request_id: c for c in batcher.drain()}, batcher


def test_a_short_pool_preempts_and_gives_the_tokens_of_a_full_pool(params):
    """4 slots of max_len 64 on 10 pages of 8 tokens (a contiguous cache would need 32 pages): the
    youngest sequence is preempted when its group runs short and starts over, and every request
    ends with the greedy tokens of the fully provisioned pool."""
    graphdef, state = params
    common: dict[str, Any] = dict(
        num_slots=4,
        max_len=64,
        chunk_size=4,
        prefill_chunk=8,
        max_prefill_rows=4,
        min_decode_window=16,
        page_size=8,
    )
    reqs = requests(6, max_new=40)
    full, _ = drain(Engine(graphdef, CONFIG, EngineConfig(**common)), state, reqs)
    short_engine = Engine(graphdef, CONFIG, EngineConfig(num_pages=10, **common))
    short, batcher = drain(short_engine, state, reqs)
    assert batcher.counters["preempted"] >= 1
    for i in range(len(reqs)):
        assert short[i].tokens == full[i].tokens, i
        np.testing.assert_allclose(short[i].logprobs, full[i].logprobs, atol=1e-5, rtol=0)
    pool = short_engine.init_decode_state().cache["k"]
    assert pool.shape[1:4] == (1, 10, 8)
    assert short_engine.pages.free_pages(0) == 10


def test_no_compile_and_no_host_read_on_the_decode_path_after_warm_up(params):
    """After `warm_up`, prompts of every length up to the limit, samples sharing a prompt, refills
    and finishing slots cause zero XLA compiles (counted by JAX's own compile events), and a chunk runs with device-to-host
    transfers disallowed (no host sync inside a chunk)."""
    graphdef, state = params
    engine = Engine(
        graphdef,
        CONFIG,
        EngineConfig(
            num_slots=4,
            max_len=96,
            chunk_size=4,
            prefill_chunk=8,
            max_prefill_rows=4,
            min_decode_window=16,
            page_size=8,
        ),
    )
    batcher = ContinuousBatcher(engine, state, seed=3)
    batcher.warm_up(max_prompt_length=40)
    # Prefill: rows 1, 2, 4 x windows 16, 32, 64 (keys below 39), whatever the prompts' lengths.
    assert engine.compile_counts["prefill"] == 3 * 3
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration_secs, **_: (
            compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, CONFIG.vocab_size, length).tolist() for length in [1, 7, 8, 9, 17, 33, 40, 3, 25, 12]]
    prompts[2:2] = [prompts[1], prompts[1]]  # samples of one prompt: forked onto its pages
    for i, prompt in enumerate(prompts):
        batcher.add_request(Request(i, prompt, 20 + 5 * (i % 4), seed=i, temperature=1.0))
    done = batcher.drain()
    assert len(done) == 12 and batcher.counters["forked_requests"] == 2 and compiles == []
    decode_state = engine.init_decode_state()
    assert engine.reserve(0, 5)
    decode_state = engine.prefill(state, decode_state, engine.prompt_pieces(0, [0] * 5), _settings(engine, 1))
    with jax.transfer_guard_device_to_host("disallow"):
        decode_state, result = engine.generate(state, decode_state)
    assert int(result.steps) == 4


def _settings(engine, rows):
    from scalerl_jax.sampler.engine import host_settings

    return host_settings(
        seeds=np.zeros(rows),
        streams=np.arange(rows),
        max_new_tokens=np.full(rows, 50),
        temperature=np.ones(rows),
        stop_tokens=np.full((rows, engine.config.max_stop_tokens), -1),
        interrupt=np.zeros(rows, bool),
    )


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_sharded_decode_moves_no_page_between_devices(params):
    """Slots over a data axis of 4, KV heads over tensor 2: the page pool is split into 4 groups on
    their devices and the compiled chunk's collectives carry only per-token values, none as large
    as one device's share of the pool (a gather across page groups would all-gather it)."""
    graphdef, state = params
    mesh = make_mesh((4, 1, 2), devices=jax.devices()[:8])
    sharded = jax.device_put(state, param_shardings(state, mesh))
    engine = Engine(graphdef, CONFIG, EngineConfig(num_slots=8, max_len=256, chunk_size=4), mesh=mesh)
    decode_state = engine.init_decode_state()
    assert engine.page_groups == 4 and decode_state.cache["k"].shape[1] == 4
    with use_mesh_rules(mesh, engine.rules):
        hlo = (
            engine._generate_jit.lower(sharded, decode_state, 256, engine.pages.table, np.zeros(8, np.int32))
            .compile()
            .as_text()
        )
    assert hlo is not None
    shard_bytes = decode_state.cache["k"].addressable_shards[0].data.nbytes
    sizes = []
    for line in hlo.splitlines():
        match = re.search(r"= (\w+)\[([\d,]*)\]\S* (all-gather|all-to-all|all-reduce|collective-permute)", line)
        if match:
            itemsize = np.dtype(
                {"f32": np.float32, "s32": np.int32, "pred": bool, "u32": np.uint32}.get(match.group(1), np.float32)
            ).itemsize
            sizes.append(itemsize * int(np.prod([int(d) for d in match.group(2).split(",") if d] or [1])))
    assert sizes and max(sizes) < shard_bytes / 8, (max(sizes), shard_bytes)


@pytest.mark.slow
def test_pallas_kernel_in_the_engine_gives_the_tokens_of_the_xla_path(params):
    """(slow: ~1 min of interpret mode) decode_kernel='pallas' (interpret mode on CPU) decodes the same greedy tokens and log-probs as
    the portable blockwise attention, with slots refilled mid-run on a short pool."""
    graphdef, state = params
    common: dict[str, Any] = dict(
        num_slots=2,
        max_len=48,
        chunk_size=4,
        prefill_chunk=8,
        max_prefill_rows=2,
        min_decode_window=16,
        page_size=8,
        num_pages=8,
    )
    reqs = requests(3, max_new=12)
    want, _ = drain(Engine(graphdef, CONFIG, EngineConfig(decode_kernel="xla", **common)), state, reqs)
    got, _ = drain(Engine(graphdef, CONFIG, EngineConfig(decode_kernel="pallas", **common)), state, reqs)
    for i in range(len(reqs)):
        assert got[i].tokens == want[i].tokens, i
        np.testing.assert_allclose(got[i].logprobs, want[i].logprobs, atol=1e-5, rtol=0)
