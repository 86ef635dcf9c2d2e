"""Group-relative advantages with the three normalizations compared in ScaleRL.

For completion ``b`` of prompt ``g``, with ``V_g`` the valid completions of ``g`` and ``V`` all
valid completions of the batch:

  centered_b = r_b - mean_{b' in V_g} r_b'
  'none'   (Dr. GRPO):  A_b = centered_b
  'prompt' (GRPO):      A_b = centered_b / (std_{b' in V_g} r_b' + eps)
  'batch'  (ScaleRL):   A_b = centered_b / (std_{b' in V} centered_b' + eps)

``std`` is the population standard deviation (divide by the count, not count - 1), and eps is
added to the std (outside the square root). ``A_b = 0`` for invalid ``b``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from scalerl_jax.rl.groups import (
    as_row_mask,
    check_group_ids,
    check_rank,
    group_sum_per_row,
    safe_divide,
)

NORMALIZATIONS = ("batch", "prompt", "none")


def compute_advantages(
    rewards: ArrayLike,
    group_ids: ArrayLike,
    *,
    normalization: str,
    valid: ArrayLike | None = None,
    eps: float = 1e-6,
) -> jax.Array:
    """Advantages float32[B] (formulas in the module docstring).

    Args:
      rewards: float[B] rewards (any float dtype; computed in float32).
      group_ids: int[B] prompt index in ``[0, B)``.
      normalization: 'batch' | 'prompt' | 'none'.
      valid: optional bool/float[B]: False for padding rows and for rows dropped by filtering
        (e.g. zero-variance prompts). Invalid rows enter no mean or std and get advantage 0.
        Default: all valid.
      eps: added to the standard deviation before dividing.

    Returns:
      float32[B], zero where not valid.
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization: expected one of {NORMALIZATIONS}, got {normalization!r}")
    rewards = jnp.asarray(rewards).astype(jnp.float32)
    check_rank("rewards", rewards, 1)
    batch = rewards.shape[0]
    group_ids = jnp.asarray(group_ids)
    check_group_ids(group_ids, batch)
    row_valid = as_row_mask("valid", valid, batch)

    group_count = group_sum_per_row(row_valid, group_ids)
    group_mean = safe_divide(group_sum_per_row(rewards * row_valid, group_ids), group_count)
    centered = (rewards - group_mean) * row_valid

    if normalization == "none":
        advantages = centered
    elif normalization == "prompt":
        group_var = safe_divide(group_sum_per_row(centered**2, group_ids), group_count)
        advantages = centered / (jnp.sqrt(group_var) + eps)
    else:
        count = jnp.sum(row_valid)
        batch_mean = safe_divide(jnp.sum(centered), count)
        batch_var = safe_divide(jnp.sum(row_valid * (centered - batch_mean) ** 2), count)
        advantages = centered / (jnp.sqrt(batch_var) + eps)
    return jnp.where(row_valid > 0, advantages, 0.0)
