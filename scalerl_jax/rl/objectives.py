"""Per-token policy-gradient terms of the four objectives (to be minimized).

Notation, for a valid token t of completion b (``m[b,t] = 1``): ``logp`` is the trainer's log-prob
of the token, ``blogp`` the sampler's (behaviour) log-prob, ``r = exp(logp - blogp)`` the
importance ratio, ``A = A_b`` the completion's advantage, ``sg`` stop-gradient. Every term is the
NEGATED surrogate objective (a loss to minimize); terms are 0 where ``m = 0``.

  cispo : x = -sg(min(r, eps_max)) * A * logp
          d x / d logp = -min(r, eps_max) * A : every token keeps a gradient, ratios above eps_max
          only have their weight truncated to eps_max. The VALUE of x is the REINFORCE-style
          surrogate (it contains logp, so it is not a ratio objective); only its gradient matters.
  dapo  : x = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
          d x / d logp = -r A where the unclipped branch is active, 0 where clipping is active,
          i.e. for (A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 - eps_low).
  grpo  : dapo with a symmetric clip: eps_high defaults to eps_low.
  gspo  : dapo with the per-sequence ratio s_b = exp(sum_t m (logp - blogp) / sum_t m) in place of
          r, every valid token of b carrying the sequence's term; s_b uses only row b's own tokens.

Default clip ranges, taken when ``eps_low`` / ``eps_high`` are None: dapo 0.2 / 0.28 (DAPO), grpo
0.2 / eps_low, gspo 3e-4 / 4e-4 (GSPO clips the sequence ratio, which stays near 1, so its range is
about three orders of magnitude smaller; callers may pass their own). cispo uses eps_max
(ScaleRL: 4) and ignores eps_low / eps_high.

Clipped branches are evaluated on a constant (the clip bound) rather than on ``clip(r)``, and the
ratio that carries the gradient is ``exp(where(clipped, 0, logp - blogp))``: values and gradients
equal the formulas above, and a huge ratio in a clipped branch cannot turn a zero gradient into NaN
(0 * inf).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from scalerl_jax.rl.groups import check_rank, check_same_shape, safe_divide

OBJECTIVES = ("cispo", "dapo", "grpo", "gspo")

# objective -> (eps_low, eps_high) used when the caller passes None; None for eps_high means
# "same as eps_low" (symmetric clip).
DEFAULT_CLIP_EPS: dict[str, tuple[float, float | None]] = {
    "dapo": (0.2, 0.28),
    "grpo": (0.2, None),
    "gspo": (3e-4, 4e-4),
}


def resolve_clip_eps(objective: str, eps_low: float | None, eps_high: float | None) -> tuple[float, float]:
    """The (eps_low, eps_high) clip range for a ratio-clipping objective (dapo, grpo, gspo).

    ``None`` takes the objective's default from ``DEFAULT_CLIP_EPS``; for grpo an unset eps_high
    equals eps_low. Raises ValueError for a negative value or an objective that does not clip.
    """
    if objective not in DEFAULT_CLIP_EPS:
        raise ValueError(f"objective: {objective!r} has no clip range; expected one of {tuple(DEFAULT_CLIP_EPS)}")
    default_low, default_high = DEFAULT_CLIP_EPS[objective]
    low = default_low if eps_low is None else float(eps_low)
    if eps_high is not None:
        high = float(eps_high)
    else:
        high = low if default_high is None else default_high
    for name, value in (("eps_low", low), ("eps_high", high)):
        if value < 0:
            raise ValueError(f"{name}: must be >= 0 for objective {objective!r}, got {value}")
    return low, high


def _clipped_weight(
    log_ratio: jax.Array, advantages: jax.Array, eps_low: float, eps_high: float
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """PPO-clip weight ``c`` with ``min(r A, clip(r, 1-eps_low, 1+eps_high) A) = c A``.

    Returns (c, clipped_low, clipped_high, ratio): ``clipped_low`` is True where the lower clip
    branch is active (A < 0 and r < 1 - eps_low), ``clipped_high`` where the upper one is
    (A > 0 and r > 1 + eps_high); there c is the constant bound (zero gradient), elsewhere
    ``c = r`` with gradient flowing into ``log_ratio``. ``ratio = exp(log_ratio)`` without
    gradient, for metrics. Shapes broadcast.
    """
    lower, upper = 1.0 - eps_low, 1.0 + eps_high
    ratio = jnp.exp(jax.lax.stop_gradient(log_ratio))
    positive = advantages > 0
    clipped_high = positive & (ratio > upper)
    clipped_low = (advantages < 0) & (ratio < lower)
    clipped = clipped_low | clipped_high
    unclipped_ratio = jnp.exp(jnp.where(clipped, 0.0, log_ratio))
    weight = jnp.where(clipped, jnp.where(positive, upper, lower), unclipped_ratio)
    return weight, clipped_low, clipped_high, ratio


def per_token_policy_terms(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    loss_mask: ArrayLike,
    *,
    objective: str,
    eps_low: float | None = None,
    eps_high: float | None = None,
    eps_max: float = 4.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token loss terms float32[B,T] of ``objective`` (formulas in the module docstring).

    Args:
      logp: float[B,T] trainer log-probs of the tokens (differentiated; any float dtype).
      behavior_logp: float[B,T] sampler log-probs of the same tokens (treated as constants).
      advantages: float[B] per-completion advantages (treated as constants).
      loss_mask: float/bool[B,T], > 0 on tokens that enter the loss. Values of logp and
        behavior_logp outside the mask are ignored (they may be padding garbage, inf or NaN).
      objective: 'cispo' | 'dapo' | 'grpo' | 'gspo'.
      eps_low, eps_high: clip range for dapo/grpo/gspo (None: the objective's default).
      eps_max: cispo's truncation of the importance weight.

    Returns:
      (terms, aux): terms float32[B,T], 0 outside the mask; aux has float32[B,T] arrays without
      gradient, 0 outside the mask, so that masked sums over microbatches give exact batch metrics:
        'ratio'          r per token (gspo: the sequence ratio s_b on each token);
        'abs_log_ratio'  |logp - blogp| per token, for every objective (gspo included);
        'clipped_low'    1 where the lower clip is active, A < 0 and r < 1 - eps_low
                         (dapo/grpo/gspo; always 0 for cispo, whose weight has no lower bound);
        'clipped_high'   1 where the upper clip is active, A > 0 and r > 1 + eps_high
                         (dapo/grpo/gspo), or where cispo truncated the weight, r > eps_max.
      The two clip flags never overlap.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: expected one of {OBJECTIVES}, got {objective!r}")
    logp = jnp.asarray(logp)
    check_rank("logp", logp, 2)
    behavior_logp = jnp.asarray(behavior_logp)
    check_same_shape("behavior_logp", behavior_logp, logp.shape, "logp")
    loss_mask = jnp.asarray(loss_mask)
    check_same_shape("loss_mask", loss_mask, logp.shape, "logp")
    advantages = jnp.asarray(advantages)
    check_same_shape("advantages", advantages, logp.shape[:1], "logp's batch")

    on = loss_mask > 0
    mask = jnp.where(on, loss_mask.astype(jnp.float32), 0.0)
    logp = jnp.where(on, logp.astype(jnp.float32), 0.0)
    behavior_logp = jax.lax.stop_gradient(jnp.where(on, behavior_logp.astype(jnp.float32), 0.0))
    advantages = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    log_ratio = logp - behavior_logp

    if objective == "cispo":
        if not float(eps_max) > 0:
            raise ValueError(f"eps_max: must be > 0 for cispo, got {eps_max}")
        ratio = jnp.exp(jax.lax.stop_gradient(log_ratio))
        terms = -jnp.minimum(ratio, eps_max) * advantages[:, None] * logp
        clipped_high = ratio > eps_max
        clipped_low = jnp.zeros_like(clipped_high)
    else:
        low, high = resolve_clip_eps(objective, eps_low, eps_high)
        if objective == "gspo":
            sequence_log_ratio = safe_divide(jnp.sum(mask * log_ratio, axis=1), jnp.sum(mask, axis=1))
            weight, clipped_low, clipped_high, ratio = _clipped_weight(sequence_log_ratio, advantages, low, high)
            terms = jnp.broadcast_to((-weight * advantages)[:, None], logp.shape)
            clipped_low, clipped_high, ratio = (
                jnp.broadcast_to(x[:, None], logp.shape) for x in (clipped_low, clipped_high, ratio)
            )
        else:
            weight, clipped_low, clipped_high, ratio = _clipped_weight(log_ratio, advantages[:, None], low, high)
            terms = -weight * advantages[:, None]

    masked_flag = lambda flag: jnp.where(on, flag, False).astype(jnp.float32)
    aux = {
        "ratio": jnp.where(on, ratio, 0.0),
        "abs_log_ratio": jnp.where(on, jnp.abs(jax.lax.stop_gradient(log_ratio)), 0.0),
        "clipped_low": masked_flag(clipped_low),
        "clipped_high": masked_flag(clipped_high),
    }
    return jnp.where(on, terms, 0.0), aux
