"""Zero-variance filtering: prompts whose completions all got the same reward carry no signal.

With group-relative advantages, a prompt whose valid completions all share one reward has every
advantage equal to 0; ScaleRL removes such prompts from the batch's loss (the batch is not
refilled), so they do not dilute the prompt- or sample-average denominators.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from scalerl_jax.rl.groups import as_row_mask, check_group_ids, check_rank


def zero_variance_mask(rewards: ArrayLike, group_ids: ArrayLike, *, valid: ArrayLike | None = None) -> jax.Array:
    """True where the completion's prompt has rewards that are not all equal.

    ``out[b] = valid[b] and max_{b' in G(b)} r[b'] > min_{b' in G(b)} r[b']`` where ``G(b)`` is the
    set of valid completions of ``b``'s prompt. Invalid rows (padding) neither count nor get True.
    A prompt with a single valid completion has zero variance (False).

    Args:
      rewards: float[B] scalar rewards (any float dtype; compared in float32).
      group_ids: int[B] prompt index in ``[0, B)``.
      valid: optional bool/float[B]; rows with ``valid == 0`` are ignored (default: all valid).

    Returns:
      bool[B].
    """
    rewards = jnp.asarray(rewards).astype(jnp.float32)
    check_rank("rewards", rewards, 1)
    batch = rewards.shape[0]
    group_ids = jnp.asarray(group_ids)
    check_group_ids(group_ids, batch)
    row_valid = as_row_mask("valid", valid, batch) > 0
    group_max = jax.ops.segment_max(jnp.where(row_valid, rewards, -jnp.inf), group_ids, num_segments=batch)
    group_min = jax.ops.segment_min(jnp.where(row_valid, rewards, jnp.inf), group_ids, num_segments=batch)
    return row_valid & (group_max[group_ids] > group_min[group_ids])
