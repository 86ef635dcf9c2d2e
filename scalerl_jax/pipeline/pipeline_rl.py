"""PipelineRL-k and PPO-off-policy-k: a generator thread and a trainer thread around the buffer.

Generator thread (`generator.py`'s `GeneratorLoop` over this pipeline's `LocalLink`): keeps the
sampler's decode slots busy. While the pending requests do not cover the free slots (plus
`admission_slack`), it asks the group buffer to admit a prompt at the sampler's current params
version (the prompt comes from `prompt_source`) and queues its n requests. It runs one sampler
chunk at a time; when all n completions of a prompt are back the group goes to the scoring
thread (`LocalLink.run_scorer`: `reward_fn`, then the buffer), so the generator thread only
decodes. With nothing to run and admission refused it blocks on the buffer (back-pressure),
first adopting any params pushed meanwhile. Generators of other processes (multi-host) share
the same `LocalLink` through `remote_generators` services.

Trainer thread: takes the batch the schedule selects (waiting if needed), builds the padded
arrays (`batching.py`), runs the train step and reports a `StepRecord` through `on_step`
(metrics, per-completion versions, the new train state), after pushing params version v + 1 to
the sampler when the schedule asks for it (`push_params`, by default `batcher.update_params`: a
device-to-device copy onto the sampler's shardings, `models.reshard.push_local`, adopted at the
sampler's next chunk boundary while in-flight sequences keep their KV cache; `pipeline/push_s`).

Evaluation. `on_start(sample_eval)` (before the first batch) and `on_step(record, sample_eval)`
run in the trainer thread and receive the evaluation sampler (`EvalSampler`):
`sample_eval(version, prompts) -> completions` samples on the generators through the link
(`generator.py`, request i with stream `evaluation_seed(seed, version, i)`). Shared evaluation
(the default): it runs in the trainer thread on the trainer's newest version, pushing it first if
the schedule did not, and no newer version can be pushed until it returns (the trainer is the only
pusher and is inside it). Concurrent evaluation (`concurrent_evaluation`, with an evaluation
batcher on every generator): `sample_eval.pin(version)` in the trainer thread pushes the newest
version if needed and marks it evaluable; `sample_eval(version, prompts)` may then be called
from any thread while the trainer keeps stepping and pushing (the generators evaluate that
version on the params they retained, `generator.py`). `on_end()` runs in the trainer thread after
its last step, while the generators still run (e.g. to wait for evaluations in flight). The
callbacks are given the sampler rather than reaching for the pipeline, so the reporting built
before the pipeline needs nothing of it. Under PPO-off-policy-k admission is held while
`on_start` / `on_step` run, so a checkpoint taken there at a phase boundary sees no prompt drawn
for the next phase yet.

The schedule (`lag.py`) makes the difference between PipelineRL-k (lag <= k by back-pressure)
and PPO-off-policy-k (k*G groups on frozen params, then k updates; no overlap).

Stopping. The trainer stops after `num_steps`; `request_stop(reason)` (from any thread, or from a
signal handler: the run's SIGTERM / SIGINT handling, `run.signals.StopSignals`, calls it) stops it
after the current step and its `on_step` (so that step's metrics and checkpoint are written), or at
once while it waits for a batch. Under PPO-off-policy-k it goes on to the end of the phase (its
batches are already generated), so that the stop lands where a checkpoint resumes the run exactly.
An exception in any thread closes the link and its buffer, which wakes and stops the others;
`run()` then re-raises that exception (with its traceback) in the calling thread. Groups still
queued at the end are listed in the result, never reported as trained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from absl import logging

from scalerl_jax.contracts.threads import FirstError
from scalerl_jax.pipeline.batching import build_train_batch, octave_buckets
from scalerl_jax.pipeline.config import PipelineConfig
from scalerl_jax.pipeline.generator import GeneratorCounters, GeneratorLoop, GeneratorStats, LocalLink, SamplingSettings
from scalerl_jax.pipeline.group import Prompt, lags
from scalerl_jax.pipeline.lag import default_capacity, make_schedule
from scalerl_jax.pipeline.queue import BufferCounts, GroupBuffer, PipelineStopped, WaitTimes
from scalerl_jax.pipeline.step_record import RunTotals, StepRecord, pipeline_step_metrics
from scalerl_jax.sampler.batcher import Batcher, Completion


@dataclasses.dataclass(frozen=True)
class PipelineResult:
    """How a run ended, the final train state and the accounting of every admitted group.

    admitted == trained + discarded + queued + in_flight + consumed by a step that failed.
    """

    train_state: Any
    version: int
    steps: int
    stop_reason: str  # 'num_steps', 'error', or `request_stop`'s reason ('stop_requested', 'signal SIGTERM')
    counts: BufferCounts
    trained_group_ids: tuple[int, ...]
    queued_group_ids: tuple[int, ...]
    waits: WaitTimes
    generator: GeneratorStats
    wall_s: float


def quiet_progress_line(
    *,
    quiet_s: float,
    next_step: int,
    num_steps: int,
    trainer: str,
    groups_ready: int,
    groups_per_step: int,
    generator: GeneratorStats,
    evaluations: Sequence[tuple[int, int, int]],
) -> str:
    """What a pipeline is doing while no step finishes: how long it has been quiet, the step it
    works towards (of `num_steps` this run), what the trainer does, `groups_ready` finished groups
    waiting of the `groups_per_step` a batch takes, the generators' cumulative counters, and each
    evaluation in flight as (params version, samples back, samples asked)."""
    parts = [
        f"no step finished for {quiet_s / 60:.1f} min (step {next_step}/{num_steps} next)",
        f"trainer {trainer}, {groups_ready} of {groups_per_step} groups ready",
        f"generator: {generator.chunks} decode chunks ({generator.busy_s:.0f} s), {generator.groups_finished} groups "
        f"finished ({generator.groups_discarded} discarded), {generator.generated_tokens} completion tokens",
    ]
    parts += [f"evaluation of step {version}: {done}/{asked} samples back" for version, done, asked in evaluations]
    return " | ".join(parts)


SampleEval = Callable[[int, Sequence[Sequence[int]]], list[Completion]]
"""`sample_eval(version, prompts)`: each prompt sampled once on params `version` (module docstring)."""


def push_to(batcher: Batcher) -> Callable[[Any, int], float]:
    """`push_params` of a pipeline whose only generator is `batcher`: `update_params` of the
    state's params (a copy onto the batcher's shardings)."""
    return lambda state, version: batcher.update_params(state.params, version)


def sampling_settings(config: PipelineConfig) -> SamplingSettings:
    """What every generator's requests share, from the pipeline config (the same on every process)."""
    return SamplingSettings(
        max_new_tokens=config.max_new_tokens,
        samples_per_prompt=config.samples_per_prompt,
        temperature=config.temperature,
        stop_tokens=tuple(config.stop_tokens),
        interrupt=config.interrupt,
        seed=config.seed,
        poll_s=config.poll_s,
        admission_slack=config.samples_per_prompt if config.admission_slack is None else config.admission_slack,
    )


