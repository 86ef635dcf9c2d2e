"""The policy loss as sums over loss tokens that add up across microbatches, and its metrics.

For a batch (or a microbatch) with effective mask ``m`` (``loss_mask * valid``), row scales ``s``
(``row_scales``, over the WHOLE batch), per-token terms ``x`` and aux arrays from
``per_token_policy_terms``:

  loss          = sum_{b,t} m[b,t] s_b x[b,t]           (the aggregated loss when over the batch)
  num_tokens    = sum m
  ratio         = sum m r,                 ratio_max         = max_{m > 0} r
  clipped_low   = sum m [lower clip],      clipped_high      = sum m [upper clip / cispo truncation]
  abs_log_ratio = sum m |logp - blogp|,    abs_log_ratio_max = max_{m > 0} |logp - blogp|

(maxima 0 without loss tokens). Every term of a row depends on that row alone and ``s`` is fixed
over the batch, so the sums of microbatches combine into those of the batch (``combine_policy_sums``:
sums add, maxima take the max), and the metrics (``policy_metrics``) are ratios of the combined sums.
``policy_loss`` is the whole batch taken as one microbatch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from scalerl_jax.rl.aggregation import count_sequences_and_prompts, effective_mask, row_scales
from scalerl_jax.rl.groups import check_group_ids, check_rank, check_same_shape, safe_divide
from scalerl_jax.rl.objectives import per_token_policy_terms


class PolicySums(NamedTuple):
    """Float32 scalars over the loss tokens of a (micro)batch (formulas in the module docstring).

    Only ``loss`` carries a gradient.
    """

    loss: jax.Array
    num_tokens: jax.Array
    ratio: jax.Array
    ratio_max: jax.Array
    clipped_low: jax.Array
    clipped_high: jax.Array
    abs_log_ratio: jax.Array
    abs_log_ratio_max: jax.Array

    @classmethod
    def zeros(cls) -> PolicySums:
        """The sums of no token: the neutral element of ``combine_policy_sums`` (maxima are >= 0)."""
        return cls(*[jnp.zeros((), jnp.float32)] * len(cls._fields))


_MAX_FIELDS = ("ratio_max", "abs_log_ratio_max")


def policy_sums(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    scales: ArrayLike,
    *,
    objective: str,
    eps_low: float | None = None,
    eps_high: float | None = None,
    eps_max: float = 4.0,
) -> PolicySums:
    """``PolicySums`` of a (micro)batch of R rows (formulas in the module docstring).

    Args:
      logp: float[R,T] trainer log-probs (the argument to differentiate).
      behavior_logp: float[R,T] sampler log-probs of the same tokens.
      advantages: float[R] per-completion advantages (computed over the whole batch).
      mask: float[R,T] effective mask ``loss_mask * valid`` (``effective_mask``).
      scales: float[R] row scales of these rows (``row_scales`` over the whole batch).
      objective, eps_low, eps_high, eps_max: as in ``per_token_policy_terms``.
    """
    mask = jnp.asarray(mask).astype(jnp.float32)
    check_rank("mask", mask, 2)
    scales = jnp.asarray(scales)
    check_same_shape("scales", scales, mask.shape[:1], "mask's batch")
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
    weights = mask * scales.astype(jnp.float32)[:, None]
    masked_sum = lambda x: jnp.sum(mask * x)
    # aux is 0 outside the mask and >= 0 inside, so its max is the max over loss tokens (0 if none).
    return PolicySums(
        loss=jnp.sum(weights * terms),
        num_tokens=jnp.sum(mask),
        ratio=masked_sum(aux["ratio"]),
        ratio_max=jnp.max(aux["ratio"]),
        clipped_low=masked_sum(aux["clipped_low"]),
        clipped_high=masked_sum(aux["clipped_high"]),
        abs_log_ratio=masked_sum(aux["abs_log_ratio"]),
        abs_log_ratio_max=jnp.max(aux["abs_log_ratio"]),
    )


def combine_policy_sums(a: PolicySums, b: PolicySums) -> PolicySums:
    """The ``PolicySums`` of two disjoint sets of rows: sums add, maxima take the larger."""
    return PolicySums(
        *(
            jnp.maximum(x, y) if name in _MAX_FIELDS else x + y
            for name, x, y in zip(PolicySums._fields, a, b, strict=True)
        )
    )


def policy_metrics(sums: PolicySums, num_sequences: jax.Array, num_prompts: jax.Array) -> dict[str, jax.Array]:
    """Batch metrics from the batch's ``PolicySums`` and its counts (``count_sequences_and_prompts``).

    Returns scalars: 'num_tokens' (sum of the mask), 'num_sequences' and 'num_prompts' (rows /
    prompts with at least one valid token, i.e. those in the loss), 'ratio_mean' and 'ratio_max'
    (importance ratio over valid tokens; gspo: sequence ratio per token), 'clip_frac' (fraction of
    valid tokens whose weight was truncated, cispo r > eps_max, or clipped, dapo/grpo/gspo), split
    into 'clip_frac_low' (lower clip active: A < 0 and r < 1 - eps_low; 0 for cispo) and
    'clip_frac_high' (upper clip active: A > 0 and r > 1 + eps_high; cispo: r > eps_max), which add
    up to 'clip_frac', and 'abs_log_ratio_mean' / 'abs_log_ratio_max' (|logp - behavior_logp| per
    valid token: the train/sampler mismatch). Means are 0 for a batch without valid tokens.
    """
    per_token = lambda total: safe_divide(total, sums.num_tokens)
    return {
        "num_tokens": sums.num_tokens,
        "num_sequences": num_sequences,
        "num_prompts": num_prompts,
        "ratio_mean": per_token(sums.ratio),
        "ratio_max": sums.ratio_max,
        "clip_frac": per_token(sums.clipped_low + sums.clipped_high),
        "clip_frac_low": per_token(sums.clipped_low),
        "clip_frac_high": per_token(sums.clipped_high),
        "abs_log_ratio_mean": per_token(sums.abs_log_ratio),
        "abs_log_ratio_max": sums.abs_log_ratio_max,
    }


def policy_loss(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    loss_mask: ArrayLike,
    group_ids: ArrayLike,
    *,
    objective: str,
    aggregation: str,
    eps_low: float | None = None,
    eps_high: float | None = None,
    eps_max: float = 4.0,
    valid: ArrayLike | None = None,
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
    tokens_per_row = jnp.sum(mask, axis=1)
    sums = policy_sums(
        logp,
        behavior_logp,
        advantages,
        mask,
        row_scales(tokens_per_row, group_ids, aggregation=aggregation),
        objective=objective,
        eps_low=eps_low,
        eps_high=eps_high,
        eps_max=eps_max,
    )
    return sums.loss, policy_metrics(sums, *count_sequences_and_prompts(tokens_per_row, group_ids))
