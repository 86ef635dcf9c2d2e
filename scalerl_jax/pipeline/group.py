"""What flows through the pipeline: a prompt, and a group (a prompt with its n scored completions)."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A prompt handed out by the prompt source.

    `key` identifies it to the data side (e.g. the pool's prompt index); `tokens` are the encoded
    prompt; `answer` is whatever the reward function needs (e.g. the gold answer).
    """

    key: Hashable
    tokens: tuple[int, ...]
    answer: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        if not self.tokens:
            raise ValueError(f"Prompt {self.key!r}: tokens is empty")


@dataclasses.dataclass(frozen=True)
class Group:
    """A prompt's n finished completions (sampler `Completion`s, in sample order) and rewards.

    `admit_version` is the generator's params version when the prompt was admitted; every
    completion's first token was produced by a version >= it.
    """

    group_id: int
    prompt: Prompt
    admit_version: int
    completions: Sequence[Any]  # any sequence in; stored as a tuple
    rewards: np.ndarray  # float32[n]

    def __post_init__(self) -> None:
        rewards = np.asarray(self.rewards, np.float32).reshape(-1)
        if rewards.shape[0] != len(self.completions):
            raise ValueError(
                f"group {self.group_id}: {rewards.shape[0]} rewards for {len(self.completions)} completions"
            )
        if not np.all(np.isfinite(rewards)):
            raise ValueError(f"group {self.group_id}: non-finite reward {rewards.tolist()}")
        object.__setattr__(self, "rewards", rewards)
        object.__setattr__(self, "completions", tuple(self.completions))

    @property
    def first_versions(self) -> list[int]:
        """Version of each completion's first generated token (admission version if empty)."""
        return [c.versions[0] if c.versions else self.admit_version for c in self.completions]

    @property
    def last_versions(self) -> list[int]:
        """Version of each completion's last generated token (admission version if empty)."""
        return [c.versions[-1] if c.versions else self.admit_version for c in self.completions]

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)


def lags(groups: Sequence[Group], trainer_version: int) -> np.ndarray:
    """int[total completions]: trainer version - first-token version, per completion."""
    firsts = [v for g in groups for v in g.first_versions]
    return trainer_version - np.asarray(firsts, np.int64)
