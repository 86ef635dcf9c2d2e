"""The composition root: builds a run from a validated config and drives it.

`run(config, workdir)` holds the workdir's lock, checks that a resumed workdir gets its own
config back, then wires the builders below: the policy's checkpoint and tokenizer, the task's
prompts, the device meshes, the trainer, the sampler engine, the scorer, the evaluator, and the
step reporter that writes metrics and checkpoints; the pipeline (`pipeline/`) runs them.

Threads: the pipeline's generator, scoring and trainer threads; `StepReporter.on_step` (metrics,
evaluation, checkpoints) runs in the trainer thread between steps, while the train state is not
donated, and the first evaluation in the same thread before the first step (`Pipeline.on_start`):
evaluation samples on the generators' own batchers (`Pipeline.sample_eval`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from scalerl_jax import data as data_lib
from scalerl_jax import fit as fit_cli
from scalerl_jax.config_validation import ConfigError, check_resume, config_json, flat_config
from scalerl_jax.console import quiet_library_logs
from scalerl_jax.data.rows import read_rows
from scalerl_jax.distributed import coordination
from scalerl_jax.distributed.remote_generator import GeneratorPush, LinkService, ParamsInbox, RemoteLink, first_version
from scalerl_jax.distributed.roles import Roles, assign_roles
from scalerl_jax.distributed.trainer_group import TrainerGroup, TrainerOps, follow, report_restored
from scalerl_jax.distributed.transport import TRAIN, LeaderTransport, Routes, plan_routes
from scalerl_jax.distributed.watchdog import Heartbeat
from scalerl_jax.distributed.weight_push import ParamsReceiver, ParamsSender, push_local
from scalerl_jax.distributed.wiring import (
    ProcessLinks,
    connect_processes,
    start_transfer_server,
    trainer_transfer_addresses,
)
from scalerl_jax.metrics import MetricsWriter, format_progress
from scalerl_jax.models import (
    CheckpointTokenizer,
    abstract_hf,
    load_checkpoint_tokenizer,
    load_hf,
    make_mesh,
    param_shardings,
)
from scalerl_jax.pipeline.generator import GeneratorCounters, GeneratorLoop, SamplingSettings
from scalerl_jax.pipeline.group import Prompt
from scalerl_jax.pipeline.pipeline_rl import Pipeline, PipelineConfig, StepRecord, sampling_settings
from scalerl_jax.pipeline.queue import PipelineStopped
from scalerl_jax.policy_source import run_model_overrides
from scalerl_jax.rl import length_penalty
from scalerl_jax.sampler import Completion, ContinuousBatcher, Engine
from scalerl_jax.sampling_setup import (
    check_think_end,
    interrupts,
    make_engine_config,
    make_prompt_encoder,
    make_reward_config,
    max_sequence_length,
)
from scalerl_jax.scaling import ComputeMeter
from scalerl_jax.train import OptimizerConfig, TrainStepConfig, init_train_state, make_optimizer, make_train_step
from scalerl_jax.train.checkpoint import CheckpointError, RunCheckpointer
from scalerl_jax.train.flops import devices_peak_flops_per_s, train_step_flops
from scalerl_jax.train.optimizer import learning_rate_schedule
from scalerl_jax.warm_start import build_warm_start, synthetic_task
from scalerl_jax.workdir_lock import WorkdirLockedError, hold_workdir

SAMPLES_FILE = "samples.jsonl"
# Failures that end a run with one line naming what and where (no traceback): another run holds
# the workdir, no usable checkpoint, a checkpoint that cannot be written.
RUN_ERRORS = (WorkdirLockedError, CheckpointError)


# ---------------------------------------------------------------------------------------------
# Policy and task
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicySource:
    """The Hugging Face directory the run starts from, its tokenizer and its prompt encoder."""

    checkpoint_dir: str
    tokens: CheckpointTokenizer
    encoder: data_lib.PromptEncoder


def build_policy_source(config: ml_collections.ConfigDict, workdir: str) -> PolicySource:
    """The warm-started tiny policy (built if needed) or `model.checkpoint`, with its tokenizer."""
    checkpoint_dir = build_warm_start(config, workdir) if "warm_start" in config else config.model.checkpoint
    tokens = load_checkpoint_tokenizer(checkpoint_dir)
    check_think_end(config, tokens, checkpoint_dir)
    return PolicySource(checkpoint_dir, tokens, make_prompt_encoder(config, tokens, checkpoint_dir))


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """Encoded prompts of one evaluation set, with what scoring and the samples file need."""

    name: str
    problems: list[str]
    prompts: list[list[int]]
    golds: list[str]
    labels: list[str] | None


@dataclasses.dataclass(frozen=True)
class TaskData:
    """Encoded train prompts with their problems and gold answers, and the evaluation sets."""

    train_problems: list[str]
    train_prompts: list[list[int]]
    train_golds: list[str]
    eval_sets: list[EvalSet]
    num_too_long: int


def _encode_rows(
    rows: list[dict], encoder: data_lib.PromptEncoder, name: str, label_field: str | None
) -> tuple[EvalSet, int]:
    prompt_set = data_lib.build_prompt_set(rows, encoder, label_field=label_field)
    problems = [rows[i]["problem"] for i in prompt_set.source_indices]
    labels = prompt_set.labels if label_field else None
    return EvalSet(name, problems, prompt_set.tokens, prompt_set.answers, labels), prompt_set.num_too_long


def _dataset_builder(config: ml_collections.ConfigDict, workdir: str):
    """The configured TFDS builder (prepared) and the label field of its held-out rows."""
    data_dir = config.data.data_dir or os.path.join(workdir, "tfds")
    if config.data.dataset == "synthetic":
        return data_lib.build_synthetic(data_dir, synthetic_task(config)), "level"
    if config.data.dataset == "polaris_53k":
        return data_lib.build_polaris(
            data_dir,
            os.path.dirname(os.path.abspath(config.data.path)),
            heldout_size=config.data.heldout_size,
            seed=config.data.heldout_seed,
        ), "difficulty"
    return data_lib.build_local_file(
        data_dir,
        config.data.path,
        problem_field=config.data.problem_field,
        answer_field=config.data.answer_field,
        heldout_size=config.data.heldout_size,
        seed=config.data.heldout_seed,
    ), "difficulty"


def load_task(config: ml_collections.ConfigDict, workdir: str, encoder: data_lib.PromptEncoder) -> TaskData:
    """Builds the configured TFDS dataset, encodes train / held-out splits and the extra eval sets."""
    builder, label = _dataset_builder(config, workdir)
    train_rows = data_lib.read_split(builder, "train")
    heldout_rows = data_lib.read_split(builder, "heldout")[: config.eval.num_prompts]
    heldout_rows = [dict(row, **{label: row.get(label, "")}) for row in heldout_rows]
    train, train_too_long = _encode_rows(train_rows, encoder, "train", None)
    heldout, heldout_too_long = _encode_rows(heldout_rows, encoder, "eval", label)
    if not train.prompts:
        raise ConfigError(
            f"config key `data.max_prompt_tokens` = {config.data.max_prompt_tokens}: all {len(train_rows)} "
            "training prompts are longer (after the prompt template); raise it or shorten the template"
        )
    extra_sets, extra_too_long = [], 0
    for name, path in sorted(config.eval.extra.items()):
        rows = [
            row.fields
            for row in read_rows(path, {"problem": config.data.problem_field, "answer": config.data.answer_field})
        ]
        eval_set, too_long = _encode_rows(rows, encoder, f"eval_{name}", None)
        extra_sets.append(eval_set)
        extra_too_long += too_long
    return TaskData(
        train.problems,
        train.prompts,
        train.golds,
        [heldout, *extra_sets],
        train_too_long + heldout_too_long + extra_too_long,
    )


# ---------------------------------------------------------------------------------------------
# Devices, trainer, sampler, scorer
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Meshes:
    """This process's meshes: its local generator devices' (None if it has none) and the trainer
    mesh (None on a process without trainer devices), with the run's device count."""

    generator: jax.sharding.Mesh | None
    trainer: jax.sharding.Mesh | None
    num_devices: int


