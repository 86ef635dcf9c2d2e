"""Continuous-batching engine against naive references written here.

The references recompute the full causal forward pass (`model(tokens)`, no KV cache, one
sequence at a time) for every new token, or, for the in-flight param swap, decode one sequence
at a time with a plain KV cache whose early entries come from the old params.
"""

import types
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scalerl_jax.config import recipes
from scalerl_jax.config.adapters import engine_config_of
from scalerl_jax.models import CheckpointTokenizer, Transformer, get_preset, init_kv_cache
from scalerl_jax.sampler import (
    Completion,
    ContinuousBatcher,
    Engine,
    EngineConfig,
    InterruptionConfig,
    Request,
    generate,
)
from scalerl_jax.sampler.engine import host_settings
from scalerl_jax.sampler.engine_config import interruption_from_tokenizer

# Larger-than-default init so next-token logits are well separated and greedy argmax is robust
# to float rounding differences between the cached and the full-recompute paths.
CONFIG = get_preset("tiny-llama", initializer_range=0.15)
TOP_K, TOP_P = 20, 0.9


@pytest.fixture(scope="module")
def model():
    return Transformer(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def other_model():
    return Transformer(CONFIG, rngs=nnx.Rngs(1))


PHRASE = (250, 251, 252)
THINK_LO, THINK_HI, ANSWER = 4, 8, 3
INTERRUPTION_PROMPT_LENGTHS = (5, 3, 8, 7, 2, 6)


@pytest.fixture(scope="module")
def end_think(model):
    """A bigram that interruption prompt 0 produces greedily as its tokens 1-2 (natural close)."""
    return tuple(naive_greedy(model, prompts_of(INTERRUPTION_PROMPT_LENGTHS, seed=21)[0], 3)[1:3])


@pytest.fixture(scope="module")
def engine(model, end_think):
    """3 slots, 4 steps a chunk, top-k/top-p on (greedy rows ignore them), forced interruption
    configured (requests opt out with interrupt=False)."""
    graphdef, _ = nnx.split(model)
    interruption = InterruptionConfig(PHRASE, end_think, THINK_LO, THINK_HI, ANSWER)
    return Engine(
        graphdef,
        CONFIG,
        EngineConfig(
            num_slots=3,
            max_len=64,
            chunk_size=4,
            top_k=TOP_K,
            top_p=TOP_P,
            prefill_chunk=8,
            max_prefill_rows=2,
            interruption=interruption,
        ),
    )


@pytest.fixture(scope="module")
def plain_engine(model):
    """3 slots, 5 steps a chunk, pure temperature sampling, no interruption."""
    graphdef, _ = nnx.split(model)
    return Engine(
        graphdef, CONFIG, EngineConfig(num_slots=3, max_len=64, chunk_size=5, prefill_chunk=8, max_prefill_rows=2)
    )


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CONFIG.vocab_size, size=n).tolist() for n in lengths]


REFERENCE_LENGTH = 64  # sequences are right padded to this (causal: padding changes nothing before it)


