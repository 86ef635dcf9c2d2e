"""Rewards: boxed-answer extraction, a 40-case verifier table, time limits, the worker pool.

Expected rewards are mathematical judgements written by hand (is the boxed answer equal to the
gold?), not outputs of the code under test.
"""

import threading

import psutil
import pytest

from scalerl_jax.config.adapters import reward_config_of
from scalerl_jax.data import rewards
from scalerl_jax.data.rewards import RewardConfig, extract_answer, last_boxed, math_reward
from scalerl_jax.data.verify_pool import TIMEOUT, VerifyPool

THINK = {"kind": "math", "answer_format": "think", "think_end": "</think>"}


def _answer(pred: str) -> str:
    return f"<think>Let me work it out.</think>The final answer is \\boxed{{{pred}}}."


@pytest.fixture(scope="module")
def pool():
    with VerifyPool(2, time_limit_s=3.0) as p:
        yield p


VERIFIER_TABLE = [
    # (gold, completion, expected reward)
    # Equivalent forms.
    ("\\frac{1}{2}", _answer("0.5"), 1),
    ("\\frac{1}{2}", _answer("\\dfrac{1}{2}"), 1),
    ("\\frac{1}{2}", _answer("\\tfrac12"), 1),
    ("0.5", _answer("\\frac{2}{4}"), 1),
    ("3", _answer("x=3"), 1),
    ("\\{1,2\\}", _answer("\\{2,1\\}"), 1),
    ("[1,2)", _answer("[1,2)"), 1),
    ("\\frac{\\sqrt{2}}{2}", _answer("\\sqrt{2}/2"), 1),
    ("(x+1)^2", _answer("x^2+2x+1"), 1),
    ("1000", _answer("1,000"), 1),
    ("\\frac{\\pi}{2}", _answer("\\dfrac{\\pi}{2}"), 1),
    ("2", _answer("\\text{2}"), 1),
    ("2\\sqrt{3}", _answer("\\sqrt{12}"), 1),
    ("\\frac{3}{4}", _answer("0.75"), 1),
    ("5", _answer("5.0"), 1),
    ("-\\frac{1}{2}", _answer("-0.5"), 1),
    ("\\infty", _answer("\\infty"), 1),
    ("a+b", _answer("b+a"), 1),
    ("(1,2)", _answer("(1, 2)"), 1),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", _answer("\\begin{pmatrix}1\\\\2\\end{pmatrix}"), 1),
    ("e", _answer("\\exp(1)"), 1),
    ("\\log 8", _answer("3\\log 2"), 1),
    ("12", _answer("\\mathbf{12}"), 1),
    ("y=2x+1", _answer("2x+1"), 1),
    # Integer fast path (no math-verify call).
    ("42", _answer("42"), 1),
    ("-7", _answer(" -7 "), 1),
    ("42", _answer("43"), -1),
    # Wrong answers.
    ("(1,2]", _answer("[1,2]"), -1),
    ("\\pi", _answer("3.14159"), -1),
    ("\\frac{1}{2}", _answer("\\frac{1}{3}"), -1),
    ("(1,2)", _answer("(2,1)"), -1),
    ("x^2", _answer("x^3"), -1),
    ("\\{1,2\\}", _answer("\\{1,2,3\\}"), -1),
    ("[1,2]", _answer("[1,3]"), -1),
    # Nested braces in the box.
    ("\\frac{1}{2}", _answer("\\frac{1}{\\sqrt{4}}"), 1),
    ("\\frac{1}{2}", "<think>x</think>\\boxed{\\frac{\\frac{1}{1}}{2}}", 1),
    # Format failures: no box, no </think>, a box only inside the thinking, an empty box.
    ("2", "<think>1+1</think>The answer is 2.", -1),
    ("2", "\\boxed{2}", -1),
    ("2", "<think>\\boxed{2}</think>So it is two.", -1),
    ("1", _answer(""), -1),
    # The last box of the answer counts; an unclosed box is skipped.
    ("4", "<think>a</think>\\boxed{3}, no wait: \\boxed{4}", 1),
    ("3", "<think>a</think>\\boxed{3}, no wait: \\boxed{4}", -1),
    ("4", "<think>a</think>\\boxed{4} and \\boxed{5", 1),
    # The box's brace is taken by \frac{ ... }, so the box never closes: no box.
    ("1", _answer("\\frac{"), -1),
]


def test_verifier_table(pool):
    assert len(VERIFIER_TABLE) >= 30
    got = [math_reward(completion, gold, pool=pool) for gold, completion, _ in VERIFIER_TABLE]
    mismatches = [
        (gold, completion, expected, g) for (gold, completion, expected), g in zip(VERIFIER_TABLE, got) if g != expected
    ]
    assert not mismatches


def test_batch_scoring_counts_outcomes(pool):
    completions = [c for _, c, _ in VERIFIER_TABLE]
    golds = [g for g, _, _ in VERIFIER_TABLE]
    scored = rewards.score_completions(completions, golds, RewardConfig(kind="math"), pool=pool)
    assert scored.rewards.tolist() == [float(e) for _, _, e in VERIFIER_TABLE]
    assert scored.correct.tolist() == [e == 1 for _, _, e in VERIFIER_TABLE]
    # Hand count: one completion without </think>; three without a closed box after it (no
    # box, box only inside the thinking, the unclosed \frac box); one empty box (unparsable).
    assert scored.counts[rewards.NO_THINK_END] == 1
    assert scored.counts[rewards.NO_BOX] == 3
    assert scored.counts["unparsable"] == 1
    assert sum(scored.counts.values()) == len(VERIFIER_TABLE)
    # The extracted answers, for the table's first rows and its format failures.
    assert scored.predictions[:3] == ["0.5", "\\dfrac{1}{2}", "\\tfrac12"]
    no_answer = [i for i, o in enumerate(scored.outcomes) if o in ("no_think_end", "no_box")]
    assert [scored.predictions[i] for i in no_answer] == [None] * 4


