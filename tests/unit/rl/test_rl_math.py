"""Tests of scalerl_jax.rl against float64 numpy references written here and hand calculations.

The references below are deliberately written as plain loops over rows, prompts and tokens, straight
from the formulas of the ScaleRL paper (arXiv 2510.13786) and the objectives' own papers, and never
call the package. Gradients w.r.t. logp are derived analytically in numpy (and those derivations are themselves checked by central
finite differences of the numpy loss).
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalerl_jax import rl

OBJECTIVES = ("cispo", "dapo", "grpo", "gspo")
AGGREGATIONS = ("prompt", "sample", "token")
NORMALIZATIONS = ("batch", "prompt", "none")
# Clip settings used with the matrix batches; gspo's are the paper's sequence-level range.
CLIP = {
    "cispo": dict(eps_max=4.0),
    "dapo": dict(eps_low=0.2, eps_high=0.28),
    "grpo": dict(eps_low=0.2, eps_high=0.2),
    "gspo": dict(eps_low=3e-4, eps_high=4e-4),
}
STD_EPS = 1e-6


# ----------------------------------------------------------------------------------------------
# float64 numpy references (loops, independent of the package)
# ----------------------------------------------------------------------------------------------
def ref_zero_variance(rewards, group_ids, valid):
    out = np.zeros(len(rewards), bool)
    for b in range(len(rewards)):
        if not valid[b]:
            continue
        members = [rewards[i] for i in range(len(rewards)) if valid[i] and group_ids[i] == group_ids[b]]
        out[b] = max(members) > min(members)
    return out


def ref_advantages(rewards, group_ids, valid, normalization):
    rewards = np.asarray(rewards, np.float64)
    centered = np.zeros(len(rewards))
    prompt_std = np.zeros(len(rewards))
    for b in range(len(rewards)):
        if not valid[b]:
            continue
        members = np.array([rewards[i] for i in range(len(rewards)) if valid[i] and group_ids[i] == group_ids[b]])
        centered[b] = rewards[b] - members.mean()
        prompt_std[b] = members.std()  # numpy's default ddof=0: population std
    if normalization == "none":
        adv = centered
    elif normalization == "prompt":
        adv = centered / (prompt_std + STD_EPS)
    else:
        adv = centered / (centered[np.asarray(valid, bool)].std() + STD_EPS)
    return np.where(valid, adv, 0.0)


def ref_weights(mask, group_ids, aggregation):
    """w[b,t] so that loss = sum w * term; the three aggregations written as means of means."""
    B, T = mask.shape
    w = np.zeros((B, T))
    if aggregation == "token":
        total = mask.sum()
        if total > 0:
            w = mask / total
    elif aggregation == "sample":
        rows = [b for b in range(B) if mask[b].sum() > 0]
        for b in rows:
            w[b] = mask[b] / mask[b].sum() / len(rows)
    else:
        prompts = sorted({group_ids[b] for b in range(B) if mask[b].sum() > 0})
        for g in prompts:
            members = [b for b in range(B) if group_ids[b] == g]
            count = sum(mask[b].sum() for b in members)
            for b in members:
                w[b] = mask[b] / count / len(prompts)
    return w


def ref_loss_grad(
    logp,
    blogp,
    adv,
    mask,
    group_ids,
    objective,
    aggregation,
    eps_low=0.2,
    eps_high=0.28,
    eps_max=4.0,
    cispo_weight_logp=None,
):
    """(loss, dloss/dlogp, clipped-token fraction, mean ratio) in float64.

    cispo_weight_logp: log-probs from which CISPO's stop-gradient weight min(r, eps_max) is
    computed (default: logp); holding it fixed is how finite differences see the stop-gradient.
    """
    logp, blogp, adv, mask = (np.asarray(x, np.float64) for x in (logp, blogp, adv, mask))
    weight_logp = logp if cispo_weight_logp is None else np.asarray(cispo_weight_logp, np.float64)
    B, T = logp.shape
    w = ref_weights(mask, group_ids, aggregation)
    loss, grad = 0.0, np.zeros((B, T))
    clipped, ratios = [], []
    lo, hi = 1 - eps_low, 1 + eps_high
    for b in range(B):
        n_b = mask[b].sum()
        if objective == "gspo" and n_b > 0:
            s = math.exp(sum(mask[b, t] * (logp[b, t] - blogp[b, t]) for t in range(T)) / n_b)
            unclipped, clipped_value = s * adv[b], min(max(s, lo), hi) * adv[b]
            seq_term = -min(unclipped, clipped_value)
            # d(-s A)/dlogp[b,t] = -A s m[b,t]/n_b on the unclipped branch; 0 on the clipped one.
            seq_dterm = -adv[b] * s if unclipped <= clipped_value else 0.0
            loss += w[b].sum() * seq_term
            grad[b] = w[b].sum() * seq_dterm * mask[b] / n_b
            clipped += [unclipped > clipped_value] * int(n_b)
            ratios += [s] * int(n_b)
            continue
        for t in range(T):
            if mask[b, t] == 0:
                continue
            r = math.exp(logp[b, t] - blogp[b, t])
            ratios.append(r)
            if objective == "cispo":
                weight = min(math.exp(weight_logp[b, t] - blogp[b, t]), eps_max)
                loss += w[b, t] * (-weight * adv[b] * logp[b, t])
                grad[b, t] = -weight * adv[b] * w[b, t]
                clipped.append(r > eps_max)
            else:  # dapo, grpo: PPO clip on the token ratio
                unclipped, clipped_value = r * adv[b], min(max(r, lo), hi) * adv[b]
                loss += w[b, t] * -min(unclipped, clipped_value)
                grad[b, t] = -adv[b] * r * w[b, t] if unclipped <= clipped_value else 0.0
                clipped.append(unclipped > clipped_value)
    clip_frac = float(np.mean(clipped)) if clipped else 0.0
    ratio_mean = float(np.mean(ratios)) if ratios else 0.0
    return loss, grad, clip_frac, ratio_mean


# ----------------------------------------------------------------------------------------------
# batches
# ----------------------------------------------------------------------------------------------
def matrix_batch(objective: str, seed: int = 0):
    """B=8, T=6 batch: 4 prompts (one zero-variance), an empty valid sequence, a padding row.

    group ids are non-contiguous, and masked positions carry garbage log-probs.
    """
    rng = np.random.default_rng(seed)
    B, T = 8, 6
    group_ids = np.array([3, 3, 3, 0, 0, 6, 6, 6], np.int32)
    lengths = np.array([6, 2, 4, 3, 5, 1, 0, 6])  # row 6: empty sequence
    row_valid = np.array([1, 1, 1, 1, 1, 1, 1, 0], bool)  # row 7: padding
    rewards = rng.normal(size=B).astype(np.float32)
    rewards[3:5] = 1.0  # prompt 0 is zero-variance
    rewards[7] = 50.0  # padding garbage that must not leak into prompt 6's statistics
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    mask[1, 0] = 0.0  # a prompt token inside the row (mask holes are fine)
    logp = -rng.uniform(0.1, 3.0, size=(B, T))
    if objective == "gspo":
        # sequence mean log-ratios spread over +-2e-3 so that some sequences clip, some do not.
        delta = rng.normal(scale=1.5e-3, size=(B, T))
    else:
        delta = rng.normal(scale=0.35, size=(B, T))
        delta[0, 1] = math.log(6.0)  # a ratio above eps_max = 4 (cispo truncation)
        delta[2, 3] = -math.log(5.0)
    blogp = logp - delta
    logp = np.where(mask > 0, logp, -30.0).astype(np.float32)
    blogp = np.where(mask > 0, blogp, 0.0).astype(np.float32)
    return dict(logp=logp, blogp=blogp, rewards=rewards, mask=mask, group_ids=group_ids, row_valid=row_valid)


def assert_away_from_kinks(batch, objective, clip):
    """Guard: no ratio within 1e-5 of a clip bound, so fp32 and fp64 pick the same branch."""
    logp, blogp, mask = (batch[k].astype(np.float64) for k in ("logp", "blogp", "mask"))
    if objective == "gspo":
        n = np.maximum(mask.sum(1), 1)
        ratios = np.exp((mask * (logp - blogp)).sum(1) / n)[mask.sum(1) > 0]
    else:
        ratios = np.exp(logp - blogp)[mask > 0]
    bounds = [clip["eps_max"]] if objective == "cispo" else [1 - clip["eps_low"], 1 + clip["eps_high"]]
    for bound in bounds:
        assert np.min(np.abs(ratios - bound)) > 1e-5 * bound


def jax_loss_and_grad(objective, aggregation, **clip):
    """jitted (loss, metrics), dloss/dlogp of rl.policy_loss, cached so that tests sharing the
    batch shape share one compilation."""
    return _jitted_loss_and_grad(objective, aggregation, tuple(sorted(clip.items())))


@functools.cache
def _jitted_loss_and_grad(objective, aggregation, clip_items):
    def loss_fn(logp, blogp, adv, mask, group_ids, valid):
        return rl.policy_loss(
            logp,
            blogp,
            adv,
            mask,
            group_ids,
            objective=objective,
            aggregation=aggregation,
            valid=valid,
            **dict(clip_items),
        )

    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


# ----------------------------------------------------------------------------------------------
# the full matrix: objective x aggregation x normalization, value and gradient, under jit
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_policy_loss_matches_numpy_reference(objective):
    batch = matrix_batch(objective)
    clip = CLIP[objective]
    assert_away_from_kinks(batch, objective, clip)
    zv = ref_zero_variance(batch["rewards"], batch["group_ids"], batch["row_valid"])
    np.testing.assert_array_equal(
        np.asarray(rl.zero_variance_mask(batch["rewards"], batch["group_ids"], valid=batch["row_valid"])), zv
    )
    valid = batch["row_valid"] & zv
    ref_mask = batch["mask"] * valid[:, None]
    for aggregation, normalization in itertools.product(AGGREGATIONS, NORMALIZATIONS):
        ref_adv = ref_advantages(batch["rewards"], batch["group_ids"], valid, normalization)
        adv = jax.jit(rl.compute_advantages, static_argnames="normalization")(
            batch["rewards"], batch["group_ids"], normalization=normalization, valid=valid
        )
        np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-5, atol=1e-6)
        # feed the reference the float32 advantages the loss will see, so the loss check
        # isolates the loss math.
        ref_loss, ref_grad, ref_clip, ref_ratio = ref_loss_grad(
            batch["logp"], batch["blogp"], np.asarray(adv), ref_mask, batch["group_ids"], objective, aggregation, **clip
        )
        (loss, metrics), grad = jax_loss_and_grad(objective, aggregation, **clip)(
            batch["logp"], batch["blogp"], adv, batch["mask"], batch["group_ids"], valid
        )
        where = f"{objective}/{aggregation}/{normalization}"
        np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-7, err_msg=where)
        np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-8, err_msg=where)
        assert float(metrics["clip_frac"]) == pytest.approx(ref_clip, abs=1e-6), where
        assert float(metrics["ratio_mean"]) == pytest.approx(ref_ratio, rel=1e-5), where
        assert int(metrics["num_tokens"]) == int(ref_mask.sum())
        # prompts 3 and 6 are in the loss (0 is zero-variance; 7's row is padding).
        assert int(metrics["num_prompts"]) == 2
        assert int(metrics["num_sequences"]) == 4  # rows 0, 1, 2, 5 (row 6 is empty)
        # the batch exercises both branches (cispo: the r = 6 token of row 0 is truncated).
        assert 0.0 < ref_clip < 1.0, where
        assert np.count_nonzero(ref_grad) > 0, where


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_reference_gradient_matches_finite_differences(objective):
    """The analytic numpy gradients used above agree with central differences of the numpy loss
    (for CISPO with its weight min(r, eps_max) held at the base point: the stop-gradient)."""
    batch = matrix_batch(objective, seed=1)
    clip = CLIP[objective]
    adv = ref_advantages(batch["rewards"], batch["group_ids"], batch["row_valid"], "batch")
    logp = batch["logp"].astype(np.float64)
    h = 1e-6
    weight_logp = logp if objective == "cispo" else None  # cispo's weight held at the base point
    for aggregation in AGGREGATIONS:
        args = (batch["blogp"], adv, batch["mask"], batch["group_ids"], objective, aggregation)
        loss_at = lambda lp: ref_loss_grad(lp, *args, **clip, cispo_weight_logp=weight_logp)
        _, grad, _, _ = loss_at(logp)
        numeric = np.zeros_like(logp)
        for b, t in zip(*np.nonzero(batch["mask"])):
            plus, minus = logp.copy(), logp.copy()
            plus[b, t] += h
            minus[b, t] -= h
            numeric[b, t] = (loss_at(plus)[0] - loss_at(minus)[0]) / (2 * h)
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-9)


# ----------------------------------------------------------------------------------------------
# a case small enough to check on paper
# ----------------------------------------------------------------------------------------------
def test_hand_computed_case():
    """One prompt, two completions, rewards (+1, -1), batch normalization, prompt aggregation.

    Advantages: mean 0, centered (1, -1), population std 1, so A = (a, -a) with a = 1/(1 + 1e-6).
    Row 0 has two tokens: p = (1/2, 1/4) under the trainer, (1/4, 1/4) under the sampler, so
    r = (2, 1). Row 1 has one token (the second column is padding): p = 1/2 vs 1, r = 1/2.
    Prompt aggregation with 3 tokens in the prompt: w = 1/3 on each valid token.

    CISPO, eps_max = 1.5: weights min(r, 1.5) = (1.5, 1, 0.5)
      terms = -1.5 a ln(1/2) = 1.5 a ln2;  -1 a ln(1/4) = 2 a ln2;  -0.5 (-a) ln(1/2) = -0.5 a ln2
      loss = (1.5 + 2 - 0.5) a ln2 / 3 = a ln2
      dloss/dlogp = -min(r, 1.5) A w = (-1.5a/3, -a/3 | +0.5a/3) = (-a/2, -a/3 | a/6)
      truncated fraction: 1 of 3 (r = 2 > 1.5).
    DAPO, eps 0.2 / 0.28: row 0 token 0, A > 0 and r = 2 > 1.28: clipped, term -1.28a, grad 0;
      token 1, r = 1: term -a, grad -a/3; row 1, A < 0 and r = 0.5 < 0.8: clipped, term
      -(0.8 * -a) = 0.8a, grad 0. loss = (-1.28 - 1 + 0.8) a / 3 = -1.48a/3; clipped 2 of 3.
    """
    a = 1.0 / (1.0 + 1e-6)
    logp = np.log(np.array([[0.5, 0.25], [0.5, 0.9]], np.float32))
    blogp = np.log(np.array([[0.25, 0.25], [1.0, 0.3]], np.float32))
    mask = np.array([[1, 1], [1, 0]], np.float32)
    group_ids = np.array([0, 0], np.int32)
    adv = rl.compute_advantages(np.array([1.0, -1.0]), group_ids, normalization="batch")
    np.testing.assert_allclose(np.asarray(adv), [a, -a], rtol=1e-6)

    def run(objective, **kw):
        fn = lambda lp: rl.policy_loss(lp, blogp, adv, mask, group_ids, objective=objective, aggregation="prompt", **kw)
        return jax.value_and_grad(fn, has_aux=True)(logp)

    (loss, metrics), grad = run("cispo", eps_max=1.5)
    np.testing.assert_allclose(float(loss), a * math.log(2), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), [[-a / 2, -a / 3], [a / 6, 0]], rtol=1e-6)
    assert float(metrics["clip_frac"]) == pytest.approx(1 / 3)
    assert float(metrics["clip_frac_high"]) == pytest.approx(1 / 3)  # the truncated r = 2
    assert float(metrics["clip_frac_low"]) == 0.0
    assert float(metrics["ratio_mean"]) == pytest.approx((2 + 1 + 0.5) / 3)
    assert int(metrics["num_tokens"]) == 3 and int(metrics["num_prompts"]) == 1

    (loss, metrics), grad = run("dapo", eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(float(loss), -1.48 * a / 3, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), [[0, -a / 3], [0, 0]], rtol=1e-6, atol=1e-9)
    assert float(metrics["clip_frac"]) == pytest.approx(2 / 3)
    assert float(metrics["clip_frac_high"]) == pytest.approx(1 / 3)  # row 0 token 0, A > 0
    assert float(metrics["clip_frac_low"]) == pytest.approx(1 / 3)  # row 1, A < 0


@pytest.mark.parametrize(
    "objective,clip",
    [
        ("cispo", dict(eps_max=1.3)),
        ("dapo", dict(eps_low=0.2, eps_high=0.28)),
        ("grpo", dict(eps_low=0.15)),
        ("gspo", dict(eps_low=0.1, eps_high=0.12)),
    ],
)
def test_clip_fractions_split_by_side(objective, clip):
    """clip_frac_low / clip_frac_high against numpy on hand-built ratios and advantages: low is
    A < 0 and r < 1 - eps_low, high is A > 0 and r > 1 + eps_high (cispo: r > eps_max, low 0);
    the ratio is per token, or gspo's per-row exp(mean log-ratio) on each of the row's tokens."""
    log_ratio = np.log(
        np.array(
            [
                [1.5, 0.9, 1.35, 1.2, 9.0],
                [0.5, 1.4, 0.95, 0.7, 1.05],
                [1.6, 0.3, 1.0, 2.0, 1.0],
                [0.75, 0.82, 1.35, 0.5, 1.0],
            ]
        )
    )
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], np.float32)
    adv = np.array([0.9, -1.2, 0.0, -0.4], np.float32)  # row 2: A = 0 is clipped on no side
    blogp = np.full(mask.shape, -2.0, np.float32)
    logp = (blogp + log_ratio).astype(np.float32)
    on = mask > 0
    if objective == "gspo":
        seq = np.exp((mask * log_ratio).sum(1) / mask.sum(1))
        ratio = np.broadcast_to(seq[:, None], mask.shape)
    else:
        ratio = np.exp(log_ratio)
    if objective == "cispo":
        low, high = np.zeros_like(on), ratio > clip["eps_max"]
    else:
        eps_low = clip["eps_low"]
        eps_high = clip.get("eps_high", eps_low)
        low = (adv[:, None] < 0) & (ratio < 1 - eps_low)
        high = (adv[:, None] > 0) & (ratio > 1 + eps_high)
    want_low, want_high = (np.sum(on & side) / on.sum() for side in (low, high))
    assert want_high > 0 and (objective == "cispo" or want_low > 0)
    _, metrics = jax.jit(
        lambda lp: rl.policy_loss(lp, blogp, adv, mask, np.arange(4), objective=objective, aggregation="token", **clip)
    )(logp)
    assert float(metrics["clip_frac_low"]) == pytest.approx(want_low, abs=1e-7)
    assert float(metrics["clip_frac_high"]) == pytest.approx(want_high, abs=1e-7)
    assert float(metrics["clip_frac"]) == pytest.approx(want_low + want_high, abs=1e-7)


# ----------------------------------------------------------------------------------------------
# the properties that make the recipe what it is
# ----------------------------------------------------------------------------------------------
def test_cispo_keeps_gradient_above_eps_max_where_dapo_clips():
    """Token aggregation over 4 tokens (w = 1/4); token (0, 1) has r = 6 > eps_max = 4, A = 2.

    CISPO: dloss/dlogp = -min(6, 4) * 2 * 1/4 = -2. DAPO: r = 6 > 1.28 with A > 0: 0.
    For A < 0 and r = 6 DAPO's unclipped branch is the min: gradient -A r w = -(-1)(6)/4 = 1.5.
    """
    logp = np.array([[-1.0, -0.5], [-1.0, -0.5]], np.float32)
    blogp = logp - np.array([[0.0, math.log(6.0)], [0.0, math.log(6.0)]], np.float32)
    mask = np.ones((2, 2), np.float32)
    group_ids = np.array([0, 0], np.int32)
    adv = np.array([2.0, -1.0], np.float32)

    def grad(objective):
        fn = lambda lp: rl.policy_loss(
            lp, blogp, adv, mask, group_ids, objective=objective, aggregation="token", eps_max=4.0
        )[0]
        return np.asarray(jax.grad(fn)(logp))

    cispo, dapo = grad("cispo"), grad("dapo")
    assert cispo[0, 1] == pytest.approx(-4.0 * 2.0 / 4, rel=1e-6)
    assert dapo[0, 1] == 0.0
    assert dapo[1, 1] == pytest.approx(1.5, rel=1e-6)
    assert cispo[1, 1] == pytest.approx(-4.0 * -1.0 / 4, rel=1e-6)


def test_grpo_clip_is_symmetric_by_default():
    """r = 1.2, A = 1, eps_low = 0.1: grpo clips at 1.1 (gradient 0); dapo's eps_high stays 0.28.

    One token, token aggregation: dapo gradient -A r = -1.2.
    """
    logp = np.array([[math.log(0.6)]], np.float32)
    blogp = np.array([[math.log(0.5)]], np.float32)
    args = (np.ones((1, 1), np.float32), np.zeros(1, np.int32))

    def grad(objective):
        fn = lambda lp: rl.policy_loss(
            lp, blogp, np.ones(1, np.float32), *args, objective=objective, aggregation="token", eps_low=0.1
        )[0]
        return float(jax.grad(fn)(logp)[0, 0])

    assert grad("grpo") == 0.0
    assert grad("dapo") == pytest.approx(-1.2, rel=1e-6)
    assert rl.resolve_clip_eps("grpo", 0.15, None) == (0.15, 0.15)
    assert rl.resolve_clip_eps("dapo", None, None) == (0.2, 0.28)
    assert rl.resolve_clip_eps("gspo", None, None) == (3e-4, 4e-4)


def test_prompt_aggregation_gives_each_prompt_equal_weight():
    """Prompt A: one completion of 5 tokens; B: completions of 1, 2 and 6 tokens; C: 2 and 0.

    With CISPO, r = 1 and A = 1 everywhere, dloss/dlogp = -w, so each prompt's summed gradient is
    minus its total weight: 1/3 each for 'prompt' (3 prompts with tokens). For 'token' it is the
    prompt's token share: 5/16, 9/16, 2/16.
    """
    lengths = [5, 1, 2, 6, 2, 0]
    group_ids = np.array([0, 2, 2, 2, 4, 4], np.int32)
    mask = (np.arange(6)[None, :] < np.array(lengths)[:, None]).astype(np.float32)
    logp = np.full((6, 6), -1.0, np.float32)
    adv = np.ones(6, np.float32)

    def per_row_weight(aggregation):
        fn = lambda lp: rl.policy_loss(lp, logp, adv, mask, group_ids, objective="cispo", aggregation=aggregation)[0]
        return -np.asarray(jax.grad(fn)(logp)).sum(axis=1)

    def per_prompt_weight(aggregation):
        row_total = per_row_weight(aggregation)
        return [row_total[group_ids == g].sum() for g in (0, 2, 4)]

    np.testing.assert_allclose(per_prompt_weight("prompt"), [1 / 3] * 3, rtol=1e-6)
    np.testing.assert_allclose(per_prompt_weight("token"), [5 / 16, 9 / 16, 2 / 16], rtol=1e-6)
    # 'sample': 5 non-empty sequences, each of total weight 1/5, the empty one 0.
    np.testing.assert_allclose(per_row_weight("sample"), [0.2] * 5 + [0.0], rtol=1e-6)


def test_batch_normalization_uses_std_over_valid_samples_only():
    """Prompt 0: valid rewards (1, -1, -1, -1), mean -0.5, centered (1.5, -0.5, -0.5, -0.5).
    Prompt 1: valid rewards (1, 1, 1, -1), mean 0.5, centered (0.5, 0.5, 0.5, -1.5).
    Invalid rows: a padding row of prompt 0 with reward 10, and prompt 2 with rewards (5, -3).
    Valid centered values have mean 0 and population variance (2*2.25 + 6*0.25)/8 = 0.75, so
    A = centered / (sqrt(0.75) + 1e-6); invalid rows get 0. Including the invalid rows would
    change both the prompt-0 mean and the std.
    """
    rewards = np.array([1, -1, -1, -1, 10, 1, 1, 1, -1, 5, -3], np.float32)
    group_ids = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2], np.int32)
    valid = np.array([1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0], bool)
    centered = np.array([1.5, -0.5, -0.5, -0.5, 0, 0.5, 0.5, 0.5, -1.5, 0, 0])
    expected = centered / (math.sqrt(0.75) + 1e-6)
    adv = rl.compute_advantages(rewards, group_ids, normalization="batch", valid=valid)
    np.testing.assert_allclose(np.asarray(adv), expected, rtol=1e-6, atol=1e-7)
    # 'prompt': prompt 0's std is sqrt((2.25 + 3 * 0.25) / 4) = sqrt(0.75) as well; prompt 1's too.
    adv = rl.compute_advantages(rewards, group_ids, normalization="prompt", valid=valid)
    np.testing.assert_allclose(np.asarray(adv), expected, rtol=1e-6, atol=1e-7)
    adv = rl.compute_advantages(rewards, group_ids, normalization="none", valid=valid)
    np.testing.assert_allclose(np.asarray(adv), centered, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_zero_variance_prompts_contribute_nothing(aggregation):
    """Loss and gradients with a zero-variance prompt filtered equal the numpy reference on the
    batch without it; its rows get exactly zero gradient."""
    batch = matrix_batch("cispo", seed=2)
    keep = batch["row_valid"].copy()
    zv = np.asarray(rl.zero_variance_mask(batch["rewards"], batch["group_ids"], valid=keep))
    assert not zv[3] and not zv[4] and zv[0]  # prompt 0 (rows 3, 4) has equal rewards
    valid = keep & zv
    adv = rl.compute_advantages(batch["rewards"], batch["group_ids"], normalization="batch", valid=valid)
    rows = np.flatnonzero(valid)
    ref_adv = ref_advantages(batch["rewards"][rows], batch["group_ids"][rows], np.ones(len(rows), bool), "batch")
    np.testing.assert_allclose(np.asarray(adv)[rows], ref_adv, rtol=1e-5)
    ref_loss, ref_grad, _, _ = ref_loss_grad(
        batch["logp"][rows],
        batch["blogp"][rows],
        np.asarray(adv)[rows],
        batch["mask"][rows],
        batch["group_ids"][rows],
        "cispo",
        aggregation,
        **CLIP["cispo"],
    )
    (loss, metrics), grad = jax_loss_and_grad("cispo", aggregation, **CLIP["cispo"])(
        batch["logp"], batch["blogp"], adv, batch["mask"], batch["group_ids"], valid
    )
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad)[rows], ref_grad, rtol=1e-5, atol=1e-8)
    assert np.all(np.asarray(grad)[~valid] == 0)
    assert int(metrics["num_prompts"]) == 2


# ----------------------------------------------------------------------------------------------
# exactness under padding, empty batches, microbatching, bf16
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_padding_invariance(objective):
    """Appending padding columns (garbage log-probs: -inf, nan, 1e30) and padding rows (valid
    False, sharing an existing prompt id or a new one) leaves loss and gradients unchanged, and
    padding gets zero gradient."""
    clip = CLIP[objective]
    base = matrix_batch(objective, seed=3)
    B, T = base["logp"].shape
    extra_t, extra_b = 3, 2
    pad = dict(
        logp=np.full((B + extra_b, T + extra_t), np.nan, np.float32),
        blogp=np.full((B + extra_b, T + extra_t), 7.0, np.float32),
        mask=np.zeros((B + extra_b, T + extra_t), np.float32),
    )
    pad["logp"][:, T:] = [-np.inf, np.nan, 1e30]
    for key in ("logp", "blogp", "mask"):
        pad[key][:B, :T] = base[key]
    pad["mask"][B:, :] = 1.0  # padding rows are removed by valid alone
    group_ids = np.concatenate([base["group_ids"], [3, 9]]).astype(np.int32)
    rewards = np.concatenate([base["rewards"], [100.0, -100.0]]).astype(np.float32)
    row_valid = np.concatenate([base["row_valid"], [False, False]])
    for aggregation in AGGREGATIONS:
        results = []
        for logp, blogp, mask, gids, rew, ok in (
            (base["logp"], base["blogp"], base["mask"], base["group_ids"], base["rewards"], base["row_valid"]),
            (pad["logp"], pad["blogp"], pad["mask"], group_ids, rewards, row_valid),
        ):
            valid = ok & np.asarray(rl.zero_variance_mask(rew, gids, valid=ok))
            adv = rl.compute_advantages(rew, gids, normalization="batch", valid=valid)
            (loss, metrics), grad = jax_loss_and_grad(objective, aggregation, **clip)(
                logp, blogp, adv, mask, gids, valid
            )
            results.append((float(loss), np.asarray(grad), metrics))
        (loss0, grad0, m0), (loss1, grad1, m1) = results
        assert np.isfinite(loss1) and np.all(np.isfinite(grad1))
        np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
        np.testing.assert_allclose(grad1[:B, :T], grad0, rtol=1e-6, atol=1e-9)
        assert np.all(grad1[B:] == 0) and np.all(grad1[:, T:] == 0)
        for key in m0:
            np.testing.assert_allclose(float(m1[key]), float(m0[key]), rtol=1e-6)


def test_all_zero_variance_batch_gives_zero_loss_and_gradient():
    """Every prompt has equal rewards: with the zero-variance filter (valid all False) and without
    it (advantages all 0, masks kept), loss 0 and gradient 0 with no NaN, under jit."""
    rewards = np.array([1, 1, -1, -1, -1, 0.5, 0.5, 0.5], np.float32)
    group_ids = np.array([0, 0, 1, 1, 1, 5, 5, 5], np.int32)
    mask = np.ones((8, 6), np.float32)
    mask[7] = 0.0
    logp = np.full((8, 6), -0.7, np.float32)
    blogp = np.full((8, 6), -0.9, np.float32)
    zv = np.asarray(rl.zero_variance_mask(rewards, group_ids))
    assert not np.any(zv)
    for valid in (zv, np.ones(8, bool)):
        for normalization in NORMALIZATIONS:
            adv = rl.compute_advantages(rewards, group_ids, normalization=normalization, valid=valid)
            assert np.all(np.asarray(adv) == 0), normalization
        for objective, aggregation in itertools.product(OBJECTIVES, AGGREGATIONS):
            (loss, metrics), grad = jax_loss_and_grad(objective, aggregation, **CLIP[objective])(
                logp, blogp, adv, mask, group_ids, valid
            )
            assert float(loss) == 0.0
            assert np.all(np.asarray(grad) == 0)
            assert all(np.isfinite(float(v)) for v in metrics.values())


def test_row_scales_give_the_reference_weights():
    """w = m * s, with s from the rows' token counts alone (row_scales), equals the numpy weights for
    the matrix batch's masks (an empty valid row, a padding row, a zero-variance prompt left out)."""
    batch = matrix_batch("cispo")
    valid = batch["row_valid"] & ref_zero_variance(batch["rewards"], batch["group_ids"], batch["row_valid"])
    mask = batch["mask"] * valid[:, None]
    for aggregation in AGGREGATIONS:
        scales = np.asarray(rl.row_scales(mask.sum(1), batch["group_ids"], aggregation=aggregation))
        want = ref_weights(mask.astype(np.float64), batch["group_ids"], aggregation)
        np.testing.assert_allclose(mask * scales[:, None], want, rtol=1e-6, err_msg=aggregation)
        assert np.all(np.isfinite(scales)), aggregation  # empty rows and prompts divide by nothing


