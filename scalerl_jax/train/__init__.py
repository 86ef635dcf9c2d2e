"""Jitted RL train step (microbatched gradients), the recipe's AdamW, and train FLOP counts.

`step.py` holds the step's math as pure functions, `compiled.py` its jitted and ahead-of-time
programs, `step_config.py` its knobs.

The train batch's layouts (keys, shapes, `split_sorted_batch`) live in `scalerl_jax.contracts.batch_layout`.
"""

from scalerl_jax.train.batch import synthetic_train_batch
from scalerl_jax.train.compiled import (
    SortedTrainStep,
    TrainStep,
    init_train_state,
    make_train_step,
    train_state_shardings,
)
from scalerl_jax.train.flops import matmul_params, train_flops_per_token, train_step_flops
from scalerl_jax.train.optimizer import (
    OptimizerConfig,
    OptimizerState,
    init_optimizer_state,
    make_optimizer,
    optimizer_update,
    warmup_constant_schedule,
)
from scalerl_jax.train.step import TrainState, accumulate_gradients, create_train_state, train_step
from scalerl_jax.train.step_config import TrainStepConfig

__all__ = [
    "OptimizerConfig",
    "OptimizerState",
    "SortedTrainStep",
    "TrainState",
    "TrainStep",
    "TrainStepConfig",
    "accumulate_gradients",
    "create_train_state",
    "init_optimizer_state",
    "init_train_state",
    "make_optimizer",
    "make_train_step",
    "matmul_params",
    "optimizer_update",
    "synthetic_train_batch",
    "train_flops_per_token",
    "train_state_shardings",
    "train_step",
    "train_step_flops",
    "warmup_constant_schedule",
]
