"""Prompts prefilled in pieces straight into the KV pages, a call at a time between decode chunks.

References: the pieces and the prefill work (real and computed tokens) counted by hand, and greedy
tokens and log-probs of a full, uncached forward pass over prompt + completion (the model's plain
`__call__`, no cache, no pages). Transformers checks the pieces in `test_sampler_hf.py`.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scalerl_jax.models import Transformer, get_preset
from scalerl_jax.models.layers import paged_prefill_attention
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig, PromptPiece, Request

CONFIG = get_preset("tiny-llama", initializer_range=0.15)
CHUNK = 8
COMMON: dict[str, Any] = dict(
    max_len=128, chunk_size=4, prefill_chunk=CHUNK, max_prefill_rows=2, min_decode_window=16, page_size=8
)


@pytest.fixture(scope="module")
def model():
    return Transformer(CONFIG, rngs=nnx.Rngs(0))


@jax.jit
def _forward(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(tokens)


def greedy_reference(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from full uncached forward passes (128 positions, right padded)."""
    graphdef, params = nnx.split(model)
    sequence, logprobs = list(prompt), []
    for _ in range(steps):
        padded = np.zeros((1, 128), np.int32)
        padded[0, : len(sequence)] = sequence
        row = np.asarray(_forward(graphdef, params, jnp.asarray(padded))[0, len(sequence) - 1], np.float64)
        token = int(row.argmax())
        logprobs.append(float(row[token] - row.max() - np.log(np.exp(row - row.max()).sum())))
        sequence.append(token)
    return sequence[len(prompt) :], logprobs


def test_a_prompt_is_cut_into_pieces_of_all_but_its_last_token(model):
    engine = Engine(nnx.split(model)[0], CONFIG, EngineConfig(num_slots=2, **COMMON))
    starts = {n: [piece.start for piece in engine.prompt_pieces(1, list(range(n)))] for n in (1, 2, 9, 10, 17, 25)}
    # n - 1 tokens in pieces of 8; a one-token prompt has one empty piece (its token is fed by decode).
    assert starts == {1: [0], 2: [0], 9: [0], 10: [0, 8], 17: [0, 8], 25: [0, 8, 16]}
    assert engine.prompt_pieces(1, [5, 6])[0] == PromptPiece(1, [5, 6], 0)


def test_a_long_prompt_is_prefilled_a_call_per_turn_while_another_decodes(model):
    """A 5-token prompt decodes; then a 60-token prompt arrives: its 59 tokens are 8 pieces, 2 a
    call, so it is prefilled over 4 turns, one call each, while the first sequence goes on decoding
    a chunk every turn. Both end with the greedy tokens and log-probs of a full forward pass; the
    prefill work is the prompt tokens (4 + 59) computed in 1 x 8 + 4 x 2 x 8 = 72 token rows."""
    graphdef, params = nnx.split(model)
    batcher = ContinuousBatcher(Engine(graphdef, CONFIG, EngineConfig(num_slots=2, **COMMON)), params)
    rng = np.random.default_rng(3)
    short, long = rng.integers(0, CONFIG.vocab_size, 5).tolist(), rng.integers(0, CONFIG.vocab_size, 60).tolist()
    batcher.add_request(Request("short", short, 40))
    done = batcher.run_chunk()
    batcher.add_request(Request("long", long, 12))
    for turn in range(1, 5):
        steps = batcher.counters["decode_steps"]
        done += batcher.run_chunk()
        assert batcher.counters["prefill_calls"] == 1 + turn  # one call a turn, not the 4 at once
        assert batcher.counters["decode_steps"] == steps + 4  # the short one decoded a chunk meanwhile
    done += batcher.drain()
    got = {c.request_id: c for c in done}
    for name, prompt, steps in (("short", short, 40), ("long", long, 12)):
        tokens, logprobs = greedy_reference(model, prompt, steps)
        assert got[name].tokens == tokens, name
        np.testing.assert_allclose(got[name].logprobs, logprobs, atol=1e-5, rtol=0)
    assert batcher.counters["prefill_tokens"] == 4 + 59
    assert batcher.counters["prefill_computed_tokens"] == 1 * CHUNK + 4 * 2 * CHUNK


def test_prompts_admitted_together_fill_whole_calls_and_start_together(model):
    """Four prompts of 9, 17, 25 and 33 tokens on an idle engine: 1 + 2 + 3 + 4 = 10 pieces of 8
    tokens exactly, run in calls of 2 rows in the same turn (nothing decodes yet), so nothing is
    padding, and every sequence decodes from the first chunk on."""
    graphdef, params = nnx.split(model)
    batcher = ContinuousBatcher(Engine(graphdef, CONFIG, EngineConfig(num_slots=4, **COMMON)), params)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (9, 17, 25, 33)]
    for i, prompt in enumerate(prompts):
        batcher.add_request(Request(i, prompt, 6))
    batcher.run_chunk()
    assert batcher.counters["prefill_calls"] == 5
    assert batcher.counters["prefill_tokens"] == batcher.counters["prefill_computed_tokens"] == 80
    got = {c.request_id: c for c in batcher.drain()}
    assert batcher.counters["decode_steps"] == 6  # 6 tokens each in 4 + 2 steps: all 4 started at once
    for i, prompt in enumerate(prompts):
        assert got[i].tokens == greedy_reference(model, prompt, 6)[0], i


@pytest.mark.parametrize("chunk", [0, 6])
def test_paged_prefill_attention_matches_a_float64_reference(chunk):
    """Rows of 4 queries in two page groups, keys read through each row's page table (pages of 4,
    out of range past what the row holds), full causal or chunked (keys from the query's chunk of
    6 on): float64 numpy attention assembled position by position."""
    rng = np.random.default_rng(0)
    layers, groups, pages, page_size, kv_heads, heads, dim = 2, 2, 6, 4, 2, 4, 8
    k_pool, v_pool = (rng.normal(size=(layers, groups, pages, page_size, kv_heads, dim)) for _ in range(2))
    table = np.array([[3, 0, 5, 6], [1, 2, 6, 6], [4, 1, 0, 2]])  # 6: not held
    row_groups = np.array([0, 1, 1])
    positions = np.array([[6, 7, 8, 9], [0, 1, 2, 3], [12, 13, 14, 15]])
    q = rng.normal(size=(3, 4, heads, dim))
    first_key = (positions // chunk) * chunk if chunk else None
    got = paged_prefill_attention(
        jnp.asarray(q, jnp.float32),
        jnp.asarray(k_pool, jnp.float32),
        jnp.asarray(v_pool, jnp.float32),
        1,
        jnp.asarray(row_groups),
        jnp.asarray(table),
        jnp.asarray(positions),
        window=16,
        first_key=None if first_key is None else jnp.asarray(first_key),
    )
    want = np.zeros_like(q)
    for r in range(3):
        for t in range(4):
            lowest = 0 if first_key is None else first_key[r, t]
            keys = range(lowest, positions[r, t] + 1)
            k = np.stack([k_pool[1, row_groups[r], table[r, s // page_size], s % page_size] for s in keys])
            v = np.stack([v_pool[1, row_groups[r], table[r, s // page_size], s % page_size] for s in keys])
            for h in range(heads):
                scores = k[:, h // 2] @ q[r, t, h] / np.sqrt(dim)
                weights = np.exp(scores - scores.max())
                want[r, t, h] = weights @ v[:, h // 2] / weights.sum()
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)
