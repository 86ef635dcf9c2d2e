"""The warm start's demonstration mix: worked traces and answer-only replies."""
import numpy as np
import pytest

from scalerl_jax import data as data_lib
from scalerl_jax.warm_start import with_direct_answers

ROWS = [{"problem": f"{i}+1", "answer": str(i + 1), "solution": f"<think>{i}+1={i + 1}</think>\\boxed{{{i + 1}}}"}
        for i in range(1000)]


def test_answer_only_reply_is_an_empty_think_block_and_scores_as_correct():
    assert data_lib.direct_answer(51) == "<think></think>\\boxed{51}"
    scored = data_lib.score_completions(["<think></think>\\boxed{51}"], ["51"], data_lib.RewardConfig(kind="exact"))
    assert scored.correct.tolist() == [True]


def test_fraction_of_answer_only_demonstrations():
    mixed = with_direct_answers(ROWS, 0.3, np.random.default_rng(0))
    direct = [r["solution"] == f"<think></think>\\boxed{{{r['answer']}}}" for r in mixed]
    # Binomial(1000, 0.3): standard deviation sqrt(1000 * 0.3 * 0.7) = 14.5, so 300 +- 58 is 4 sigma.
    assert 242 <= sum(direct) <= 358
    kept = [m for m, d in zip(mixed, direct) if not d]
    assert all(m == ROWS[int(m["answer"]) - 1] for m in kept)  # the other rows are untouched
    assert with_direct_answers(ROWS, 0.0, np.random.default_rng(0)) == ROWS
    assert all(r["solution"].startswith("<think></think>") for r in with_direct_answers(ROWS, 1.0, np.random.default_rng(0)))


def test_fraction_outside_unit_interval_is_refused():
    with pytest.raises(ValueError, match="direct_answer_fraction"):
        with_direct_answers(ROWS, 1.5, np.random.default_rng(0))
