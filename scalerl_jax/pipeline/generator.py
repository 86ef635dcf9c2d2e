"""The generator side of the pipeline: one loop that keeps a sampler's decode slots busy, and the
link through which it asks the group buffer for work and hands back finished completions.

`GeneratorLoop.run()` is the same code for a generator thread in the trainer's process and for a
generator process of a multi-host run; only the `GeneratorLink` differs. While the pending
requests do not cover the free slots (plus `admission_slack`) it first takes evaluation requests
(priority), then asks the link to admit prompts at the sampler's current params version and
queues each prompt's n requests; it runs one sampler chunk at a time, hands evaluation
completions back to `link.finish_evaluations` and every prompt whose n completions are back to
`link.finish`. With nothing to run and admission refused it waits on the link (back-pressure),
first adopting any params pushed meanwhile.

Evaluation, two ways. Shared (no evaluation batcher): evaluation requests go to the generator's
batcher (its engine, KV cache and params): the trainer pushes params version v, then asks for an
evaluation of v (`LocalLink.evaluate`) and waits for it, so no newer version can reach a
generator before the evaluation is back; a generator takes an evaluation request only once its
batcher decodes with version >= v, hence exactly v. Concurrent (`eval_batcher` given): the
generator's batcher retains the params of every version the run evaluates
(`ContinuousBatcher.retain_versions`), evaluation requests go to a second batcher on the same
devices, which decodes one evaluated version at a time with those retained params while the
first goes on with the newest; the trainer keeps stepping and pushing meanwhile. The loop runs one
chunk of each batcher that has work per turn. Either way `finish_evaluations` checks every
token's version against the evaluated one. Request i of an evaluation of version v samples with
stream `evaluation_seed(run seed, v, i)` and the batcher's run seed, whichever generator serves
it and whatever else its batch holds.

Streams. The sampler takes a request's stream as one 32-bit word, and a run's versions, indices
and seeds are counters that keep growing, so streams are hashed from them (`request_seed`,
`evaluation_seed`), never packed into the word by shifts or sums that overflow it; each input
must itself be one word (in [0, 2**32)), so that no two input tuples hash the same words.

`LocalLink` is the link over the group buffer itself: admission, the prompt draw and the seed
index happen under one lock, so several generators (threads serving remote processes and a local
one) may share it. Request seeds depend on (run seed, admission version, index of the group
among those admitted at that version, sample): the index is counted here, once for all
generators, so no two generators sample with the same stream. Rewards are computed off the
generators: `finish` queues the group for `run_scorer`, one scoring thread that scores groups in
the order they finished and puts them in the buffer.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Protocol, TypeGuard, cast

import numpy as np

from scalerl_jax.pipeline.group import Group, Prompt
from scalerl_jax.pipeline.queue import GroupBuffer, PipelineStopped
from scalerl_jax.sampler.batcher import Batcher, Completion, Request

# How many evaluated versions a generator's batcher retains for its evaluation batcher beyond the
# one that batcher holds: the next to evaluate. Each is a copy of the params on the generator's
# devices; one means an evaluation must be done before the version after next is pushed.
RETAINED_EVAL_VERSIONS = 1

EVAL_TAG = "eval"  # first element of an evaluation request's id: (EVAL_TAG, job, index)


@dataclasses.dataclass(frozen=True)
class Admission:
    """A prompt admitted at `version`: its group id, and its index among that version's groups."""

    group_id: int
    prompt: Prompt
    version: int
    index: int


@dataclasses.dataclass(frozen=True)
class EvalItem:
    """One evaluation request: sample `prompt` with stream `seed` on params `version` (the
    generator takes it once its batcher decodes with that version)."""

    job: int
    index: int
    prompt: tuple[int, ...]
    seed: int
    version: int

    @property
    def request_id(self) -> tuple[str, int, int]:
        return (EVAL_TAG, self.job, self.index)


def is_evaluation(request_id: Hashable) -> TypeGuard[tuple[str, int, int]]:
    """Whether a sampler request id is an evaluation request's (`EvalItem.request_id`)."""
    return isinstance(request_id, tuple) and len(request_id) == 3 and request_id[0] == EVAL_TAG


@dataclasses.dataclass(frozen=True)
class GeneratorStats:
    """Cumulative generator-side counters."""

    chunks: int = 0
    busy_s: float = 0.0  # time inside sampler chunks, summed over generators
    generated_tokens: int = 0  # of finished groups
    completions: int = 0  # of finished groups
    groups_finished: int = 0
    groups_discarded: int = 0  # zero-variance groups dropped on arrival ('refill')
    score_s: float = 0.0  # time inside reward_fn (on the scoring thread)
    prefill_tokens: int = 0  # prompt tokens prefilled (a prompt shared by its samples counts once)
    shared_prompt_pages: int = 0  # KV pages samples took from another sample of their prompt


