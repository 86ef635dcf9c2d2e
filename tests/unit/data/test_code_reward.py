"""The code reward on MBPP rows: completions written here, their verdicts known by construction
(the reference solution passes, a wrong one fails, a completion without a program never runs)."""

from __future__ import annotations

import numpy as np
import pytest
from repo_paths import MBPP_PATH

from scalerl_jax.data.answers import OUTCOMES
from scalerl_jax.data.code_reward import CODE_KINDS, score_code_completions
from scalerl_jax.data.code_rows import read_code_problems
from scalerl_jax.sandbox import CodeVerifier, SandboxLimits


@pytest.fixture(scope="module")
def problems():
    return {p.task_id: p for p in read_code_problems(MBPP_PATH)}


@pytest.fixture(scope="module")
def verifier():
    return CodeVerifier(SandboxLimits(wall_s=5.0, cpu_s=3, workers=2))


def test_rewards_kinds_and_counts(problems, verifier):
    add = problems["11"]  # remove_Occ: remove the first and last occurrence of a character
    completions = [
        f"Here it is:\n```python\n{add.reference}\n```\nDone.",
        "```python\ndef remove_Occ(s, ch):\n    return s\n```",
        "I cannot write code today.",
        "```python\nwhile True:\n    pass\n```",
    ]
    scored = score_code_completions(
        completions, [add] * 4, verifier, whole_text_when_unfenced=False, correct_reward=1.0, incorrect_reward=-0.5
    )
    assert scored.outcomes == ["passed", "failed", "unparsable", "timeout"]
    assert scored.correct.tolist() == [True, False, False, False]
    np.testing.assert_array_equal(scored.rewards, np.array([1.0, -0.5, -0.5, -0.5], np.float32))
    assert scored.predictions[0] == add.reference + "\n" and scored.predictions[2] is None
    assert scored.answer_found.tolist() == [True, True, False, True]
    assert set(scored.counts) == set(OUTCOMES) | set(CODE_KINDS)
    assert {k: scored.counts[k] for k in CODE_KINDS} == {
        "passed": 1,
        "failed": 1,
        "timeout": 1,
        "memory": 0,
        "crash": 0,
        "unparsable": 1,
    }
    assert scored.details[1].startswith("AssertionError")


def test_the_whole_text_is_the_program_when_asked(problems, verifier):
    add = problems["11"]
    scored = score_code_completions([add.reference], [add], verifier, whole_text_when_unfenced=True)
    assert scored.outcomes == ["passed"] and scored.rewards.tolist() == [1.0]


def test_mismatched_lengths_are_refused(problems, verifier):
    with pytest.raises(ValueError, match="2 completions but 1 problems"):
        score_code_completions(["a", "b"], [problems["11"]], verifier)
