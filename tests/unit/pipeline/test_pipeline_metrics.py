"""The pipeline's per-step metrics (step_record.pipeline_step_metrics) on a hand-built batch."""

import numpy as np
import pytest

from scalerl_jax.pipeline.batching import build_train_batch
from scalerl_jax.pipeline.config import PipelineConfig
from scalerl_jax.pipeline.generator import GeneratorStats
from scalerl_jax.pipeline.group import Group, Prompt
from scalerl_jax.pipeline.queue import BufferCounts, WaitTimes
from scalerl_jax.pipeline.step_record import RunTotals, pipeline_step_metrics
from scalerl_jax.sampler import Completion


def completion(length, *, truncated=False, finish_reason="stop"):
    return Completion(
        request_id=None,
        prompt_tokens=[],
        tokens=[1] * length,
        logprobs=[-1.0] * length,
        versions=[0] * length,
        sampled=[True] * length,
        interrupted=False,
        truncated=truncated,
        num_think_tokens=0,
        num_answer_tokens=length,
        finish_reason=finish_reason,
        think_budget=-1,
    )


def groups():
    # rewards (1, 0, 0.5, 0, 0): mean 0.3, squared deviations .49 .09 .04 .09 .09, sum 0.8,
    # population variance 0.16, std 0.4. Completion lengths 3, 3, 2, 5, 1: mean 2.8, max 5.
    return [
        Group(
            0,
            Prompt("a", (7,)),
            0,
            rewards=np.asarray([1.0, 0.0, 0.5]),
            completions=[completion(3), completion(3, truncated=True, finish_reason="length"), completion(2)],
        ),
        Group(
            1,
            Prompt("b", (7,)),
            0,
            rewards=np.asarray([0.0, 0.0]),
            completions=[completion(5), completion(1, truncated=True, finish_reason="answer_budget")],
        ),
    ]


def metrics_of(step_flops=None, peak_flops_per_s=None, mask_truncated=True):
    batch_groups = groups()
    _, info = build_train_batch(batch_groups, rows=6, length_buckets=(8,), mask_truncated=mask_truncated)
    return pipeline_step_metrics(
        batch_groups,
        info,
        version=1,
        counts=BufferCounts(2, 2, 0, 0, 0, 2),
        waits=WaitTimes(),
        generator=GeneratorStats(),
        totals=RunTotals(start=0.0),
        elapsed=10.0,
        wait_s=0.0,
        step_s=0.5,
        push_s=0.0,
        step_flops=step_flops,
        peak_flops_per_s=peak_flops_per_s,
    )


def test_reward_and_length_metrics_by_hand():
    metrics = metrics_of()
    assert metrics["train/reward_std"] == pytest.approx(0.4, rel=1e-6)
    assert metrics["train/completion_len_mean"] == pytest.approx(2.8)
    assert metrics["train/completion_len_max"] == 5.0
    # only the completion cut by 'length' is masked, not the answer-budget one.
    assert metrics["data/truncated_masked"] == 1.0
    assert metrics_of(mask_truncated=False)["data/truncated_masked"] == 0.0
    assert metrics["sampler/truncated_frac"] == pytest.approx(2 / 5)


def test_flops_and_mfu():
    # 2e12 model FLOPs in a 0.5 s step: 4e12 FLOP/s; against a 8e12 FLOP/s peak, MFU 0.5.
    metrics = metrics_of(step_flops=2e12, peak_flops_per_s=8e12)
    assert metrics["compute/model_flops_per_s"] == pytest.approx(4e12)
    assert metrics["compute/mfu"] == pytest.approx(0.5)
    no_peak = metrics_of(step_flops=2e12)
    assert no_peak["compute/model_flops_per_s"] == pytest.approx(4e12) and "compute/mfu" not in no_peak
    assert "compute/model_flops_per_s" not in metrics_of()


def test_config_rejects_a_bad_peak():
    with pytest.raises(ValueError, match="peak_flops_per_s=0"):
        PipelineConfig(max_new_tokens=8, max_seq_len=32, peak_flops_per_s=0.0)