class GeneratorCounters:
    """Lock-guarded `GeneratorStats`, added to by generators and read by the trainer."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stats = GeneratorStats()

    def add(self, **increments: float) -> None:
        with self._lock:
            self._stats = dataclasses.replace(
                self._stats, **{name: getattr(self._stats, name) + value for name, value in increments.items()}
            )

    def snapshot(self) -> GeneratorStats:
        with self._lock:
            return self._stats


class GeneratorLink(Protocol):
    """What a generator loop needs from the side that owns the group buffer."""

    def admit(self, version: int) -> Admission | None:
        """Admit one prompt generated from `version`, or None when the schedule refuses."""
        ...

    def finish(self, admission: Admission, completions: Sequence[Any]) -> None:
        """Hand over the n completions of an admitted prompt (in sample order)."""
        ...

    def take_evaluations(self, version: int, limit: int) -> list[EvalItem]:
        """Up to `limit` waiting evaluation requests of params versions <= `version` (oldest first)."""
        ...

    def finish_evaluations(self, completions: Sequence[Completion]) -> None:
        """Hand back completions of evaluation requests (request ids `EvalItem.request_id`)."""
        ...

    def epoch(self) -> int:
        """Counter bumped by every params push (see `GroupBuffer.epoch`)."""
        ...

    def wait_admissible(self, version: int, *, epoch: int, timeout: float) -> bool:
        """Block an idle generator until admission is possible, a push happened, or `timeout`."""
        ...


WORD = 2**32  # the sampler's request streams, and every input of their derivation, are < WORD
EVALUATION_DOMAIN = 0x6576616C  # b"eval": the spawn key that sets evaluation streams apart


def _check_words(where: str, **values: int) -> None:
    for name, value in values.items():
        if not 0 <= value < WORD:
            raise ValueError(f"{where}: {name}={value} must be in [0, 2**32)")


def request_seed(base_seed: int, admit_version: int, index: int, sample: int) -> int:
    """A training request's sampler stream in [0, 2**32): the first 32-bit word of the state of
    `np.random.SeedSequence` over the four words (run seed, admission version, index of the group
    among those admitted at that version, sample). Distinct per request (up to hash collisions),
    and the same after a resume at a PPO phase boundary (group ids restart, these do not).
    ValueError unless every input is in [0, 2**32)."""
    _check_words("request_seed", base_seed=base_seed, admit_version=admit_version, index=index, sample=sample)
    state = np.random.SeedSequence([base_seed, admit_version, index, sample]).generate_state(1)
    return int(state[0])


def evaluation_seed(run_seed: int, version: int, index: int) -> int:
    """Request `index` of an evaluation of params `version`: its sampler stream in [0, 2**32),
    the first 32-bit word of the state of `np.random.SeedSequence(entropy=(run_seed, version,
    index), spawn_key=(EVALUATION_DOMAIN,))`. NumPy pads the entropy to its four-word pool and
    appends the spawn key, so the hash input is the five words (run_seed, version, index, 0,
    EVALUATION_DOMAIN) where `request_seed` hashes four: an evaluation and a training request
    never hash the same words, whatever their numbers. ValueError unless every input is in
    [0, 2**32)."""
    _check_words("evaluation_seed", run_seed=run_seed, version=version, index=index)
    state = np.random.SeedSequence([run_seed, version, index], spawn_key=(EVALUATION_DOMAIN,)).generate_state(1)
    return int(state[0])


@dataclasses.dataclass
class _EvalJob:
    """An evaluation in progress: its params version, prompts, and the completions back so far."""

    version: int
    prompts: list[tuple[int, ...]]
    done: dict[int, Completion] = dataclasses.field(default_factory=dict)


class LocalLink:
    """`GeneratorLink` over the group buffer, the prompt source and the reward function.

    `finish` queues the group for the scoring thread (`run_scorer`), which scores it
    (`reward_fn(prompt, completions) -> n rewards`) and puts it in the buffer, or discards it when
    `zero_variance == 'refill'` and all rewards are equal; groups are scored one at a time, in
    the order they finished. Tokens and completions are counted when their group is scored,
    whichever generator made them. What the reward function records (e.g. the prompt pool's
    pass rates) lands when the group is scored, possibly after later prompt draws, as it always
    did with generators in other processes. `evaluate` (the trainer's side) queues evaluation requests
    for the generators and waits for their completions (module docstring); `run_seed` (the run's
    seed, in [0, 2**32)) seeds their streams.
    `hold_admission()`: while held, admission is refused (evaluations still run).
    Thread safe. `close()` closes the buffer and wakes every waiter here with `PipelineStopped`.
    """

    def __init__(
        self,
        buffer: GroupBuffer,
        *,
        prompt_source: Callable[[], Prompt],
        reward_fn: Callable[[Prompt, Sequence[Any]], Sequence[float]],
        samples_per_prompt: int,
        zero_variance: str,
        counters: GeneratorCounters,
        run_seed: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        _check_words("LocalLink", run_seed=run_seed)
        self.buffer = buffer
        self._run_seed = run_seed
        self._prompt_source, self._reward_fn = prompt_source, reward_fn
        self._samples, self._zero_variance = samples_per_prompt, zero_variance
        self._counters, self._clock = counters, clock
        self._admit_lock = threading.Lock()
        self._admitted_at: collections.Counter = collections.Counter()  # groups admitted per version
        # Guards everything below: the scoring queue, evaluations, the admission hold, closing.
        self._cond = threading.Condition()
        self._to_score: collections.deque[tuple[Admission, Sequence[Any]]] = collections.deque()
        self._eval_queue: collections.deque[EvalItem] = collections.deque()
        self._jobs: dict[int, _EvalJob] = {}
        self._next_job = 0
        self._held = False
        self._closed = False

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise PipelineStopped("generator link closed")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.buffer.close()

    # ------------------------------------------------------------------ training groups
    def admit(self, version: int) -> Admission | None:
        with self._cond:
            self._raise_if_closed()
            if self._held:
                return None
        with self._admit_lock:
            group_id = self.buffer.try_admit(version)
            if group_id is None:
                return None
            index = self._admitted_at[version]
            self._admitted_at[version] += 1
            return Admission(group_id, self._prompt_source(), version, index)

    def finish(self, admission: Admission, completions: Sequence[Any]) -> None:
        early = [v for c in completions for v in c.versions[:1] if v < admission.version]
        if early:
            raise RuntimeError(
                f"group {admission.group_id}: first token version {min(early)} is older than "
                f"its admission version {admission.version}"
            )
        with self._cond:
            self._raise_if_closed()
            self._to_score.append((admission, completions))
            self._cond.notify_all()

    def run_scorer(self, stop: threading.Event) -> None:
        """The scoring thread: scores finished groups until the link closes (`PipelineStopped`);
        a reward function that raises ends it with that error."""
        del stop  # closing the link ends it
        while True:
            with self._cond:
                while not self._to_score:
                    self._raise_if_closed()
                    self._cond.wait()
                admission, completions = self._to_score.popleft()
            self._score(admission, completions)

    def _score(self, admission: Admission, completions: Sequence[Any]) -> None:
        start = self._clock()
        rewards = np.asarray(self._reward_fn(admission.prompt, completions), np.float32)
        score_s = self._clock() - start
        if rewards.shape != (self._samples,):
            raise ValueError(
                f"reward_fn returned shape {rewards.shape} for group {admission.group_id}; expected ({self._samples},)"
            )
        group = Group(
            group_id=admission.group_id,
            prompt=admission.prompt,
            admit_version=admission.version,
            completions=completions,
            rewards=rewards,
        )
        produced = dict(
            generated_tokens=sum(len(c.tokens) for c in completions), completions=len(completions), score_s=score_s
        )
        if self._zero_variance == "refill" and np.all(rewards == rewards[0]):
            self.buffer.discard(admission.group_id)
            self._counters.add(groups_discarded=1, **produced)
            return
        self.buffer.put(admission.group_id, group)
        self._counters.add(groups_finished=1, **produced)

    def record_generator_work(self, chunks: int, busy_s: float, prefill_tokens: int, shared_prompt_pages: int) -> None:
        """Chunks run, seconds spent in them, prompt tokens prefilled and prompt pages shared by a
        generator of another process."""
        self._counters.add(
            chunks=chunks, busy_s=busy_s, prefill_tokens=prefill_tokens, shared_prompt_pages=shared_prompt_pages
        )

    @contextlib.contextmanager
    def hold_admission(self) -> Iterator[None]:
        """Refuses admission inside the block (generators keep decoding and evaluating)."""
        with self._cond:
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def epoch(self) -> int:
        return self.buffer.epoch

    def wait_admissible(self, version: int, *, epoch: int, timeout: float) -> bool:
        with self._cond:
            self._raise_if_closed()
            if self._takeable(version):
                return False
            if self._held:
                self._cond.wait(timeout)
                self._raise_if_closed()
                return False
        return self.buffer.wait_admissible(version, epoch=epoch, timeout=timeout)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, version: int, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        """Samples each prompt once on the generators' params `version` (request i with stream
        `evaluation_seed(run_seed, version, i)`) and returns the completions in prompt order. The
        caller must have pushed `version` to every generator and push nothing newer before this
        returns."""
        seeds = [evaluation_seed(self._run_seed, version, i) for i in range(len(prompts))]
        with self._cond:
            self._raise_if_closed()
            job = self._next_job
            self._next_job += 1
            self._jobs[job] = _EvalJob(version, [tuple(int(t) for t in p) for p in prompts])
            self._eval_queue.extend(
                EvalItem(job, i, prompt, seed, version)
                for i, (prompt, seed) in enumerate(zip(self._jobs[job].prompts, seeds, strict=True))
            )
            self._cond.notify_all()
        self.buffer.notify()  # wakes generators waiting on the buffer
        with self._cond:
            while len(self._jobs[job].done) < len(prompts):
                self._raise_if_closed()
                self._cond.wait()
            done = self._jobs.pop(job).done
        return [done[i] for i in range(len(prompts))]

    def evaluations_in_progress(self) -> list[tuple[int, int, int]]:
        """(params version, samples back, samples asked) of each evaluation not yet returned."""
        with self._cond:
            return [(job.version, len(job.done), len(job.prompts)) for job in self._jobs.values()]

    def _takeable(self, version: int) -> bool:
        return bool(self._eval_queue) and self._eval_queue[0].version <= version

    def take_evaluations(self, version: int, limit: int) -> list[EvalItem]:
        with self._cond:
            self._raise_if_closed()
            taken = []
            while len(taken) < limit and self._takeable(version):
                taken.append(self._eval_queue.popleft())
            return taken

    def evaluation_prompt(self, request_id: Hashable) -> list[int]:
        """The prompt of an evaluation request in progress (for completions sent without it)."""
        assert is_evaluation(request_id), request_id
        _, job, index = request_id
        with self._cond:
            return list(self._jobs[job].prompts[index])

    def finish_evaluations(self, completions: Sequence[Completion]) -> None:
        with self._cond:
            self._raise_if_closed()
            for completion in completions:
                request_id = completion.request_id
                assert is_evaluation(request_id), request_id
                _, job_id, index = request_id
                job = self._jobs[job_id]
                newer = sorted(set(completion.versions) - {job.version})
                if newer:
                    raise RuntimeError(
                        f"evaluation of params version {job.version} (request {index}) sampled tokens with "
                        f"versions {newer}: a params version was pushed before the evaluation returned"
                    )
                job.done[index] = completion
            self._cond.notify_all()


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


class RetainingBatcher(Batcher, Protocol):
    """A batcher that can hand out the params of a version it retained (`ContinuousBatcher`)."""

    def params_at(self, version: int) -> Any | None: ...


class GeneratorLoop:
    """Keeps `batcher`'s slots busy with evaluation requests and prompts admitted through `link`
    (module docstring); with `eval_batcher`, evaluation requests run there instead, on the params
    of their own version that `batcher` retained.

    `run(stop)` returns when `stop` is set; it raises whatever the link raises (e.g.
    `PipelineStopped` when the buffer closes, or a lost peer). `counters` receives the chunks run
    and the seconds spent in them.
    """

    def __init__(
        self,
        batcher: Batcher,
        link: GeneratorLink,
        settings: SamplingSettings,
        counters: GeneratorCounters,
        clock: Callable[[], float] = time.monotonic,
        eval_batcher: Batcher | None = None,
    ):
        if eval_batcher is not None and not hasattr(batcher, "params_at"):
            raise TypeError(
                f"GeneratorLoop: an evaluation batcher needs a batcher that retains params, not {batcher!r}"
            )
        self.batcher, self.link, self.settings = batcher, link, settings
        self.eval_batcher = eval_batcher
        self._counters, self._clock = counters, clock
        self._eval_backlog: collections.deque[EvalItem] = collections.deque()
        self._eval_version: int | None = None  # the version the evaluation batcher was given

    def _request(self, request_id: Hashable, prompt: Sequence[int], seed: int) -> Request:
        s = self.settings
        return Request(
            request_id=request_id,
            prompt_tokens=prompt,
            max_new_tokens=s.max_new_tokens,
            seed=seed,
            temperature=s.temperature,
            stop_tokens=s.stop_tokens,
            interrupt=s.interrupt,
        )

    def _requests(self, admission: Admission) -> list[Request]:
        s = self.settings
        return [
            self._request(
                (admission.group_id, sample),
                admission.prompt.tokens,
                request_seed(s.seed, admission.version, admission.index, sample),
            )
            for sample in range(s.samples_per_prompt)
        ]

    def _room(self, batcher: Batcher) -> int:
        """Requests `batcher` may still queue: its free slots plus the slack, less those pending."""
        return batcher.num_free_slots + self.settings.admission_slack - batcher.num_pending

    def _feed_evaluations(self, version: int) -> None:
        """Concurrent evaluation: takes the waiting evaluation requests (of any version this
        generator has seen) into the backlog, and moves those of one version at a time into the
        evaluation batcher, first giving it that version's retained params."""
        eval_batcher = self.eval_batcher
        assert eval_batcher is not None
        room = self._room(eval_batcher) - len(self._eval_backlog)
        if room > 0:
            self._eval_backlog.extend(self.link.take_evaluations(version, room))
        if not self._eval_backlog:
            return
        wanted = self._eval_backlog[0].version
        if wanted != self._eval_version:
            if not eval_batcher.idle:
                return  # the previous version's requests finish first
            params = cast(RetainingBatcher, self.batcher).params_at(wanted)
            if params is None:
                raise RuntimeError(
                    f"evaluation of params version {wanted}: this generator no longer holds that version "
                    f"(it retains the newest {RETAINED_EVAL_VERSIONS} evaluated ones; the evaluations fell behind)"
                )
            eval_batcher.update_params(params, wanted, copy=False)
            self._eval_version = wanted
        while self._eval_backlog and self._eval_backlog[0].version == wanted and self._room(eval_batcher) > 0:
            item = self._eval_backlog.popleft()
            eval_batcher.add_request(self._request(item.request_id, item.prompt, item.seed))

    def _run_chunk(self, batcher: Batcher) -> list[Completion]:
        start = self._clock()
        prefilled, shared = (batcher.counters[name] for name in ("prefill_tokens", "shared_prompt_pages"))
        completions = batcher.run_chunk()
        self._counters.add(
            chunks=1,
            busy_s=self._clock() - start,
            prefill_tokens=batcher.counters["prefill_tokens"] - prefilled,
            shared_prompt_pages=batcher.counters["shared_prompt_pages"] - shared,
        )
        evaluated = [c for c in completions if is_evaluation(c.request_id)]
        if evaluated:
            self.link.finish_evaluations(evaluated)
        return [c for c in completions if not is_evaluation(c.request_id)]

    def run(self, stop: threading.Event) -> None:
        batcher, s = self.batcher, self.settings
        eval_batcher = self.eval_batcher
        assembling: dict[int, tuple[Admission, dict[int, Any]]] = {}
        while not stop.is_set():
            version = batcher.version
            if eval_batcher is not None:
                self._feed_evaluations(version)
            elif self._room(batcher) > 0:
                for item in self.link.take_evaluations(version, self._room(batcher)):
                    batcher.add_request(self._request(item.request_id, item.prompt, item.seed))
            while self._room(batcher) > 0:
                admission = self.link.admit(version)
                if admission is None:
                    break
                assembling[admission.group_id] = (admission, {})
                for request in self._requests(admission):
                    batcher.add_request(request)
            evaluating = eval_batcher is not None and not eval_batcher.idle
            if batcher.idle and not evaluating:
                epoch = self.link.epoch()
                batcher.run_chunk()  # nothing to decode: only adopts params pushed meanwhile
                if batcher.version == version:
                    self.link.wait_admissible(version, epoch=epoch, timeout=s.poll_s)
                continue
            completions = self._run_chunk(eval_batcher) if evaluating and eval_batcher is not None else []
            completions += self._run_chunk(batcher) if not batcher.idle else []
            for completion in completions:
                request_id = completion.request_id
                assert isinstance(request_id, tuple), request_id  # (group_id, sample): see `_requests`
                group_id, sample = request_id
                admission, done = assembling[group_id]
                done[sample] = completion
                if len(done) == s.samples_per_prompt:
                    del assembling[group_id]
                    self.link.finish(admission, [done[i] for i in range(s.samples_per_prompt)])
