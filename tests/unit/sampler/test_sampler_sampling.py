"""Sampling math (temperature, top-k, top-p, greedy) against numpy references written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalerl_jax.sampler.sampling import (
    first_argmax,
    gumbel_max,
    log_softmax_at,
    masked_log_probs,
    sample_tokens,
    top_k_mask,
    top_p_mask,
)


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    finite = np.isfinite(x)
    shifted = np.where(finite, x - x[finite].max(), -np.inf)
    return shifted - np.log(np.exp(shifted).sum())


def np_masked_log_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Reference: z/T, keep the k largest, then the nucleus of the renormalised rest, log-softmax."""
    z = logits.astype(np.float64) / temperature
    if 0 < top_k < z.size:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z >= kth, z, -np.inf)
    if top_p < 1.0:
        order = np.argsort(-z, kind="stable")
        probs = np.exp(np_log_softmax(z))[order]
        before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
        keep = np.zeros(z.size, bool)
        keep[order[before < top_p]] = True
        z = np.where(keep, z, -np.inf)
    return np_log_softmax(z)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (7, 0.5), (3, 0.99)])
def test_masked_log_probs_match_numpy(top_k, top_p):
    rng = np.random.default_rng(top_k * 100 + int(top_p * 10))
    logits = rng.normal(scale=3.0, size=(4, 32)).astype(np.float32)
    temperature = np.array([0.5, 1.0, 1.3, 2.0], np.float32)
    got = np.asarray(masked_log_probs(jnp.asarray(logits), jnp.asarray(temperature), top_k=top_k, top_p=top_p))
    for row in range(4):
        want = np_masked_log_probs(logits[row], float(temperature[row]), top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(got[row]), np.isfinite(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[row][finite], want[finite], atol=1e-5)


def test_top_k_keeps_exactly_k_and_top_p_keeps_smallest_prefix():
    # Hand example: probabilities 0.5, 0.25, 0.125, 0.125 (logits log p).
    logits = jnp.log(jnp.array([[0.125, 0.5, 0.125, 0.25]]))
    # top-p 0.7: mass before tokens in order (1, 3, 0/2) is 0, 0.5, 0.75 -> keep tokens 1 and 3.
    np.testing.assert_array_equal(np.asarray(top_p_mask(logits, 0.7))[0], [False, True, False, True])
    # top-p 0.74 -> mass before the third token is 0.75 >= 0.74 -> still tokens 1 and 3.
    np.testing.assert_array_equal(np.asarray(top_p_mask(logits, 0.74))[0], [False, True, False, True])
    # top-p 0.76 -> the third-ranked token (mass before 0.75) is kept and so is its tie (mass
    # before 0.875): ties at the boundary are included.
    np.testing.assert_array_equal(np.asarray(top_p_mask(logits, 0.76))[0], [True, True, True, True])
    np.testing.assert_array_equal(np.asarray(top_k_mask(logits, 1))[0], [False, True, False, False])
    np.testing.assert_array_equal(np.asarray(top_k_mask(logits, 2))[0], [False, True, False, True])


def test_greedy_rows_take_argmax_and_record_temperature_one_logprob():
    rng = np.random.default_rng(1)
    logits = rng.normal(scale=2.0, size=(3, 50)).astype(np.float32)
    keys = jax.random.split(jax.random.key(0), 3)
    tokens, logprobs = sample_tokens(jnp.asarray(logits), keys, jnp.zeros(3), top_k=4, top_p=0.5)
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
    for row in range(3):
        want = np_log_softmax(logits[row])[logits[row].argmax()]
        np.testing.assert_allclose(float(logprobs[row]), want, atol=1e-6)


def test_sampled_frequencies_match_masked_distribution():
    """20,000 draws from a 6-token row: frequencies within 5 sigma of the numpy q; masked never drawn."""
    logits = np.array([2.0, 1.5, 1.0, 0.2, -0.5, 0.9], np.float32)
    temperature, top_k, top_p, draws = 0.8, 4, 0.85, 20_000
    q = np.exp(np_masked_log_probs(logits, temperature, top_k, top_p))
    keys = jax.random.split(jax.random.key(42), draws)
    tokens, logprobs = sample_tokens(
        jnp.broadcast_to(jnp.asarray(logits), (draws, 6)),
        keys,
        jnp.full((draws,), temperature),
        top_k=top_k,
        top_p=top_p,
    )
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    counts = np.bincount(tokens, minlength=6) / draws
    sigma = np.sqrt(q * (1 - q) / draws)
    assert np.all(np.abs(counts - q) <= 5 * sigma + 1e-9), (counts, q)
    assert counts[q == 0].sum() == 0
    np.testing.assert_allclose(logprobs, np.log(q[tokens]), atol=1e-5)


def test_first_argmax_matches_numpy_on_ties_infinities_and_nan():
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, size=(6, 40)).astype(np.float32)  # many ties at the maximum
    x[1] = -np.inf  # every entry -inf: index 0
    x[2, 17] = np.inf
    x[3, [5, 30]] = np.nan  # the first NaN wins, as numpy's argmax
    x[4, [2, 9]] = np.inf
    got = np.asarray(first_argmax(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got.dtype == np.int32


def test_log_softmax_at_matches_numpy():
    rng = np.random.default_rng(4)
    x = rng.normal(scale=5.0, size=(5, 70)).astype(np.float32)
    x[2, :60] = -np.inf  # masked entries
    index = np.array([0, 69, 65, 3, 41])
    got = np.asarray(log_softmax_at(jnp.asarray(x), jnp.asarray(index)))
    want = np.array([np_log_softmax(x[row])[index[row]] for row in range(5)])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_gumbel_max_draws_jax_categorical_tokens_and_its_frequencies():
    """Same keys, same tokens as jax.random.categorical; 20,000 draws within 5 sigma of softmax."""
    log_p = np_log_softmax(np.array([1.0, -0.5, 2.0, 0.0, -np.inf, 0.3], np.float32))
    draws = 20_000
    keys = jax.random.split(jax.random.key(7), draws)
    rows = jnp.broadcast_to(jnp.asarray(log_p, jnp.float32), (draws, 6))
    tokens = np.asarray(gumbel_max(keys, rows))
    np.testing.assert_array_equal(tokens, np.asarray(jax.vmap(jax.random.categorical)(keys, rows)))
    p = np.exp(log_p)
    counts = np.bincount(tokens, minlength=6) / draws
    assert np.all(np.abs(counts - p) <= 5 * np.sqrt(p * (1 - p) / draws) + 1e-9), (counts, p)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 0.9)])
