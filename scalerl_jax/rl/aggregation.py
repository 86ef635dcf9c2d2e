"""Loss aggregation as explicit per-token weights computed over the whole batch.

With ``m[b,t]`` the loss mask, ``n_b = sum_t m[b,t]`` tokens in sequence ``b`` and
``n_g = sum_{b in g} n_b`` tokens of prompt ``g``, the aggregated loss is ``sum_{b,t} w[b,t] x[b,t]``
for per-token terms ``x``:

  'token'  : w = m / N_tok,           N_tok = sum_b n_b           (mean over all valid tokens)
  'sample' : w = m / (n_b N_seq),     N_seq = #{b : n_b > 0}      (mean over sequences of their token mean)
  'prompt' : w = m / (n_g N_prompt),  N_prompt = #{g : n_g > 0}   (mean over prompts of their token mean)

Empty sequences and prompts with no valid token get weight 0 and do not count in ``N_seq`` or
``N_prompt``; an all-empty batch gets all-zero weights (loss 0, gradient 0, no NaN).

Because the weights depend only on the masks of the whole batch, a train step may split the
batch along B into microbatches and sum ``sum(w[mb] * x[mb])`` to get exactly the full-batch loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from scalerl_jax.rl.groups import (
    as_row_mask,
    check_group_ids,
    check_rank,
    group_sum,
    safe_divide,
)

AGGREGATIONS = ("prompt", "sample", "token")


def effective_mask(loss_mask: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """float32[B,T] mask ``m[b,t] = loss_mask[b,t] * valid[b]`` (``valid`` defaults to all ones)."""
    loss_mask = jnp.asarray(loss_mask)
    check_rank("loss_mask", loss_mask, 2)
    row_valid = as_row_mask("valid", valid, loss_mask.shape[0])
    return loss_mask.astype(jnp.float32) * row_valid[:, None]


def aggregation_weights(
    loss_mask: jax.Array,
    group_ids: jax.Array,
    *,
    aggregation: str,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Per-token weights float32[B,T] whose weighted sum of per-token terms is the aggregated loss.

    Args:
      loss_mask: float/bool[B,T], 1 on tokens that enter the loss (sampled completion tokens).
      group_ids: int[B] prompt index in ``[0, B)``.
      aggregation: 'prompt' | 'sample' | 'token' (formulas in the module docstring).
      valid: optional bool/float[B]; rows with ``valid == 0`` leave the loss entirely (as if their
        mask were all zero), e.g. padding rows and rows of zero-variance prompts.

    Returns:
      float32[B,T] non-negative weights summing to 1 (or to 0 when no token is valid).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {aggregation!r}")
    mask = effective_mask(loss_mask, valid)
    group_ids = jnp.asarray(group_ids)
    check_group_ids(group_ids, mask.shape[0])
    tokens_per_row = jnp.sum(mask, axis=1)

    if aggregation == "token":
        return safe_divide(mask, jnp.sum(tokens_per_row))
    if aggregation == "sample":
        num_sequences = jnp.sum(tokens_per_row > 0)
        return safe_divide(mask, (tokens_per_row * num_sequences)[:, None])
    tokens_per_group = group_sum(tokens_per_row, group_ids)
    num_prompts = jnp.sum(tokens_per_group > 0)
    return safe_divide(mask, (tokens_per_group[group_ids] * num_prompts)[:, None])


def count_sequences_and_prompts(mask: jax.Array, group_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(number of rows with a valid token, number of prompts with a valid token), as int32."""
    tokens_per_row = jnp.sum(mask, axis=1)
    tokens_per_group = group_sum(tokens_per_row, group_ids)
    return (
        jnp.sum(tokens_per_row > 0).astype(jnp.int32),
        jnp.sum(tokens_per_group > 0).astype(jnp.int32),
    )
