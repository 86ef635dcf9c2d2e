"""The train step's knobs (`TrainStepConfig`) and the run config's `nan_policy` choices."""

from __future__ import annotations

import dataclasses

from scalerl_jax.contracts.batch_layout import Routing
from scalerl_jax.rl import AGGREGATIONS, NORMALIZATIONS, OBJECTIVES

NAN_POLICIES = ("skip", "stop")  # `nan_policy`: keep the old state (`skip_nonfinite`), or the run loop raises


@dataclasses.dataclass(frozen=True)
class TrainStepConfig:
    """Loss and step knobs (the recipe's defaults: CISPO, prompt average, batch-std advantages)."""

    objective: str = "cispo"
    aggregation: str = "prompt"
    advantage_normalization: str = "batch"
    eps_low: float | None = None  # clip range of dapo/grpo/gspo; None: the objective's default
    eps_high: float | None = None  # (dapo 0.2/0.28, grpo symmetric, gspo 3e-4/4e-4; rl.objectives)
    eps_max: float = 4.0  # cispo's importance-weight truncation
    num_microbatches: int = 1
    temperature: float = 1.0  # the sampler's temperature: logp of logits / temperature
    logprob_chunk_size: int = 512  # sequence chunk of the log-prob computation
    skip_nonfinite: bool = True  # keep the old state when loss or grads are NaN/inf
    sort_by_length: bool = False  # batches in the sorted layout (split_sorted_batch); SortedTrainStep
    # A mixture-of-experts policy: its MoE layers and experts (the routing statistics' shapes), and
    # the weight of the load-balancing loss added to each microbatch's loss (`moe.load_balancing_loss`).
    moe_layers: int = 0
    num_experts: int = 0
    router_aux_loss_coef: float = 0.0
    # experts_per_token k > 0: batches carry the sampler's routing (`batch_layout.ROUTING_KEY`), its
    # mismatch with the trainer's is logged, and with router_replay the trainer computes the recorded
    # experts in place of its own.
    experts_per_token: int = 0
    router_replay: bool = False

    def __post_init__(self):
        for name, allowed in (
            ("objective", OBJECTIVES),
            ("aggregation", AGGREGATIONS),
            ("advantage_normalization", NORMALIZATIONS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"TrainStepConfig.{name}={getattr(self, name)!r}; expected one of {allowed}")
        if self.num_microbatches < 1:
            raise ValueError(f"TrainStepConfig.num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.temperature <= 0:
            raise ValueError(f"TrainStepConfig.temperature must be > 0, got {self.temperature}")
        if (self.moe_layers > 0) != (self.num_experts > 0):
            raise ValueError(
                f"TrainStepConfig: moe_layers={self.moe_layers} and num_experts={self.num_experts} must both be 0 or both > 0"
            )
        if self.router_aux_loss_coef and not self.moe_layers:
            raise ValueError("TrainStepConfig.router_aux_loss_coef is for mixture-of-experts policies (moe_layers=0)")
        if self.experts_per_token and not self.moe_layers:
            raise ValueError("TrainStepConfig.experts_per_token is for mixture-of-experts policies (moe_layers=0)")
        if self.router_replay and not self.experts_per_token:
            raise ValueError("TrainStepConfig.router_replay needs the sampler's routing (experts_per_token > 0)")
        if self.logprob_chunk_size < 1:
            raise ValueError(f"TrainStepConfig.logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")

    @property
    def routing(self) -> Routing | None:
        """The sampler's routing in the batches (`batch_layout.Routing`); None: the batches carry none."""
        return Routing(self.moe_layers, self.experts_per_token, self.num_experts) if self.experts_per_token else None
