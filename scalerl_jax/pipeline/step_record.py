"""What a trainer step reports: its `StepRecord` and the pipeline's per-step metrics (lag, waits,
throughput, batch shape, data and compute rates) beside the train step's own."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from scalerl_jax.pipeline.batching import BatchInfo
from scalerl_jax.pipeline.generator import GeneratorStats
from scalerl_jax.pipeline.group import Group, lags
from scalerl_jax.pipeline.queue import BufferCounts, WaitTimes


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One trainer step: which groups it trained on and what it measured.

    `version` is the params version the step ran on (it produced `version + 1`); per completion
    (group by group, sample order) `first_versions`, `last_versions` and `lags`. `train_state`
    is the state the step produced (version + 1), whether or not it was pushed to the sampler;
    it stays valid during `on_step` and is donated by the next step.
    """

    version: int
    group_ids: tuple[int, ...]
    first_versions: tuple[int, ...]
    last_versions: tuple[int, ...]
    lags: tuple[int, ...]
    metrics: dict[str, float]
    groups: tuple[Group, ...]
    train_state: Any = None


@dataclasses.dataclass
class RunTotals:
    """Trainer-side running totals since the start of the run."""

    start: float
    completions: int = 0
    tokens: int = 0  # prompt + completion tokens trained on
    discarded: int = 0  # buffer's discarded count at the previous step
    prefill_tokens: int = 0  # the generators' count at the previous step
    shared_prompt_pages: int = 0  # the generators' count at the previous step
    step_s: float = 0.0  # seconds spent in train steps


def pipeline_step_metrics(
    groups: Sequence[Group],
    info: BatchInfo,
    *,
    version: int,
    counts: BufferCounts,
    waits: WaitTimes,
    generator: GeneratorStats,
    totals: RunTotals,
    elapsed: float,
    wait_s: float,
    step_s: float,
    push_s: float,
    step_flops: float | None = None,
    peak_flops_per_s: float | None = None,
) -> dict[str, float]:
    """The pipeline's per-step metrics. Lag of a completion = `version` (the params the step ran
    on) - version of its first token; versions spanned = last - first token version + 1; idle
    fractions and rates are cumulative over the `elapsed` seconds of the run; trainer_idle_frac counts
    the waits for a batch, trainer_step_frac the time in train steps (1 - it is the trainer's time
    in anything else: waits, pushes, evaluations and checkpoints in the trainer thread, metrics). Over the batch's
    completions (every completion of `groups`, whether or not in the loss): train/reward_std is
    the population std of their rewards, train/completion_len_mean / _max their generated
    tokens (forced phrase tokens included). sampler/prefill_tokens: prompt tokens the generators
    prefilled since the previous step (a prompt its samples share counted once);
    sampler/shared_prompt_pages: KV pages samples took from another sample of their prompt
    instead of filling their own, since the previous step. pipeline/sequence_length: the longest padded length
    of the step; pipeline/padding_frac: the share of padding among the token positions the step
    computes (`BatchInfo.padding_frac`); pipeline/skipped_microbatches: sorted microbatches
    without a row in the loss, not computed. data/truncated_masked: completions masked out of
    the loss as cut by length. Given `step_flops` (model FLOPs of the step, padding included),
    compute/model_flops_per_s = step_flops / step_s, where step_s is the step's wall time up to
    its metrics on the host (compilation included on a new length bucket); with
    `peak_flops_per_s` too, compute/mfu = that / peak_flops_per_s."""
    lag = lags(groups, version)
    firsts = np.asarray([v for g in groups for v in g.first_versions])
    spans = np.asarray([v for g in groups for v in g.last_versions]) - firsts + 1
    blocked = waits.generator_blocked_lag + waits.generator_blocked_full
    rewards = np.concatenate([g.rewards for g in groups])
    lengths = np.asarray([len(c.tokens) for g in groups for c in g.completions])
    metrics = {
        "pipeline/version": float(version + 1),
        "pipeline/lag_min": float(lag.min()),
        "pipeline/lag_mean": float(lag.mean()),
        "pipeline/lag_max": float(lag.max()),
        "pipeline/versions_spanned_mean": float(spans.mean()),
        "pipeline/versions_spanned_max": float(spans.max()),
        "pipeline/trainer_wait_s": wait_s,
        "pipeline/trainer_idle_frac": waits.trainer_waiting_for_data / elapsed,
        "pipeline/trainer_step_frac": totals.step_s / elapsed,
        "pipeline/generator_blocked_lag_s": waits.generator_blocked_lag,
        "pipeline/generator_blocked_full_s": waits.generator_blocked_full,
        "pipeline/generator_idle_frac": blocked / elapsed,
        "pipeline/queue_depth": float(counts.queued),
        "pipeline/in_flight_groups": float(counts.in_flight),
        "pipeline/groups_admitted": float(counts.admitted),
        "pipeline/groups_discarded": float(counts.discarded),
        "pipeline/samples_per_s": totals.completions / elapsed,
        "pipeline/train_tokens_per_s": totals.tokens / elapsed,
        "pipeline/step_s": step_s,
        "pipeline/push_s": push_s,
        "pipeline/sequence_length": float(info.sequence_length),
        "pipeline/padding_frac": info.padding_frac,
        "pipeline/skipped_microbatches": float(info.skipped_microbatches),
        "sampler/tokens_per_s": generator.generated_tokens / elapsed,
        "sampler/completions_per_s": generator.completions / elapsed,
        "sampler/busy_frac": generator.busy_s / elapsed,
        "sampler/interrupted_frac": info.interrupted / info.num_completions,
        "sampler/truncated_frac": info.truncated / info.num_completions,
        "sampler/score_s": generator.score_s,
        "sampler/prefill_tokens": float(generator.prefill_tokens - totals.prefill_tokens),
        "sampler/shared_prompt_pages": float(generator.shared_prompt_pages - totals.shared_prompt_pages),
        "data/zero_variance_dropped": float(info.zero_variance_groups + counts.discarded - totals.discarded),
        "data/truncated_masked": float(info.truncated_masked),
        "train/reward_std": float(rewards.std()),
        "train/completion_len_mean": float(lengths.mean()),
        "train/completion_len_max": float(lengths.max()),
    }
    if step_flops is not None and step_s > 0:
        metrics["compute/model_flops_per_s"] = step_flops / step_s
        if peak_flops_per_s is not None:
            metrics["compute/mfu"] = step_flops / step_s / peak_flops_per_s
    return metrics
