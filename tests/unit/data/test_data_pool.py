"""Prompt pool: epochs, No-Positive-Resampling on the full history, state round-trip, seeds."""

import json

import pytest

from scalerl_jax.data.pool import PoolExhaustedError, PromptPool


def _drain_epoch(pool: PromptPool) -> list[int]:
    """Draws one prompt at a time until the pool enters the next epoch; returns this epoch's."""
    epoch = pool.epoch
    drawn = []
    while True:
        state = pool.state_dict()
        prompt = pool.next_prompts(1)[0]
        if pool.epoch != epoch and drawn:
            pool.load_state_dict(state)  # un-draw the first prompt of the next epoch
            return drawn
        epoch = pool.epoch
        drawn.append(prompt)


def test_each_epoch_visits_every_active_prompt_once():
    pool = PromptPool(7, seed=0)
    first = pool.next_prompts(3) + pool.next_prompts(4)
    assert sorted(first) == list(range(7)) and pool.epoch == 0
    second = pool.next_prompts(7)
    assert sorted(second) == list(range(7)) and pool.epoch == 1


def test_nine_of_ten_leaves_eight_of_ten_stays():
    pool = PromptPool(4, seed=0, npr_threshold=0.9)
    assert sorted(_drain_epoch(pool)) == [0, 1, 2, 3]
    pool.record(0, 9, 10)  # 0.9 >= 0.9: leaves
    pool.record(1, 8, 10)  # 0.8 < 0.9: stays
    # Full history, not the last group: 5/5 then 4/5 = 9/10 leaves even though the last
    # group alone (0.8) would not; 5/5 then 3/5 = 8/10 stays though its first group was perfect.
    pool.record(2, 5, 5)
    pool.record(2, 4, 5)
    pool.record(3, 5, 5)
    pool.record(3, 3, 5)
    assert pool.history(2) == [(5, 5), (4, 5)]
    assert pool.pass_rate(2) == pytest.approx(0.9) and pool.pass_rate(3) == pytest.approx(0.8)
    assert pool.num_remaining == 2 and pool.num_retired == 2
    for _ in range(3):
        assert sorted(_drain_epoch(pool)) == [1, 3]
    assert pool.metrics()["data/pool_remaining"] == 2.0


def test_retired_prompt_is_skipped_in_the_current_epoch():
    pool = PromptPool(5, seed=2)
    pool.next_prompts(1)
    rest_of_epoch = pool.state_dict()["order"][1:]
    pool.record(rest_of_epoch[0], 3, 3)  # a late record retires a prompt not yet drawn
    assert pool.next_prompts(4)[:3] == rest_of_epoch[1:]


def test_threshold_none_never_retires():
    pool = PromptPool(2, seed=0, npr_threshold=None)
    pool.record(0, 10, 10)
    assert sorted(pool.next_prompts(2)) == [0, 1] and pool.num_remaining == 2


def test_runs_dry_with_a_clear_error():
    pool = PromptPool(3, seed=1)
    for prompt in pool.next_prompts(3):
        pool.record(prompt, 16, 16)
    with pytest.raises(PoolExhaustedError, match="ran dry: all 3 prompts"):
        pool.next_prompts(1)


def test_state_round_trips_exactly():
    pool = PromptPool(11, seed=5)
    for step in range(9):
        for prompt in pool.next_prompts(4):
            pool.record(prompt, (prompt * 7 + step) % 9, 8)
    state = json.loads(json.dumps(pool.state_dict()))  # plain JSON-able data
    restored = PromptPool(11, seed=5)
    restored.load_state_dict(state)
    assert restored.state_dict() == pool.state_dict()
    assert [restored.pass_rate(i) for i in range(11)] == [pool.pass_rate(i) for i in range(11)]
    assert [restored.history(i) for i in range(11)] == [pool.history(i) for i in range(11)]
    assert restored.num_remaining == pool.num_remaining
    for step in range(20):
        drawn = pool.next_prompts(3)
        assert restored.next_prompts(3) == drawn
        for p in drawn:
            pool.record(p, step % 2, 2)
            restored.record(p, step % 2, 2)
    with pytest.raises(ValueError, match="seed"):
        PromptPool(11, seed=6).load_state_dict(state)
    broken = dict(state)
    del broken["order"]
    with pytest.raises(ValueError, match="order"):
        PromptPool(11, seed=5).load_state_dict(broken)


def test_seed_determinism():
    def sequence(seed):
        pool = PromptPool(50, seed=seed)
        return [pool.next_prompts(8) for _ in range(20)]

    assert sequence(3) == sequence(3)
    assert sequence(3) != sequence(4)


def test_bad_records():
    pool = PromptPool(3, seed=0)
    with pytest.raises(ValueError, match="prompt index 3"):
        pool.record(3, 1, 1)
    with pytest.raises(ValueError, match="num_correct"):
        pool.record(0, 5, 4)
    with pytest.raises(ValueError, match="count"):
        pool.next_prompts(0)
