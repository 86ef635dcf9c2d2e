"""The policy loss: per-token objective terms weighted by the chosen aggregation, plus metrics.

  loss = sum_{b,t} w[b,t] * x[b,t]

with ``w`` from ``aggregation_weights`` (over the whole batch) and ``x`` from
``per_token_policy_terms``. See those modules for the formulas and sign conventions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from scalerl_jax.rl.aggregation import (
    aggregation_weights,
    count_sequences_and_prompts,
    effective_mask,
)
from scalerl_jax.rl.groups import check_group_ids, safe_divide
from scalerl_jax.rl.objectives import per_token_policy_terms


def policy_metrics(aux: dict[str, jax.Array], mask: jax.Array, group_ids: jax.Array) -> dict[str, jax.Array]:
    """Batch metrics from ``per_token_policy_terms``'s aux arrays and the effective mask.

    Returns float32/int32 scalars: 'num_tokens' (sum of the mask), 'num_sequences' and
    'num_prompts' (rows / prompts with at least one valid token, i.e. those in the loss),
    'ratio_mean' and 'ratio_max' (importance ratio over valid tokens; gspo: sequence ratio per
    token; 0 for an empty batch), 'clip_frac' (fraction of valid tokens whose weight was truncated,
    cispo r > eps_max, or clipped, dapo/grpo/gspo), split into 'clip_frac_low' (lower clip active:
    A < 0 and r < 1 - eps_low; 0 for cispo) and 'clip_frac_high' (upper clip active: A > 0 and
    r > 1 + eps_high; cispo: r > eps_max), which add up to 'clip_frac'.
    """
    num_tokens = jnp.sum(mask)
    num_sequences, num_prompts = count_sequences_and_prompts(mask, group_ids)
    return {
        "num_tokens": num_tokens,
        "num_sequences": num_sequences,
        "num_prompts": num_prompts,
        "ratio_mean": safe_divide(jnp.sum(mask * aux["ratio"]), num_tokens),
        "ratio_max": jnp.max(jnp.where(mask > 0, aux["ratio"], 0.0)),
        "clip_frac": safe_divide(jnp.sum(mask * aux["clipped"]), num_tokens),
        "clip_frac_low": safe_divide(jnp.sum(mask * aux["clipped_low"]), num_tokens),
        "clip_frac_high": safe_divide(jnp.sum(mask * aux["clipped_high"]), num_tokens),
    }


def policy_loss(
    logp: jax.Array,
    behavior_logp: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    group_ids: jax.Array,
    *,
    objective: str,
    aggregation: str,
    eps_low: float | None = None,
    eps_high: float | None = None,
    eps_max: float = 4.0,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Aggregated policy loss (a float32 scalar to minimize) and metrics.

    Args:
      logp: float[B,T] trainer log-probs (the argument to differentiate).
      behavior_logp: float[B,T] sampler log-probs of the same tokens.
      advantages: float[B] per-completion advantages.
      loss_mask: float/bool[B,T], 1 on sampled completion tokens, 0 on prompt, padding and
        forced tokens.
      group_ids: int[B] prompt index in ``[0, B)``.
      objective: 'cispo' | 'dapo' | 'grpo' | 'gspo'.
      aggregation: 'prompt' | 'sample' | 'token'.
      eps_low, eps_high: clip range for dapo/grpo/gspo; None takes the objective's default
        (dapo 0.2/0.28, grpo symmetric eps_low, gspo 3e-4/4e-4).
      eps_max: cispo's importance-weight truncation (ScaleRL: 4).
      valid: optional bool/float[B]; rows with ``valid == 0`` (padding, zero-variance prompts)
        leave the loss and every denominator.

    Returns:
      (loss, metrics); metrics as in ``policy_metrics``. A batch with no valid token gives loss 0
      and zero gradient.
    """
    mask = effective_mask(loss_mask, valid)
    group_ids = jnp.asarray(group_ids)
    check_group_ids(group_ids, mask.shape[0])
    weights = aggregation_weights(mask, group_ids, aggregation=aggregation)
    terms, aux = per_token_policy_terms(
        logp,
        behavior_logp,
        advantages,
        mask,
        objective=objective,
        eps_low=eps_low,
        eps_high=eps_high,
        eps_max=eps_max,
    )
    loss = jnp.sum(weights * terms)
    return loss, policy_metrics(aux, mask, group_ids)
