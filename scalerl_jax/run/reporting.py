"""What the leader records of a run: its host-side state, a metrics row and progress line per
step, the evaluations and the checkpoints.

`StepReporter.on_step(record, sample_eval)` runs in the pipeline's trainer thread between steps,
while the train state is not donated; `on_start(sample_eval)` evaluates step 0 there before the
first batch of a fresh run (or the step a resumed run's checkpoint left unevaluated).

With a concurrent evaluation sampler, an evaluation due at step v (but the last) is pinned in
the trainer thread and run on the evaluation thread (`EvaluationQueue`) while training goes on;
its row, written when it is done, carries step v and the compute of step v. A checkpoint of
step v first waits for the evaluations of earlier steps; if step v's own is still running it
records so (`pending_evaluation`), and a run resumed from it evaluates step v first (its row,
written after the checkpoint's offset, is dropped on resume). The last step's evaluation runs in
the trainer thread after all others; `on_end` waits for any still running.
`pipeline/trainer_eval_frac`: the share of the trainer thread's time (since the pipeline's first
callback) spent evaluating or waiting for evaluations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import ml_collections
import numpy as np
from absl import logging

from scalerl_jax import data as data_lib
from scalerl_jax.data.mixture import MixturePool
from scalerl_jax.data.rewards import RewardTallies
from scalerl_jax.distributed.trainer_group import TrainerGroup
from scalerl_jax.pipeline.group import Group
from scalerl_jax.pipeline.pipeline_rl import EvalSampler
from scalerl_jax.pipeline.step_record import StepRecord
from scalerl_jax.run.build import TaskData, Trainer
from scalerl_jax.run.evaluation import EvaluationQueue, Evaluator
from scalerl_jax.scaling import ComputeMeter
from scalerl_jax.telemetry.metrics import MetricsWriter, format_progress
from scalerl_jax.train.checkpoint import RunCheckpointer


class MetricsSink(Protocol):
    """Where metrics rows go (metrics.jsonl + TensorBoard, Weights & Biases)."""

    def write(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class RunState:
    """Host-side state saved with every checkpoint beside the train state."""

    pool: data_lib.PromptPool | MixturePool
    meter: ComputeMeter
    nonfinite_steps: int = 0
    # Items the reward failed on, per scope (training, each evaluation set): data/reward_* etc.
    rewards: RewardTallies = dataclasses.field(default_factory=RewardTallies)


@dataclasses.dataclass(frozen=True)
class Resumed:
    """Where a restored run goes on from: the version reached, the metrics file's offset, and
    whether that version's evaluation is still owed (its checkpoint was taken while it ran)."""

    version: int
    metrics_offset: int | None
    evaluation_owed: bool = False


def restore(checkpointer: RunCheckpointer, trainer: Trainer) -> dict | None:
    """Restores the newest usable checkpoint into `trainer.state`; its run state (with `step`), or None."""
    restored = checkpointer.restore_latest(trainer.state)
    if restored is None:
        return None
    trainer.state = restored.train_state
    logging.info("resumed from checkpoint step %d", restored.step)
    return {**restored.run_state, "step": restored.step}


def resume_run_state(saved: dict | None, run_state: RunState) -> Resumed:
    """Loads a restored checkpoint's run state into `run_state`; where the run goes on from."""
    if saved is None:
        return Resumed(0, None)
    run_state.pool.load_state_dict(saved["pool"])
    run_state.meter.load_state_dict(saved["meter"])
    run_state.nonfinite_steps = int(saved["nonfinite_steps"])
    if "rewards" in saved:
        run_state.rewards.load_state_dict(saved["rewards"])
    else:  # a checkpoint written before the reward counts existed
        logging.warning("the checkpoint has no reward failure counts: data/reward_* count from this resume on")
    return Resumed(
        int(saved["version"]), int(saved["metrics_offset"]), saved.get("pending_evaluation") == saved["version"]
    )