def generator_mesh(config: ml_collections.ConfigDict, roles: Roles, process: int) -> jax.sharding.Mesh:
    """The local mesh of generator process `process` (any process can build it for any other)."""
    return make_mesh(config.mesh.generator_shape, devices=roles.local_generator_devices(process))


def build_meshes(config: ml_collections.ConfigDict, roles: Roles) -> Meshes:
    return Meshes(
        generator_mesh(config, roles, roles.process) if roles.is_generator else None,
        make_mesh(config.mesh.trainer_shape, devices=roles.trainer_devices) if roles.is_trainer else None,
        len(set(roles.generator_devices) | set(roles.trainer_devices)),
    )


@dataclasses.dataclass
class Trainer:
    """The policy's graph, its train state on the trainer mesh, and the jitted train step."""

    graphdef: Any
    model_config: Any
    state: Any
    step_fn: Any


def build_trainer(config: ml_collections.ConfigDict, checkpoint_dir: str, mesh: jax.sharding.Mesh) -> Trainer:
    """Loads the policy onto the trainer mesh, with the recipe's AdamW and train step."""
    model = load_hf(checkpoint_dir, mesh=mesh, **run_model_overrides(config))
    graphdef, params = nnx.split(model)
    o = config.optimizer
    optimizer_config = OptimizerConfig(
        learning_rate=o.lr,
        warmup_steps=o.warmup_steps,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm or None,
    )
    optimizer = make_optimizer(optimizer_config)
    state, state_shardings = init_train_state(params, optimizer, mesh=mesh)
    step_fn = make_train_step(
        graphdef,
        optimizer,
        TrainStepConfig(
            objective=config.rl.objective,
            aggregation=config.rl.aggregation,
            advantage_normalization=config.rl.advantage_normalization,
            eps_low=config.rl.eps_low,
            eps_high=config.rl.eps_high,
            eps_max=config.rl.eps_max,
            num_microbatches=config.batch.microbatches,
            temperature=config.sampler.temperature,
            logprob_chunk_size=config.model.logprob_chunk,
            skip_nonfinite=config.nan_policy == "skip",
            sort_by_length=config.batch.sort_by_length,
        ),
        mesh=mesh,
        state_shardings=state_shardings,
        learning_rate_schedule=learning_rate_schedule(optimizer_config),
    )
    return Trainer(graphdef, model.config, state, step_fn)


