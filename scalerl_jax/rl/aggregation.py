"""Loss aggregation as per-row scales of the loss mask, computed over the whole batch.

With ``m[b,t]`` the loss mask, ``n_b = sum_t m[b,t]`` tokens in sequence ``b`` and
``n_g = sum_{b in g} n_b`` tokens of prompt ``g``, the aggregated loss is ``sum_{b,t} w[b,t] x[b,t]``
for per-token terms ``x``, with ``w[b,t] = m[b,t] s_b`` and the row scale ``s_b``:

  'token'  : s_b = 1 / N_tok,           N_tok = sum_b n_b           (mean over all valid tokens)
  'sample' : s_b = 1 / (n_b N_seq),     N_seq = #{b : n_b > 0}      (mean over sequences of their token mean)
  'prompt' : s_b = 1 / (n_g N_prompt),  N_prompt = #{g : n_g > 0}   (mean over prompts of their token mean)

Empty sequences and prompts with no valid token get scale 0 and do not count in ``N_seq`` or
``N_prompt``; an all-empty batch gets all-zero scales (loss 0, gradient 0, no NaN).

The scales depend only on the per-row token counts ``n_b`` of the whole batch, so a train step may
compute them once, split the batch along B into microbatches (each padded to its own length) and
sum ``sum(w[mb] * x[mb])`` to get exactly the full-batch loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from scalerl_jax.rl.groups import (
    as_row_mask,
    check_rank,
    group_sum,
    safe_divide,
)

AGGREGATIONS = ("prompt", "sample", "token")


def effective_mask(loss_mask: ArrayLike, valid: ArrayLike | None = None) -> jax.Array:
    """float32[B,T] mask ``m[b,t] = loss_mask[b,t] * valid[b]`` (``valid`` defaults to all ones)."""
    loss_mask = jnp.asarray(loss_mask)
    check_rank("loss_mask", loss_mask, 2)
    row_valid = as_row_mask("valid", valid, loss_mask.shape[0])
    return loss_mask.astype(jnp.float32) * row_valid[:, None]


def row_scales(tokens_per_row: ArrayLike, group_ids: ArrayLike, *, aggregation: str) -> jax.Array:
    """Row scales float32[B] ``s`` with aggregation weights ``w[b,t] = m[b,t] s_b`` (module docstring).

    Args:
      tokens_per_row: float[B] ``n_b = sum_t m[b,t]``, the loss tokens of each row of the whole
        batch (0 for padding rows and rows left out of the loss).
      group_ids: int[B] prompt index in ``[0, B)``.
      aggregation: 'prompt' | 'sample' | 'token'.

    Returns:
      float32[B], 0 where the denominator is 0 (a row without loss tokens for 'sample', its prompt
      without for 'prompt', the batch without for any); a row without loss tokens may get a
      positive scale ('token', 'prompt'), but its weights m s are 0.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {aggregation!r}")
    tokens_per_row = jnp.asarray(tokens_per_row).astype(jnp.float32)
    check_rank("tokens_per_row", tokens_per_row, 1)
    group_ids = jnp.asarray(group_ids)
    if aggregation == "token":
        return jnp.broadcast_to(safe_divide(1.0, jnp.sum(tokens_per_row)), tokens_per_row.shape)
    if aggregation == "sample":
        return safe_divide(1.0, tokens_per_row * jnp.sum(tokens_per_row > 0))
    tokens_per_group = group_sum(tokens_per_row, group_ids)
    return safe_divide(1.0, tokens_per_group[group_ids] * jnp.sum(tokens_per_group > 0))


def count_sequences_and_prompts(tokens_per_row: ArrayLike, group_ids: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """(``N_seq``, ``N_prompt``) of the module docstring as int32: the rows, and the prompts, with at
    least one loss token, from the per-row token counts ``n_b`` of the whole batch."""
    tokens_per_row, group_ids = jnp.asarray(tokens_per_row), jnp.asarray(group_ids)
    tokens_per_group = group_sum(tokens_per_row, group_ids)
    return (
        jnp.sum(tokens_per_row > 0).astype(jnp.int32),
        jnp.sum(tokens_per_group > 0).astype(jnp.int32),
    )
