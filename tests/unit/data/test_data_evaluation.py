"""Evaluation with a scripted fake policy (a test double for the sampler: the logic under test
is the evaluation's bookkeeping). Expected numbers are computed by hand in the comments."""

import dataclasses
import functools
import math

import numpy as np
import pytest

from scalerl_jax.data.evaluation import evaluate, pass_at_k
from scalerl_jax.data.rewards import RewardConfig, score_completions


@dataclasses.dataclass
class FakeCompletion:
    tokens: list[int]
    interrupted: bool
    truncated: bool


def _decode(tokens):
    return "".join(chr(t) for t in tokens)


def _encode(text):
    return [ord(c) for c in text]


def _no_scoring(completions, golds):
    raise AssertionError("inputs that evaluate rejects are never scored")


def test_pass_at_k_matches_binomial_formula():
    for n in (1, 4, 16):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, np.array([c]), k)[0] == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, np.array([1]), 5)


def test_evaluate_with_scripted_policy():
    # Three prompts "p0", "p1", "p2" with golds 10, 11, 12; K = 4 samples each.
    # Scripted: prompt i's sample j is correct iff j < num_correct[i] = (4, 1, 0);
    # wrong samples answer 99, except prompt 2's sample 3, which never closes </think> (a format
    # failure) and is flagged interrupted and truncated; prompt 1's sample 0 is interrupted.
    num_correct = {"p0": 4, "p1": 1, "p2": 0}
    golds = {"p0": "10", "p1": "11", "p2": "12"}
    calls = []

    def sample_fn(requests):
        calls.append(len(requests))
        seen = {}
        out = []
        for request in requests:
            name = _decode(request)
            j = seen.get(name, 0)
            seen[name] = j + 1
            answer = golds[name] if j < num_correct[name] else "99"
            text = f"<think>work</think>\\boxed{{{answer}}}"
            interrupted = truncated = False
            if name == "p2" and j == 3:
                text, interrupted, truncated = "<think>work work", True, True
            if name == "p1" and j == 0:
                interrupted = True
            out.append(FakeCompletion(_encode(text), interrupted, truncated))
        return out

    reward_fn = functools.partial(score_completions, config=RewardConfig(kind="exact"))
    result = evaluate(
        sample_fn,
        [_encode("p0"), _encode("p1"), _encode("p2")],
        ["10", "11", "12"],
        num_samples=4,
        decode=_decode,
        reward_fn=reward_fn,
        pass_at=(1, 2, 4),
        difficulties=["easy", "hard", "hard"],
    )
    m = result.metrics
    assert calls == [12]
    assert result.per_prompt_pass_rate.tolist() == [1.0, 0.25, 0.0]
    assert m["eval/pass_rate"] == pytest.approx((1.0 + 0.25 + 0.0) / 3)
    assert m["eval/pass@1"] == pytest.approx(m["eval/pass_rate"])
    # pass@2: prompt0 1; prompt1 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; prompt2 0 -> 0.5.
    assert m["eval/pass@2"] == pytest.approx(0.5)
    # pass@4: prompt0 1, prompt1 1, prompt2 0 -> 2/3.
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    assert m["eval/interrupted_frac"] == pytest.approx(2 / 12)
    assert m["eval/truncated_frac"] == pytest.approx(1 / 12)
    assert m["eval/format_failure_frac"] == pytest.approx(1 / 12)
    assert m["eval/num_prompts"] == 3 and m["eval/num_samples"] == 12
    # 11 samples "<think>work</think>\boxed{NN}" of 7 + 4 + 8 + 7 + 2 + 1 = 29 characters (one
    # token each), and the truncated "<think>work work" of 16.
    assert m["eval/mean_completion_tokens"] == pytest.approx((11 * 29 + 16) / 12)
    assert m["eval/max_completion_tokens"] == 29.0
    assert m["eval/pass_rate/difficulty_easy"] == 1.0
    assert m["eval/pass_rate/difficulty_hard"] == pytest.approx(0.125)
    assert result.correct.shape == (3, 4) and result.correct.sum() == 5


def test_evaluate_rejects_mismatched_inputs():
    def sample_fn(requests):
        return []

    with pytest.raises(ValueError, match="golds"):
        evaluate(sample_fn, [[1]], [], num_samples=1, decode=_decode, reward_fn=_no_scoring)
    with pytest.raises(ValueError, match="returned 0 completions for 2"):
        evaluate(sample_fn, [[1]], ["1"], num_samples=2, decode=_decode, reward_fn=_no_scoring)
