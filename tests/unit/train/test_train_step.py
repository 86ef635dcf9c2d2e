"""The jitted train step against a float64 numpy computation of the ScaleRL loss.

Reference: the per-token log-probs come from one full-batch, unchunked forward of the model
(`reference_logp` in the `model_parts` fixture: log_softmax(model(tokens) / temperature) gathered at the next token, written
here). Advantages, aggregation weights, loss and dL/dlogp are computed in float64 numpy from
the formulas of the ScaleRL paper (written again below, independently of scalerl_jax.rl), and
the reference parameter gradient is the VJP of that single full-batch log-prob function with the
numpy dL/dlogp as cotangent. The train step instead deals rows into microbatches, scans, uses the
chunked `sequence_logprobs` and the rl module; both must agree for every aggregation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from small_models import small_llama

from scalerl_jax.config import recipes
from scalerl_jax.config.adapters import train_step_config_of
from scalerl_jax.contracts.batch_layout import Routing, validate_batch
from scalerl_jax.models import Transformer, get_preset, make_mesh, param_shardings
from scalerl_jax.train import (
    OptimizerConfig,
    TrainStepConfig,
    accumulate_gradients,
    create_train_state,
    init_train_state,
    make_optimizer,
    make_train_step,
)
from scalerl_jax.train.optimizer import learning_rate_schedule

B, T = 8, 12
TEMPERATURE = 0.8
EPS_STD = 1e-6  # added to the batch std of the advantages


def _tiny_config():
    return small_llama()


# ---------------------------------------------------------------------------------------------
# float64 numpy reference of the loss
# ---------------------------------------------------------------------------------------------
def np_advantages(rewards, group_ids, valid):
    """ScaleRL: A = (r - mean of the prompt's valid rewards) / (population std over valid rows
    of those centered values + 1e-6); 0 on invalid rows."""
    centered = np.zeros(len(rewards))
    for g in np.unique(group_ids[valid]):
        rows = valid & (group_ids == g)
        centered[rows] = rewards[rows] - rewards[rows].mean()
    std = centered[valid].std()
    return np.where(valid, centered / (std + EPS_STD), 0.0)


def np_weights(mask, group_ids, aggregation):
    """Per-token weights: token = 1/N; sample = 1/(n_b * #rows); prompt = 1/(n_g * #prompts)."""
    n_row = mask.sum(1)
    w = np.zeros_like(mask)
    if aggregation == "token":
        return mask / mask.sum()
    if aggregation == "sample":
        rows = n_row > 0
        w[rows] = mask[rows] / n_row[rows, None] / rows.sum()
        return w
    groups = [g for g in np.unique(group_ids) if n_row[group_ids == g].sum() > 0]
    for g in groups:
        rows = group_ids == g
        w[rows] = mask[rows] / n_row[rows].sum() / len(groups)
    return w


def np_loss_and_dlogp(logp, blogp, adv, mask, weights, objective, eps_low, eps_high, eps_max):
    """(loss = sum w x, dloss/dlogp, clip fractions), float64. Clip fractions: the fractions of loss
    tokens with the lower clip active (A < 0, r < 1 - el; cispo: none) and with the upper clip
    active (A > 0, r > 1 + eh; cispo: the weight truncated, r > eps_max), as {'low', 'high'}.

    cispo: x = -sg(min(r, eps_max)) A logp, dx/dlogp = -min(r, eps_max) A.
    dapo : x = -min(r A, clip(r, 1-el, 1+eh) A); derivative -r A unless the clip branch is the min.
    grpo : dapo with eh = el.
    gspo : dapo with s_b = exp(sum_t m (logp - blogp) / n_b) for every token of row b;
           d(-s_b A_b)/dlogp[b,t] = -s_b A_b m[b,t] / n_b unless clipped.
    """
    A = adv[:, None]
    on = mask > 0
    if objective == "cispo":
        r = np.exp(logp - blogp)
        c = np.minimum(r, eps_max)
        x = -c * A * logp
        return (
            np.sum(weights * x),
            np.where(on, -weights * c * A, 0.0),
            {"low": 0.0, "high": np.sum(on & (r > eps_max)) / on.sum()},
        )
    if eps_high is None:  # grpo: symmetric clip
        eps_high = eps_low
    low, high = 1 - eps_low, 1 + eps_high
    if objective in ("dapo", "grpo"):
        r = np.exp(logp - blogp)
        x = -np.minimum(r * A, np.clip(r, low, high) * A)
        clipped_low, clipped_high = (A < 0) & (r < low), (A > 0) & (r > high)
        grad = np.where(on & ~(clipped_low | clipped_high), -weights * r * A, 0.0)
        return (
            np.sum(weights * x),
            grad,
            {"low": np.sum(on & clipped_low) / on.sum(), "high": np.sum(on & clipped_high) / on.sum()},
        )
    assert objective == "gspo"
    n = mask.sum(1)
    s = np.exp(np.sum(mask * (logp - blogp), 1) / np.maximum(n, 1))
    x_row = -np.minimum(s * adv, np.clip(s, low, high) * adv)
    clipped_low, clipped_high = (adv < 0) & (s < low), (adv > 0) & (s > high)
    weight_row = weights.sum(1)
    grad = np.where(clipped_low | clipped_high, 0.0, -weight_row * adv * s / np.maximum(n, 1))[:, None] * mask
    return (
        np.sum(weight_row * x_row),
        grad,
        {"low": np.sum(on & clipped_low[:, None]) / on.sum(), "high": np.sum(on & clipped_high[:, None]) / on.sum()},
    )


# ---------------------------------------------------------------------------------------------
# fixtures: a tiny model, its unchunked full-batch log-probs, and a batch with varied structure
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_parts():
    model = Transformer(_tiny_config(), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def reference_logp(p, tokens):
        logits = nnx.merge(graphdef, p)(tokens) / TEMPERATURE
        logp_all = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp_all[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.pad(picked, ((0, 0), (1, 0)))

    logp_fn = jax.jit(reference_logp)
    vjp_fn = jax.jit(lambda p, tokens, ct: jax.vjp(lambda q: reference_logp(q, tokens), p)[1](ct)[0])
    return graphdef, params, logp_fn, vjp_fn


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _make_batch(logp_fn, params, seed=0):
    """8 rows: prompt 0 (rows 0-2), prompt 5 (rows 3-4), prompt 2 (rows 5-6, all rewards equal:
    dropped as zero-variance), row 7 padding. Varied prompt/completion lengths, one forced
    (unsampled) token, behaviour log-probs = model log-probs - noise, a few with ratio > 4."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 64, (B, T)).astype(np.int32)
    prompt_len = np.array([2, 3, 4, 2, 5, 3, 3, 2])
    completion_len = np.array([9, 6, 8, 10, 3, 5, 4, 0])
    cols = np.arange(T)[None]
    mask = (cols >= prompt_len[:, None]) & (cols < (prompt_len + completion_len)[:, None])
    mask = mask.astype(np.float32)
    mask[0, 5] = 0.0  # a forced interruption token inside row 0's completion
    logp = np.asarray(logp_fn(params, jnp.asarray(tokens)), np.float64)
    delta = rng.normal(0.0, 0.4, (B, T))
    delta[1, 4] = delta[4, 5] = 2.0  # r = e^2 > eps_max = 4: cispo truncates
    delta[3, 6] = 3.0  # and the batch's largest |logp - behavior_logp|, outside microbatch 0
    behavior = np.where(mask > 0, logp - delta, 0.0).astype(np.float32)
    batch = dict(
        tokens=tokens,
        loss_mask=mask,
        behavior_logp=behavior,
        rewards=np.array([1, -1, 1, -1, 1, 1, 1, 0], np.float32),
        group_ids=np.array([0, 0, 0, 5, 5, 2, 2, 7], np.int32),
        sample_valid=np.array([1, 1, 1, 1, 1, 0, 0, 0], bool),
    )
    return batch


def _reference(model_parts, batch, objective, aggregation, eps_low, eps_high, eps_max=4.0):
    """(loss, clip fractions {'low', 'high'}, parameter gradient) of the full batch from the numpy
    formulas."""
    _, params, logp_fn, vjp_fn = model_parts
    logp = np.asarray(logp_fn(params, jnp.asarray(batch["tokens"])), np.float64)
    valid = batch["sample_valid"]
    mask = batch["loss_mask"].astype(np.float64) * valid[:, None]
    adv = np_advantages(batch["rewards"].astype(np.float64), batch["group_ids"], valid)
    weights = np_weights(mask, batch["group_ids"], aggregation)
    loss, dlogp, clip_fracs = np_loss_and_dlogp(
        logp, batch["behavior_logp"].astype(np.float64), adv, mask, weights, objective, eps_low, eps_high, eps_max
    )
    grads = vjp_fn(params, jnp.asarray(batch["tokens"]), jnp.asarray(dlogp, jnp.float32))
    return loss, clip_fracs, grads


def _assert_trees_close(got, want, rtol=2e-4):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        w = np.asarray(w, np.float64)
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=rtol, atol=rtol * np.max(np.abs(w)) + 1e-12)


# ---------------------------------------------------------------------------------------------
# microbatched gradient == full-batch gradient of the numpy loss, for every aggregation
# ---------------------------------------------------------------------------------------------
# Fast cases cover each aggregation and each objective kind once; the rest run with -m slow.
@pytest.mark.parametrize(
    "objective,aggregation,eps,num_microbatches",
    [
        ("cispo", "prompt", (None, None), 4),
        ("dapo", "token", (0.2, 0.28), 2),
        ("gspo", "sample", (0.05, 0.05), 4),
        pytest.param("cispo", "sample", (None, None), 4, marks=pytest.mark.slow),
        pytest.param("cispo", "token", (None, None), 8, marks=pytest.mark.slow),
        pytest.param("dapo", "prompt", (0.2, 0.28), 4, marks=pytest.mark.slow),
        pytest.param("grpo", "prompt", (0.1, None), 1, marks=pytest.mark.slow),
    ],
)
def test_microbatched_gradient_equals_full_batch_reference(model_parts, objective, aggregation, eps, num_microbatches):
    graphdef, params, logp_fn, _ = model_parts
    batch = _make_batch(logp_fn, params)
    config = TrainStepConfig(
        objective=objective,
        aggregation=aggregation,
        eps_low=eps[0],
        eps_high=eps[1],
        num_microbatches=num_microbatches,
        temperature=TEMPERATURE,
        logprob_chunk_size=5,
    )
    grads, metrics = jax.jit(lambda p, b: accumulate_gradients(graphdef, p, b, config))(params, batch)
    want_loss, want_clip, want_grads = _reference(model_parts, batch, objective, aggregation, *eps)
    np.testing.assert_allclose(float(metrics["train/loss"]), want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["train/clip_frac"]), want_clip["low"] + want_clip["high"], rtol=1e-6)
    if objective == "cispo":
        np.testing.assert_allclose(float(metrics["train/cispo_truncated_frac"]), want_clip["high"], rtol=1e-6)
        assert "train/clip_frac_low" not in metrics
    else:
        np.testing.assert_allclose(float(metrics["train/clip_frac_low"]), want_clip["low"], rtol=1e-6)
        np.testing.assert_allclose(float(metrics["train/clip_frac_high"]), want_clip["high"], rtol=1e-6)
    if objective != "gspo":  # the chosen deltas make some tokens clip / truncate
        assert want_clip["high"] > 0
    if objective == "dapo":
        assert want_clip["low"] > 0
    # Valid rows 0-4 (rows 5-6 dropped, row 7 padding); completion lengths 9, 6, 8, 10, 3, and
    # row 0 loses its forced token.
    assert float(metrics["train/num_loss_tokens"]) == 8 + 6 + 8 + 10 + 3
    assert float(metrics["train/num_prompts"]) == 2
    grad_norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(want_grads)))
    np.testing.assert_allclose(float(metrics["train/grad_norm"]), grad_norm, rtol=1e-4)
    _assert_trees_close(grads, want_grads)


# ---------------------------------------------------------------------------------------------
# the full jitted step: AdamW update, NaN flag, no recompiles, sharding, learning
# ---------------------------------------------------------------------------------------------
OPTIMIZER = OptimizerConfig(learning_rate=1e-2, warmup_steps=0, eps=1e-3)
STEP_CONFIG = TrainStepConfig(num_microbatches=2, temperature=TEMPERATURE, logprob_chunk_size=8)


@pytest.fixture(scope="module")
def jitted_step(model_parts):
    graphdef = model_parts[0]
    optimizer = make_optimizer(OPTIMIZER)
    return optimizer, make_train_step(graphdef, optimizer, STEP_CONFIG)


def _numpy_adamw_first_step(params, grads, config):
    """First AdamW step: m = (1-b1) g, v = (1-b2) g^2, bias corrections 1-b1, 1-b2, so
    p1 = p - lr (g / (|g| + eps) + wd p)."""
    return jax.tree.map(
        lambda p, g: (
            np.asarray(p, np.float64)
            - config.learning_rate
            * (
                np.asarray(g, np.float64) / (np.abs(np.asarray(g, np.float64)) + config.eps)
                + config.weight_decay * np.asarray(p, np.float64)
            )
        ),
        params,
        grads,
    )


def test_step_applies_adamw_to_the_reference_gradient(model_parts, jitted_step):
    _, params, logp_fn, _ = model_parts
    optimizer, step = jitted_step
    batch = _make_batch(logp_fn, params, seed=1)
    _, _, ref_grads = _reference(model_parts, batch, "cispo", "prompt", None, None)
    want = _numpy_adamw_first_step(params, ref_grads, OPTIMIZER)
    state, metrics = step(create_train_state(_copy(params), optimizer), batch)
    assert int(state.step) == 1 and float(metrics["train/finite"]) == 1.0
    assert float(metrics["train/update_applied"]) == 1.0
    _assert_trees_close(state.params, want, rtol=1e-5)
    # Entropy and train/behaviour mismatch are plain averages over loss tokens: numpy from logits.
    mask = batch["loss_mask"] * batch["sample_valid"][:, None]
    logp = np.asarray(logp_fn(params, jnp.asarray(batch["tokens"])), np.float64)
    mismatch = np.sum(mask * np.abs(logp - batch["behavior_logp"])) / mask.sum()
    np.testing.assert_allclose(float(metrics["train/logp_mismatch"]), mismatch, rtol=1e-5)
    first_mb = np.arange(B) % STEP_CONFIG.num_microbatches == 0  # rows dealt to microbatch 0
    mismatch_first = np.sum((mask * np.abs(logp - batch["behavior_logp"]))[first_mb]) / mask[first_mb].sum()
    np.testing.assert_allclose(float(metrics["train/logp_mismatch_first_mb"]), mismatch_first, rtol=1e-5)
    # the largest gap is the planted delta 3 of row 3, dealt to microbatch 1 of 2.
    mismatch_max = np.max(np.where(mask > 0, np.abs(logp - batch["behavior_logp"]), 0.0))
    np.testing.assert_allclose(float(metrics["train/logp_mismatch_max"]), mismatch_max, rtol=1e-5)
    np.testing.assert_allclose(mismatch_max, 3.0, rtol=1e-5)
    graphdef = model_parts[0]
    logits = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(batch["tokens"])), np.float64)
    z = logits[:, :-1] / TEMPERATURE
    z = z - z.max(-1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    entropy = np.pad(-np.sum(prob * np.log(prob), -1), ((0, 0), (1, 0)))
    np.testing.assert_allclose(float(metrics["train/entropy"]), np.sum(mask * entropy) / mask.sum(), rtol=1e-5)


@pytest.mark.parametrize("field,row,col", [("behavior_logp", 0, 4), ("rewards", 3, None)])
def test_nan_in_batch_is_flagged_and_state_kept(model_parts, jitted_step, field, row, col):
    _, params, logp_fn, _ = model_parts
    optimizer, step = jitted_step
    batch = _make_batch(logp_fn, params, seed=2)
    if col is None:
        batch[field][row] = np.nan
    else:
        assert batch["loss_mask"][row, col] == 1.0
        batch[field][row, col] = np.nan
    before = jax.device_get(params)
    state, metrics = step(create_train_state(_copy(params), optimizer), batch)
    assert float(metrics["train/finite"]) == 0.0
    assert float(metrics["train/update_applied"]) == 0.0
    assert int(state.step) == 0
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state.opt_state))


def test_steady_state_never_recompiles(model_parts, jitted_step):
    _, params, logp_fn, _ = model_parts
    optimizer, step = jitted_step
    state = create_train_state(_copy(params), optimizer)
    traces_before = step.num_traces
    for seed in range(3):
        state, _ = step(state, _make_batch(logp_fn, params, seed=seed))
    assert step.num_traces - traces_before <= 1 and step.num_traces == 1
    assert int(state.step) == 3


def test_lr_metric_follows_the_warmup_schedule(model_parts):
    """train/lr of the t-th update (t = 0, 1, ...) is peak * min(1, (t + 1) / warmup) by hand; a
    step skipped for a NaN does not advance it (the same lr is applied by the next step)."""
    graphdef, params, logp_fn, _ = model_parts
    config = OptimizerConfig(learning_rate=3e-3, warmup_steps=3)
    optimizer = make_optimizer(config)
    step = make_train_step(graphdef, optimizer, STEP_CONFIG, learning_rate_schedule=learning_rate_schedule(config))
    state = create_train_state(_copy(params), optimizer)
    lrs = []
    for seed in range(5):
        batch = _make_batch(logp_fn, params, seed=seed)
        if seed == 1:
            batch["rewards"][0] = np.nan
        state, metrics = step(state, batch)
        lrs.append(float(metrics["train/lr"]))
    np.testing.assert_allclose(lrs, [1e-3, 2e-3, 2e-3, 3e-3, 3e-3], rtol=1e-6)
    assert int(state.step) == 4 and step.num_traces == 1
    assert (
        "train/lr"
        not in make_train_step(graphdef, optimizer, STEP_CONFIG)(
            create_train_state(_copy(params), optimizer), _make_batch(logp_fn, params)
        )[1]
    )


def test_log_prob_of_rewarded_tokens_rises(model_parts, jitted_step):
    """Behaviour: prompt 0's row 0 (+1) and row 1 (-1), prompt 1's row 2 (+1) and row 3 (-1); the
    batch is fixed (behaviour log-probs of the initial params) and the step repeated.

    The loss that must decrease is the importance-weighted surrogate -sum_bt w r A (numpy, from the
    model's log-probs): it is the negated objective whose gradient CISPO follows. (The value of the
    CISPO loss itself, -sum w sg(min(r, 4)) A logp, is not monotone: its stop-gradient weight grows
    on rewarded tokens as they get likelier.)"""
    _, params, logp_fn, _ = model_parts
    optimizer, step = jitted_step
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 64, (B, T)).astype(np.int32)
    mask = np.zeros((B, T), np.float32)
    mask[:4, 3:] = 1.0
    logp0 = np.asarray(logp_fn(params, jnp.asarray(tokens)))
    batch = dict(
        tokens=tokens,
        loss_mask=mask,
        behavior_logp=np.where(mask > 0, logp0, 0.0),
        rewards=np.array([1, -1, 1, -1, 0, 0, 0, 0], np.float32),
        group_ids=np.array([0, 0, 1, 1, 4, 5, 6, 7], np.int32),
        sample_valid=np.array([1, 1, 1, 1, 0, 0, 0, 0], bool),
    )
    weights = np_weights(mask.astype(np.float64), batch["group_ids"], "prompt")
    adv = np_advantages(batch["rewards"].astype(np.float64), batch["group_ids"], batch["sample_valid"])
    surrogate = lambda logp: -np.sum(weights * np.exp(logp - logp0) * adv[:, None])
    state = create_train_state(_copy(params), optimizer)
    losses = [surrogate(logp0)]
    for _ in range(4):
        state, metrics = step(state, batch)
        assert float(metrics["train/finite"]) == 1.0
        losses.append(surrogate(np.asarray(logp_fn(state.params, jnp.asarray(tokens)), np.float64)))
    logp4 = np.asarray(logp_fn(state.params, jnp.asarray(tokens)))
    mean_rise = lambda rows: np.mean(np.sum((logp4 - logp0)[rows] * mask[rows], 1) / mask[rows].sum(1))
    assert mean_rise([0, 2]) > 0.1, mean_rise([0, 2])  # rewarded completions got likelier
    assert mean_rise([1, 3]) < -0.1, mean_rise([1, 3])  # penalized ones less likely
    assert np.all(np.diff(losses) < 0), losses


def test_sharded_step_equals_single_device_step(model_parts, jitted_step):
    """Mesh (data 2, fsdp 2, tensor 2) on 8 CPU devices: same params and metrics as one device,
    and every param keeps its rule sharding."""
    graphdef, params, logp_fn, _ = model_parts
    optimizer, step = jitted_step
    batch = _make_batch(logp_fn, params, seed=4)
    want_state, want_metrics = step(create_train_state(_copy(params), optimizer), batch)
    mesh = make_mesh((2, 2, 2))
    state, shardings = init_train_state(_copy(params), optimizer, mesh=mesh)
    sharded_step = make_train_step(graphdef, optimizer, STEP_CONFIG, mesh=mesh, state_shardings=shardings)
    got_state, got_metrics = sharded_step(state, batch)
    _assert_trees_close(got_state.params, want_state.params, rtol=1e-5)
    for name in ("train/loss", "train/grad_norm", "train/entropy", "train/clip_frac"):
        np.testing.assert_allclose(float(got_metrics[name]), float(want_metrics[name]), rtol=1e-5)
    rule_shardings = param_shardings(params, mesh)
    adam_mu = optax.tree_utils.tree_get(got_state.opt_state.inner, "mu")
    for tree in (got_state.params, adam_mu):
        for got, want in zip(jax.tree.leaves(tree), jax.tree.leaves(rule_shardings), strict=True):
            assert got.sharding.is_equivalent_to(want, got.ndim)
    assert any(not s.is_fully_replicated for s in jax.tree.leaves(rule_shardings))


def test_bad_batch_names_the_key():
    good = dict(
        tokens=np.zeros((4, 6), np.int32),
        loss_mask=np.zeros((4, 6), np.float32),
        behavior_logp=np.zeros((4, 6), np.float32),
        rewards=np.zeros(4, np.float32),
        group_ids=np.zeros(4, np.int32),
        sample_valid=np.ones(4, bool),
    )
    assert validate_batch(good) == (4, 6)
    with pytest.raises(ValueError, match="rewards"):
        validate_batch({k: v for k, v in good.items() if k != "rewards"})
    with pytest.raises(ValueError, match="loss_mask"):
        validate_batch({**good, "loss_mask": np.zeros((4, 5), np.float32)})
    with pytest.raises(ValueError, match="sample_valid"):
        validate_batch({**good, "sample_valid": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match="num_microbatches"):
        TrainStepConfig(num_microbatches=0)
    with pytest.raises(ValueError, match="aggregation"):
        TrainStepConfig(aggregation="tokens")


def test_step_config_from_the_run_config():
    """configs/tiny.py's run config, written out: CISPO with prompt aggregation and batch
    normalization, the recipe's clip settings, one microbatch in the sorted layout, temperature 1,
    log-prob chunks of 64, and nan_policy 'skip' (skip_nonfinite); 'stop' turns skip_nonfinite off."""
    config = recipes.tiny()
    model_config = get_preset(config.model.preset)
    assert train_step_config_of(config, model_config) == TrainStepConfig(
        objective="cispo",
        aggregation="prompt",
        advantage_normalization="batch",
        eps_low=0.2,
        eps_high=0.28,
        eps_max=4.0,
        num_microbatches=1,
        temperature=1.0,
        logprob_chunk_size=64,
        skip_nonfinite=True,
        sort_by_length=True,
    )
    config.nan_policy = "stop"
    assert not train_step_config_of(config, model_config).skip_nonfinite


def test_step_config_of_a_moe_run_carries_the_samplers_routing():
    """configs/tiny_moe.py: 2 MoE layers of 8 experts, 2 per token, so its batches carry the
    sampler's routing [B, T, 2, 2] in int8; `rl.router_replay` turns replay on. The step refuses
    routing or replay without experts."""
    config = recipes.tiny_moe()
    config.rl.router_replay = True
    step_config = train_step_config_of(config, get_preset(config.model.preset))
    assert (step_config.moe_layers, step_config.num_experts, step_config.experts_per_token) == (2, 8, 2)
    routing = step_config.routing
    assert routing is not None and routing == Routing(2, 2, 8) and routing.dtype == np.int8
    assert step_config.router_replay
    with pytest.raises(ValueError, match="experts_per_token is for mixture-of-experts policies"):
        TrainStepConfig(experts_per_token=2)
    with pytest.raises(ValueError, match="router_replay needs the sampler's routing"):
        TrainStepConfig(moe_layers=2, num_experts=8, router_replay=True)


@pytest.mark.slow
def test_bf16_body_trains_through_fp32_master():
    """bf16 body + fp32 head: the step runs, the master copy is fp32 and moved, the params are the
    master rounded to bf16, and the tempered log-probs match a float64 numpy log-softmax of the
    model's own fp32 logits (metric: train/behaviour mismatch with behaviour = those log-probs)."""
    config = _tiny_config().replace(dtype="bfloat16")
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(1)))
    tokens = np.random.default_rng(5).integers(0, 64, (B, T)).astype(np.int32)
    logits = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(tokens)), np.float64) / TEMPERATURE
    logp_all = (
        logits
        - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    logp = np.pad(np.take_along_axis(logp_all[:, :-1], tokens[:, 1:, None], -1)[..., 0], ((0, 0), (1, 0)))
    mask = np.zeros((B, T), np.float32)
    mask[:, 4:] = 1.0
    batch = dict(
        tokens=tokens,
        loss_mask=mask,
        behavior_logp=np.where(mask > 0, logp, 0.0).astype(np.float32),
        rewards=np.tile([1.0, -1.0], B // 2).astype(np.float32),
        group_ids=np.repeat(np.arange(B // 2), 2).astype(np.int32),
        sample_valid=np.ones(B, bool),
    )
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-4, warmup_steps=0))
    start = jax.device_get(params)
    step = make_train_step(graphdef, optimizer, STEP_CONFIG)
    state, metrics = step(create_train_state(_copy(params), optimizer), batch)
    assert float(metrics["train/finite"]) == 1.0
    # Same params and same tokens (chunked vs full forward): bf16 body rounding only.
    assert float(metrics["train/logp_mismatch"]) < 1e-2
    master = state.opt_state.master
    for p0, p1, m in zip(jax.tree.leaves(start), jax.tree.leaves(state.params), jax.tree.leaves(master), strict=True):
        assert m.dtype == jnp.float32 and p1.dtype == p0.dtype
        np.testing.assert_array_equal(np.asarray(p1), np.asarray(m.astype(p1.dtype)))
        assert np.max(np.abs(np.asarray(m) - np.asarray(p0, np.float32))) > 0
