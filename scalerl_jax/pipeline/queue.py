"""The bounded host-side hand-off between the generator and the trainer threads.

`GroupBuffer` holds every group that was admitted and not yet consumed: in flight (being
generated) or finished (queued for the trainer). Its capacity counts both, so a slot is reserved
at admission and `put` of a finished group never blocks: a generator blocked on a full buffer
simply admits nothing new while its in-flight sequences run to the end. (A buffer that counted
only finished groups could deadlock: full of young groups while the trainer waits for an old one
the blocked generator can no longer finish.) What may be admitted and what may be taken is
decided by a schedule (`lag.py`); this class adds the lock, the waiting, the accounting
(admitted = consumed + discarded + queued + in flight) and the clean stop: `close()` wakes every waiter, and
every later or pending wait raises `PipelineStopped`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from scalerl_jax.pipeline.lag import Schedule, Ticket


class PipelineStopped(Exception):
    """The buffer was closed (normal stop, signal, or a failure in the other thread)."""


@dataclasses.dataclass
class WaitTimes:
    """Seconds spent blocked and number of blocking waits, by side and reason (cumulative)."""

    trainer_waiting_for_data: float = 0.0
    generator_blocked_lag: float = 0.0  # idle generator; admission refused by the schedule
    generator_blocked_full: float = 0.0  # idle generator; the buffer is at capacity
    trainer_waits: int = 0  # take_batch calls that had to wait
    generator_lag_waits: int = 0
    generator_full_waits: int = 0


@dataclasses.dataclass(frozen=True)
class BufferCounts:
    """Accounting snapshot: admitted == consumed + discarded + queued + in_flight."""

    admitted: int
    consumed: int
    discarded: int  # finished groups dropped on arrival (e.g. zero variance in refill mode)
    queued: int
    in_flight: int
    next_batch_version: int


class GroupBuffer:
    """Thread-safe admitted-group buffer with schedule-driven admission and batch selection."""

    def __init__(
        self,
        schedule: Schedule,
        *,
        capacity: int,
        first_version: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if capacity < schedule.min_capacity():
            raise ValueError(
                f"GroupBuffer capacity={capacity} groups is below the schedule's minimum "
                f"{schedule.min_capacity()} (it could never form a batch)"
            )
        self.schedule = schedule
        self.capacity = capacity
        self._clock = clock
        self._cond = threading.Condition()
        self._tickets: dict[int, Ticket] = {}
        self._finished: dict[int, Any] = {}
        self._next_group_id = 0
        self._next_batch_version = first_version
        self._consumed = 0
        self._discarded = 0
        self._epoch = 0
        self._trainer_waiting_for: int | None = None
        self._generator_waiting_at: int | None = None  # version of a blocked, idle generator
        self._closed = False
        self._waits = WaitTimes()

    # ------------------------------------------------------------------ generator side
    def _admission_refusal(self, generator_version: int) -> str | None:
        if len(self._tickets) + 1 > self.capacity:
            return "full"
        if not self.schedule.admission_allowed(
            num_unconsumed=len(self._tickets),
            generator_version=generator_version,
            next_batch_version=self._next_batch_version,
        ):
            return "lag"
        return None

    def try_admit(self, generator_version: int) -> int | None:
        """Reserve a place for a new group generated from `generator_version`; its id or None."""
        with self._cond:
            self._raise_if_closed()
            if self._admission_refusal(generator_version) is not None:
                return None
            group_id = self._next_group_id
            self._next_group_id += 1
            self._tickets[group_id] = Ticket(group_id, generator_version, finished=False)
            return group_id

    @property
    def epoch(self) -> int:
        """Counter bumped by `notify()` (a params push); lets a waiter detect a missed wake-up."""
        with self._cond:
            return self._epoch

    def wait_admissible(self, generator_version: int, *, epoch: int, timeout: float) -> bool:
        """Block an idle generator until admission would succeed, up to `timeout` seconds.

        Returns at once if `notify()` was called since the caller read `epoch` (new params may
        change the generator's version, which the caller must adopt first). Returns whether
        admission is allowed at `generator_version`; blocked time and waits are booked by reason.
        """
        start = self._clock()
        with self._cond:
            self._raise_if_closed()
            reason = self._admission_refusal(generator_version)
            if reason is None or self._epoch != epoch:
                return reason is None
            self._generator_waiting_at = generator_version
            try:
                self._cond.wait(timeout)
            finally:
                self._generator_waiting_at = None
            blocked = self._clock() - start
            if reason == "full":
                self._waits.generator_blocked_full += blocked
                self._waits.generator_full_waits += 1
            else:
                self._waits.generator_blocked_lag += blocked
                self._waits.generator_lag_waits += 1
            self._raise_if_closed()
            return self._admission_refusal(generator_version) is None

    def put(self, group_id: int, group: Any) -> None:
        """Hand over the finished group with an admitted id (never blocks: its place is reserved)."""
        with self._cond:
            self._raise_if_closed()
            ticket = self._tickets.get(group_id)
            if ticket is None or ticket.finished:
                raise RuntimeError(f"GroupBuffer.put: group {group_id} was not admitted or was put twice")
            self._tickets[group_id] = dataclasses.replace(ticket, finished=True)
            self._finished[group_id] = group
            self._cond.notify_all()

    def discard(self, group_id: int) -> None:
        """Drop an admitted group that finished but will not be trained (counted as discarded)."""
        with self._cond:
            self._raise_if_closed()
            ticket = self._tickets.pop(group_id, None)
            if ticket is None or ticket.finished:
                raise RuntimeError(f"GroupBuffer.discard: group {group_id} is not in flight")
            self._discarded += 1
            self._cond.notify_all()

    # ------------------------------------------------------------------ trainer side
    def take_batch(
        self, timeout: float | None = None, *, stop: Callable[[], bool] | None = None
    ) -> tuple[int, list[Any]]:
        """Block until the schedule selects a batch; returns (trainer version, groups).

        The groups are consumed (removed) at once, and the version of the next batch advances,
        so the generator's admission already counts the step being trained.
        Raises `PipelineStopped` when closed or, before a batch is chosen, when `stop()` is true
        (checked under the buffer's lock at each wake-up: `wake()` after setting it), and
        `TimeoutError` after `timeout` seconds.
        """
        start = self._clock()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            waited = False
            try:
                while True:
                    self._raise_if_closed()
                    if stop is not None and stop():
                        raise PipelineStopped("stop requested")
                    chosen = self.schedule.select_batch(list(self._tickets.values()), self._next_batch_version)
                    if chosen is not None:
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"no batch for trainer version {self._next_batch_version}")
                    waited = True
                    self._trainer_waiting_for = self._next_batch_version
                    self._cond.wait(remaining)
            finally:
                self._trainer_waiting_for = None
                self._waits.trainer_waiting_for_data += self._clock() - start
                self._waits.trainer_waits += int(waited)
            version = self._next_batch_version
            groups = []
            for group_id in chosen:
                del self._tickets[group_id]
                groups.append(self._finished.pop(group_id))
            self._consumed += len(chosen)
            self._next_batch_version += 1
            self._cond.notify_all()
            return version, groups

    def notify(self) -> None:
        """Wake waiters and bump `epoch` (the trainer pushed a new params version)."""
        with self._cond:
            self._epoch += 1
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter to re-check its condition (a stop request for `take_batch`)."""
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ both
    def close(self) -> None:
        """Stop: every pending and later wait raises `PipelineStopped`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise PipelineStopped("group buffer closed")

    def counts(self) -> BufferCounts:
        """Consistent snapshot of the accounting."""
        with self._cond:
            queued = len(self._finished)
            return BufferCounts(
                admitted=self._next_group_id,
                consumed=self._consumed,
                discarded=self._discarded,
                queued=queued,
                in_flight=len(self._tickets) - queued,
                next_batch_version=self._next_batch_version,
            )

    def waits(self) -> WaitTimes:
        """Copy of the cumulative wait times and counts."""
        with self._cond:
            return dataclasses.replace(self._waits)

    def trainer_waiting_for(self) -> int | None:
        """Version of the batch the trainer is blocked on right now, or None."""
        with self._cond:
            return self._trainer_waiting_for

    def generator_blocked(self) -> str | None:
        """'lag' or 'full' while an idle generator waits and admission is still refused, else None."""
        with self._cond:
            if self._generator_waiting_at is None:
                return None
            return self._admission_refusal(self._generator_waiting_at)

    def queued_group_ids(self) -> list[int]:
        """Ids of finished groups still waiting (reported at shutdown, never as trained)."""
        with self._cond:
            return sorted(self._finished)