def test_mixed_greedy_and_sampled_rows_record_their_own_logprobs(top_k, top_p):
    """Greedy rows (T = 0) take argmax z and log softmax(z)[y]; sampled rows a token of the masked
    set and log q[y] (numpy). All-greedy batches (no noise drawn) agree with the mixed ones."""
    rng = np.random.default_rng(5)
    logits = rng.normal(scale=2.0, size=(8, 30)).astype(np.float32)
    temperature = np.array([0.0, 1.0, 0.0, 0.7, 1.5, 0.0, 1.0, 0.0], np.float32)
    keys = jax.random.split(jax.random.key(1), 8)
    tokens, logprobs = sample_tokens(jnp.asarray(logits), keys, jnp.asarray(temperature), top_k=top_k, top_p=top_p)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    for row in range(8):
        if temperature[row] == 0:
            assert tokens[row] == logits[row].argmax()
            want = np_log_softmax(logits[row])[tokens[row]]
        else:
            want = np_masked_log_probs(logits[row], float(temperature[row]), top_k, top_p)[tokens[row]]
            assert np.isfinite(want)
        np.testing.assert_allclose(logprobs[row], want, atol=1e-5)
    greedy_rows = temperature == 0
    all_greedy = sample_tokens(
        jnp.asarray(logits[greedy_rows]), keys[greedy_rows], jnp.zeros(int(greedy_rows.sum())), top_k=top_k, top_p=top_p
    )
    np.testing.assert_array_equal(np.asarray(all_greedy[0]), tokens[greedy_rows])
    np.testing.assert_allclose(np.asarray(all_greedy[1]), logprobs[greedy_rows], atol=1e-6)