@jax.jit
def _jitted_forward(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(tokens)


def full_logits(model, sequence):
    """Logits [len, V] of a full, uncached forward pass over one sequence (right padded)."""
    padded = np.zeros((1, REFERENCE_LENGTH), np.int32)
    padded[0, : len(sequence)] = sequence
    graphdef, params = nnx.split(model)
    logits = _jitted_forward(graphdef, params, jnp.asarray(padded))
    return np.asarray(logits[0, : len(sequence)], np.float64)


def naive_greedy(model, prompt, steps, stop=()):
    sequence = list(prompt)
    for _ in range(steps):
        token = int(full_logits(model, sequence)[-1].argmax())
        sequence.append(token)
        if token in stop:
            break
    return sequence[len(prompt) :]


def run(engine, params, requests, *, seed=0) -> dict[Any, Completion]:
    batcher = ContinuousBatcher(engine, params, seed=seed)
    for request in requests:
        batcher.add_request(request)
    done = batcher.drain()
    assert batcher.idle and batcher.num_free_slots == engine.config.num_slots
    return {c.request_id: c for c in done}


def test_greedy_continuous_batching_equals_full_recompute(model, engine):
    lengths = [3, 9, 1, 5, 14, 2, 12, 6]  # 8 prompts through 3 slots, prefill buckets 8 and 16
    budgets = [12, 5, 9, 12, 3, 7, 12, 10]
    prompts = prompts_of(lengths)
    _, params = nnx.split(model)
    requests = [Request(i, p, budget, interrupt=False) for i, (p, budget) in enumerate(zip(prompts, budgets))]
    got = run(engine, params, requests)
    assert sorted(got) == list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        want = naive_greedy(model, prompt, budgets[i])
        assert got[i].tokens == want, i
        assert got[i].finish_reason == "length" and got[i].truncated
        assert got[i].versions == [0] * budgets[i] and all(got[i].sampled)
        # Greedy records the temperature-1 log-prob of the argmax token.
        logits = full_logits(model, prompt + want)
        for t, token in enumerate(want):
            row = logits[len(prompt) - 1 + t]
            want_lp = row[token] - row.max() - np.log(np.exp(row - row.max()).sum())
            assert abs(got[i].logprobs[t] - want_lp) < 1e-5
    assert engine.compile_counts["generate"] == 1
    # Shapes (rows, window) with rows in {1, 2} and the one window (max_len 64): at most 2 compiles.
    assert engine.compile_counts["prefill"] <= 2


def test_engine_protocol_prefill_generate(model, engine):
    """The engine used directly: two prompts prefilled into slots 2 and 0 in one call, one chunk of
    greedy steps."""
    prompts = prompts_of([5, 3], seed=41)
    _, params = nnx.split(model)
    state = engine.init_decode_state()
    assert engine.reserve(2, 5) and engine.reserve(0, 3)
    pieces = engine.prompt_pieces(2, prompts[0]) + engine.prompt_pieces(0, prompts[1])
    settings = host_settings(
        seeds=np.zeros(2),
        streams=np.arange(2),
        max_new_tokens=np.full(2, 9),
        temperature=np.zeros(2),
        stop_tokens=np.full((2, 4), -1),
        interrupt=np.zeros(2, bool),
    )
    state = engine.prefill(params, state, pieces, settings)
    state, result = engine.generate(params, state)
    chunk = engine.config.chunk_size
    assert int(result.steps) == chunk
    np.testing.assert_array_equal(np.asarray(result.emitted), [[True] * chunk, [False] * chunk, [True] * chunk])
    assert np.asarray(result.tokens)[2].tolist() == naive_greedy(model, prompts[0], chunk)
    assert np.asarray(result.tokens)[0].tolist() == naive_greedy(model, prompts[1], chunk)
    np.testing.assert_array_equal(np.asarray(result.active), [True, False, True])


def test_stop_token_ends_sequence_and_is_kept(model, engine):
    prompt = prompts_of([6], seed=3)[0]
    free_run = naive_greedy(model, prompt, 10)
    stop = free_run[4]
    first = free_run.index(stop)
    _, params = nnx.split(model)
    got = run(engine, params, [Request("s", prompt, 10, stop_tokens=(stop,), interrupt=False)])["s"]
    assert got.tokens == free_run[: first + 1]
    assert got.finish_reason == "stop" and not got.truncated


def np_masked_log_probs(logits, temperature, top_k, top_p):
    """log softmax of z/T after top-k, then top-p of the renormalised rest (numpy reference)."""
    z = logits / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[::-1][top_k - 1], z, -np.inf)
    if top_p < 1.0:
        order = np.argsort(-z, kind="stable")
        p = np.exp(z - z.max())
        p = p / p.sum()
        before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        keep = np.zeros(z.size, bool)
        keep[order[before < top_p]] = True
        z = np.where(keep, z, -np.inf)
    finite = np.isfinite(z)
    return np.where(finite, z - z.max() - np.log(np.exp(z[finite] - z.max()).sum()), -np.inf)


