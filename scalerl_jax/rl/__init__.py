"""Pure, jittable RL loss math of ScaleRL: filters, advantages, objectives, aggregation, shaping.

Imports nothing from the rest of scalerl_jax. All functions take static shapes (padding plus
masks), accept any float input dtype and compute in float32. The train step computes its loss
and metrics with these functions: advantages and row scales over the whole batch, then
``policy_sums`` per microbatch, ``combine_policy_sums`` and ``policy_metrics``.
"""

from scalerl_jax.rl.advantages import NORMALIZATIONS, compute_advantages
from scalerl_jax.rl.aggregation import (
    AGGREGATIONS,
    count_sequences_and_prompts,
    effective_mask,
    row_scales,
)
from scalerl_jax.rl.filters import zero_variance_mask
from scalerl_jax.rl.length_penalty import length_penalty
from scalerl_jax.rl.loss import PolicySums, combine_policy_sums, policy_loss, policy_metrics, policy_sums
from scalerl_jax.rl.objectives import (
    DEFAULT_CLIP_EPS,
    OBJECTIVES,
    per_token_policy_terms,
    resolve_clip_eps,
)

__all__ = [
    "AGGREGATIONS",
    "DEFAULT_CLIP_EPS",
    "NORMALIZATIONS",
    "OBJECTIVES",
    "PolicySums",
    "combine_policy_sums",
    "compute_advantages",
    "count_sequences_and_prompts",
    "effective_mask",
    "length_penalty",
    "per_token_policy_terms",
    "policy_loss",
    "policy_metrics",
    "policy_sums",
    "resolve_clip_eps",
    "row_scales",
    "zero_variance_mask",
]
