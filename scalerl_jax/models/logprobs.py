"""Per-token log-probabilities of given tokens, chunked over the sequence.

At 16k tokens and a 128k vocabulary the float32 logits of one sequence take 8 GB, so they are
never materialized for the whole sequence: the head runs on one chunk of positions at a time
inside `lax.scan`, and each chunk is rematerialized in the backward pass (`jax.checkpoint`), so
the gradient does not keep all chunks' logits either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, overload

import jax
import jax.numpy as jnp

from scalerl_jax.models.transformer import Transformer


def token_logprobs_from_logits(
    logits: jax.Array, targets: jax.Array, temperature: float, *, with_entropy: bool = True
) -> tuple[jax.Array, jax.Array | None]:
    """(log softmax(z)[target], entropy of softmax(z) or None) with z = logits / temperature, float32.

    entropy = logsumexp(z) - sum softmax(z) z.
    """
    z = logits.astype(jnp.float32) / temperature
    log_norm = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    entropy = log_norm - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1) if with_entropy else None
    return picked - log_norm, entropy


def chunked_head_logprobs(
    head: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    targets: jax.Array,
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
    """log p(targets[:, t] | hidden[:, t]) and entropies (or None), float32 [B, N], chunk by chunk.

    hidden [B, N, D], targets int [B, N]; `head` maps [B, C, D] -> float32 logits [B, C, V].
    N is padded up to a multiple of `chunk_size` (padding is cut off again).
    """
    batch, length = targets.shape
    chunk = max(1, min(chunk_size, length))
    num_chunks = -(-length // chunk)
    pad = num_chunks * chunk - length
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hidden_chunks = hidden.reshape(batch, num_chunks, chunk, -1).swapaxes(0, 1)
    target_chunks = targets.reshape(batch, num_chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(h: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        return token_logprobs_from_logits(head(h), t, temperature, with_entropy=with_entropy)

    def step(carry: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, tuple[jax.Array, jax.Array | None]]:
        return carry, one_chunk(*xs)

    _, (logp, entropy) = jax.lax.scan(step, None, (hidden_chunks, target_chunks))
    unchunk = lambda a: a.swapaxes(0, 1).reshape(batch, num_chunks * chunk)[:, :length]
    return unchunk(logp), None if entropy is None else unchunk(entropy)


@overload
def sequence_logprobs(
    model: Transformer,
    tokens: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 512,
    return_entropy: Literal[False] = False,
) -> jax.Array: ...


@overload
def sequence_logprobs(
    model: Transformer,
    tokens: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 512,
    return_entropy: Literal[True],
) -> tuple[jax.Array, jax.Array]: ...


@overload
def sequence_logprobs(
    model: Transformer,
    tokens: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 512,
    return_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]: ...


def sequence_logprobs(
    model: Transformer,
    tokens: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 512,
    return_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """out[:, t] = log softmax(logits[:, t-1] / temperature)[tokens[:, t]] for t >= 1; out[:, 0] = 0.

    float32 [B, T]; with `return_entropy` also the entropy of the same distributions, aligned the
    same way (entropy[:, t] is that of the distribution that produced tokens[:, t]; 0 at t = 0).
    Logits are computed `chunk_size` positions at a time.
    """
    if tokens.ndim != 2:
        raise ValueError(f"sequence_logprobs: tokens must be [B, T], got shape {tokens.shape}")
    logp, entropy = next_token_logprobs(
        model.head,
        model.hidden(tokens),
        tokens,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=return_entropy,
    )
    if return_entropy:
        assert entropy is not None  # next_token_logprobs computed it
        return logp, entropy
    return logp


def next_token_logprobs(
    head: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    tokens: jax.Array,
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """`sequence_logprobs` (and entropies, or None) from the final hidden states [B, T, D] of
    tokens [B, T]: position t is scored by the hidden state at t - 1; position 0 gets 0."""
    if temperature <= 0:
        raise ValueError(f"sequence_logprobs: temperature={temperature} must be > 0")
    logp, entropy = chunked_head_logprobs(
        head, hidden[:, :-1], tokens[:, 1:], temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
    )
    shift = lambda a: jnp.pad(a, ((0, 0), (1, 0)))
    return shift(logp), None if entropy is None else shift(entropy)