def test_adversarial_answer_times_out_without_hanging(pool):
    result = {}

    def run():
        before = pool.stats().timeouts
        outcome = rewards.score_completions(
            [_answer("9^{9^{9^{9}}}"), _answer("0.5")], ["1", "\\frac{1}{2}"], RewardConfig(), pool=pool
        )
        result["outcome"] = outcome
        result["timeouts"] = pool.stats().timeouts - before

    thread = threading.Thread(target=run)  # also: scoring works off the main thread
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "verification hung"
    assert result["outcome"].outcomes[0] == TIMEOUT
    assert result["outcome"].rewards.tolist() == [-1.0, 1.0]
    assert result["timeouts"] == 1
    # The pool still works after replacing the timed-out worker.
    assert math_reward(_answer("4/2"), "2", pool=pool) == 1.0


def test_hard_limit_kills_a_worker_that_does_not_stop():
    # math-verify's own timeout is set far above the hard limit, so this item (which runs for
    # at least 3 s: see the adversarial test) can only end by the pool killing its worker.
    with VerifyPool(1, time_limit_s=1.0, soft_timeout_s=60) as pool:
        [result] = pool.score([(_answer("9^{9^{9^{9}}}"), "1", "")], **THINK)
        assert result.status == TIMEOUT and result.prediction is None
        assert pool.stats().kills == 1 and pool.stats().timeouts == 1
        assert [r.status for r in pool.score([(_answer("0.5"), "\\frac{1}{2}", "")], **THINK)] == ["equal"]


def _worker_processes() -> set:
    return {c for c in psutil.Process().children() if "verify_worker.py" in " ".join(c.cmdline())}


def test_pool_from_many_threads_and_close():
    others = _worker_processes()  # e.g. the module fixture's pool
    pool = VerifyPool(2, time_limit_s=5.0)
    items = [
        (_answer(pred), gold, "")
        for gold, pred in [("\\frac{1}{2}", "0.5"), ("3", "4"), ("x+1", "1+x"), ("2", "\\sqrt{4}")]
    ]
    expected = ["equal", "fast_not_equal", "equal", "equal"]
    results: list[list[str] | None] = [None] * 4

    def score(i):
        results[i] = [r.status for r in pool.score(items, **THINK)]

    threads = [threading.Thread(target=score, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [expected] * 4
    workers = list(_worker_processes() - others)
    assert len(workers) == 2
    pool.close()
    psutil.wait_procs(workers, timeout=10)
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(items, **THINK)


def test_last_boxed_brace_matching():
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{a} \\boxed{b}") == "b"
    assert last_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert last_boxed("\\boxed{\\}}") == "\\}"
    assert last_boxed("\\boxed{1} \\boxed{2") == "1"
    assert last_boxed("\\boxed{{x}") is None
    assert last_boxed("no box") is None
    assert extract_answer("<think>\\boxed{1}</think>x</think>\\boxed{2}") == ("2", None)
    assert extract_answer("\\boxed{1}") == (None, rewards.NO_THINK_END)
    assert extract_answer("<think></think>1") == (None, rewards.NO_BOX)


def test_reward_config_from_the_tiny_and_8b_configs():
    from scalerl_jax.config import recipes

    # Hand-read from recipes.tiny(): synthetic task, +1 / -1, think format ending at </think>.
    assert reward_config_of(recipes.tiny()) == RewardConfig(
        kind="exact", correct_reward=1.0, incorrect_reward=-1.0, think_end="</think>", answer_format="think"
    )
    config = recipes.scalerl_8b()
    config.data.answer_format = "plain"
    config.data.reward_fn = "custom_rewards:contains_gold"
    config.data.reward_incorrect = 0.0
    assert reward_config_of(config) == RewardConfig(
        kind="math",
        correct_reward=1.0,
        incorrect_reward=0.0,
        think_end="</think>",
        answer_format="plain",
        reward_fn="custom_rewards:contains_gold",
    )


def test_exact_kind():
    config = RewardConfig(kind="exact")
    scored = rewards.score_completions(
        [_answer("51"), _answer("051"), _answer("50"), _answer("x"), "<think>51"], ["51", "51", "51", "x", "51"], config
    )
    assert scored.rewards.tolist() == [1.0, 1.0, -1.0, 1.0, -1.0]
    assert scored.counts[rewards.NO_THINK_END] == 1


def test_bad_inputs():
    with pytest.raises(ValueError, match="2 completions but 1 golds"):
        rewards.score_completions(["a", "b"], ["1"], RewardConfig())
    with pytest.raises(ValueError, match="item 0"):  # bytes on purpose: the check for non-strings
        rewards.score_completions([b"bytes"], ["1"], RewardConfig(kind="exact"))  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="1 problems for 2 completions"):
        rewards.score_completions(["a", "b"], ["1", "2"], RewardConfig(), problems=["p"])
    with pytest.raises(ValueError, match="RewardConfig.kind"):
        RewardConfig(kind="fuzzy")
    with pytest.raises(ValueError, match="RewardConfig.answer_format"):
        RewardConfig(answer_format="boxed")
    with pytest.raises(ValueError, match="RewardConfig.think_end"):
        RewardConfig(think_end="")
    with pytest.raises(ValueError, match="RewardConfig.reward_fn must look like"):
        RewardConfig(reward_fn="module.function")