def test_microbatches_along_batch_sum_to_full_batch_loss():
    """The train step's decomposition: advantages and row scales over the whole batch, then
    policy_sums per microbatch (rows in any order, each microbatch cut to its own length as in the
    sorted layout), combined by combine_policy_sums, give the numpy reference full-batch loss,
    gradient, clip fraction and mean ratio (gspo's sequence ratio uses each row only)."""
    aggregation = "prompt"  # the one whose weights couple rows across microbatches most
    # rows 1, 3, 5, 6 have no loss token from column 3 on: their microbatch is cut to 3 columns.
    microbatches = ((np.array([1, 3, 5, 6]), 3), (np.array([0, 2, 4, 7]), 6))
    for objective in OBJECTIVES:
        clip = CLIP[objective]
        batch = matrix_batch(objective, seed=4)
        valid = batch["row_valid"]
        adv = np.asarray(
            rl.compute_advantages(batch["rewards"], batch["group_ids"], normalization="batch", valid=valid)
        )
        mask = batch["mask"] * valid[:, None]
        assert not mask[microbatches[0][0], microbatches[0][1] :].any()
        scales = np.asarray(rl.row_scales(mask.sum(1), batch["group_ids"], aggregation=aggregation))

        def microbatched_loss(logp):
            total = rl.PolicySums.zeros()
            for rows, length in microbatches:
                sums = rl.policy_sums(
                    logp[rows, :length],
                    batch["blogp"][rows, :length],
                    adv[rows],
                    mask[rows, :length],
                    scales[rows],
                    objective=objective,
                    **clip,
                )
                total = rl.combine_policy_sums(total, sums)
            return total.loss, total

        (loss, sums), grad = jax.jit(jax.value_and_grad(microbatched_loss, has_aux=True))(batch["logp"])
        ref_loss, ref_grad, ref_clip, ref_ratio = ref_loss_grad(
            batch["logp"], batch["blogp"], adv, mask, batch["group_ids"], objective, aggregation, **clip
        )
        np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-8)
        metrics = rl.policy_metrics(sums, *rl.count_sequences_and_prompts(mask.sum(1), batch["group_ids"]))
        assert float(metrics["clip_frac"]) == pytest.approx(ref_clip, abs=1e-6), objective
        assert float(metrics["ratio_mean"]) == pytest.approx(ref_ratio, rel=1e-5), objective
        # rows 0-5 have loss tokens (row 6 is empty, row 7 padding), in prompts 3, 0 and 6.
        assert int(metrics["num_sequences"]) == 6 and int(metrics["num_prompts"]) == 3


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_bfloat16_inputs_are_computed_in_float32(objective):
    """bf16 logp / behaviour logp / advantages: the loss is float32 and matches the float64
    reference on the bf16-rounded inputs to float32 accuracy; the gradient comes back in bf16."""
    clip = CLIP[objective]
    batch = matrix_batch(objective, seed=5)
    if objective == "gspo":
        # bf16 log-probs cannot resolve 1e-3 log-ratios; use a sequence-level clip range that
        # the bf16-rounded inputs exercise.
        clip = dict(eps_low=0.05, eps_high=0.08)
        batch["blogp"] = np.where(
            batch["mask"] > 0,
            batch["logp"] - np.linspace(-0.3, 0.3, batch["logp"].size).reshape(batch["logp"].shape),
            0.0,
        ).astype(np.float32)
    valid = batch["row_valid"]
    adv = rl.compute_advantages(batch["rewards"], batch["group_ids"], normalization="batch", valid=valid)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    logp, blogp, adv_bf = bf(batch["logp"]), bf(batch["blogp"]), bf(adv)
    to64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    (loss, _), grad = jax_loss_and_grad(objective, "prompt", **clip)(
        logp, blogp, adv_bf, batch["mask"], batch["group_ids"], valid
    )
    ref_loss, ref_grad, _, _ = ref_loss_grad(
        to64(logp),
        to64(blogp),
        to64(adv_bf),
        batch["mask"] * valid[:, None],
        batch["group_ids"],
        objective,
        "prompt",
        **clip,
    )
    assert loss.dtype == jnp.float32 and grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(to64(grad), ref_grad, rtol=1e-2, atol=1e-4)
    assert np.count_nonzero(ref_grad) > 0