def domain_metrics(groups: Sequence[Group], domain_of: Callable[[int], str]) -> dict[str, float]:
    """Per domain d of the step's groups (`domain_of(prompt index)`): `train/d/groups`,
    `train/d/reward_mean` and `train/d/pass_rate` (share of rewards > 0) over its completions,
    `train/d/completion_len_mean` (tokens) and `train/d/truncated_frac` (cut by the token limit)."""
    by_domain: dict[str, list[Group]] = {}
    for group in groups:
        key = group.prompt.key
        assert isinstance(key, int)  # the run's prompt source keys prompts by their index in the task
        by_domain.setdefault(domain_of(key), []).append(group)
    metrics: dict[str, float] = {}
    for domain, members in sorted(by_domain.items()):
        rewards = np.concatenate([g.rewards for g in members])
        completions = [c for g in members for c in g.completions]
        metrics.update(
            {
                f"train/{domain}/groups": float(len(members)),
                f"train/{domain}/reward_mean": float(rewards.mean()),
                f"train/{domain}/pass_rate": float((rewards > 0).mean()),
                f"train/{domain}/completion_len_mean": float(np.mean([len(c.tokens) for c in completions])),
                f"train/{domain}/truncated_frac": float(np.mean([bool(c.truncated) for c in completions])),
            }
        )
    return metrics


