"""Decode writes the KV cache in place and attends over a live window.

References: a float64 numpy softmax attention written here, the compiled executable's own memory
analysis, and the same engine run with the window pinned to max_len (full-length attention).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scalerl_jax.models import Transformer, get_preset
from scalerl_jax.models.layers import decode_attention
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig, Request
from scalerl_jax.sampler.engine import host_settings

CONFIG = get_preset("tiny-llama", initializer_range=0.15)


@pytest.fixture(scope="module")
def model():
    return Transformer(CONFIG, rngs=nnx.Rngs(0))


def cache_bytes(cache) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))


def test_decode_chunk_scratch_is_a_small_fraction_of_the_cache(model):
    """At max_len 4096 with 8 slots the compiled chunk needs <= 10% of the cache as XLA scratch
    (before the in-place write it needed ~176%: a new cache per layer scan plus layer copies)
    and aliases the donated cache to its output."""
    graphdef, params = nnx.split(model)
    engine = Engine(graphdef, CONFIG, EngineConfig(num_slots=8, max_len=4096, chunk_size=16))
    state = jax.eval_shape(engine.init_decode_state)
    held = np.full((8,), 4096, np.int32)
    compiled = engine._generate_jit.lower(params, state, 4096, engine.pages.table, held).compile()
    memory = compiled.memory_analysis()
    assert memory is not None  # the CPU backend reports it
    kv_bytes = cache_bytes(state.cache)
    assert memory.temp_size_in_bytes <= 0.10 * kv_bytes, (memory.temp_size_in_bytes, kv_bytes)
    assert memory.alias_size_in_bytes >= kv_bytes


def reference_attention(q, stacked_k, stacked_v, layer, positions, window):
    """float64: out[b, t, h] = sum_s softmax_s(q . k_s / sqrt(D)) v_s over s < window, s <= positions[b, t]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, stacked_k[layer], stacked_v[layer]))
    batch, length, heads, dim = q.shape
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for t in range(length):
            keys = np.arange(window)[np.arange(window) <= positions[b, t]]
            if keys.size == 0:
                continue
            for h in range(heads):
                scores = k[b, keys, h // group] @ q[b, t, h] / np.sqrt(dim)
                weights = np.exp(scores - scores.max())
                out[b, t, h] = weights @ v[b, keys, h // group] / weights.sum()
    return out


@pytest.mark.parametrize("window,block", [(32, 32), (32, 8), (30, 8), (17, 64)])
def test_decode_attention_matches_float64_reference(window, block):
    """Blockwise online softmax (block dividing the window or not) = one softmax over the window;
    keys at or beyond the window, or after the query's position, never count."""
    rng = np.random.default_rng(0)
    layers, batch, max_len, kv_heads, heads, dim = 3, 4, 40, 2, 6, 8
    stacked_k = rng.normal(size=(layers, batch, max_len, kv_heads, dim)).astype(np.float32)
    stacked_v = rng.normal(size=(layers, batch, max_len, kv_heads, dim)).astype(np.float32)
    q = rng.normal(size=(batch, 1, heads, dim)).astype(np.float32)
    positions = np.array([[0], [5], [window - 1], [-1]])  # the last row has no valid key: zeros
    got = decode_attention(
        jnp.asarray(q),
        jnp.asarray(stacked_k),
        jnp.asarray(stacked_v),
        1,
        jnp.asarray(positions),
        window=window,
        block=block,
    )
    want = reference_attention(q, stacked_k, stacked_v, 1, positions, window)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CONFIG.vocab_size, size=n).tolist() for n in lengths]


def run_batcher(engine, params, requests):
    batcher = ContinuousBatcher(engine, params, seed=5)
    for request in requests:
        batcher.add_request(request)
    return {c.request_id: c for c in batcher.drain()}


def test_live_window_matches_full_length_attention(model):
    """Windows 16 -> 128 as sequences grow (one compile each) give the tokens and log-probs of
    attention over all max_len positions, greedy and sampled, with slots refilled mid-run."""
    graphdef, params = nnx.split(model)
    common: dict[str, Any] = dict(num_slots=3, max_len=128, chunk_size=4, prefill_chunk=8, max_prefill_rows=2)
    windowed = Engine(graphdef, CONFIG, EngineConfig(min_decode_window=16, **common))
    full = Engine(graphdef, CONFIG, EngineConfig(min_decode_window=128, **common))
    lengths = (3, 20, 9, 40, 5)
    requests = [
        Request(i, p, 30 + 15 * i, seed=i, temperature=float(i % 2)) for i, p in enumerate(prompts_of(lengths, seed=2))
    ]
    got, want = run_batcher(windowed, params, requests), run_batcher(full, params, requests)
    for i in range(len(requests)):
        assert got[i].tokens == want[i].tokens, i
        np.testing.assert_allclose(got[i].logprobs, want[i].logprobs, atol=1e-5, rtol=0)
    assert max(len(p) + len(got[i].tokens) for i, p in enumerate(prompts_of(lengths, seed=2))) > 64
    assert 2 <= windowed.compile_counts["generate"] <= 4  # windows among 16, 32, 64, 128
    assert full.compile_counts["generate"] == 1


def test_a_slot_without_pages_stops_the_chunk_instead_of_misreading(model):
    """A second `init_decode_state` resets the engine's host page table while the first state still
    holds a 40-token prompt in slot 0: the device sees no pages for it, so every chunk stops before
    its first step (nothing is written or read outside the pages the host gave out)."""
    graphdef, params = nnx.split(model)
    common: dict[str, Any] = dict(num_slots=2, max_len=128, chunk_size=4, prefill_chunk=64, max_prefill_rows=1)
    engine = Engine(graphdef, CONFIG, EngineConfig(min_decode_window=16, **common))
    prompt = prompts_of([40], seed=4)[0]
    settings = host_settings(
        seeds=np.zeros(1),
        streams=np.zeros(1),
        max_new_tokens=np.full(1, 12),
        temperature=np.zeros(1),
        stop_tokens=np.full((1, 4), -1),
        interrupt=np.zeros(1, bool),
    )
    state = engine.init_decode_state()
    assert engine.reserve(0, len(prompt))
    state = engine.prefill(params, state, engine.prompt_pieces(0, prompt), settings)
    engine.init_decode_state()  # another state: slot 0 now holds no pages on the host
    for _ in range(3):
        state, result = engine.generate(params, state)
        assert int(result.steps) == 0
        assert not np.asarray(result.emitted).any()
    assert bool(np.asarray(result.active)[0])


def test_finished_slots_stop_widening_the_window(model):
    """A long prompt that finished no longer counts: the window falls back to what the short live
    request needs (before, the finished slot's bound kept growing and held the window at 128+)."""
    graphdef, params = nnx.split(model)
    engine = Engine(
        graphdef,
        CONFIG,
        EngineConfig(num_slots=2, max_len=256, chunk_size=4, prefill_chunk=8, max_prefill_rows=2, min_decode_window=16),
    )
    batcher = ContinuousBatcher(engine, params, seed=5)
    batcher.add_request(Request("long prompt", list(range(1, 101)), 8, stop_tokens=()))
    batcher.add_request(Request("short prompt", [4, 5, 6], 200, stop_tokens=()))
    done = []
    while not any(c.request_id == "long prompt" for c in done):
        done += batcher.run_chunk()
    for _ in range(2):
        batcher.run_chunk()
    # the short request is near position 3 + 4 * (chunks so far) < 32: one 32-wide window covers it
    assert engine.decode_window() <= 32, engine.decode_window()
