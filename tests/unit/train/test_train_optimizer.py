"""The recipe's AdamW against a numpy (float64) AdamW written here from the textbook update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalerl_jax.config import recipes
from scalerl_jax.config.adapters import optimizer_config_of
from scalerl_jax.train.optimizer import (
    OptimizerConfig,
    init_optimizer_state,
    make_optimizer,
    optimizer_update,
    warmup_constant_schedule,
)


def numpy_adamw(params, grads_per_step, *, lr_per_step, b1, b2, eps, weight_decay, max_grad_norm=None):
    """Decoupled AdamW (Loshchilov & Hutter; PyTorch's torch.optim.AdamW), float64.

    For t = 1..n:  g <- clip(g) ; m = b1 m + (1-b1) g ; v = b2 v + (1-b2) g^2 ;
    p <- p - lr_t (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd p).
    """
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, (grads, lr) in enumerate(zip(grads_per_step, lr_per_step), start=1):
        g = {k: np.asarray(x, np.float64) for k, x in grads.items()}
        if max_grad_norm is not None:
            norm = np.sqrt(sum(np.sum(x**2) for x in g.values()))
            scale = min(1.0, max_grad_norm / norm)
            g = {k: x * scale for k, x in g.items()}
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            m_hat = m[k] / (1 - b1**t)
            v_hat = v[k] / (1 - b2**t)
            p[k] = p[k] - lr * (m_hat / (np.sqrt(v_hat) + eps) + weight_decay * p[k])
    return p


def _random_problem(seed, num_steps, dtype=np.float32):
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=(4, 3)).astype(dtype), "b": rng.normal(size=(3,)).astype(dtype)}
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(num_steps)]
    return params, grads


def _run_optax(config, params, grads_per_step):
    optimizer = make_optimizer(config)
    jparams = jax.tree.map(jnp.asarray, params)
    state = init_optimizer_state(optimizer, jparams)
    update = jax.jit(lambda g, s, p: optimizer_update(optimizer, g, s, p))
    for grads in grads_per_step:
        jparams, state = update(jax.tree.map(jnp.asarray, grads), state, jparams)
    return jparams, state


def test_schedule_warmup_then_constant():
    # lr(t) = 5e-7 * min(1, (t+1)/100): t=0 -> 5e-9, t=49 -> 2.5e-7, t=99 and later -> 5e-7.
    schedule = warmup_constant_schedule(5e-7, 100)
    got = [float(np.asarray(schedule(jnp.asarray(t)))) for t in (0, 49, 99, 100, 5000)]
    np.testing.assert_allclose(got, [5e-9, 2.5e-7, 5e-7, 5e-7, 5e-7], rtol=1e-6)
    assert float(np.asarray(warmup_constant_schedule(1e-3, 0)(jnp.asarray(0)))) == pytest.approx(1e-3)


def test_adamw_matches_numpy_during_and_after_warmup():
    # Recipe betas / eps / weight decay; a larger lr and a 2-step warmup so all phases are visible.
    config = OptimizerConfig(learning_rate=1e-2, warmup_steps=2)
    params, grads = _random_problem(0, num_steps=4)
    got, state = _run_optax(config, params, grads)
    want = numpy_adamw(
        params, grads, lr_per_step=[5e-3, 1e-2, 1e-2, 1e-2], b1=0.9, b2=0.999, eps=1e-15, weight_decay=0.01
    )
    assert state.master is None  # fp32 params need no master copy
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5, atol=1e-7)


def test_adamw_with_global_norm_clip_matches_numpy():
    config = OptimizerConfig(
        learning_rate=3e-3, warmup_steps=0, b1=0.8, b2=0.99, eps=1e-8, weight_decay=0.1, max_grad_norm=0.5
    )
    params, grads = _random_problem(1, num_steps=3)
    grads = [{k: 10.0 * v for k, v in g.items()} for g in grads]  # norms >> 0.5: clip is active
    got, _ = _run_optax(config, params, grads)
    want = numpy_adamw(
        params, grads, lr_per_step=[3e-3] * 3, b1=0.8, b2=0.99, eps=1e-8, weight_decay=0.1, max_grad_norm=0.5
    )
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5, atol=1e-7)


def test_bf16_params_keep_fp32_master_so_tiny_updates_accumulate():
    # Recipe lr 5e-7 (no warmup here): each step moves a weight by ~5e-7, far below a bf16 ulp.
    config = OptimizerConfig(learning_rate=5e-7, warmup_steps=0)
    params32, grads = _random_problem(2, num_steps=5)
    params_bf16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in params32.items()}
    got, state = _run_optax(config, params_bf16, grads)
    start = {k: np.asarray(jnp.asarray(v, jnp.float32), np.float64) for k, v in params_bf16.items()}
    want = numpy_adamw(start, grads, lr_per_step=[5e-7] * 5, b1=0.9, b2=0.999, eps=1e-15, weight_decay=0.01)
    for k in params32:
        assert got[k].dtype == jnp.bfloat16
        master = np.asarray(state.master[k], np.float64)
        assert state.master[k].dtype == jnp.float32
        # The master follows the float64 reference up to fp32 rounding of 5 additions:
        # 5 * half an fp32 ulp of |p| (ulp = |p| * 2^-23).
        fp32_tolerance = 3.0 * np.abs(start[k]) * 2.0**-23 + 1e-12
        assert np.all(np.abs(master - want[k]) <= fp32_tolerance)
        # ...and it did move (updates ~5e-7 per step), which bf16 params alone could not do.
        assert np.max(np.abs(master - start[k])) > 1e-6
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(state.master[k].astype(jnp.bfloat16)))


@pytest.mark.parametrize("field,value", [("learning_rate", -1.0), ("b2", 1.0), ("warmup_steps", -3)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        OptimizerConfig(**{field: value})


def test_mixed_dtype_params_share_no_buffer_with_master():
    """bf16 body + fp32 head: the master holds its own copy of the fp32 leaf, so the train step can
    donate params and optimizer state together (XLA refuses to donate one buffer twice)."""
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3, warmup_steps=0))
    params = {"body": jnp.ones((4, 4), jnp.bfloat16), "head": jnp.full((4, 2), 0.5, jnp.float32)}
    state = init_optimizer_state(optimizer, params)
    assert state.master["head"] is not params["head"]
    update = jax.jit(lambda g, s, p: optimizer_update(optimizer, g, s, p), donate_argnums=(1, 2))
    grads = {"body": jnp.ones((4, 4), jnp.float32), "head": -jnp.ones((4, 2), jnp.float32)}
    new_params, new_state = update(grads, state, params)
    # First Adam step: p - lr (sign(g) + wd p) with eps 1e-15 negligible.
    np.testing.assert_allclose(np.asarray(new_state.master["head"]), 0.5 - 1e-3 * (-1 + 0.01 * 0.5), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(new_state.master["body"]), 1.0 - 1e-3 * (1 + 0.01), rtol=1e-6)
    assert new_params["body"].dtype == jnp.bfloat16 and new_params["head"].dtype == jnp.float32


def test_optimizer_config_of_reads_the_optimizer_section():
    """configs/tiny.py's optimizer section, written out: lr 5e-5 after 5 warmup steps, eps 1e-8,
    the recipe's betas and weight decay, global-norm clip 1.0; the recipe's clip 0 means none."""
    assert optimizer_config_of(recipes.tiny()) == OptimizerConfig(
        learning_rate=5e-5, warmup_steps=5, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, max_grad_norm=1.0
    )
    assert optimizer_config_of(recipes.scalerl_8b()).max_grad_norm is None