def build_engine(
    config: ml_collections.ConfigDict,
    graphdef: Any,
    model_config: Any,
    tokens: CheckpointTokenizer,
    mesh: jax.sharding.Mesh,
) -> Engine:
    """The generator's decode engine: slots, cache length, sampling knobs, stop ids, interruption."""
    return Engine(graphdef, model_config, make_engine_config(config, tokens), mesh=mesh)


def make_reward_fn(
    config: ml_collections.ConfigDict,
    tokens: CheckpointTokenizer,
    reward_config,
    verify_pool,
    pool: data_lib.PromptPool,
    task: TaskData,
):
    """`(prompt, completions) -> rewards`: verify the answers, shape lengths, update the pool history."""
    length_shaping = config.rl.length_control == "length_penalty"

    def reward_fn(prompt: Prompt, completions) -> list[float]:
        texts = [tokens.tokenizer.decode(list(c.tokens)) for c in completions]
        scored = data_lib.score_completions(
            texts,
            [task.train_golds[prompt.key]] * len(texts),
            reward_config,
            pool=verify_pool,
            problems=[task.train_problems[prompt.key]] * len(texts),
        )
        rewards = np.asarray(scored.rewards, np.float32)
        if length_shaping:
            lengths = np.asarray([len(c.tokens) for c in completions], np.float32)
            penalty = np.asarray(
                length_penalty(lengths, l_max=config.rl.length_penalty_max, l_cache=config.rl.length_penalty_cache)
            )
            rewards = rewards + np.where(scored.correct, penalty, 0.0)
        pool.record(prompt.key, int(scored.correct.sum()), len(completions))
        return rewards.tolist()

    return reward_fn


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


