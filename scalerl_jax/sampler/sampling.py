"""Token sampling with fp32 behaviour log-probs of the distribution actually sampled from.

For a row of logits `z` (fp32, shape [V]) and temperature `T > 0` the sampler draws from

    q = softmax(mask(z / T))

where `mask` first sets to -inf every logit outside the top-k set (k largest of z / T, ties at
the k-th value kept), then every logit outside the top-p nucleus of what remains (the smallest
prefix of tokens sorted by decreasing probability whose cumulative probability reaches p; a token
is kept when the cumulative probability of the tokens strictly before it is < p). This is the
order Hugging Face's warpers apply (temperature, top-k, top-p). The behaviour log-prob of
the drawn token `y` is `log q[y]`, i.e. the log-prob under the masked, tempered distribution.

Greedy decoding (`T == 0`) takes `argmax z` and records `log softmax(z)[y]` at temperature 1
(there is no sampling distribution at T = 0; temperature 1 is the natural convention and is what
a train step at temperature 1 recomputes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k_mask(scaled_logits: jax.Array, top_k: int) -> jax.Array:
    """Bool mask [..., V]: True where `scaled_logits` >= the k-th largest value of its row.

    `top_k <= 0` or `top_k >= V` keeps everything. Ties at the k-th value are all kept.
    """
    vocab = scaled_logits.shape[-1]
    if top_k <= 0 or top_k >= vocab:
        return jnp.ones(scaled_logits.shape, dtype=bool)
    kth_value = jax.lax.top_k(scaled_logits, top_k)[0][..., -1:]
    return scaled_logits >= kth_value


def top_p_mask(scaled_logits: jax.Array, top_p: float) -> jax.Array:
    """Bool mask [..., V] of the nucleus: tokens whose preceding cumulative probability is < p.

    Tokens are ordered by decreasing logit; with `c_i` the cumulative probability of the tokens
    ranked before token i, token i is kept iff `c_i < top_p` (so the top token is always kept).
    The kept set is a prefix of the sorted order, returned as `logit >= smallest kept logit`
    (ties at the boundary kept). -inf logits have probability 0. `top_p >= 1` keeps everything.
    """
    if top_p >= 1.0:
        return jnp.ones(scaled_logits.shape, dtype=bool)
    sorted_logits = -jnp.sort(-scaled_logits, axis=-1)
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return scaled_logits >= threshold


def masked_log_probs(logits: jax.Array, temperature: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """log softmax(mask(logits / T)) in fp32, shape [..., V]; -inf outside the kept set.

    `temperature` broadcasts against `logits[..., 0]` and must be > 0 here.
    """
    scaled = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)[..., None]
    top_k_logits = jnp.where(top_k_mask(scaled, top_k), scaled, -jnp.inf)
    masked = jnp.where(top_p_mask(top_k_logits, top_p), top_k_logits, -jnp.inf)
    return jax.nn.log_softmax(masked, axis=-1)


def first_argmax(x: jax.Array) -> jax.Array:
    """int32 [...]: index of the first maximum of each row of `x` [..., V], as `jnp.argmax` (a NaN
    counts as the maximum, the first NaN wins).

    Two plain reductions (max, then the smallest index holding it) in place of argmax's
    (value, index) pair reduction, which XLA:CPU runs unvectorized: over a [32, 16,384] row block
    3-4x slower, and ~5x slower again when the pair reduction is fused with the Gumbel noise.
    """
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def gumbel_max(keys: jax.Array, log_probs: jax.Array) -> jax.Array:
    """One draw per row from softmax(log_probs) [S, V] with row s's own key: int32 [S].

    The Gumbel-max trick as `jax.vmap(jax.random.categorical)(keys, log_probs)` computes it
    (first argmax of log_probs + Gumbel noise drawn from the row's key), hence the same tokens.
    The noise is S x V threefry hashes: cheap fused elementwise work on GPU/TPU, but on CPU, where
    jax lowers threefry as a rolled loop, most of what a sampled decode step adds to the forward.
    """
    vocab = log_probs.shape[-1]
    noise = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), log_probs.dtype))(keys)
    return first_argmax(noise + log_probs)


def log_softmax_at(x: jax.Array, index: jax.Array) -> jax.Array:
    """`jax.nn.log_softmax(x)[..., index]` for x [..., V], index int [...], without the [..., V] result:
    (x[index] - max x) - log sum exp(x - max x)."""
    top = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    shifted = x - top
    picked = jnp.take_along_axis(shifted, index[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row and return (tokens int32[S], behaviour log-probs float32[S]).

    Rows with `temperature > 0` sample y ~ softmax(mask(z / T)) with their own PRNG key and
    record log q[y]; rows with `temperature == 0` take argmax z and record log softmax(z)[y]
    (temperature 1). `logits` float [S, V], `keys` a PRNG key array [S], `temperature` float [S].

    Cost: one log-softmax over the vocabulary (greedy rows run at T = 1, so without top-k/top-p
    their log softmax(z) is that same log q); the Gumbel noise only when some row samples.
    """
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = temperature <= 0.0
    safe_temperature = jnp.where(greedy, 1.0, temperature)
    log_q = masked_log_probs(logits, safe_temperature, top_k=top_k, top_p=top_p)
    greedy_tokens = first_argmax(logits)
    tokens = jax.lax.cond(
        jnp.all(greedy),
        lambda: greedy_tokens,
        lambda: jnp.where(greedy, greedy_tokens, gumbel_max(keys, log_q)),
    )
    chosen_sampled = jnp.take_along_axis(log_q, tokens[:, None], axis=-1)[:, 0]
    if top_k <= 0 and top_p >= 1.0:
        return tokens, chosen_sampled  # greedy rows: log q = log softmax(z / 1), nothing masked
    return tokens, jnp.where(greedy, log_softmax_at(logits, tokens), chosen_sampled)
