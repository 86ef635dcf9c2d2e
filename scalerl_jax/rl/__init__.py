"""Pure, jittable RL loss math of ScaleRL: filters, advantages, objectives, aggregation, shaping.

Imports nothing from the rest of scalerl_jax. All functions take static shapes (padding plus
masks), accept any float input dtype and compute in float32.
"""

from scalerl_jax.rl.advantages import NORMALIZATIONS, compute_advantages
from scalerl_jax.rl.aggregation import AGGREGATIONS, aggregation_weights, effective_mask
from scalerl_jax.rl.filters import zero_variance_mask
from scalerl_jax.rl.length_penalty import length_penalty
from scalerl_jax.rl.loss import policy_loss, policy_metrics
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
    "aggregation_weights",
    "compute_advantages",
    "effective_mask",
    "length_penalty",
    "per_token_policy_terms",
    "policy_loss",
    "policy_metrics",
    "resolve_clip_eps",
    "zero_variance_mask",
]