class Evaluator:
    """Every evaluation set, sampled by `sample_eval(version, prompts, seed_offset)` (on the
    generators' own batchers, beside training: `Pipeline.sample_eval`), scored here.

    `__call__(version)` returns the metrics of all sets (held-out under `eval/`, extras
    under `eval_<name>/`) and appends, for the first `eval.samples_logged` held-out prompts, every
    sample (rendered prompt, completion, extracted answer, gold, reward, finish reason) to
    `WORKDIR/samples.jsonl`. Request i of an evaluation at version v samples with the PRNG stream
    `(v << 20) + i`.
    """

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        task: TaskData,
        source: PolicySource,
        sample_eval: Callable[[int, list[list[int]], int], list[Completion]],
        reward_config,
        verify_pool,
        samples_path: str,
    ):
        self._config, self._task, self._source = config, task, source
        self._sample_eval, self._reward_config, self._pool = sample_eval, reward_config, verify_pool
        self._samples_path = samples_path

    def __call__(self, version: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for eval_set in self._task.eval_sets:
            metrics.update(self._evaluate(eval_set, version))
        return metrics

    def _evaluate(self, eval_set: EvalSet, version: int) -> dict[str, float]:
        samples = self._config.eval.samples_per_prompt
        problems = [p for p in eval_set.problems for _ in range(samples)]
        captured: dict[str, Any] = {}

        def sample(prompts):
            captured["completions"] = self._sample_eval(version, prompts, version << 20)
            return captured["completions"]

        def score(texts, golds):
            captured["texts"] = texts
            captured["scored"] = data_lib.score_completions(
                texts, golds, self._reward_config, pool=self._pool, problems=problems
            )
            return captured["scored"]

        result = data_lib.evaluate(
            sample,
            eval_set.prompts,
            eval_set.golds,
            num_samples=samples,
            decode=lambda t: self._source.tokens.tokenizer.decode(t),
            reward_fn=score,
            difficulties=eval_set.labels,
            prefix=eval_set.name,
        )
        if eval_set.name == "eval":
            self._write_samples(eval_set, version, captured)
        return result.metrics

    def _write_samples(self, eval_set: EvalSet, version: int, captured: dict[str, Any]) -> None:
        samples, logged = self._config.eval.samples_per_prompt, self._config.eval.samples_logged
        scored = captured["scored"]
        with open(self._samples_path, "a", encoding="utf-8") as f:
            for index in range(min(logged, len(eval_set.prompts)) * samples):
                completion = captured["completions"][index]
                problem = eval_set.problems[index // samples]
                f.write(
                    json.dumps(
                        {
                            "step": version,
                            "set": eval_set.name,
                            "prompt_index": index // samples,
                            "sample": index % samples,
                            "prompt": self._source.encoder.text(problem),
                            "completion": captured["texts"][index],
                            "extracted_answer": scored.predictions[index],
                            "gold": eval_set.golds[index // samples],
                            "reward": float(scored.rewards[index]),
                            "outcome": scored.outcomes[index],
                            "finish_reason": completion.finish_reason,
                            "last_token": completion.tokens[-1] if completion.tokens else None,
                            "num_tokens": len(completion.tokens),
                        }
                    )
                    + "\n"
                )


# ---------------------------------------------------------------------------------------------
# Per-step reporting: metrics, evaluation, checkpoints
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RunState:
    """Host-side state saved with every checkpoint beside the train state."""

    pool: data_lib.PromptPool
    meter: ComputeMeter
    nonfinite_steps: int = 0


class StepReporter:
    """`on_step(record)`: metrics row and progress line, evaluation and checkpoints of one step."""

    def __init__(
        self,
        config,
        task: TaskData,
        run_state: RunState,
        writers: Sequence[Any],
        evaluator: Evaluator,
        checkpointer: RunCheckpointer,
        group: TrainerGroup,
        state: Any,
        fingerprint: dict,
    ):
        self._config, self._task, self._run_state = config, task, run_state
        self._writers, self._evaluator, self._checkpointer = writers, evaluator, checkpointer
        self._group = group  # every trainer process saves with the leader
        self.state = state  # the newest trained state, pushed to the sampler or not
        self._fingerprint = fingerprint
        self._step_times: list[float] = []
        self.last_eval: tuple[int, float] | None = None

    def write(self, version: int, metrics: dict) -> None:
        for writer in self._writers:
            writer.write(version, metrics)

    def evaluate(self, version: int) -> dict[str, float]:
        metrics = self._evaluator(version)
        self.last_eval = (version, metrics["eval/pass_rate"])
        return metrics

    def checkpoint(self, version: int) -> None:
        rs = self._run_state
        run_state = {
            "version": version,
            "pool": rs.pool.state_dict(),
            "meter": rs.meter.state_dict(),
            "metrics_offset": self._writers[0].offset(),
            "nonfinite_steps": rs.nonfinite_steps,
        }
        self._group.checkpoint(
            version, lambda: self._checkpointer.save(version, self.state, run_state, config=self._fingerprint)
        )

    def on_step(self, record: StepRecord) -> None:
        config, rs = self._config, self._run_state
        version = record.version + 1
        self.state = record.train_state
        metrics = dict(record.metrics)
        finite = bool(metrics.get("train/finite", 1.0))
        rs.nonfinite_steps += int(not finite)
        rewards = np.concatenate([g.rewards for g in record.groups])
        rs.meter.add_tokens(
            generated=sum(g.num_generated_tokens for g in record.groups),
            trained=int(metrics.get("train/num_loss_tokens", 0)),
        )
        metrics.update(
            {
                "train/reward_mean": float(rewards.mean()),
                "train/pass_rate": float((rewards > 0).mean()),
                "train/nonfinite_steps": rs.nonfinite_steps,
                "data/prompts_too_long": self._task.num_too_long,
                **rs.pool.metrics(),
                **rs.meter.metrics(),
                "compute/unit": "device_hours",
            }
        )
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
        if version % config.eval.every == 0 or version == config.num_steps:
            metrics.update(self.evaluate(version))
            metrics.update(rs.meter.metrics())
        self.write(version, metrics)
        self._step_times.append(time.time())
        eta = None
        if len(self._step_times) > 1:
            eta = (
                (self._step_times[-1] - self._step_times[0])
                / (len(self._step_times) - 1)
                * (config.num_steps - version)
            )
        logging.info(format_progress(version, config.num_steps, metrics, eta, self.last_eval))
        aligned = config.schedule.kind != "ppo_off_policy" or version % config.schedule.k == 0
        if version % config.checkpoint.every == 0 and aligned:
            self.checkpoint(version)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def preserved_signal_handlers() -> Iterator[None]:
    """Restores the SIGINT / SIGTERM handlers found on entry (the caller keeps its Ctrl-C)."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:
                signal.signal(signum, handler)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any] | None:
    """Runs this process's part of the configured job to `num_steps` (or a stop).

    Works out the process's roles (`distributed/roles.py`), prepares the shared files once
    (process 0: the workdir lock, the warm start, the TFDS dataset), connects the processes, and
    runs the leader, a follower trainer or a generator process. Returns the leader's summary dict
    (None elsewhere). Restores the caller's signal handlers on the way out.
    """
    quiet_library_logs()
    os.makedirs(workdir, exist_ok=True)
    roles = assign_roles(jax.devices(), config.mesh.generator_fraction, jax.process_index(), jax.process_count())
    logging.info("%s", roles.describe())
    if roles.distributed:  # host-side array math runs here, not on global device 0 (process 0's)
        jax.config.update("jax_default_device", jax.local_devices()[0])
    d = config.distributed
    with preserved_signal_handlers(), contextlib.ExitStack() as stack:
        coordination.run_once(
            "prepare", lambda: prepare_shared_files(config, workdir, stack), timeout_s=d.connect_timeout_s
        )
        source = build_policy_source(config, workdir)
        links = connect_processes(roles, timeout_s=d.connect_timeout_s) if roles.distributed else None
        heartbeat = (
            Heartbeat(links.heartbeats(), interval_s=d.heartbeat_s, timeout_s=d.heartbeat_timeout_s) if links else None
        )
        policy = abstract_hf(source.checkpoint_dir, **run_model_overrides(config))
        meshes = build_meshes(config, roles)
        transfer = build_transfer(config, roles, plan_routes(roles), policy[1], meshes.trainer)
        if roles.is_leader:
            summary = _run_leader(config, workdir, roles, source, links, meshes, transfer)
        elif roles.is_trainer:
            summary = _run_follower(config, workdir, roles, source, links, meshes, transfer, policy)
        else:
            summary = _run_generator(config, roles, source, links, meshes, transfer, policy)
        if heartbeat is not None:  # a process that fails says no goodbye: the others see it lost
            heartbeat.close()
        return summary


def prepare_shared_files(config: ml_collections.ConfigDict, workdir: str, stack: contextlib.ExitStack) -> None:
    """Process 0 (the leader), once for the run: holds the workdir lock (for the run's life, in
    `stack`); refuses, before any work, a workdir whose checkpoints belong to another config and a
    custom reward that does not load; writes `config.json`; builds the warm-started policy and the
    TFDS dataset that every process reads."""
    stack.enter_context(hold_workdir(workdir))
    check_workdir_config(config, workdir)
    check_custom_reward(config)
    if "warm_start" in config:
        build_warm_start(config, workdir)
    _dataset_builder(config, workdir)


def check_workdir_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    """A resumed workdir must get its own config back (`check_resume`); then `config.json` is written."""
    checkpointer = RunCheckpointer(workdir, keep=config.checkpoint.keep, processes=(0,))
    try:
        saved = checkpointer.saved_config()
    finally:
        checkpointer.close()
    check_resume(config, workdir, saved_fingerprint=saved)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config_json(config), f, indent=2, sort_keys=True)


def check_custom_reward(config: ml_collections.ConfigDict) -> None:
    """Imports `data.reward_fn` and calls it once on a dummy item in a worker, before any heavy work."""
    if config.data.reward_fn:
        try:
            data_lib.check_reward_fn(config.data.reward_fn, time_limit_s=config.data.verify_timeout_s)
        except ValueError as e:
            raise ConfigError(f"config key `data.reward_fn` = {config.data.reward_fn!r}: {e}") from e


# ---------------------------------------------------------------------------------------------
# Params routes: weight transfer between processes
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TransferSide:
    """This process's weight-transfer pieces: offers (trainer processes) and pulls (generators)."""

    offer: Callable[[str, int, Any], None] | None  # (purpose, transfer id = version, params)
    pull: Callable[[int], Any] | None  # version -> params on this generator's shardings


def build_transfer(
    config: ml_collections.ConfigDict,
    roles: Roles,
    routes: Routes,
    abstract_params: Any,
    trainer_mesh: jax.sharding.Mesh | None,
) -> TransferSide:
    """A sender on trainer processes and a receiver on a generator process that gets its params by
    transfer; nothing otherwise."""
    needs_pull = roles.process in routes.transfer_generators
    if not routes.transfer_generators or not (roles.is_trainer or needs_pull):
        return TransferSide(None, None)
    server = start_transfer_server(roles)
    targets = lambda processes: {
        g: param_shardings(abstract_params, generator_mesh(config, roles, g)) for g in processes
    }
    offer = None
    if roles.is_trainer:
        senders = {TRAIN: ParamsSender(trainer_mesh, server, targets(routes.transfer_generators))}
        offer = lambda purpose, ident, params: senders[purpose].offer(params, ident)
    pull = None
    if needs_pull:
        receiver = ParamsReceiver(
            targets([roles.process])[roles.process],
            abstract_params,
            server,
            trainer_transfer_addresses(roles, timeout_s=config.distributed.connect_timeout_s),
        )
        pull = receiver.pull
    return TransferSide(offer, pull)


# ---------------------------------------------------------------------------------------------
# The three kinds of process
# ---------------------------------------------------------------------------------------------


def _restore(checkpointer: RunCheckpointer, trainer: Trainer) -> dict | None:
    """Restores the newest usable checkpoint into `trainer.state`; its run state, or None."""
    restored = checkpointer.restore_latest(trainer.state)
    if restored is None:
        return None
    trainer.state = restored.train_state
    logging.info("resumed from checkpoint step %d", restored.step)
    return {**restored.run_state, "step": restored.step}


def _run_follower(
    config: ml_collections.ConfigDict,
    workdir: str,
    roles: Roles,
    source: PolicySource,
    links: ProcessLinks,
    meshes: Meshes,
    transfer: TransferSide,
    policy: tuple,
) -> None:
    """A trainer process other than the leader: the same state, the leader's operations; with
    generator devices too, its generator runs in a thread beside them."""
    errors: list[BaseException] = []
    generator = None
    if roles.is_generator:
        generator = threading.Thread(
            target=_capture,
            args=(errors, _run_generator, config, roles, source, links, meshes, transfer, policy),
            name="generator",
            daemon=True,
        )
        generator.start()
    _follow(config, workdir, roles, source, links, meshes.trainer, transfer)
    if generator is not None:
        generator.join(timeout=config.distributed.reply_timeout_s)
    if errors:
        raise errors[0]


def _capture(errors: list[BaseException], fn: Callable, *args) -> None:
    """Runs `fn(*args)` in a thread, keeping its exception for the thread that joins it."""
    try:
        fn(*args)
    except BaseException as error:  # noqa: BLE001 - re-raised by the joining thread
        errors.append(error)


def _follow(
    config: ml_collections.ConfigDict,
    workdir: str,
    roles: Roles,
    source: PolicySource,
    links: ProcessLinks,
    mesh: jax.sharding.Mesh,
    transfer: TransferSide,
) -> None:
    checkpointer = RunCheckpointer(workdir, keep=config.checkpoint.keep, processes=roles.trainer_processes)
    try:
        trainer = build_trainer(config, source.checkpoint_dir, mesh)
        saved = _restore(checkpointer, trainer)
        report_restored(links.leader["trainer"], None if saved is None else saved["step"])
        fingerprint = flat_config(config)

        def train(batch):
            trainer.state, _ = trainer.step_fn(trainer.state, batch)

        ops = TrainerOps(
            train=train,
            offer=lambda ident, purpose: transfer.offer(purpose, ident, trainer.state.params),
            checkpoint=lambda step: checkpointer.save(step, trainer.state, {}, config=fingerprint),
        )
        steps = follow(
            links.leader["trainer"],
            batch_sharding=trainer.step_fn.batch_sharding,
            ops=ops,
            timeout_s=config.distributed.reply_timeout_s,
        )
        logging.info("follower trainer: %d steps, stopped by the leader", steps)
    finally:
        checkpointer.close()


def _run_generator(
    config: ml_collections.ConfigDict,
    roles: Roles,
    source: PolicySource,
    links: ProcessLinks,
    meshes: Meshes,
    transfer: TransferSide,
    policy: tuple,
) -> None:
    """A generator process: its own engine on its local devices, fed by the leader (module doc of
    `distributed/remote_generator.py`); the first announced version starts it. `policy`: the
    checkpoint's (graphdef, abstract params, model config)."""
    d = config.distributed
    graphdef, _, model_config = policy
    engine = build_engine(config, graphdef, model_config, source.tokens, meshes.generator)
    params_connection = links.leader["params"]
    params, version = first_version(params_connection, pull=transfer.pull, timeout_s=d.reply_timeout_s)
    batcher = build_batcher(config, engine, params, version)
    stop = threading.Event()
    inbox = ParamsInbox(params_connection, pull=transfer.pull, batcher=batcher, timeout_s=d.reply_timeout_s)
    errors: list[BaseException] = []

    def receive():
        _capture(errors, inbox.run, stop)
        stop.set()

    thread = threading.Thread(target=receive, name="params-inbox", daemon=True)
    thread.start()
    counters = GeneratorCounters()
    loop = GeneratorLoop(
        batcher,
        RemoteLink(links.leader["control"], timeout_s=d.reply_timeout_s, counters=counters),
        generator_sampling(config, source.tokens),
        counters,
    )
    try:
        loop.run(stop)
    except PipelineStopped:
        pass
    thread.join(timeout=d.heartbeat_timeout_s)
    if errors:
        raise errors[0]
    stats = counters.snapshot()
    logging.info("generator: %d chunks, %.1f s decoding", stats.chunks, stats.busy_s)


def generator_sampling(config: ml_collections.ConfigDict, tokens: CheckpointTokenizer) -> SamplingSettings:
    """What every generator's requests share (the same on every process)."""
    return sampling_settings(build_pipeline_config(config, tokens, None, (), 0))


def _leader_batcher(
    config: ml_collections.ConfigDict,
    source: PolicySource,
    trainer: Trainer,
    meshes: Meshes,
    routes: Routes,
    transfer: TransferSide,
    group: TrainerGroup,
    start_step: int,
) -> ContinuousBatcher | None:
    """Offers version `start_step` to the generators fed by transfer; then the leader's own
    generator batcher holding it (None without generator devices here). It also evaluates."""
    if routes.transfer_generators:
        group.offer(start_step, TRAIN, lambda: transfer.offer(TRAIN, start_step, trainer.state.params))
    if meshes.generator is None:
        return None
    engine = build_engine(config, trainer.graphdef, trainer.model_config, source.tokens, meshes.generator)
    if transfer.pull is not None:
        params = transfer.pull(start_step)
    else:
        params = push_local(trainer.state.params, param_shardings(trainer.state.params, meshes.generator))
    return build_batcher(config, engine, params, start_step)


def build_batcher(config: ml_collections.ConfigDict, engine: Engine, params: Any, version: int) -> ContinuousBatcher:
    """The generator's batcher holding `params` at `version`; with `sampler.compile_ahead`, every
    decode-path program for prompts up to `data.max_prompt_tokens` is compiled before it returns,
    so no compile stalls decoding later (`Engine.warm_up`)."""
    batcher = ContinuousBatcher(engine, params, version=version, seed=config.seed)
    if config.sampler.compile_ahead:
        start = time.perf_counter()
        batcher.warm_up(config.data.max_prompt_tokens)
        logging.info(
            "generator: compiled %d decode-path programs ahead in %.1f s",
            sum(engine.compile_counts.values()),
            time.perf_counter() - start,
        )
    return batcher


def _run_leader(
    config: ml_collections.ConfigDict,
    workdir: str,
    roles: Roles,
    source: PolicySource,
    links: ProcessLinks | None,
    meshes: Meshes,
    transfer: TransferSide,
) -> dict[str, Any]:
    """The leader: the run's decisions and outputs. Its collective steps (checkpointer, trainer,
    restore) come in the same order as a follower's."""
    checkpointer = RunCheckpointer(workdir, keep=config.checkpoint.keep, processes=roles.trainer_processes)
    try:
        return _lead(config, workdir, roles, source, links, checkpointer, meshes, transfer)
    finally:
        checkpointer.close()


def _lead(
    config: ml_collections.ConfigDict,
    workdir: str,
    roles: Roles,
    source: PolicySource,
    links: ProcessLinks | None,
    checkpointer: RunCheckpointer,
    meshes: Meshes,
    transfer: TransferSide,
) -> dict[str, Any]:
    run_start = time.time()
    task = load_task(config, workdir, source.encoder)
    trainer = build_trainer(config, source.checkpoint_dir, meshes.trainer)

    run_state = RunState(
        pool=data_lib.PromptPool(
            len(task.train_prompts),
            seed=config.seed,
            npr_threshold=config.rl.positive_pass_rate if config.rl.no_positive_resampling else None,
        ),
        meter=ComputeMeter(),
    )
    start_step, metrics_offset = 0, None
    saved = _restore(checkpointer, trainer)
    if saved is not None:
        start_step, metrics_offset = int(saved["version"]), int(saved["metrics_offset"])
        run_state.pool.load_state_dict(saved["pool"])
        run_state.meter.load_state_dict(saved["meter"])
        run_state.nonfinite_steps = int(saved["nonfinite_steps"])

    routes = plan_routes(roles)
    group = TrainerGroup(
        list(links.of_role("trainer").values()) if links else [],
        process=roles.process,
        step_fn=trainer.step_fn,
        batch_sharding=trainer.step_fn.batch_sharding,
    )
    group.check_restored(None if saved is None else saved["step"], timeout_s=config.distributed.reply_timeout_s)
    remote_params = [c for p, c in links.of_role("params").items()] if links else []
    remote = GeneratorPush(remote_params, timeout_s=config.distributed.reply_timeout_s) if remote_params else None
    batcher = _leader_batcher(config, source, trainer, meshes, routes, transfer, group, start_step)
    transport = LeaderTransport(
        routes, group=group, offer=transfer.offer, local_batcher=batcher, local_pull=transfer.pull, remote=remote
    )
    if remote is not None:
        remote.announce(start_step)  # the offer was made with the local one

    reward_config = make_reward_config(config)
    verify_pool = data_lib.VerifyPool(
        config.data.verify_workers, time_limit_s=config.data.verify_timeout_s, reward_fn=reward_config.reward_fn
    )
    writers = [MetricsWriter(workdir, resume_offset=metrics_offset)]
    if config.logging.wandb_project:
        from scalerl_jax.wandb_sink import WandbSink  # optional extra

        writers.append(
            WandbSink(
                project=config.logging.wandb_project,
                mode=config.logging.wandb_mode,
                workdir=workdir,
                config=config_json(config),
            )
        )

    def prompt_source() -> Prompt:
        index = run_state.pool.next_prompts(1)[0]
        return Prompt(index, tuple(task.train_prompts[index]))

    pipeline = Pipeline(
        build_pipeline_config(config, source.tokens, trainer.model_config, roles.trainer_devices, start_step),
        batcher=batcher,
        prompt_source=prompt_source,
        reward_fn=make_reward_fn(config, source.tokens, reward_config, verify_pool, run_state.pool, task),
        train_step=group.train_step,
        train_state=trainer.state,
        push_params=transport.push,
        remote_generators=[
            (f"link-{process}", LinkService(conn, timeout_s=config.distributed.reply_timeout_s).serve)
            for process, conn in (links.of_role("control").items() if links else [])
        ],
    )
    # Evaluation samples on the pipeline's generators, so it runs inside the pipeline's trainer thread.
    evaluator = Evaluator(
        config, task, source, pipeline.sample_eval, reward_config, verify_pool, os.path.join(workdir, SAMPLES_FILE)
    )
    reporter = StepReporter(
        config, task, run_state, writers, evaluator, checkpointer, group, trainer.state, flat_config(config)
    )
    pipeline.on_step = reporter.on_step

    def first_evaluation() -> None:
        initial = reporter.evaluate(0)
        reporter.write(0, {**initial, **run_state.meter.metrics(), "compute/unit": "device_hours"})
        logging.info("step 0: held-out pass rate %.3f", initial["eval/pass_rate"])

    pipeline.on_start = first_evaluation if start_step == 0 else None
    run_state.meter.start(meshes.num_devices)
    try:
        result = pipeline.run()
        reporter.state = result.train_state
        if result.version > start_step and result.version % config.checkpoint.every != 0:
            reporter.checkpoint(result.version)
    finally:
        run_state.meter.stop()
        verify_pool.close()
        for writer in writers:
            writer.close()
    group.stop()
    if remote is not None:
        remote.stop()
    summary = {
        "steps": result.version,
        "stop_reason": result.stop_reason,
        "queued_groups_at_stop": len(result.queued_group_ids),
        "minutes": (time.time() - run_start) / 60,
    }
    low, high = config.eval.fit_a_range
    fit_cli.main([workdir, "--a-range", f"{low},{high}", "--plot", os.path.join(workdir, "scaling.png")])
    return summary


def build_pipeline_config(
    config: ml_collections.ConfigDict,
    tokens: CheckpointTokenizer,
    model_config: Any,
    trainer_devices: Sequence[jax.Device],
    start_step: int,
) -> PipelineConfig:
    """Schedule, batch shape, sampling, stopping and the MFU denominators of the pipeline
    (`model_config` None: no FLOP counts, as on a generator process)."""
    return PipelineConfig(
        max_new_tokens=config.sampler.max_new_tokens,
        max_seq_len=max_sequence_length(config),
        schedule=config.schedule.kind,
        k=config.schedule.k,
        prompts_per_step=config.batch.prompts_per_step,
        samples_per_prompt=config.batch.generations_per_prompt,
        num_steps=max(0, config.num_steps - start_step),
        capacity=config.schedule.queue_groups or None,
        zero_variance=(
            "refill" if config.rl.refill_zero_variance else "drop" if config.rl.zero_variance_filter else "none"
        ),
        temperature=config.sampler.temperature,
        stop_tokens=tokens.stop_ids,
        interrupt=interrupts(config),
        min_length_bucket=min(32, max_sequence_length(config)),
        seed=config.seed,
        first_version=start_step,
        length_buckets_per_octave=config.batch.length_buckets_per_octave,
        sort_by_length=config.batch.sort_by_length,
        microbatches=config.batch.microbatches,
        mask_truncated=config.rl.mask_truncated_completions,
        train_step_flops=None if model_config is None else functools.partial(train_step_flops, model_config),
        peak_flops_per_s=devices_peak_flops_per_s(list(trainer_devices)) if trainer_devices else None,
    )