@pytest.mark.parametrize("which,top_k,top_p", [("plain", 0, 1.0), ("masked", TOP_K, TOP_P)])
def test_sampled_behaviour_logprobs_equal_full_forward(model, plain_engine, engine, which, top_k, top_p):
    engine = plain_engine if which == "plain" else engine
    temperature = 0.7
    prompts = prompts_of([4, 8, 2, 7, 5], seed=5)
    _, params = nnx.split(model)
    got = run(
        engine,
        params,
        [Request(i, p, 10, seed=100 + i, temperature=temperature, interrupt=False) for i, p in enumerate(prompts)],
        seed=7,
    )
    for i, prompt in enumerate(prompts):
        tokens = got[i].tokens
        logits = full_logits(model, prompt + tokens)
        for t, token in enumerate(tokens):
            ref = np_masked_log_probs(logits[len(prompt) - 1 + t], temperature, top_k, top_p)
            assert np.isfinite(ref[token]), (i, t, "sampled a masked token")
            assert abs(got[i].logprobs[t] - ref[token]) < 1e-5, (i, t)
    # Not greedy: some sampled token differs from the argmax.
    assert any(
        tok != int(full_logits(model, prompts[i] + got[i].tokens[:t])[-1].argmax())
        for i in range(len(prompts))
        for t, tok in enumerate(got[i].tokens)
    )


def test_samples_do_not_depend_on_slot_or_arrival_order(model, plain_engine):
    """A request's PRNG stream is its own: reversed arrival (other slots, chunk phases) = same tokens."""
    prompts = prompts_of([3, 8, 5, 1, 2, 6, 7], seed=9)
    _, params = nnx.split(model)
    requests = [Request(i, p, 4 + 2 * i, seed=i, temperature=1.0) for i, p in enumerate(prompts)]
    forward = run(plain_engine, params, requests, seed=11)
    backward = run(plain_engine, params, requests[::-1], seed=11)
    for i in range(len(prompts)):
        assert forward[i].tokens == backward[i].tokens
    other_seed = run(plain_engine, params, requests, seed=12)
    assert any(forward[i].tokens != other_seed[i].tokens for i in range(len(prompts)))


@jax.jit
def _cached_argmax(graphdef, params, token, position, cache):
    """Feed one token at `position` of a one-row cache; argmax of the next-token logits."""
    current = nnx.merge(graphdef, params)
    hidden, cache = current.forward_cached(token[None, None], position[None, None], cache)
    return jnp.argmax(current.head(hidden[0, -1])), cache


def cached_greedy_with_swap(old_model, new_model, prompt, steps, swap_after):
    """One sequence, one token at a time through a plain KV cache; old params, then new ones.

    Token k (k >= 1) is produced by feeding token k-1; tokens [0, swap_after) come from the old
    params, so the cache entries of the prompt and of tokens 0..swap_after-2 are written by the
    old params and all later entries by the new ones.
    """
    cache = init_kv_cache(CONFIG, 1, REFERENCE_LENGTH)
    sequence = list(prompt)
    out = []
    for position, token in enumerate(sequence[:-1]):  # the prompt, token by token, old params
        _, cache = _cached_argmax(*nnx.split(old_model), jnp.int32(token), jnp.int32(position), cache)
    while len(out) < steps:
        current = old_model if len(out) < swap_after else new_model
        position = len(prompt) + len(out) - 1
        token, cache = _cached_argmax(*nnx.split(current), jnp.int32(sequence[-1]), jnp.int32(position), cache)
        out.append(int(token))
        sequence.append(int(token))
    return out


def test_param_swap_mid_generation_keeps_kv_cache(model, other_model, engine):
    prompt = prompts_of([7], seed=13)[0]
    _, old_params = nnx.split(model)
    _, new_params = nnx.split(other_model)
    batcher = ContinuousBatcher(engine, old_params)
    batcher.add_request(Request("swap", prompt, 12, interrupt=False))
    assert batcher.run_chunk() == []  # chunk 1 (tokens 0..3) dispatched under version 0
    seconds = batcher.update_params(new_params, version=1)
    assert seconds >= 0.0
    done = batcher.drain()
    assert [c.request_id for c in done] == ["swap"]
    got = done[0]
    chunk = engine.config.chunk_size
    assert got.versions == [0] * chunk + [1] * (12 - chunk)
    want = cached_greedy_with_swap(model, other_model, prompt, 12, swap_after=chunk)
    assert got.tokens == want
    # The reference is discriminating: recomputing the new params' cache from scratch differs.
    recomputed = naive_greedy(other_model, prompt + want[:chunk], 12 - chunk)
    assert recomputed != want[chunk:]
    # The pushed params are a copy, not an alias of the caller's buffers.
    leaf_pushed = jax.tree.leaves(batcher._params)[0]
    leaf_source = jax.tree.leaves(new_params)[0]
    assert leaf_pushed.unsafe_buffer_pointer() != leaf_source.unsafe_buffer_pointer()
    assert batcher.stats()["sampler/params_version"] == 1.0


