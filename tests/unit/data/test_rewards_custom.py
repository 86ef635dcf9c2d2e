"""Custom reward functions (``RewardConfig.reward_fn``): called in the workers under the time
limit, checked at pool start with errors that name the spec. The functions are in
``tests/support/custom_rewards.py``; expected rewards are computed by hand from their definitions."""

import pytest

from scalerl_jax.data.rewards import RewardConfig, check_reward_fn, score_completions
from scalerl_jax.data.verify_pool import VerifyPool

CONTAINS_GOLD = "custom_rewards:contains_gold"


@pytest.fixture(scope="module")
def pool():
    with VerifyPool(2, time_limit_s=5.0, reward_fn=CONTAINS_GOLD) as p:
        yield p


def test_custom_reward_values_and_correctness(pool):
    config = RewardConfig(reward_fn=CONTAINS_GOLD)
    completions = [
        "<think>7?</think>42",  # 2 answer characters: 1 - 0.002
        "<think>42</think>\\boxed{41}",  # the gold only in the thinking: -1
        "42 without a think tag",  # no answer part: -1
        "<think></think>It is \\boxed{42}.",
    ]  # 6 + 10 + 1 characters: 1 - 0.017
    scored = score_completions(completions, ["42"] * 4, config, pool=pool, problems=["p"] * 4)
    assert scored.rewards.tolist() == pytest.approx([0.998, -1.0, -1.0, 0.983])
    assert scored.correct.tolist() == [True, False, False, True]  # correct: reward > 0
    assert scored.outcomes == ["custom"] * 4 and scored.counts["custom"] == 4
    assert scored.predictions == [None, "41", None, "42"]  # extracted for the samples log


def test_problems_reach_the_function():
    config = RewardConfig(reward_fn="custom_rewards:mentions_problem")
    with VerifyPool(1, reward_fn=config.reward_fn) as pool:
        scored = score_completions(
            ["<think>What is 2+2?</think>4", "<think></think>4"],
            ["4", "4"],
            config,
            pool=pool,
            problems=["What is 2+2?", "What is 2+2?"],
        )
    assert scored.rewards.tolist() == [0.5, 0.0]
    assert scored.correct.tolist() == [True, False]


def test_config_and_pool_must_agree(pool):
    with pytest.raises(ValueError, match="needs the problems"):
        score_completions(["a"], ["1"], RewardConfig(reward_fn=CONTAINS_GOLD), pool=pool)
    with pytest.raises(ValueError, match="VerifyPool has reward_fn='custom_rewards:contains"):
        score_completions(["a"], ["1"], RewardConfig(), pool=pool)
    with pytest.raises(ValueError, match="VerifyPool has reward_fn=None"):
        score_completions(["a"], ["1"], RewardConfig(reward_fn=CONTAINS_GOLD), problems=["p"])


def test_hung_and_raising_items_are_incorrect_not_fatal():
    with VerifyPool(1, time_limit_s=1.0, reward_fn="custom_rewards:sleeps_on_hang") as pool:
        config = RewardConfig(reward_fn=pool.reward_fn, incorrect_reward=-2.0)
        # One worker: all three items go in one chunk; the hung one is killed, the last is
        # scored by the replacement worker.
        scored = score_completions(
            ["<think></think>ok", "<think></think>HANG", "ok"], ["1"] * 3, config, pool=pool, problems=[""] * 3
        )
        assert scored.outcomes == ["custom", "timeout", "custom"]
        assert scored.rewards.tolist() == [1.0, -2.0, 1.0]
        assert pool.stats().kills == 1
    with VerifyPool(1, reward_fn="custom_rewards:raises_on_long") as pool:
        config = RewardConfig(reward_fn=pool.reward_fn)
        scored = score_completions(["short", "x" * 101], ["1", "1"], config, pool=pool, problems=["", ""])
        assert scored.outcomes == ["custom", "error"]
        assert scored.rewards.tolist() == [1.0, -1.0]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("no_such_module_for_scalerl:f", "module not found"),
        ("custom_rewards:missing", "has no attribute 'missing'"),
        ("custom_rewards:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not callable"),
        ("custom_rewards:raises", "raised RuntimeError: cannot score '2'"),
        ("custom_rewards:returns_string", r"returned '1.0' \(str\), not a finite number"),
        ("custom_rewards:returns_nan", r"returned nan \(float\), not a finite number"),
        ("custom_rewards:sleeps", "did not return within time_limit_s=1.0"),
    ],
)
def test_bad_functions_are_named_at_start(spec, message):
    with pytest.raises(ValueError, match=f"reward_fn '{spec}'.*{message}"):
        check_reward_fn(spec, time_limit_s=1.0)


def test_user_modules_import_through_the_parents_sys_path(tmp_path, monkeypatch):
    (tmp_path / "reward_module_only_here.py").write_text("def one(completion, gold, problem):\n    return 1\n")
    (tmp_path / "reward_module_broken.py").write_text("import os\nraise KeyError('setting')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_reward_fn("reward_module_only_here:one")  # found only through the parent's sys.path
    with pytest.raises(ValueError, match="importing 'reward_module_broken' raised KeyError"):
        check_reward_fn("reward_module_broken:f")