class Pipeline:
    """Runs the generator and trainer threads (module docstring). One `run()` per instance.

    `batcher`: the sampler driver of this process's generator (a `sampler.Batcher`), or None
    when this process has no generator devices (multi-host: generators in other processes come
    in through `link` and `remote_generators`).
    `prompt_source()` -> `Prompt`; `reward_fn(prompt, completions)` -> n floats (called by the
    scoring thread, one group at a time). `train_step(state, batch)` -> (state, metrics) (may
    donate `state`). `push_params(state, version)` sends new params to every generator (default:
    `update_params` of `state.params`) and returns once they will have them (a run's transport
    dispatches the local copy without waiting for it). `on_step(record, sample_eval)` is called
    in the trainer thread after each step; `on_start(sample_eval)` once before the first batch, with the generators running (e.g. the first evaluation); both may
    evaluate with `sample_eval` (`EvalSampler`). `on_end()` once after the last step.
    `concurrent_evaluation`: evaluations may run while the trainer steps (module docstring); the
    local generator then evaluates on `eval_batcher`. `remote_generators`: (name,
    serve(link, stop_event)), each run in its own thread beside the others and guarded the same
    way (an error in one stops all), serving a generator of another process with this pipeline's
    `LocalLink`. `clock` measures
    waits and throughput.
    """

    def __init__(
        self,
        config: PipelineConfig,
        *,
        batcher: Batcher | None,
        prompt_source: Callable[[], Prompt],
        reward_fn: Callable[[Prompt, Sequence[Any]], Sequence[float]],
        train_step: Callable[[Any, dict], tuple[Any, dict]],
        train_state: Any,
        push_params: Callable[[Any, int], Any] | None = None,
        on_step: Callable[[StepRecord, EvalSampler], None] | None = None,
        on_start: Callable[[EvalSampler], None] | None = None,
        on_end: Callable[[], None] | None = None,
        eval_batcher: Batcher | None = None,
        concurrent_evaluation: bool = False,
        remote_generators: Sequence[tuple[str, Callable[[LocalLink, threading.Event], None]]] = (),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.schedule = make_schedule(
            config.schedule, k=config.k, groups_per_step=config.prompts_per_step, first_version=config.first_version
        )
        capacity = config.capacity if config.capacity is not None else default_capacity(self.schedule)
        self.buffer = GroupBuffer(self.schedule, capacity=capacity, first_version=config.first_version, clock=clock)
        if batcher is not None and batcher.version != config.first_version:
            raise ValueError(
                f"batcher holds params version {batcher.version} but "
                f"PipelineConfig.first_version={config.first_version}"
            )
        if push_params is None:
            if batcher is None:
                raise ValueError("Pipeline without a local batcher needs push_params")
            push_params = push_to(batcher)
        self.batcher = batcher
        self.train_step = train_step
        self.push_params = push_params
        if concurrent_evaluation and batcher is not None and eval_batcher is None:
            raise ValueError("concurrent_evaluation needs an eval_batcher beside the local batcher")
        self._on_step, self._on_start, self._on_end = on_step, on_start, on_end
        self.eval_batcher = eval_batcher
        self.sample_eval = EvalSampler(self, concurrent=concurrent_evaluation)
        self.clock = clock
        self.length_buckets = octave_buckets(
            min(config.min_length_bucket, config.max_seq_len), config.max_seq_len, config.length_buckets_per_octave
        )
        self._train_state = train_state
        self._version = config.first_version
        self._pushed_version = config.first_version  # the newest version every generator holds
        self._trained_ids: list[int] = []
        self._generator_stats = GeneratorCounters()
        self.link = LocalLink(
            self.buffer,
            prompt_source=prompt_source,
            reward_fn=reward_fn,
            samples_per_prompt=config.samples_per_prompt,
            zero_variance=config.zero_variance,
            counters=self._generator_stats,
            run_seed=config.seed,
            clock=clock,
        )
        self.sampling = sampling_settings(config)
        self._remote_generators = list(remote_generators)
        self._stop = threading.Event()  # every loop: leave now
        self._stop_requested = threading.Event()  # trainer: leave after the current step
        self._stop_reason = ""
        self._errors = FirstError()
        self._started = False
        self._trainer_activity = "starting"  # read by the quiet-period progress line
        self._last_step_at = time.monotonic()

    # ------------------------------------------------------------------ control
    def request_stop(self, reason: str = "stop_requested") -> None:
        """Stop after the current train step (thread safe; a signal handler may call it)."""
        if not self._stop_requested.is_set():
            self._stop_reason = reason
        self._stop_requested.set()

    def run(self) -> PipelineResult:
        """Run until `num_steps`, a stop request or an error (re-raised here)."""
        if self._started:
            raise RuntimeError("Pipeline.run() may be called once per Pipeline")
        self._started = True
        start = self.clock()
        loops = [("trainer", self._trainer_loop), ("scorer", functools.partial(self.link.run_scorer, self._stop))]
        if self.batcher is not None:
            loops.append(("generator", functools.partial(self._generator_loop, self.batcher)))
        loops += [(name, functools.partial(serve, self.link, self._stop)) for name, serve in self._remote_generators]
        threads = [
            threading.Thread(target=self._guarded(name, loop), name=f"pipeline-{name}", daemon=True)
            for name, loop in loops
        ]
        try:
            for thread in threads:
                thread.start()
            self._last_step_at = last_line = time.monotonic()
            while any(thread.is_alive() for thread in threads):
                now = time.monotonic()
                if now - max(self._last_step_at, last_line) >= self.config.quiet_log_s:
                    logging.info("%s", self._quiet_line(now - self._last_step_at))
                    last_line = now
                # A trainer waiting for a batch leaves now, a training one after its step and on_step
                # (`_stopping`); its end stops the other loops. The wake-up is sent from here, not
                # from `request_stop`, which a signal handler may call and so must not wait for the
                # buffer's lock.
                if self._stop_requested.is_set():
                    self.buffer.wake()
                for thread in threads:
                    thread.join(timeout=self.config.poll_s)
        finally:
            self._stop.set()
            self._stop_requested.set()
            self.link.close()
            for thread in threads:
                thread.join(timeout=self.config.join_timeout_s)
        stuck = [thread.name for thread in threads if thread.is_alive()]
        self._errors.raise_first()
        if stuck:
            raise RuntimeError(f"pipeline threads {stuck} did not stop within {self.config.join_timeout_s} s")
        return PipelineResult(
            train_state=self._train_state,
            version=self._version,
            steps=self._version - self.config.first_version,
            stop_reason=self._stop_reason or "num_steps",
            counts=self.buffer.counts(),
            trained_group_ids=tuple(self._trained_ids),
            queued_group_ids=tuple(self.buffer.queued_group_ids()),
            waits=self.buffer.waits(),
            generator=self._generator_stats.snapshot(),
            wall_s=self.clock() - start,
        )

    def _stopping(self) -> bool:
        """A stop was requested and the trainer is at a step where it may stop: any step of
        PipelineRL-k, the end of a phase of PPO-off-policy-k (module docstring)."""
        if not self._stop_requested.is_set():
            return False
        return (
            self.config.schedule != "ppo_off_policy" or (self._version - self.config.first_version) % self.config.k == 0
        )

    def _guarded(self, name: str, loop: Callable[[], None]) -> Callable[[], None]:
        """`loop` as a thread target: the first exception of any loop is kept for `run()` to
        re-raise (a stop is not one); however it ends, the other loops are stopped."""

        def failed(_: BaseException) -> None:
            self._stop_reason = "error"

        def stop_all() -> None:
            self._stop.set()
            self.link.close()

        return self._errors.guarded(
            f"pipeline {name}", loop, expected=(PipelineStopped,), on_error=failed, on_exit=stop_all
        )

    # ------------------------------------------------------------------ generator
    def _quiet_line(self, quiet_s: float) -> str:
        cfg = self.config
        return quiet_progress_line(
            quiet_s=quiet_s,
            next_step=self._version + 1,
            num_steps=cfg.first_version + cfg.num_steps,
            trainer=self._trainer_activity,
            groups_ready=self.buffer.counts().queued,
            groups_per_step=cfg.prompts_per_step,
            generator=self._generator_stats.snapshot(),
            evaluations=self.link.evaluations_in_progress(),
        )

    def _generator_loop(self, batcher: Batcher) -> None:
        GeneratorLoop(
            batcher, self.link, self.sampling, self._generator_stats, clock=self.clock, eval_batcher=self.eval_batcher
        ).run(self._stop)

    # ------------------------------------------------------------------ trainer
    @contextlib.contextmanager
    def _reporting_step(self) -> Iterator[None]:
        """Push, `on_start`, `on_step`: under PPO-off-policy-k admission is held meanwhile
        (module docstring)."""
        hold = self.link.hold_admission() if self.config.schedule == "ppo_off_policy" else contextlib.nullcontext()
        with hold:
            yield

    def _push(self, state: Any, version: int) -> float:
        """Pushes params `version` to every generator and wakes them; seconds taken."""
        start = self.clock()
        self.push_params(state, version)
        self._pushed_version = version
        self.buffer.notify()
        return self.clock() - start

    def _push_for_evaluation(self, version: int) -> None:
        """Trainer thread: `version` must be the trainer's newest; pushed now if the schedule did not."""
        if version != self._version:
            raise ValueError(
                f"evaluation of version {version}: the trainer holds version {self._version}; "
                "only the newest version can be evaluated from the trainer"
            )
        if self._pushed_version != version:
            self._push(self._train_state, version)

    def _trainer_loop(self) -> None:
        cfg = self.config
        totals = RunTotals(start=self.clock())
        state = self._train_state
        if self._on_start is not None:
            self._trainer_activity = "evaluating the start"
            with self._reporting_step():
                self._on_start(self.sample_eval)
        while self._version - cfg.first_version < cfg.num_steps and not self._stopping():
            wait_before = self.buffer.waits().trainer_waiting_for_data
            self._trainer_activity = "waiting for a batch"
            version, groups = self.buffer.take_batch(stop=self._stopping)
            self._trainer_activity = "training"
            if version != self._version:
                raise RuntimeError(f"trainer at version {self._version} got batch {version}")
            counts = self.buffer.counts()
            batch, info = build_train_batch(
                groups,
                rows=cfg.rows,
                length_buckets=self.length_buckets,
                zero_variance="none" if cfg.zero_variance == "none" else "drop",
                mask_truncated=cfg.mask_truncated,
                microbatches=cfg.microbatches if cfg.sort_by_length else None,
                routing=cfg.routing,
            )
            step_start = self.clock()
            self._train_state = None  # the step may donate the state's buffers
            state, train_metrics = self.train_step(state, batch)
            train_metrics = {name: float(value) for name, value in jax.device_get(train_metrics).items()}
            step_s = self.clock() - step_start
            totals.step_s += step_s
            self._train_state = state
            self._version += 1
            self._last_step_at = time.monotonic()
            self._trainer_activity = "reporting (metrics, evaluation, checkpoint)"
            with self._reporting_step():
                push_s = self._push(state, self._version) if self.schedule.should_push(self._version) else 0.0
                self._trained_ids.extend(g.group_id for g in groups)
                totals.completions += info.num_completions
                totals.tokens += info.completion_tokens + sum(len(g.prompt.tokens) * len(g.completions) for g in groups)
                waits = self.buffer.waits()
                metrics = dict(train_metrics)
                generator_stats = self._generator_stats.snapshot()
                metrics.update(
                    pipeline_step_metrics(
                        groups,
                        info,
                        version=version,
                        counts=counts,
                        waits=waits,
                        generator=generator_stats,
                        totals=totals,
                        elapsed=max(self.clock() - totals.start, 1e-9),
                        wait_s=waits.trainer_waiting_for_data - wait_before,
                        step_s=step_s,
                        push_s=push_s,
                        step_flops=(
                            None
                            if cfg.train_step_flops is None
                            else sum(cfg.train_step_flops(r, length) for r, length in info.padded_shapes if length)
                        ),
                        peak_flops_per_s=cfg.peak_flops_per_s,
                    )
                )
                metrics["pipeline/groups_trained"] = float(len(self._trained_ids))
                totals.discarded = counts.discarded
                totals.prefill_tokens = generator_stats.prefill_tokens
                totals.shared_prompt_pages = generator_stats.shared_prompt_pages
                if self._on_step is not None:
                    self._on_step(
                        StepRecord(
                            version=version,
                            group_ids=tuple(g.group_id for g in groups),
                            first_versions=tuple(v for g in groups for v in g.first_versions),
                            last_versions=tuple(v for g in groups for v in g.last_versions),
                            lags=tuple(int(x) for x in lags(groups, version)),
                            metrics=metrics,
                            groups=tuple(groups),
                            train_state=state,
                        ),
                        self.sample_eval,
                    )
        if self._on_end is not None:
            self._on_end()


class EvalSampler:
    """The evaluation sampler a pipeline hands its callbacks (module docstring):
    `sample_eval(version, prompts)` -> one completion per prompt, sampled on params `version`.

    Shared (`concurrent` False): called in the trainer thread for its newest version, pushed
    first if needed; it returns before the trainer goes on. Concurrent: `pin(version)` first, in
    the trainer thread (the newest version, pushed if needed); then any thread may sample that
    version while the trainer goes on.
    """

    def __init__(self, pipeline: Pipeline, *, concurrent: bool):
        self._pipeline = pipeline
        self.concurrent = concurrent
        self._pinned: set[int] = set()
        self._lock = threading.Lock()

    def pin(self, version: int) -> None:
        if not self.concurrent:
            raise ValueError("EvalSampler.pin: this pipeline evaluates in the trainer thread (not concurrent)")
        self._pipeline._push_for_evaluation(version)
        with self._lock:
            self._pinned.add(version)

    def __call__(self, version: int, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        if self.concurrent:
            with self._lock:
                if version not in self._pinned:
                    raise ValueError(f"sample_eval(version={version}): pin the version in the trainer thread first")
        else:
            self._pipeline._push_for_evaluation(version)
        return self._pipeline.link.evaluate(version, prompts)