# ------------------------------------------------------------------------- forced interruption
def naive_interrupted_greedy(model, prompt, *, think_budget, end_think, max_new, stop=()):
    """Plain-Python statement of the length-control rule with full recompute for every token.

    Thinking: sample greedily; thinking closes when the last len(end_think) sampled tokens equal
    end_think. If think_budget sampled thinking tokens were produced without closing, append the
    phrase (not sampled). Then sample at most ANSWER answer tokens. A stop token ends everything.
    Returns (tokens, sampled flags, interrupted, num_think, num_answer).
    """
    sequence, tokens, sampled = list(prompt), [], []
    thinking, interrupted, num_think, num_answer = True, False, 0, 0
    while len(tokens) < max_new:
        if thinking and num_think == think_budget:
            for token in PHRASE[: max_new - len(tokens)]:
                tokens.append(token)
                sampled.append(False)
            sequence += PHRASE
            thinking, interrupted = False, True
            continue
        token = int(full_logits(model, sequence)[-1].argmax())
        sequence.append(token)
        tokens.append(token)
        sampled.append(True)
        if thinking:
            num_think += 1
            if tokens[-len(end_think) :] == list(end_think):
                thinking = False
        else:
            num_answer += 1
        if token in stop or (not thinking and num_answer >= ANSWER):
            break
    return tokens, sampled, interrupted, num_think, num_answer


def test_interruption_forces_phrase_once_at_drawn_budget(model, engine, end_think):
    prompts = prompts_of(INTERRUPTION_PROMPT_LENGTHS, seed=21)
    _, params = nnx.split(model)
    max_new = 20
    got = run(engine, params, [Request(i, p, max_new, seed=i) for i, p in enumerate(prompts)])
    budgets = [got[i].think_budget for i in range(len(prompts))]
    assert all(THINK_LO <= b <= THINK_HI for b in budgets)
    assert len(set(budgets)) > 1, budgets  # drawn per request, not one constant
    for i, prompt in enumerate(prompts):
        want, want_sampled, interrupted, num_think, num_answer = naive_interrupted_greedy(
            model, prompt, think_budget=budgets[i], end_think=end_think, max_new=max_new
        )
        c = got[i]
        assert c.tokens == want and c.sampled == want_sampled, i
        assert (c.interrupted, c.num_think_tokens, c.num_answer_tokens) == (interrupted, num_think, num_answer), i
        forced = [t for t, s in enumerate(c.sampled) if not s]
        if interrupted:
            # Exactly one phrase, right after the drawn budget of thinking tokens, logprob 0.
            assert forced == list(range(budgets[i], budgets[i] + len(PHRASE)))
            assert [c.tokens[t] for t in forced] == list(PHRASE)
            assert all(c.logprobs[t] == 0.0 for t in forced)
            assert c.num_answer_tokens == ANSWER and len(c.tokens) == budgets[i] + len(PHRASE) + ANSWER
            assert c.finish_reason == "answer_budget" and c.truncated
        else:
            assert forced == []
    # Prompt 0 closes its thinking naturally at token 2 (budget >= 4): no phrase, then answers.
    assert not got[0].interrupted and got[0].num_think_tokens == 3
    assert got[0].num_answer_tokens == ANSWER
    assert sum(got[i].interrupted for i in range(len(prompts))) >= 3


def test_stop_before_think_budget_means_no_phrase(model, engine, end_think):
    prompts = prompts_of(INTERRUPTION_PROMPT_LENGTHS, seed=21)
    _, params = nnx.split(model)
    prompt = prompts[3]
    free_run = naive_greedy(model, prompt, 3)
    stop = free_run[2]  # greedy reaches this token by index 2 < THINK_LO
    got = run(engine, params, [Request("eos", prompt, 20, stop_tokens=(stop,))])["eos"]
    want, _, interrupted, num_think, _ = naive_interrupted_greedy(
        model, prompt, think_budget=got.think_budget, end_think=end_think, max_new=20, stop=(stop,)
    )
    assert not interrupted and got.tokens == want and len(want) <= 3
    assert not got.interrupted and all(got.sampled) and got.finish_reason == "stop"
    assert got.num_think_tokens == num_think and got.num_answer_tokens == 0


