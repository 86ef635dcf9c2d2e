"""Batch assembly from graded groups, with zero-variance filtering.

A group is one prompt's ``G`` completions with their rewards. A prompt whose rewards are all
equal has zero advantage everywhere and carries no policy-gradient signal. Modes
(``filter_mode``):

- ``'drop'`` (ScaleRL): the batch is the next ``prompts_per_batch`` groups; zero-variance groups
  stay in it with ``sample_valid = False`` (they leave the loss); the batch is not refilled.
- ``'refill'`` (DAPO dynamic sampling): zero-variance groups are discarded on arrival and the
  batch waits for more groups until it holds ``prompts_per_batch`` groups with variance.
- ``'none'``: every group is kept and valid.

Either way the number of zero-variance prompts filtered out of the batch is reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from scalerl_jax.rl import zero_variance_mask

FILTER_MODES = ("drop", "refill", "none")


def zero_variance_filter(
    rewards: np.ndarray, group_ids: np.ndarray, valid: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """``(keep, num_dropped_prompts)`` from ``scalerl_jax.rl.zero_variance_mask``.

    ``keep[b]`` is True where ``b``'s prompt has unequal rewards among its valid completions;
    ``num_dropped_prompts`` counts prompts with at least one valid completion and none kept.
    """
    rewards = np.asarray(rewards, np.float32)
    group_ids = np.asarray(group_ids, np.int32)
    valid_rows = np.ones(rewards.shape, bool) if valid is None else np.asarray(valid, bool)
    keep = np.asarray(zero_variance_mask(rewards, group_ids, valid=valid_rows))
    present = set(group_ids[valid_rows].tolist())
    kept = set(group_ids[keep].tolist())
    return keep, len(present - kept)


@dataclasses.dataclass(frozen=True)
class Group:
    """One prompt's graded completions: ``rewards[g]`` for completion ``g``; ``payload`` is opaque
    (e.g. the sampler's completions) and handed back with the batch."""

    prompt_index: int
    rewards: np.ndarray
    payload: Any = None


@dataclasses.dataclass(frozen=True)
class AssembledBatch:
    """Groups of one train batch and the per-sample validity, flattened group by group.

    ``group_ids[i]`` is the position of sample ``i``'s group in ``groups`` (in ``[0, B)``).
    """

    groups: list[Group]
    sample_valid: np.ndarray  # bool[B]
    group_ids: np.ndarray  # int32[B]
    num_zero_variance_dropped: int
    num_groups_consumed: int

    def metrics(self) -> dict[str, float]:
        """``data/zero_variance_dropped`` and ``data/groups_consumed``."""
        return {
            "data/zero_variance_dropped": float(self.num_zero_variance_dropped),
            "data/groups_consumed": float(self.num_groups_consumed),
        }


def _flatten(groups: Sequence[Group]) -> tuple[np.ndarray, np.ndarray]:
    rewards = np.concatenate([np.asarray(g.rewards, np.float32) for g in groups])
    group_ids = np.concatenate([np.full(len(g.rewards), i, np.int32) for i, g in enumerate(groups)])
    return rewards, group_ids


class BatchAssembler:
    """Collects groups and emits batches of ``prompts_per_batch`` groups per ``filter_mode``."""

    def __init__(self, prompts_per_batch: int, *, filter_mode: str = "drop"):
        if prompts_per_batch < 1:
            raise ValueError(f"prompts_per_batch must be >= 1, got {prompts_per_batch}")
        if filter_mode not in FILTER_MODES:
            raise ValueError(f"filter_mode must be one of {FILTER_MODES}, got {filter_mode!r}")
        self._size = prompts_per_batch
        self._mode = filter_mode
        self._groups: list[Group] = []
        self._discarded = 0

    @property
    def num_groups(self) -> int:
        """Groups held for the next batch."""
        return len(self._groups)

    def is_full(self) -> bool:
        return len(self._groups) >= self._size

    def add(self, group: Group) -> None:
        """Adds a group (in ``'refill'`` mode a zero-variance group is counted and discarded)."""
        if len(group.rewards) < 1:
            raise ValueError(f"group of prompt {group.prompt_index} has no completions")
        if self._mode == "refill":
            rewards = np.asarray(group.rewards, np.float32)
            keep, _ = zero_variance_filter(rewards, np.zeros(len(rewards), np.int32))
            if not keep.any():
                self._discarded += 1
                return
        self._groups.append(group)

    def pop_batch(self) -> AssembledBatch:
        """The next batch (the first ``prompts_per_batch`` groups held); ValueError if not full."""
        if not self.is_full():
            raise ValueError(f"pop_batch: {len(self._groups)} of {self._size} groups collected")
        groups, self._groups = self._groups[: self._size], self._groups[self._size :]
        rewards, group_ids = _flatten(groups)
        if self._mode == "drop":
            sample_valid, dropped = zero_variance_filter(rewards, group_ids)
        else:
            sample_valid, dropped = np.ones(len(rewards), bool), self._discarded
        consumed = len(groups) + (self._discarded if self._mode == "refill" else 0)
        self._discarded = 0
        return AssembledBatch(
            groups=groups,
            sample_valid=sample_valid,
            group_ids=group_ids,
            num_zero_variance_dropped=dropped,
            num_groups_consumed=consumed,
        )
