"""Answer formats (``think`` / ``plain``), the extracted predictions, and the pool's chunked
scoring: per-item limits inside a chunk, a kill or a crash mid-chunk, concurrent calls with
different configs. Expected values are hand judgements of the texts."""

import threading

import pytest

from scalerl_jax.data.rewards import RewardConfig, extract_answer, math_reward, score_completions
from scalerl_jax.data.synthetic import THINK_END
from scalerl_jax.data.verify_pool import VerifyPool


@pytest.fixture(scope="module")
def pool():
    with VerifyPool(2, time_limit_s=5.0) as p:
        yield p


def test_extract_answer_by_format():
    text = "\\boxed{1} thinking \\boxed{2}</think> so \\boxed{3} or \\boxed{4"
    assert extract_answer(text) == ("3", None)  # after the tag; the open box is skipped
    assert extract_answer(text, answer_format="plain") == ("3", None)
    thinking_only = "Let me see: \\boxed{5} is it.</think>Five."
    assert extract_answer(thinking_only) == (None, "no_box")
    assert extract_answer(thinking_only, answer_format="plain") == ("5", None)
    base_model = "We add: 2 + 3 = 5, so the answer is \\boxed{5}."
    assert extract_answer(base_model) == (None, "no_think_end")
    assert extract_answer(base_model, answer_format="plain") == ("5", None)
    custom_tag = "<reason>\\boxed{1}<|end_reason|>\\boxed{2}"
    assert extract_answer(custom_tag, think_end="<|end_reason|>") == ("2", None)
    assert extract_answer(custom_tag) == (None, "no_think_end")
    assert THINK_END == "</think>"


def test_plain_format_scores_base_model_answers(pool):
    base_model = "2 + 3 = 5, so the answer is \\boxed{\\frac{10}{2}}."
    assert math_reward(base_model, "5", pool=pool, answer_format="plain") == 1.0
    assert math_reward(base_model, "5", pool=pool) == -1.0  # no </think>
    config = RewardConfig(kind="math", answer_format="plain")
    scored = score_completions([base_model, "no box at all", "\\boxed{6}"], ["5", "5", "5"], config, pool=pool)
    assert scored.outcomes == ["equal", "no_box", "fast_not_equal"]
    assert scored.predictions == ["\\frac{10}{2}", None, "6"]
    assert scored.counts["no_think_end"] == 0


def test_custom_think_end(pool):
    config = RewardConfig(kind="exact", think_end="<|end_reason|>")
    scored = score_completions(["a<|end_reason|>\\boxed{7}", "a</think>\\boxed{7}"], ["7", "7"], config, pool=pool)
    assert scored.outcomes == ["fast_equal", "no_think_end"]


def test_limit_is_per_item_inside_a_chunk():
    # One worker, one chunk of 4 items of 0.4 s each: 1.6 s in all, each under the 1 s limit.
    with VerifyPool(1, time_limit_s=1.0, reward_fn="custom_rewards:sleeps_briefly") as pool:
        scored = score_completions(
            ["a"] * 4, ["1"] * 4, RewardConfig(reward_fn=pool.reward_fn), pool=pool, problems=[""] * 4
        )
        assert scored.outcomes == ["custom"] * 4
        assert pool.stats().kills == 0


def test_kill_mid_chunk_rest_is_scored():
    # math-verify's own timeout far above the hard limit: only a kill ends the second item.
    with VerifyPool(1, time_limit_s=1.0, soft_timeout_s=60) as pool:
        completions = [f"<think></think>\\boxed{{{p}}}" for p in ["0.5", "9^{9^{9^{9}}}", "12", "x+1"]]
        scored = score_completions(completions, ["\\frac{1}{2}", "1", "12", "1+x"], RewardConfig(), pool=pool)
        assert scored.outcomes == ["equal", "timeout", "fast_equal", "equal"]
        assert scored.predictions == ["0.5", None, "12", "x+1"]
        assert pool.stats().kills == 1


def test_crash_mid_chunk_rest_is_scored():
    with VerifyPool(1, reward_fn="custom_rewards:exits_on_crash") as pool:
        scored = score_completions(
            ["ok", "CRASH", "ok"], ["1"] * 3, RewardConfig(reward_fn=pool.reward_fn), pool=pool, problems=[""] * 3
        )
        assert scored.outcomes == ["custom", "crash", "custom"]
        assert scored.rewards.tolist() == [1.0, -1.0, 1.0]
        assert pool.stats().crashes == 1


def test_concurrent_calls_with_different_configs(pool):
    completions = ["<think></think>\\boxed{0.5}", "\\boxed{0.5}"] * 20
    golds = ["\\frac{1}{2}"] * 40
    expected = {
        "math": ["equal", "no_think_end"] * 20,
        "exact": ["fast_not_equal", "no_think_end"] * 20,
        "plain": ["equal", "equal"] * 20,
    }
    configs = {
        "math": RewardConfig(kind="math"),
        "exact": RewardConfig(kind="exact"),
        "plain": RewardConfig(kind="math", answer_format="plain"),
    }
    got = {}

    def run(name):
        got[name] = score_completions(completions, golds, configs[name], pool=pool).outcomes

    threads = [threading.Thread(target=run, args=(name,)) for name in configs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == expected