def test_stop_on_the_last_thinking_token_means_no_phrase(model, engine):
    """EOS as the budget-th thinking token: the sequence ends there, no phrase, not interrupted."""
    prompts = prompts_of(INTERRUPTION_PROMPT_LENGTHS, seed=21)
    _, params = nnx.split(model)
    probes = run(engine, params, [Request(i, p, 30, seed=i) for i, p in enumerate(prompts)])
    # A prompt that got interrupted and whose last thinking token does not occur earlier.
    index = next(
        i
        for i, c in probes.items()
        if c.interrupted and c.tokens[c.think_budget - 1] not in c.tokens[: c.think_budget - 1]
    )
    probe = probes[index]
    stop = probe.tokens[probe.think_budget - 1]
    got = run(engine, params, [Request("x", prompts[index], 30, seed=index, stop_tokens=(stop,))])["x"]
    assert got.think_budget == probe.think_budget  # same request stream, same draw
    assert got.tokens == probe.tokens[: probe.think_budget]
    assert not got.interrupted and got.finish_reason == "stop" and all(got.sampled)


def test_truncation_inside_phrase_and_interruption_off_per_request(model, engine):
    prompts = prompts_of(INTERRUPTION_PROMPT_LENGTHS, seed=21)
    _, params = nnx.split(model)
    prompt = prompts[1]
    probe = run(engine, params, [Request("probe", prompt, 30, seed=1)])["probe"]
    assert probe.interrupted
    cut = probe.think_budget + 1  # room for one phrase token only
    got = run(
        engine, params, [Request("cut", prompt, cut, seed=1), Request("off", prompt, 10, seed=1, interrupt=False)]
    )
    assert got["cut"].tokens == probe.tokens[:cut] and got["cut"].truncated
    assert got["cut"].finish_reason == "length" and got["cut"].sampled[-1] is False
    assert got["off"].think_budget == -1 and all(got["off"].sampled)
    assert got["off"].tokens == naive_greedy(model, prompt, 10)


def test_generate_api_matches_reference_and_rejects_bad_input(model):
    prompts = prompts_of([2, 6, 3], seed=31)
    out = generate(model, prompts, max_new_tokens=5, num_slots=2, chunk_size=3)
    assert [c.request_id for c in out] == [0, 1, 2]
    for prompt, completion in zip(prompts, out):
        assert completion.tokens == naive_greedy(model, prompt, 5)
    with pytest.raises(ValueError, match="prompt_tokens\\[1\\]=999"):
        generate(model, [[1, 999]], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_tokens is empty or not a flat list"):
        generate(model, [[]], max_new_tokens=2)


def test_interruption_from_tokenizer_encodes_phrase_and_end_think():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "Okay,": 1, "time": 2, "is": 3, "up.": 4, "</think>": 5}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    config = interruption_from_tokenizer(
        tokenizer,
        phrase="Okay, time is up. </think>",
        end_think="</think>",
        think_budget_min=10,
        think_budget_max=12,
        answer_budget=4,
    )
    assert config.phrase_ids == (1, 2, 3, 4, 5) and config.end_think_ids == (5,)
    with pytest.raises(ValueError, match="think budget range"):
        InterruptionConfig((1,), (5,), 0, 3, 4)


class PhraseTokenizer:
    """`tokenizers.Tokenizer.encode` over a fixed table of whole strings."""

    def __init__(self, table):
        self.table = table

    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return types.SimpleNamespace(ids=list(self.table[text]))


def test_engine_config_from_the_8b_recipe():
    config = recipes.scalerl_8b()
    s = config.sampler
    # A stand-in: engine_config_of reads only `stop_ids` and `tokenizer.encode`.
    tokens = cast(
        CheckpointTokenizer,
        types.SimpleNamespace(
            stop_ids=(2, 5, 9), tokenizer=PhraseTokenizer({s.interruption_phrase: (40, 41, 42), s.think_end: (42,)})
        ),
    )
    assert engine_config_of(config, tokens) == EngineConfig(
        num_slots=256,
        max_len=2048 + 14336,
        chunk_size=64,
        top_k=0,
        top_p=1.0,
        max_stop_tokens=3,
        interruption=InterruptionConfig((40, 41, 42), (42,), 10240, 12288, 2048),
        page_size=16,
        num_pages=0,
        decode_kernel="auto",
    )
    config.data.answer_format = "plain"  # no think phase, nothing to interrupt
    assert engine_config_of(config, tokens).interruption is None