class StepReporter:
    """Metrics row and progress line, evaluation and checkpoints of each step."""

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        task: TaskData,
        run_state: RunState,
        metrics_writer: MetricsWriter,
        extra_sinks: Sequence[MetricsSink],
        evaluator: Evaluator,
        checkpointer: RunCheckpointer,
        group: TrainerGroup,
        state: Any,
        fingerprint: dict,
        start_version: int = 0,
    ):
        self._config, self._task, self._run_state = config, task, run_state
        self._metrics_writer = metrics_writer
        self._writers: list[MetricsSink] = [metrics_writer, *extra_sinks]
        self._evaluator, self._checkpointer = evaluator, checkpointer
        self._group = group  # every trainer process saves with the leader
        self.state = state  # the newest trained state, pushed to the sampler or not
        self._fingerprint = fingerprint
        self._step_times: list[float] = []
        self.last_eval: tuple[int, float] | None = None
        self.checkpointed: int | None = None  # the step of the newest checkpoint this run wrote
        self._start_version = start_version
        self._write_lock = threading.Lock()  # rows come from the trainer and the evaluation thread
        self._evaluated: set[int] = set()  # steps whose evaluation row is written
        self._evaluations = EvaluationQueue()
        # The trainer thread's time in evaluations (its own, or waiting for the evaluation thread's)
        # since the pipeline's first callback: pipeline/trainer_eval_frac.
        self._started: float | None = None
        self._trainer_eval_s = 0.0

    def write(self, version: int, metrics: Mapping[str, Any]) -> None:
        with self._write_lock:
            for writer in self._writers:
                writer.write(version, metrics)
            if "eval/pass_rate" in metrics:
                self._evaluated.add(version)

    def close(self) -> None:
        self._evaluations.close()
        if self._evaluations.abandoned:
            logging.warning("evaluations of steps %s were abandoned at the stop", self._evaluations.abandoned)
        for writer in self._writers:
            writer.close()

    def evaluate(self, version: int, sample_eval: EvalSampler) -> dict[str, float]:
        metrics = self._evaluator.evaluate(version, sample_eval)
        self.last_eval = (version, metrics["eval/pass_rate"])
        return metrics

    def _evaluate_row(self, version: int, sample_eval: EvalSampler, compute: Mapping[str, Any]) -> None:
        """Evaluation thread: evaluates `version` and writes its row with the compute of that step."""
        metrics = self.evaluate(version, sample_eval)
        self.write(version, {**metrics, **self._run_state.rewards.metrics(), **compute})
        logging.info("step %d: held-out pass rate %.3f (evaluated beside training)", version, metrics["eval/pass_rate"])

    def _submit_evaluation(self, version: int, sample_eval: EvalSampler, compute: Mapping[str, Any]) -> None:
        """Trainer thread: pins `version` and queues its evaluation (concurrent sampler), whose row
        will carry `compute`, the compute metrics of that step."""
        sample_eval.pin(version)
        self._evaluations.submit(version, lambda: self._evaluate_row(version, sample_eval, compute))

    @contextlib.contextmanager
    def _trainer_evaluating(self) -> Iterator[None]:
        """Counts the block's seconds as the trainer thread's time in evaluations."""
        start = time.monotonic()
        try:
            yield
        finally:
            self._trainer_eval_s += time.monotonic() - start

    def on_end(self) -> None:
        """Trainer thread, after the last step: waits for the evaluations still running."""
        self._evaluations.wait()

    def checkpoint(self, version: int) -> None:
        rs = self._run_state
        with self._trainer_evaluating():
            self._evaluations.wait(before=version)
        with self._write_lock:  # the offset, the reward tallies and this step's evaluation agree
            owed = version in self._evaluations.pending() and version not in self._evaluated
            run_state = {
                "version": version,
                "pool": rs.pool.state_dict(),
                "meter": rs.meter.state_dict(),
                "metrics_offset": self._metrics_writer.offset(),
                "nonfinite_steps": rs.nonfinite_steps,
                "rewards": rs.rewards.state_dict(),
                "pending_evaluation": version if owed else None,
            }
        self._group.checkpoint(
            version, lambda: self._checkpointer.save(version, self.state, run_state, config=self._fingerprint)
        )
        self.checkpointed = version

    def on_start(self, sample_eval: EvalSampler) -> None:
        """The start version's held-out pass rate (step 0 of a fresh run: before any training)."""
        self._started = time.monotonic()
        version = self._start_version
        if sample_eval.concurrent:
            self._submit_evaluation(
                version, sample_eval, {**self._run_state.meter.metrics(), "compute/unit": "device_hours"}
            )
            return
        with self._trainer_evaluating():
            initial = self.evaluate(version, sample_eval)
        rs = self._run_state
        self.write(version, {**initial, **rs.rewards.metrics(), **rs.meter.metrics(), "compute/unit": "device_hours"})
        logging.info("step %d: held-out pass rate %.3f", version, initial["eval/pass_rate"])

    def on_step(self, record: StepRecord, sample_eval: EvalSampler) -> None:
        config, rs = self._config, self._run_state
        self._started = self._started or time.monotonic()
        version = record.version + 1
        self.state = record.train_state
        metrics: dict[str, Any] = dict(record.metrics)
        finite = bool(metrics.get("train/finite", 1.0))
        rs.nonfinite_steps += int(not finite)
        rewards = np.concatenate([g.rewards for g in record.groups])
        rs.meter.add_tokens(
            generated=sum(g.num_generated_tokens for g in record.groups),
            trained=int(metrics.get("train/num_loss_tokens", 0)),
        )
        compute = {**rs.meter.metrics(), "compute/unit": "device_hours"}  # this step's, in its rows
        step_answers = rs.rewards.training.take_step()  # before the counts, which include this step
        metrics.update(
            {
                "train/reward_mean": float(rewards.mean()),
                "train/pass_rate": float((rewards > 0).mean()),
                "train/nonfinite_steps": rs.nonfinite_steps,
                "data/prompts_too_long": self._task.num_too_long,
                **rs.pool.metrics(),
                **rs.rewards.metrics(),
                **step_answers,
                **compute,
            }
        )
        if self._task.per_domain:
            metrics.update(domain_metrics(record.groups, self._task.domain_of))
        if not finite:
            if config.nan_policy == "stop":
                self.write(version, metrics)  # the failing step's row stays on record
                raise FloatingPointError(
                    f"non-finite loss or gradient at step {version}; the last "
                    "checkpoint is intact; set nan_policy='skip' to skip such steps"
                )
            logging.warning(
                "step %d: non-finite loss or gradient, update skipped (%d so far)", version, rs.nonfinite_steps
            )
        due = version % config.eval.every == 0 or version == config.num_steps
        if due and sample_eval.concurrent and version != config.num_steps:
            self._submit_evaluation(version, sample_eval, compute)
        elif due:
            with self._trainer_evaluating():
                if sample_eval.concurrent:
                    self._evaluations.wait()  # the earlier rows first
                    sample_eval.pin(version)
                metrics.update(self.evaluate(version, sample_eval))
            metrics.update(rs.rewards.metrics())  # with the evaluation's items
            metrics.update(rs.meter.metrics())
        metrics["pipeline/trainer_eval_frac"] = self._trainer_eval_s / max(time.monotonic() - self._started, 1e-9)
        self.write(version, metrics)
        self._step_times.append(time.time())
        eta = None
        if len(self._step_times) > 1:
            per_step = (self._step_times[-1] - self._step_times[0]) / (len(self._step_times) - 1)
            eta = per_step * (config.num_steps - version)
        logging.info(format_progress(version, config.num_steps, metrics, eta, self.last_eval))
        aligned = config.schedule.kind != "ppo_off_policy" or version % config.schedule.k == 0
        if version % config.checkpoint.every == 0 and aligned:
            self.checkpoint(version)