def test_batch_sharded_over_devices_matches_reference():
    """Rows sharded over all devices of a data mesh (8 CPU devices under the test conftest): the
    group reductions cross shards, and loss and gradient still equal the numpy reference."""
    devices = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devices, ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    batch = matrix_batch("dapo", seed=6)
    reps = len(devices)  # B = 8 * #devices; the copies keep their own prompts (ids offset by 8)
    tile = lambda x: np.concatenate([x] * reps)
    group_ids = np.concatenate([batch["group_ids"] + 8 * k for k in range(reps)]).astype(np.int32)
    host = dict(
        logp=tile(batch["logp"]),
        blogp=tile(batch["blogp"]),
        mask=tile(batch["mask"]),
        rewards=tile(batch["rewards"]),
        valid=tile(batch["row_valid"]),
    )
    valid = host["valid"] & ref_zero_variance(host["rewards"], group_ids, host["valid"])

    def loss_and_grad(logp, blogp, mask, rewards, gids, valid):
        adv = rl.compute_advantages(rewards, gids, normalization="batch", valid=valid)
        fn = lambda lp: rl.policy_loss(lp, blogp, adv, mask, gids, objective="dapo", aggregation="prompt", valid=valid)[
            0
        ]
        return jax.value_and_grad(fn)(logp)

    args = [
        jax.device_put(x, rows) for x in (host["logp"], host["blogp"], host["mask"], host["rewards"], group_ids, valid)
    ]
    loss, grad = jax.jit(loss_and_grad)(*args)
    adv = ref_advantages(host["rewards"], group_ids, valid, "batch")
    ref_loss, ref_grad, _, _ = ref_loss_grad(
        host["logp"], host["blogp"], adv, host["mask"] * valid[:, None], group_ids, "dapo", "prompt"
    )
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------------------------------------
# filters, advantages, length penalty
# ----------------------------------------------------------------------------------------------
def test_zero_variance_mask_by_hand():
    """Prompt 0 (1, 1, -1) varies, its invalid row (reward 5) stays False; prompt 1 (0.5, 0.5)
    does not vary once its invalid row (2.0) is ignored; prompt 4 has a single completion."""
    rewards = np.array([1, 1, -1, 0.5, 0.5, 2.0, 3.0, 5.0], np.float32)
    group_ids = np.array([0, 0, 0, 1, 1, 1, 4, 0], np.int32)
    valid = np.array([1, 1, 1, 1, 1, 0, 1, 0], bool)
    out = jax.jit(rl.zero_variance_mask)(rewards, group_ids, valid=valid)
    np.testing.assert_array_equal(np.asarray(out), [1, 1, 1, 0, 0, 0, 0, 0])
    out = rl.zero_variance_mask(rewards, group_ids)  # all valid: prompt 1 now varies
    np.testing.assert_array_equal(np.asarray(out), [1, 1, 1, 1, 1, 1, 0, 1])


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_advantages_match_numpy_reference(normalization):
    rng = np.random.default_rng(7)
    rewards = rng.normal(size=12).astype(np.float32)
    group_ids = rng.integers(0, 4, size=12).astype(np.int32)
    valid = rng.random(12) > 0.25
    adv = rl.compute_advantages(jnp.asarray(rewards, jnp.bfloat16), group_ids, normalization=normalization, valid=valid)
    rounded = np.asarray(jnp.asarray(rewards, jnp.bfloat16).astype(jnp.float32), np.float64)
    assert adv.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(adv), ref_advantages(rounded, group_ids, valid, normalization), rtol=1e-5, atol=1e-6
    )


