"""AdamW with linear warmup to a constant learning rate, and fp32 master weights.

The ScaleRL recipe (arXiv 2510.13786, Sec. 3 / App. A) trains with AdamW at a constant
learning rate of 5e-7 after a 100-step linear warmup, epsilon 1e-15 and weight decay 0.01;
betas are the usual (0.9, 0.999). All of them are fields of `OptimizerConfig`.

Update rule (t = 1, 2, ... counts applied updates; g the gradient, after the optional clip):
    m_t = b1 m_{t-1} + (1 - b1) g
    v_t = b2 v_{t-1} + (1 - b2) g^2
    p_t = p_{t-1} - lr_t * ( (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t)) + eps) + wd * p_{t-1} )
which is PyTorch's decoupled AdamW (p <- p (1 - lr wd), then the Adam step). Weight decay applies
to every parameter (the paper names no exclusions).

Precision: with a bf16 policy an update of size 5e-7 is far below a bf16 ulp (~4e-5 at |p|=1e-2),
so updates would round away. The optimizer therefore works on an fp32 master copy of the params
(`OptimizerState.master`, None when the params are already fp32); Adam moments are fp32 too, and
the params the model uses are the master cast back to their own dtypes after each update.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Knobs of the recipe's optimizer; defaults are the paper's values."""

    learning_rate: float = 5e-7
    warmup_steps: int = 100
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-15
    weight_decay: float = 0.01
    max_grad_norm: float | None = None  # global-norm clip before Adam; None or <= 0: off

    def __post_init__(self):
        if self.learning_rate < 0:
            raise ValueError(f"OptimizerConfig.learning_rate must be >= 0, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("b1", "b2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"OptimizerConfig.{name} must be in [0, 1), got {value}")
        if self.eps < 0:
            raise ValueError(f"OptimizerConfig.eps must be >= 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay}")


def warmup_constant_schedule(peak_lr: float, warmup_steps: int) -> optax.Schedule:
    """lr(t) = peak_lr * min(1, (t + 1) / warmup_steps) for the t-th update (t = 0, 1, ...).

    The first update already moves (peak_lr / warmup_steps) rather than wasting a step at lr 0;
    update number `warmup_steps` (t = warmup_steps - 1) is the first at the peak. warmup_steps = 0
    gives the constant peak_lr.
    """
    if warmup_steps == 0:
        return optax.constant_schedule(peak_lr)

    def schedule(count):
        fraction = jnp.minimum(1.0, (count + 1).astype(jnp.float32) / warmup_steps)
        return peak_lr * fraction

    return schedule


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    """The schedule `make_optimizer(config)` applies: lr of the t-th update (t = 0, 1, ...)."""
    return warmup_constant_schedule(config.learning_rate, config.warmup_steps)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """optax chain: optional clip_by_global_norm(max_grad_norm), then AdamW with the schedule above."""
    adamw = optax.adamw(
        learning_rate=learning_rate_schedule(config),
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        eps_root=0.0,
        weight_decay=config.weight_decay,
    )
    if config.max_grad_norm is not None and config.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
    return adamw


class OptimizerState(NamedTuple):
    """optax state over the fp32 master params; `master` is None when params are already fp32."""

    inner: Any
    master: Any


def _needs_master(params) -> bool:
    return any(jnp.dtype(leaf.dtype) != jnp.float32 for leaf in jax.tree.leaves(params))


def _to_float32(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def init_optimizer_state(optimizer: optax.GradientTransformation, params) -> OptimizerState:
    """Adam moments (fp32) and, for non-fp32 params, an fp32 master copy of them.

    The master is a copy even of leaves already in fp32 (e.g. an fp32 head next to a bf16 body),
    so that no buffer is shared between params and master (both are donated by the train step).
    """
    master = None
    if _needs_master(params):
        master = jax.tree.map(lambda x: jnp.array(x, dtype=jnp.float32, copy=True), params)
    reference = master if master is not None else params
    return OptimizerState(inner=optimizer.init(reference), master=master)


def optimizer_update(optimizer: optax.GradientTransformation, grads, state: OptimizerState, params):
    """One AdamW update in fp32; returns (new_params in the params' dtypes, new_state)."""
    reference = state.master if state.master is not None else params
    updates, inner = optimizer.update(_to_float32(grads), state.inner, reference)
    new_reference = optax.apply_updates(reference, updates)
    if state.master is None:
        return new_reference, OptimizerState(inner=inner, master=None)
    new_params = jax.tree.map(lambda m, p: m.astype(p.dtype), new_reference, params)
    return new_params, OptimizerState(inner=inner, master=new_reference)
