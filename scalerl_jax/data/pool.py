"""Prompt pool: seeded epochs over the training prompts with No-Positive-Resampling.

Each epoch visits every active prompt once, in the order ``default_rng([seed, epoch])``
permutes them. Every graded group is recorded as ``(prompt, num_correct, num_samples)``; the full
log is kept, and a prompt's historical pass rate is ``sum(correct) / sum(samples)`` over all its
records. No-Positive-Resampling (ScaleRL): a prompt whose pass rate is ``>= npr_threshold`` is
retired and never handed out again (it leaves all later epochs). When no active prompt is left
the pool raises ``PoolExhaustedError`` instead of looping on nothing.

The state is a plain dict of ints and lists of ints (JSON-able, checkpointable), and restoring
it reproduces the pool exactly, including the rest of the current epoch's order. One lock
guards every method, so a generator thread may draw prompts while a trainer thread records.
"""

from __future__ import annotations

import threading

import numpy as np

STATE_VERSION = 1


class PoolExhaustedError(RuntimeError):
    """Raised when every prompt of the pool has been retired."""


class PromptPool:
    """Hands out prompt indices in ``[0, num_prompts)`` and tracks their pass rates."""

    def __init__(self, num_prompts: int, *, seed: int, npr_threshold: float | None = 0.9):
        """
        Args:
          num_prompts: size of the training prompt set.
          seed: seeds every epoch's order.
          npr_threshold: retire prompts whose pass rate is ``>=`` this; None disables retiring.
        """
        if num_prompts < 1:
            raise ValueError(f"PromptPool.num_prompts must be >= 1, got {num_prompts}")
        if npr_threshold is not None and not 0.0 < npr_threshold <= 1.0:
            raise ValueError(f"PromptPool.npr_threshold must be in (0, 1] or None, got {npr_threshold}")
        self._num_prompts = num_prompts
        self._seed = seed
        self._threshold = npr_threshold
        self._epoch = -1
        self._order: list[int] = []
        self._position = 0
        self._log_prompt: list[int] = []
        self._log_correct: list[int] = []
        self._log_samples: list[int] = []
        self._correct = np.zeros(num_prompts, np.int64)
        self._samples = np.zeros(num_prompts, np.int64)
        self._retired = np.zeros(num_prompts, bool)
        self._lock = threading.RLock()

    @property
    def num_prompts(self) -> int:
        return self._num_prompts

    @property
    def epoch(self) -> int:
        """Index of the current epoch (-1 before the first prompt is handed out)."""
        return self._epoch

    @property
    def num_remaining(self) -> int:
        """Prompts not retired by No-Positive-Resampling."""
        return int(self._num_prompts - self._retired.sum())

    @property
    def num_retired(self) -> int:
        return int(self._retired.sum())

    def pass_rate(self, prompt: int) -> float | None:
        """Historical pass rate of ``prompt`` over all its records (None if never graded)."""
        with self._lock:
            self._check_prompt(prompt)
            if self._samples[prompt] == 0:
                return None
            return float(self._correct[prompt] / self._samples[prompt])

    def history(self, prompt: int) -> list[tuple[int, int]]:
        """Every ``(num_correct, num_samples)`` record of ``prompt``, oldest first."""
        with self._lock:
            self._check_prompt(prompt)
            records = zip(self._log_prompt, self._log_correct, self._log_samples)
            return [(c, n) for p, c, n in records if p == prompt]

    def _check_prompt(self, prompt: int) -> None:
        if not 0 <= prompt < self._num_prompts:
            raise ValueError(f"prompt index {prompt} is outside [0, {self._num_prompts})")

    def _start_epoch(self) -> None:
        active = np.flatnonzero(~self._retired)
        if active.size == 0:
            raise PoolExhaustedError(
                f"prompt pool ran dry: all {self._num_prompts} prompts reached a pass rate >= "
                f"{self._threshold} (No-Positive-Resampling) after epoch {self._epoch}; add "
                "prompts, raise npr_threshold or disable it"
            )
        self._epoch += 1
        rng = np.random.default_rng([self._seed, self._epoch])
        self._order = active[rng.permutation(active.size)].tolist()
        self._position = 0

    def next_prompts(self, count: int) -> list[int]:
        """The next ``count`` prompt indices; crosses into new epochs as needed.

        Retired prompts still in the current order are skipped. A prompt can repeat within one
        call only if fewer than ``count`` prompts remain active.
        """
        with self._lock:
            if count < 1:
                raise ValueError(f"next_prompts: count must be >= 1, got {count}")
            prompts = []
            while len(prompts) < count:
                if self._position >= len(self._order):
                    self._start_epoch()
                prompt = self._order[self._position]
                self._position += 1
                if not self._retired[prompt]:
                    prompts.append(prompt)
            return prompts

    def record(self, prompt: int, num_correct: int, num_samples: int) -> None:
        """Adds a graded group of ``prompt``; retires it if its pass rate reaches the threshold."""
        with self._lock:
            self._check_prompt(prompt)
            if num_samples < 1 or not 0 <= num_correct <= num_samples:
                raise ValueError(
                    f"record(prompt {prompt}): need 0 <= num_correct ({num_correct})"
                    f" <= num_samples ({num_samples}) and num_samples >= 1"
                )
            self._log_prompt.append(int(prompt))
            self._log_correct.append(int(num_correct))
            self._log_samples.append(int(num_samples))
            self._correct[prompt] += num_correct
            self._samples[prompt] += num_samples
            self._update_retired(prompt)

    def _update_retired(self, prompt: int) -> None:
        if self._threshold is not None:
            rate = self._correct[prompt] / self._samples[prompt]
            self._retired[prompt] = rate >= self._threshold

    def metrics(self) -> dict[str, float]:
        """``data/pool_remaining``, ``data/pool_retired``, ``data/pool_epoch``."""
        with self._lock:
            return {
                "data/pool_remaining": float(self.num_remaining),
                "data/pool_retired": float(self.num_retired),
                "data/pool_epoch": float(self._epoch),
            }

    def state_dict(self) -> dict:
        """The whole pool as a plain dict of ints and lists of ints (copies, JSON-able)."""
        with self._lock:
            return {
                "version": STATE_VERSION,
                "num_prompts": self._num_prompts,
                "seed": self._seed,
                "epoch": self._epoch,
                "order": list(self._order),
                "position": self._position,
                "log_prompt": list(self._log_prompt),
                "log_correct": list(self._log_correct),
                "log_samples": list(self._log_samples),
            }

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()`` output (ValueError naming a missing or mismatched key)."""
        with self._lock:
            expected = self.state_dict().keys()
            missing = [key for key in expected if key not in state]
            if missing:
                raise ValueError(f"PromptPool state is missing keys {missing}")
            if state["version"] != STATE_VERSION:
                raise ValueError(f"PromptPool state version {state['version']} != {STATE_VERSION}")
            for key in ("num_prompts", "seed"):
                if int(state[key]) != getattr(self, f"_{key}"):
                    raise ValueError(
                        f"PromptPool state {key}={state[key]} does not match this pool's {getattr(self, f'_{key}')}"
                    )
            lengths = {len(state[k]) for k in ("log_prompt", "log_correct", "log_samples")}
            if len(lengths) != 1:
                raise ValueError("PromptPool state log_prompt/log_correct/log_samples differ in length")
            for prompt in set(state["log_prompt"]) | set(state["order"]):
                self._check_prompt(int(prompt))
            self._epoch = int(state["epoch"])
            self._order = [int(p) for p in state["order"]]
            self._position = int(state["position"])
            self._log_prompt = [int(p) for p in state["log_prompt"]]
            self._log_correct = [int(c) for c in state["log_correct"]]
            self._log_samples = [int(n) for n in state["log_samples"]]
            self._correct[:] = 0
            self._samples[:] = 0
            np.add.at(self._correct, np.asarray(self._log_prompt, np.int64), self._log_correct)
            np.add.at(self._samples, np.asarray(self._log_prompt, np.int64), self._log_samples)
            self._retired[:] = False
            for prompt in set(self._log_prompt):
                self._update_retired(prompt)
