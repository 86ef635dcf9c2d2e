"""Admission control and batch selection of PipelineRL-k / PPO-off-policy-k (pipeline/lag.py).

The reference is a brute force written here: enumerate every batch of G finished groups and
decide feasibility by *simulating* the rest (earliest deadline first, G groups per future step,
each group's step must be <= its deadline), not by the counting formula the code uses.
"""

import itertools

import numpy as np
import pytest

from scalerl_jax.pipeline.lag import PipelineSchedule, PPOOffPolicySchedule, Ticket, default_capacity, make_schedule


def remaining_feasible(deadlines, next_version, size):
    """Can these unconsumed groups all be consumed by their deadlines from step next_version on?"""
    for position, deadline in enumerate(sorted(deadlines)):
        if next_version + position // size > deadline:
            return False
    return True


def brute_force_batches(tickets, version, k, size):
    """All feasible batches (as sorted id tuples) of `size` finished groups at trainer `version`."""
    finished = [t for t in tickets if t.finished]
    feasible = []
    for chosen in itertools.combinations(finished, size):
        ids = {t.group_id for t in chosen}
        if any(t.admit_version + k < version for t in chosen):
            continue
        rest = [t.admit_version + k for t in tickets if t.group_id not in ids]
        if remaining_feasible(rest, version + 1, size):
            feasible.append(tuple(sorted(ids)))
    return feasible


def test_pipeline_selection_matches_brute_force():
    rng = np.random.default_rng(0)
    checked = waits = 0
    for _ in range(800):
        k = int(rng.integers(0, 4))
        size = int(rng.integers(1, 4))
        version = int(rng.integers(k, k + 4))
        count = int(rng.integers(size, 3 * size + 3))
        # admission versions in [version - k, version]: nothing already overdue
        admits = rng.integers(version - k, version + 1, size=count)
        tickets = [Ticket(i, int(a), bool(rng.random() < 0.6)) for i, a in enumerate(sorted(admits))]
        if not remaining_feasible([t.admit_version + k for t in tickets], version, size):
            continue  # a state admission control never produces
        chosen = PipelineSchedule(max_lag=k, groups_per_step=size).select_batch(tickets, version)
        feasible = brute_force_batches(tickets, version, k, size)
        if chosen is None:
            assert feasible == [], (k, size, version, tickets)
            waits += 1
        else:
            assert tuple(sorted(chosen)) in feasible
            assert len(set(chosen)) == size
        checked += 1
    assert checked > 300 and 30 < waits < checked - 30  # both outcomes exercised


def test_pipeline_admission_rule_by_hand():
    # k=1, G=2, generator at version 0, next batch 0: (0 + 1 - 0 + 1) * 2 = 4 groups may be open.
    schedule = PipelineSchedule(max_lag=1, groups_per_step=2)
    allowed = [
        schedule.admission_allowed(num_unconsumed=n, generator_version=0, next_batch_version=0) for n in range(6)
    ]
    assert allowed == [True, True, True, True, False, False]
    # After batch 0 was taken (next batch 1) with 2 open, a generator still on version 0 may
    # admit nothing: (0 + 1 - 1 + 1) * 2 = 2 already reached. Once it holds version 1: 4.
    assert not schedule.admission_allowed(num_unconsumed=2, generator_version=0, next_batch_version=1)
    assert schedule.admission_allowed(num_unconsumed=3, generator_version=1, next_batch_version=1)
    assert not schedule.admission_allowed(num_unconsumed=4, generator_version=1, next_batch_version=1)


def test_trainer_must_wait_for_group_at_its_deadline():
    # k=1, G=1: group 0 (admitted v0, deadline 1) is still running; group 2 (v1) is finished.
    schedule = PipelineSchedule(max_lag=1, groups_per_step=1)
    tickets = [Ticket(0, 0, finished=False), Ticket(2, 1, finished=True)]
    assert schedule.select_batch(tickets, 1) is None
    tickets[0] = Ticket(0, 0, finished=True)
    assert schedule.select_batch(tickets, 1) == [0]