def test_length_penalty():
    """L_max = 14000, L_cache = 2000 (the paper's): 0 up to 12000 tokens, linear to -1 at 14000,
    -1 beyond; e.g. 13000 -> (14000 - 13000)/2000 - 1 = -0.5, 13500 -> -0.75."""
    lengths = np.array([0, 10000, 12000, 13000, 13500, 14000, 20000])
    expected = [0, 0, 0, -0.5, -0.75, -1, -1]
    out = jax.jit(rl.length_penalty, static_argnames=("l_max", "l_cache"))(lengths, l_max=14000, l_cache=2000)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-7)
    # DAPO's piecewise definition, checked on every integer length around the window.
    lengths = np.arange(11000, 15001)
    piecewise = np.where(lengths <= 12000, 0.0, np.where(lengths <= 14000, (12000 - lengths) / 2000, -1.0))
    np.testing.assert_allclose(np.asarray(rl.length_penalty(lengths, l_max=14000, l_cache=2000)), piecewise, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
def test_bad_input_raises_naming_the_culprit():
    logp = np.zeros((2, 3), np.float32)
    mask = np.ones((2, 3), np.float32)
    adv = np.zeros(2, np.float32)
    gids = np.zeros(2, np.int32)
    call = lambda **kw: rl.policy_loss(
        kw.pop("logp", logp),
        kw.pop("blogp", logp),
        kw.pop("adv", adv),
        kw.pop("mask", mask),
        kw.pop("gids", gids),
        **{"objective": "cispo", "aggregation": "token", **kw},
    )
    with pytest.raises(ValueError, match="objective"):
        call(objective="ppo")
    with pytest.raises(ValueError, match="aggregation"):
        call(aggregation="mean")
    with pytest.raises(ValueError, match="behavior_logp"):
        call(blogp=np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="advantages"):
        call(adv=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="group_ids"):
        call(gids=np.array([0, 2], np.int32))
    with pytest.raises(ValueError, match="group_ids"):
        call(gids=np.array([0.0, 1.0], np.float32))
    with pytest.raises(ValueError, match="eps_high"):
        call(objective="dapo", eps_high=-0.1)
    with pytest.raises(ValueError, match="eps_max"):
        call(eps_max=0.0)
    with pytest.raises(ValueError, match="normalization"):
        rl.compute_advantages(adv, gids, normalization="group")
    with pytest.raises(ValueError, match="l_cache"):
        rl.length_penalty(np.array([1]), l_max=10, l_cache=0)
