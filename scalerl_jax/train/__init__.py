"""Jitted RL train step (microbatched gradients), the recipe's AdamW, and train FLOP counts."""

from scalerl_jax.train.batch import synthetic_train_batch
from scalerl_jax.train.flops import matmul_params, train_flops_per_token, train_step_flops
from scalerl_jax.train.optimizer import (
    OptimizerConfig,
    OptimizerState,
    init_optimizer_state,
    make_optimizer,
    optimizer_update,
    warmup_constant_schedule,
)
from scalerl_jax.train.step import (
    BATCH_SPEC,
    SortedTrainStep,
    TrainState,
    TrainStep,
    TrainStepConfig,
    accumulate_gradients,
    create_train_state,
    deal_microbatches,
    init_train_state,
    make_train_step,
    sorted_batch_key,
    split_sorted_batch,
    train_state_shardings,
    train_step,
    validate_batch,
)

__all__ = [
    "BATCH_SPEC",
    "OptimizerConfig",
    "OptimizerState",
    "SortedTrainStep",
    "TrainState",
    "TrainStep",
    "TrainStepConfig",
    "accumulate_gradients",
    "create_train_state",
    "deal_microbatches",
    "init_optimizer_state",
    "init_train_state",
    "make_optimizer",
    "make_train_step",
    "matmul_params",
    "optimizer_update",
    "sorted_batch_key",
    "split_sorted_batch",
    "synthetic_train_batch",
    "train_flops_per_token",
    "train_state_shardings",
    "train_step",
    "train_step_flops",
    "validate_batch",
    "warmup_constant_schedule",
]
