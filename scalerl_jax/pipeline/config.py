"""A pipeline run's settings (`PipelineConfig`): schedule, batch shape, sampling and stopping."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from scalerl_jax.contracts.batch_layout import Routing

ZERO_VARIANCE_MODES = ("drop", "refill", "none")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Schedule, batch shape, sampling settings and stopping of a pipeline run.

    `capacity`: groups admitted and not yet consumed (in flight + queued); None means the
    schedule's natural bound, (k+1)*G for PipelineRL-k and k*G for PPO-off-policy-k. A smaller
    capacity bounds host memory and tightens the effective lag further.
    `zero_variance`: 'drop' (filtered from the loss, batch not refilled), 'refill' (discarded
    on arrival, counted; the batch fills with other groups) or 'none'.
    `admission_slack`: extra pending requests allowed beyond the free slots, so that slots
    freed by the chunk in flight are refilled at once (None: one prompt's worth, n).
    `mask_truncated`: completions cut by the token limit leave the loss (loss mask 0) but keep
    their reward in the advantages' statistics (`batching.py`); counted in data/truncated_masked.
    `sort_by_length`: batches in the sorted layout (`batching.py`), rows sorted by length into
    `microbatches` microbatches each padded to its own bucket (the train step must be a
    `SortedTrainStep` with as many microbatches); length buckets `length_buckets_per_octave` to
    an octave from `min_length_bucket` to `max_seq_len` (`batching.octave_buckets`).
    `quiet_log_s`: while no step has finished for this long, one progress line (`quiet_progress_line`)
    every `quiet_log_s` seconds, so the minutes of a first batch or a long evaluation show.
    `train_step_flops(rows, sequence_length)`: model FLOPs of one train step on a padded
    [rows, sequence_length] block (summed over a sorted batch's microbatches), e.g.
    `functools.partial(train.flops.train_step_flops, model_config)`; gives
    compute/model_flops_per_s. `peak_flops_per_s`: summed peak FLOP/s of the trainer's devices
    (`train.flops.devices_peak_flops_per_s`); with both, compute/mfu.
    `routing`: a mixture-of-experts policy's batches carry the sampler's routing in this layout
    (`batch_layout.Routing`; the train step's `TrainStepConfig.routing`); None: they carry none.
    """

    max_new_tokens: int
    max_seq_len: int
    schedule: str = "pipeline"
    k: int = 8
    prompts_per_step: int = 48
    samples_per_prompt: int = 16
    num_steps: int = 1
    capacity: int | None = None
    zero_variance: str = "drop"
    temperature: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    interrupt: bool = True
    min_length_bucket: int = 128
    length_buckets_per_octave: int = 1
    sort_by_length: bool = False
    microbatches: int = 1
    admission_slack: int | None = None
    seed: int = 0
    first_version: int = 0
    poll_s: float = 0.05
    join_timeout_s: float = 30.0
    quiet_log_s: float = 60.0
    mask_truncated: bool = False
    train_step_flops: Callable[[int, int], float] | None = None
    peak_flops_per_s: float | None = None
    routing: Routing | None = None

    def __post_init__(self) -> None:
        if self.schedule not in ("pipeline", "ppo_off_policy"):
            raise ValueError(f"PipelineConfig.schedule={self.schedule!r}: expected 'pipeline' or 'ppo_off_policy'")
        if self.zero_variance not in ZERO_VARIANCE_MODES:
            raise ValueError(
                f"PipelineConfig.zero_variance={self.zero_variance!r}: expected one of {ZERO_VARIANCE_MODES}"
            )
        for name, minimum in (
            ("prompts_per_step", 1),
            ("samples_per_prompt", 1),
            ("num_steps", 0),
            ("max_new_tokens", 1),
            ("max_seq_len", 2),
            ("min_length_bucket", 1),
            ("length_buckets_per_octave", 1),
            ("microbatches", 1),
            ("first_version", 0),
        ):
            if getattr(self, name) < minimum:
                raise ValueError(f"PipelineConfig.{name}={getattr(self, name)} must be >= {minimum}")
        if self.zero_variance == "refill" and self.samples_per_prompt < 2:
            raise ValueError(
                "PipelineConfig.zero_variance='refill' needs samples_per_prompt >= 2 "
                "(a single completion always has zero variance)"
            )
        if self.admission_slack is not None and self.admission_slack < 0:
            raise ValueError(f"PipelineConfig.admission_slack={self.admission_slack} must be >= 0")
        if self.poll_s <= 0 or self.join_timeout_s <= 0 or self.quiet_log_s <= 0:
            raise ValueError("PipelineConfig.poll_s, join_timeout_s and quiet_log_s must be > 0")
        if self.peak_flops_per_s is not None and not self.peak_flops_per_s > 0:
            raise ValueError(
                f"PipelineConfig.peak_flops_per_s={self.peak_flops_per_s} must be > 0 "
                "(None when the devices' peak is unknown)"
            )

    @property
    def rows(self) -> int:
        """Rows of every train batch: G prompts x n completions."""
        return self.prompts_per_step * self.samples_per_prompt
