"""The thread-safe group buffer (pipeline/queue.py): accounting, wake-ups, clean stop."""

import threading
import time

import pytest

from scalerl_jax.pipeline.lag import PipelineSchedule, PPOOffPolicySchedule
from scalerl_jax.pipeline.queue import GroupBuffer, PipelineStopped


def test_accounting_and_fifo_within_a_version():
    buffer = GroupBuffer(PipelineSchedule(max_lag=1, groups_per_step=2), capacity=4)
    ids = [buffer.try_admit(0) for _ in range(5)]
    assert ids == [0, 1, 2, 3, None]  # (0 + 1 - 0 + 1) * 2 = 4 open groups at most
    for group_id in (3, 1, 0):
        buffer.put(group_id, f"group{group_id}")
    buffer.discard(2)
    counts = buffer.counts()
    assert (counts.admitted, counts.queued, counts.in_flight, counts.discarded) == (4, 3, 0, 1)
    version, groups = buffer.take_batch(timeout=1)
    assert (version, groups) == (0, ["group0", "group1"])  # equal deadlines: admission order
    assert buffer.queued_group_ids() == [3]
    counts = buffer.counts()
    assert counts.admitted == counts.consumed + counts.discarded + counts.queued + counts.in_flight
    with pytest.raises(RuntimeError, match="group 3 was not admitted or was put twice"):
        buffer.put(3, "again")


def test_put_wakes_a_waiting_trainer():
    buffer = GroupBuffer(PipelineSchedule(max_lag=0, groups_per_step=1), capacity=1)
    group_id = buffer.try_admit(0)
    assert group_id is not None
    got = {}
    trainer = threading.Thread(target=lambda: got.update(batch=buffer.take_batch(timeout=10)))
    trainer.start()
    deadline = time.monotonic() + 10
    while buffer.trainer_waiting_for() != 0:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    buffer.put(group_id, "g")
    trainer.join(10)
    assert got["batch"] == (0, ["g"])
    assert buffer.waits().trainer_waits == 1


def test_close_wakes_every_waiter_with_pipeline_stopped():
    buffer = GroupBuffer(PipelineSchedule(max_lag=0, groups_per_step=1), capacity=1)
    buffer.try_admit(0)  # full: the generator waits, and the trainer has nothing finished
    errors = []

    def call(fn):
        try:
            fn()
        except PipelineStopped:
            errors.append(fn)

    waiters = [
        threading.Thread(target=call, args=(lambda: buffer.take_batch(),)),
        threading.Thread(target=call, args=(lambda: buffer.wait_admissible(0, epoch=buffer.epoch, timeout=30),)),
    ]
    for waiter in waiters:
        waiter.start()
    deadline = time.monotonic() + 10
    while buffer.trainer_waiting_for() is None or buffer.generator_blocked() != "full":
        assert time.monotonic() < deadline
        time.sleep(0.001)
    start = time.monotonic()
    buffer.close()
    for waiter in waiters:
        waiter.join(10)
    assert time.monotonic() - start < 10 and len(errors) == 2  # not the 30 s timeouts
    with pytest.raises(PipelineStopped):
        buffer.try_admit(0)


def test_notify_cancels_a_generator_wait_that_missed_a_push():
    buffer = GroupBuffer(PPOOffPolicySchedule(max_lag=1, groups_per_step=1), capacity=1)
    epoch = buffer.epoch
    buffer.notify()  # a push happened after the generator read the epoch
    start = time.monotonic()
    assert buffer.wait_admissible(5, epoch=epoch, timeout=30) is False  # returns at once
    assert time.monotonic() - start < 10  # not the 30 s timeout


def test_capacity_below_schedule_minimum():
    with pytest.raises(ValueError, match="capacity=3 groups is below the schedule's minimum 4"):
        GroupBuffer(PPOOffPolicySchedule(max_lag=2, groups_per_step=2), capacity=3)
