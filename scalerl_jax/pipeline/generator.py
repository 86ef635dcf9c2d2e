"""The generator side of the pipeline: one loop that keeps a sampler's decode slots busy, and the
link through which it asks the group buffer for work and hands back finished completions.

`GeneratorLoop.run()` is the same code for a generator thread in the trainer's process and for a
generator process of a multi-host run; only the `GeneratorLink` differs. While the pending
requests do not cover the free slots (plus `admission_slack`) it asks the link to admit a prompt
at the sampler's current params version and queues the prompt's n requests; it runs one sampler
chunk at a time and hands every prompt whose n completions are back to `link.finish`. With
nothing to run and admission refused it waits on the link (back-pressure), first adopting any
params pushed meanwhile.

`LocalLink` is the link over the group buffer itself: admission, the prompt draw, the seed index
and scoring happen under one lock, so several generators (threads serving remote processes and a
local one) may share it. Request seeds depend on (run seed, admission version, index of the group
among those admitted at that version, sample): the index is counted here, once for all
generators, so no two generators sample with the same stream.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from scalerl_jax.pipeline.group import Group, Prompt
from scalerl_jax.pipeline.queue import GroupBuffer
from scalerl_jax.sampler.batcher import Request


@dataclasses.dataclass(frozen=True)
class Admission:
    """A prompt admitted at `version`: its group id, and its index among that version's groups."""

    group_id: int
    prompt: Prompt
    version: int
    index: int


@dataclasses.dataclass(frozen=True)
class GeneratorStats:
    """Cumulative generator-side counters."""

    chunks: int = 0
    busy_s: float = 0.0  # time inside sampler chunks, summed over generators
    generated_tokens: int = 0  # of finished groups
    completions: int = 0  # of finished groups
    groups_finished: int = 0
    groups_discarded: int = 0  # zero-variance groups dropped on arrival ('refill')
    score_s: float = 0.0  # time inside reward_fn