def test_overdue_group_is_an_error():
    schedule = PipelineSchedule(max_lag=2, groups_per_step=1)
    with pytest.raises(RuntimeError, match="lag bound broken: group 7"):
        schedule.select_batch([Ticket(7, 0, finished=True)], 3)


@pytest.mark.parametrize("k", [0, 1, 2, 8])
def test_random_pipeline_run_respects_lag_and_never_deadlocks(k):
    """Random admissions, finish orders and trainer progress under the two rules."""
    rng = np.random.default_rng(k)
    size = 3
    schedule = PipelineSchedule(max_lag=k, groups_per_step=size)
    capacity = default_capacity(schedule)
    open_tickets: dict[int, Ticket] = {}
    generator_version, next_batch, next_id, consumed = 0, 0, 0, 0
    lags = []
    for _ in range(3000):
        action = rng.integers(0, 4)
        if (
            action == 0
            and len(open_tickets) < capacity
            and schedule.admission_allowed(
                num_unconsumed=len(open_tickets), generator_version=generator_version, next_batch_version=next_batch
            )
        ):
            open_tickets[next_id] = Ticket(next_id, generator_version, False)
            next_id += 1
        elif action == 1:
            running = [t for t in open_tickets.values() if not t.finished]
            if running:
                pick = running[rng.integers(len(running))]
                open_tickets[pick.group_id] = Ticket(pick.group_id, pick.admit_version, True)
        elif action == 2:
            chosen = schedule.select_batch(list(open_tickets.values()), next_batch)
            if chosen is not None:
                lags.extend(next_batch - open_tickets.pop(i).admit_version for i in chosen)
                consumed += len(chosen)
                next_batch += 1
        elif generator_version < next_batch:
            generator_version += 1  # the generator adopts a pushed version
        # Liveness: if everything open were finished, a batch (or an admission) must be possible.
        everything = [Ticket(t.group_id, t.admit_version, True) for t in open_tickets.values()]
        if len(everything) >= size:
            assert schedule.select_batch(everything, next_batch) is not None
    assert consumed > 100
    assert max(lags) <= k and min(lags) >= 0
    if k > 0:
        assert max(lags) == k  # the bound is reached, not just respected


def test_ppo_off_policy_phases():
    k, size = 3, 2
    schedule = PPOOffPolicySchedule(max_lag=k, groups_per_step=size)
    assert schedule.admission_allowed(num_unconsumed=5, generator_version=0, next_batch_version=0)
    assert not schedule.admission_allowed(num_unconsumed=6, generator_version=0, next_batch_version=0)
    tickets = [Ticket(i, 0, finished=i != 4) for i in range(6)]
    assert schedule.select_batch(tickets, 0) is None  # the phase is not complete
    tickets[4] = Ticket(4, 0, True)
    assert schedule.select_batch(tickets, 0) == [0, 1]
    assert schedule.select_batch(tickets[2:], 1) == [2, 3]
    # mid-phase: no admission, even with the generator caught up
    assert not schedule.admission_allowed(num_unconsumed=2, generator_version=2, next_batch_version=2)
    # next phase starts at version 3, once the generator holds version 3
    assert not schedule.admission_allowed(num_unconsumed=0, generator_version=2, next_batch_version=3)
    assert schedule.admission_allowed(num_unconsumed=0, generator_version=3, next_batch_version=3)
    assert [schedule.should_push(v) for v in range(1, 7)] == [False, False, True, False, False, True]


def test_make_schedule_rejects_unknown_kind():
    with pytest.raises(ValueError, match="schedule kind 'async'"):
        make_schedule("async", k=1, groups_per_step=1)
    with pytest.raises(ValueError, match="max_lag"):
        make_schedule("ppo_off_policy", k=0, groups_per_step=1)
