"""Version bookkeeping and admission control: which groups may be generated, which trained, when.

Versions. The trainer's params version t is the number of updates applied; the update that
consumes batch number t runs on params version t and produces version t + 1. A group (a prompt
with its n completions) is *admitted* while the generator holds params version v; its first
token is produced under a version >= v (the generator only ever moves forward). Its lag when
consumed by the batch at trainer version t is `t - first_token_version <= t - v`.

PipelineRL-k (`PipelineSchedule`). A group admitted at version v must be consumed at a trainer
version <= v + k: its *deadline* is `d = v + k`. Let t be the version of the next batch to be
taken, G the groups per batch, and N(<=d) the number of admitted, not yet consumed groups with
deadline <= d. A consumption schedule meeting every deadline exists iff (the EDF condition,
each step taking exactly G groups)

    N(<=d) <= (d - t + 1) * G      for every d >= t,   and no deadline is < t.

* Admission (generator back-pressure). A new group gets the largest deadline so far, v + k
  (admission versions never decrease), so it only changes N(<=d) for d >= v + k, where
  N(<=d) = all unconsumed groups. Admit iff  `unconsumed + 1 <= (v + k - t + 1) * G`
  (and the buffer capacity allows it).
* Selection (the trainer waits). Take the G finished groups of earliest deadline (ties by
  admission order); the batch is feasible iff afterwards, for every d >= t + 1,
  `N(<=d) - taken(<=d) <= (d - t) * G`, i.e. the EDF condition holds for the next step (which
  also forces every group with deadline t into this batch). Otherwise some group with an early
  deadline is still being generated: the trainer waits for it. Taking the earliest deadlines
  first is optimal (an exchange argument), so if any feasible batch of finished groups exists
  this one is. Admission keeps the condition true, each feasible take keeps it true, so the
  trainer never waits forever and no group is ever trained with lag > k or dropped.

PPO-off-policy-k (`PPOOffPolicySchedule`). Phases of k updates: at a phase start
(t - t0 = 0 mod k) the generator, once it holds version t, generates k*G groups with frozen
params; the trainer waits until all k*G are finished, then takes them G at a time in admission
order for k updates (lags 0..k-1); the generator idles until it holds version t + k.

Both schedules are pure bookkeeping (no threads, no clocks), shared by the threaded pipeline
(`queue.GroupBuffer`) and the discrete-event simulator (`sim.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class Ticket:
    """An admitted, not yet consumed group: its id (admission order), admission version, state."""

    group_id: int
    admit_version: int
    finished: bool


class Schedule(Protocol):
    """What the group buffer asks a schedule (see the module docstring)."""

    # Read-only, so that frozen dataclasses satisfy the protocol.
    @property
    def groups_per_step(self) -> int: ...

    @property
    def max_lag(self) -> int: ...

    def admission_allowed(self, *, num_unconsumed: int, generator_version: int, next_batch_version: int) -> bool:
        """May one more group be admitted now?"""
        ...

    def select_batch(self, tickets: Sequence[Ticket], next_batch_version: int) -> list[int] | None:
        """Group ids of the next batch (exactly `groups_per_step`), or None: wait."""
        ...

    def should_push(self, new_version: int) -> bool:
        """Must params `new_version` be pushed to the generator?"""
        ...

    def min_capacity(self) -> int:
        """Smallest buffer capacity (in groups) with which the schedule cannot deadlock."""
        ...


def _check_positive(name: str, value: int, minimum: int) -> None:
    if int(value) != value or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """PipelineRL-k: lag <= k for every consumed completion, by back-pressure on both sides."""

    max_lag: int
    groups_per_step: int

    def __post_init__(self) -> None:
        _check_positive("PipelineSchedule.max_lag", self.max_lag, 0)
        _check_positive("PipelineSchedule.groups_per_step", self.groups_per_step, 1)

    def admission_allowed(self, *, num_unconsumed: int, generator_version: int, next_batch_version: int) -> bool:
        """`unconsumed + 1 <= (v + k - t + 1) * G` (module docstring)."""
        horizon = generator_version + self.max_lag - next_batch_version + 1
        return num_unconsumed + 1 <= horizon * self.groups_per_step

    def select_batch(self, tickets: Sequence[Ticket], next_batch_version: int) -> list[int] | None:
        """Earliest-deadline finished groups if the EDF condition then holds, else None."""
        size, t = self.groups_per_step, next_batch_version
        deadlines = {}
        for ticket in tickets:
            deadline = ticket.admit_version + self.max_lag
            if deadline < t:
                raise RuntimeError(
                    f"lag bound broken: group {ticket.group_id} admitted at version "
                    f"{ticket.admit_version} is still unconsumed at trainer version {t} "
                    f"(max_lag={self.max_lag}); admission control was bypassed"
                )
            deadlines[ticket.group_id] = deadline
        finished = sorted((deadlines[x.group_id], x.group_id) for x in tickets if x.finished)
        if len(finished) < size:
            return None
        taken = finished[:size]
        taken_ids = {gid for _, gid in taken}
        # Remaining groups per deadline after the take, checked cumulatively in deadline order.
        remaining_by_deadline: dict[int, int] = {}
        for gid, deadline in deadlines.items():
            if gid not in taken_ids:
                remaining_by_deadline[deadline] = remaining_by_deadline.get(deadline, 0) + 1
        cumulative = 0
        for deadline in sorted(remaining_by_deadline):
            cumulative += remaining_by_deadline[deadline]
            if cumulative > (deadline - t) * size:
                return None
        return [gid for _, gid in taken]

    def should_push(self, new_version: int) -> bool:
        """Every new version goes to the generator at once."""
        return True

    def min_capacity(self) -> int:
        """One batch: with fewer admitted groups no batch can ever form."""
        return self.groups_per_step


@dataclasses.dataclass(frozen=True)
class PPOOffPolicySchedule:
    """PPO-off-policy-k: k*G groups on frozen params, then k updates of G groups; no overlap."""

    max_lag: int  # k, the number of updates per generation phase
    groups_per_step: int
    first_version: int = 0  # trainer version at which the first phase starts (resume)

    def __post_init__(self) -> None:
        _check_positive("PPOOffPolicySchedule.max_lag (k)", self.max_lag, 1)
        _check_positive("PPOOffPolicySchedule.groups_per_step", self.groups_per_step, 1)

    @property
    def groups_per_phase(self) -> int:
        return self.max_lag * self.groups_per_step

    def is_phase_start(self, version: int) -> bool:
        return (version - self.first_version) % self.max_lag == 0

    def admission_allowed(self, *, num_unconsumed: int, generator_version: int, next_batch_version: int) -> bool:
        """At a phase start, with the generator on the trainer's version, up to k*G groups."""
        return (
            self.is_phase_start(next_batch_version)
            and generator_version == next_batch_version
            and num_unconsumed + 1 <= self.groups_per_phase
        )

    def select_batch(self, tickets: Sequence[Ticket], next_batch_version: int) -> list[int] | None:
        """First batch of a phase once all k*G groups are finished; later ones right away."""
        if self.is_phase_start(next_batch_version):
            if len(tickets) < self.groups_per_phase or not all(x.finished for x in tickets):
                return None
        versions = {x.admit_version for x in tickets}
        if len(versions) > 1:
            raise RuntimeError(
                f"PPO-off-policy phase mixes admission versions {sorted(versions)}; admission control was bypassed"
            )
        ordered = sorted(x.group_id for x in tickets if x.finished)
        if len(ordered) < self.groups_per_step:
            return None
        return ordered[: self.groups_per_step]

    def should_push(self, new_version: int) -> bool:
        """Only the version that starts the next phase is needed by the generator."""
        return self.is_phase_start(new_version)

    def min_capacity(self) -> int:
        """A whole phase must fit."""
        return self.groups_per_phase


SCHEDULES = ("pipeline", "ppo_off_policy")  # the kinds `make_schedule` builds (config key `schedule.kind`)


def make_schedule(kind: str, *, k: int, groups_per_step: int, first_version: int = 0) -> Schedule:
    """'pipeline' -> PipelineRL-k, 'ppo_off_policy' -> PPO-off-policy-k."""
    if kind == "pipeline":
        return PipelineSchedule(max_lag=k, groups_per_step=groups_per_step)
    if kind == "ppo_off_policy":
        return PPOOffPolicySchedule(max_lag=k, groups_per_step=groups_per_step, first_version=first_version)
    raise ValueError(f"schedule kind {kind!r}: expected 'pipeline' or 'ppo_off_policy'")


def default_capacity(schedule: Schedule) -> int:
    """Capacity that never limits the schedule: (k+1)*G (pipeline) or k*G (PPO)."""
    if isinstance(schedule, PipelineSchedule):
        return (schedule.max_lag + 1) * schedule.groups_per_step
    return schedule.min_capacity()
