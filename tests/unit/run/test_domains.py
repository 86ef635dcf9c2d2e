"""Per-domain reporting of a math+code run, checked against hand calculations: the step's
per-domain metrics, the weighted held-out pass rate, the code verdict counts of the reward tally,
and a run's train prompts split into domains."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scalerl_jax.data.rewards import RewardTallies, ScoredBatch
from scalerl_jax.pipeline.group import Group, Prompt
from scalerl_jax.run.build import TaskData
from scalerl_jax.run.evaluation import weighted_pass_rate
from scalerl_jax.run.reporting import domain_metrics


@dataclasses.dataclass(frozen=True)
class Done:
    tokens: tuple[int, ...]
    truncated: bool = False


def group(key: int, rewards: list[float], lengths: list[int], truncated: list[bool]) -> Group:
    completions = [Done(tuple(range(n)), t) for n, t in zip(lengths, truncated)]
    return Group(key, Prompt(key, (1, 2)), 0, completions, np.asarray(rewards, np.float32))


def test_domain_metrics_by_hand():
    task = TaskData([], [], [], [], 0, domain_sizes={"math": 3, "code": 2})
    groups = [
        group(0, [1, -1], [4, 6], [False, False]),  # math
        group(2, [-1, -1], [10, 2], [True, False]),  # math
        group(4, [1, 1], [3, 5], [False, True]),  # code
    ]
    metrics = domain_metrics(groups, task.domain_of)
    assert metrics == {
        "train/code/groups": 1.0,
        "train/code/reward_mean": 1.0,
        "train/code/pass_rate": 1.0,
        "train/code/completion_len_mean": 4.0,
        "train/code/truncated_frac": 0.5,
        "train/math/groups": 2.0,
        "train/math/reward_mean": -0.5,  # (1 - 1 - 1 - 1) / 4
        "train/math/pass_rate": 0.25,
        "train/math/completion_len_mean": 5.5,  # (4 + 6 + 10 + 2) / 4
        "train/math/truncated_frac": 0.25,
    }


def test_weighted_pass_rate_by_hand():
    metrics = {"eval/math/pass_rate": 0.5, "eval/code/pass_rate": 0.2}
    assert weighted_pass_rate(metrics, {"math": 1.0, "code": 1.0}) == pytest.approx(0.35)
    assert weighted_pass_rate(metrics, {"math": 3.0, "code": 1.0}) == pytest.approx((1.5 + 0.2) / 4)


def test_domain_of_follows_the_domain_sizes():
    task = TaskData([], [], [], [], 0, domain_sizes={"math": 3, "code": 2})
    assert [task.domain_of(i) for i in range(5)] == ["math"] * 3 + ["code"] * 2


def scored(outcomes: list[str]) -> ScoredBatch:
    n = len(outcomes)
    return ScoredBatch(
        rewards=np.full(n, -1.0, np.float32),
        correct=np.array([o == "passed" for o in outcomes]),
        outcomes=outcomes,
        counts={},
        predictions=["p"] * n,
        details=[""] * n,
    )


def test_code_verdicts_are_counted_per_kind_in_every_row_and_survive_a_resume():
    tallies = RewardTallies(report_code=True)
    zero = {f"data/code_{k}": 0 for k in ("failed", "timeout", "memory", "crash", "unparsable")}
    assert {k: v for k, v in tallies.metrics().items() if "/code_" in k} == zero  # before any item
    tallies.training.add(
        scored(["passed", "failed", "timeout", "failed", "unparsable"]), ["p"] * 5, ["g"] * 5, code=True
    )
    tallies.evaluation("eval/math").add(scored(["fast_equal"]), ["p"], ["g"])
    tallies.evaluation("eval/code").add(scored(["memory", "crash"]), ["p"] * 2, ["g"] * 2, code=True)
    metrics = tallies.metrics()
    assert {k: v for k, v in metrics.items() if k.startswith("data/code_")} == {
        **zero,
        "data/code_failed": 2,
        "data/code_timeout": 1,
        "data/code_unparsable": 1,
    }
    # a code timeout is the program's, not the math verifier's
    assert metrics["data/reward_timeouts"] == 0 and metrics["data/reward_unparsable"] == 0
    assert metrics["eval/code/code_memory"] == 1 and metrics["eval/code/code_crash"] == 1
    assert not [k for k in metrics if k.startswith("eval/math/code_")]  # a math set has no code kinds
    restored = RewardTallies(report_code=True)
    restored.load_state_dict(tallies.state_dict())
    assert restored.metrics() == metrics