class GeneratorCounters:
    """Lock-guarded `GeneratorStats`, added to by generators and read by the trainer."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stats = GeneratorStats()

    def add(self, **increments: float) -> None:
        with self._lock:
            self._stats = dataclasses.replace(self._stats, **{
                name: getattr(self._stats, name) + value for name, value in increments.items()})

    def snapshot(self) -> GeneratorStats:
        with self._lock:
            return self._stats


class GeneratorLink(Protocol):
    """What a generator loop needs from the side that owns the group buffer."""

    def admit(self, version: int) -> Admission | None:
        """Admit one prompt generated from `version`, or None when the schedule refuses."""

    def finish(self, admission: Admission, completions: Sequence[Any]) -> None:
        """Hand over the n completions of an admitted prompt (in sample order)."""

    def epoch(self) -> int:
        """Counter bumped by every params push (see `GroupBuffer.epoch`)."""

    def wait_admissible(self, version: int, *, epoch: int, timeout: float) -> bool:
        """Block an idle generator until admission is possible, a push happened, or `timeout`."""


def request_seed(base_seed: int, admit_version: int, index: int, sample: int) -> int:
    """A request's sampler stream in [0, 2**32), from (run seed, admission version, index of the
    group among those admitted at that version, sample): distinct per request, and the same
    after a resume at a PPO phase boundary (group ids restart, these do not)."""
    state = np.random.SeedSequence([base_seed, admit_version, index, sample]).generate_state(1)
    return int(state[0])


class LocalLink:
    """`GeneratorLink` over the group buffer, the prompt source and the reward function.

    `finish` scores the completions (`reward_fn(prompt, completions) -> n rewards`) and puts the
    group in the buffer, or discards it when `zero_variance == 'refill'` and all rewards are equal.
    Thread safe: admission with its prompt draw, and scoring, each run under a lock. Tokens and
    completions are counted here, when their group is finished, whichever generator made them.
    """

    def __init__(self, buffer: GroupBuffer, *, prompt_source: Callable[[], Prompt],
                 reward_fn: Callable[[Prompt, Sequence[Any]], Sequence[float]], samples_per_prompt: int,
                 zero_variance: str, counters: GeneratorCounters, clock: Callable[[], float] = time.monotonic):
        self.buffer = buffer
        self._prompt_source, self._reward_fn = prompt_source, reward_fn
        self._samples, self._zero_variance = samples_per_prompt, zero_variance
        self._counters, self._clock = counters, clock
        self._admit_lock, self._score_lock = threading.Lock(), threading.Lock()
        self._admitted_at: collections.Counter = collections.Counter()  # groups admitted per version

    def admit(self, version: int) -> Admission | None:
        with self._admit_lock:
            group_id = self.buffer.try_admit(version)
            if group_id is None:
                return None
            index = self._admitted_at[version]
            self._admitted_at[version] += 1
            return Admission(group_id, self._prompt_source(), version, index)

    def finish(self, admission: Admission, completions: Sequence[Any]) -> None:
        start = self._clock()
        with self._score_lock:
            rewards = np.asarray(self._reward_fn(admission.prompt, completions), np.float32)
        score_s = self._clock() - start
        if rewards.shape != (self._samples,):
            raise ValueError(f"reward_fn returned shape {rewards.shape} for group {admission.group_id}; "
                             f"expected ({self._samples},)")
        group = Group(group_id=admission.group_id, prompt=admission.prompt, admit_version=admission.version,
                      completions=completions, rewards=rewards)
        early = [v for v in group.first_versions if v < group.admit_version]
        if early:
            raise RuntimeError(f"group {admission.group_id}: first token version {min(early)} is older than "
                               f"its admission version {group.admit_version}")
        produced = dict(generated_tokens=sum(len(c.tokens) for c in completions), completions=len(completions),
                        score_s=score_s)
        if self._zero_variance == "refill" and np.all(rewards == rewards[0]):
            self.buffer.discard(admission.group_id)
            self._counters.add(groups_discarded=1, **produced)
            return
        self.buffer.put(admission.group_id, group)
        self._counters.add(groups_finished=1, **produced)

    def record_generator_time(self, chunks: int, busy_s: float) -> None:
        """Chunks run and seconds spent in them by a generator of another process."""
        self._counters.add(chunks=chunks, busy_s=busy_s)

    def epoch(self) -> int:
        return self.buffer.epoch

    def wait_admissible(self, version: int, *, epoch: int, timeout: float) -> bool:
        return self.buffer.wait_admissible(version, epoch=epoch, timeout=timeout)


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """What every request of the run shares: budget, temperature, stops, interruption, n, seed."""

    max_new_tokens: int
    samples_per_prompt: int
    temperature: float
    stop_tokens: tuple[int, ...]
    interrupt: bool
    seed: int
    admission_slack: int
    poll_s: float


class GeneratorLoop:
    """Keeps `batcher`'s slots busy with prompts admitted through `link` (module docstring).

    `run(stop)` returns when `stop` is set; it raises whatever the link raises (e.g.
    `PipelineStopped` when the buffer closes, or a lost peer). `counters` receives the chunks run
    and the seconds spent in them.
    """

    def __init__(self, batcher: Any, link: GeneratorLink, settings: SamplingSettings,
                 counters: GeneratorCounters, clock: Callable[[], float] = time.monotonic):
        self.batcher, self.link, self.settings = batcher, link, settings
        self._counters, self._clock = counters, clock

    def _requests(self, admission: Admission) -> list[Request]:
        s = self.settings
        return [Request(request_id=(admission.group_id, sample), prompt_tokens=admission.prompt.tokens,
                        max_new_tokens=s.max_new_tokens,
                        seed=request_seed(s.seed, admission.version, admission.index, sample),
                        temperature=s.temperature, stop_tokens=s.stop_tokens, interrupt=s.interrupt)
                for sample in range(s.samples_per_prompt)]

    def run(self, stop: threading.Event) -> None:
        batcher, s = self.batcher, self.settings
        assembling: dict[int, tuple[Admission, dict[int, Any]]] = {}
        while not stop.is_set():
            version = batcher.version
            while batcher.num_pending < batcher.num_free_slots + s.admission_slack:
                admission = self.link.admit(version)
                if admission is None:
                    break
                assembling[admission.group_id] = (admission, {})
                for request in self._requests(admission):
                    batcher.add_request(request)
            if batcher.idle:
                epoch = self.link.epoch()
                batcher.run_chunk()  # nothing to decode: only adopts params pushed meanwhile
                if batcher.version == version:
                    self.link.wait_admissible(version, epoch=epoch, timeout=s.poll_s)
                continue
            start = self._clock()
            completions = batcher.run_chunk()
            self._counters.add(chunks=1, busy_s=self._clock() - start)
            for completion in completions:
                group_id, sample = completion.request_id
                admission, done = assembling[group_id]
                done[sample] = completion
                if len(done) == s.samples_per_prompt:
                    del assembling[group_id]
                    self.link.finish(admission, [done[i] for i in range(s.samples_per_prompt)])
