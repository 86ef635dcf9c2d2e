"""Builders of a run's parts from its validated config: the policy's checkpoint and tokenizer, the
task's prompts, the device meshes, the trainer, the generator engine and batcher, the reward, and
the weight-transfer pieces. Each is a function of the config and what it needs. Two reach beyond
the calling thread: `RunTrainStep.compile_ahead_in_background` compiles in a thread of its own
(with a pool of `threads` compiling at once), and `build_transfer` starts this process's
weight-transfer server and talks to the other processes through the coordination service: a
trainer publishes its server's address, a generator that pulls its params looks up the trainers'.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from scalerl_jax import data as data_lib
from scalerl_jax.config.adapters import (
    domain_weights,
    engine_config_of,
    ladder_config,
    max_sequence_length,
    optimizer_config_of,
    pipeline_config_of,
    puzzle_config,
    train_step_config_of,
)
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.contracts.threads import FirstError
from scalerl_jax.data.builders import build_code_file, dataset_kind
from scalerl_jax.data.code_puzzles import PUZZLES
from scalerl_jax.data.code_puzzles import generate_splits as generate_puzzles
from scalerl_jax.data.code_reward import score_code_completions
from scalerl_jax.data.code_rows import TEMPLATES, CodeProblem, code_problem_of_row, read_code_problems
from scalerl_jax.data.mixture import CODE, MATH, MixturePool
from scalerl_jax.data.rewards import RewardTallies
from scalerl_jax.data.rows import read_rows, with_extracted_golds
from scalerl_jax.distributed.roles import Roles
from scalerl_jax.distributed.transport import TRAIN, Routes
from scalerl_jax.distributed.weight_push import ParamsReceiver, ParamsSender
from scalerl_jax.distributed.wiring import start_transfer_server, trainer_transfer_addresses
from scalerl_jax.models import (
    CheckpointTokenizer,
    get_preset,
    load_checkpoint_tokenizer,
    load_hf,
    load_hf_config,
    make_mesh,
    param_shardings,
)
from scalerl_jax.models.config import ModelConfig
from scalerl_jax.pipeline.batching import MIN_LENGTH_BUCKET, octave_buckets
from scalerl_jax.pipeline.config import PipelineConfig
from scalerl_jax.pipeline.generator import SamplingSettings
from scalerl_jax.pipeline.group import Prompt
from scalerl_jax.pipeline.pipeline_rl import sampling_settings
from scalerl_jax.rl import length_penalty
from scalerl_jax.run.policy_source import run_model_overrides
from scalerl_jax.run.sampling_setup import check_think_end, check_token_ids, make_prompt_encoder
from scalerl_jax.run.warm_start import build_warm_start, puzzle_template, synthetic_task
from scalerl_jax.sampler import ContinuousBatcher, Engine
from scalerl_jax.sandbox import CodeVerifier, SandboxLimits
from scalerl_jax.telemetry.compile_events import CompileLog, compile_log, summary
from scalerl_jax.train import init_train_state, make_optimizer, make_train_step
from scalerl_jax.train.compiled import abstract_state
from scalerl_jax.train.flops import devices_peak_flops_per_s, train_step_flops
from scalerl_jax.train.optimizer import learning_rate_schedule

# ---------------------------------------------------------------------------------------------
# Policy and task
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicySource:
    """The Hugging Face directory the run starts from, its tokenizer and its prompt encoder (and
    the code domain's, whose user turn differs, in a run with one)."""

    checkpoint_dir: str
    tokens: CheckpointTokenizer
    encoder: data_lib.PromptEncoder
    code_encoder: data_lib.PromptEncoder | None = None


def check_moe_keys(config: ml_collections.ConfigDict) -> None:
    """The keys that only mean something for a mixture-of-experts policy (`rl.router_replay`,
    `model.router_aux_loss_coef` > 0) are refused when the policy is dense, naming them and the
    key that chose the policy (`model.preset` for a warm start, else `model.checkpoint`, whose
    config.json is read only then)."""
    asked = (["`rl.router_replay` = True"] if config.rl.router_replay else []) + (
        [f"`model.router_aux_loss_coef` = {config.model.router_aux_loss_coef}"]
        if config.model.router_aux_loss_coef
        else []
    )
    if not asked:
        return
    if "warm_start" in config:
        model_config, policy_key = get_preset(config.model.preset), f"`model.preset` = {config.model.preset!r}"
    else:
        checkpoint = config.model.checkpoint
        model_config, policy_key = load_hf_config(checkpoint), f"`model.checkpoint` = {checkpoint!r}"
    if not model_config.num_experts:
        keys, need = ("keys", "need") if len(asked) > 1 else ("key", "needs")
        raise ConfigError(
            f"config {keys} {' and '.join(asked)} {need} a mixture-of-experts policy, but config key "
            f"{policy_key} is a dense one (no experts)"
        )


def build_policy_source(config: ml_collections.ConfigDict, workdir: str) -> PolicySource:
    """The warm-started tiny policy (built if needed) or `model.checkpoint`, with its tokenizer
    (checked: the think-end tag when interrupting, every special and stop id inside the model's
    vocabulary)."""
    checkpoint_dir = build_warm_start(config, workdir) if "warm_start" in config else config.model.checkpoint
    tokens = load_checkpoint_tokenizer(checkpoint_dir)
    check_think_end(config, tokens, checkpoint_dir)
    check_token_ids(config, tokens, checkpoint_dir)
    code_encoder = (
        make_prompt_encoder(config, tokens, checkpoint_dir, template=code_template(config))
        if "code" in config
        else None
    )
    return PolicySource(checkpoint_dir, tokens, make_prompt_encoder(config, tokens, checkpoint_dir), code_encoder)


def code_template(config: ml_collections.ConfigDict) -> str:
    """The code domain's user turn: `code.prompt_template`, else its layout's own (the puzzles',
    or MBPP's / HumanEval's as read off `code.path`)."""
    if config.code.task == PUZZLES:
        return puzzle_template(config)
    return config.code.prompt_template or TEMPLATES[read_code_problems(config.code.path)[0].code_format]


@dataclasses.dataclass(frozen=True)
class AbstractPolicy:
    """The policy's architecture without weights: what a generator fed by weight transfer needs."""

    graphdef: Any
    params: Any  # abstract nnx.State (ShapeDtypeStructs)
    model_config: ModelConfig


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """Encoded prompts of one evaluation set, with what scoring and the samples file need; a code
    set also has each prompt's problem as the sandbox runs it (`code`; its golds are the problems'
    reference solutions, shown in logs only)."""

    name: str
    problems: list[str]
    prompts: list[list[int]]
    golds: list[str]
    labels: list[str] | None
    code: list[CodeProblem] | None = None


@dataclasses.dataclass(frozen=True)
class TaskData:
    """Encoded train prompts with their problems and gold answers, and the evaluation sets.

    The train prompts are the domains' one after another (`domain_sizes`, in `weights`' order;
    empty: math alone); `train_code` maps a code prompt's index to its problem. With a configured
    mixture (`per_domain`) the held-out sets are `eval/<domain>` and `eval/pass_rate` is their
    mean weighted by `weights`."""

    train_problems: list[str]
    train_prompts: list[list[int]]
    train_golds: list[str]
    eval_sets: list[EvalSet]
    num_too_long: int
    domain_sizes: dict[str, int] = dataclasses.field(default_factory=dict)
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    train_code: dict[int, CodeProblem] = dataclasses.field(default_factory=dict)
    per_domain: bool = False

    def domain_of(self, index: int) -> str:
        """The domain of train prompt `index`."""
        offset = 0
        for domain, size in self.domain_sizes.items():
            offset += size
            if index < offset:
                return domain
        return MATH


def _encode_rows(
    rows: list[dict], encoder: data_lib.PromptEncoder, name: str, label_field: str | None
) -> tuple[EvalSet, int]:
    prompt_set = data_lib.build_prompt_set(rows, encoder, label_field=label_field)
    problems = [rows[i]["problem"] for i in prompt_set.source_indices]
    labels = prompt_set.labels if label_field else None
    return EvalSet(name, problems, prompt_set.tokens, prompt_set.answers, labels), prompt_set.num_too_long


def _encode_code(
    problems: Sequence[CodeProblem], encoder: data_lib.PromptEncoder, name: str, labels: Sequence[str] | None
) -> tuple[EvalSet, int]:
    """The code problems that fit `data.max_prompt_tokens`, encoded; how many did not."""
    encoded = encoder.encode([p.problem for p in problems])
    kept = [problems[i] for i in encoded.source_indices]
    return EvalSet(
        name,
        [p.problem for p in kept],
        encoded.tokens,
        [p.reference for p in kept],
        [labels[i] for i in encoded.source_indices] if labels is not None else None,
        kept,
    ), len(problems) - len(kept)


TRANSFER_SPLIT = "transfer"  # the ladder's rungs that are evaluated and never trained


def dataset_builder(config: ml_collections.ConfigDict, workdir: str) -> tuple[Any, str]:
    """The configured TFDS builder (prepared) and the label field of its held-out rows."""
    data_dir = config.data.data_dir or os.path.join(workdir, "tfds")
    kind = dataset_kind(config.data.dataset, config.data.path)
    if kind == "synthetic":
        return data_lib.build_synthetic(data_dir, synthetic_task(config)), "level"
    if kind == "ladder":
        return data_lib.build_ladder(data_dir, ladder_config(config)), "level"
    if kind == "polaris_53k":
        return data_lib.build_polaris(
            data_dir,
            os.path.dirname(os.path.abspath(config.data.path)),
            heldout_size=config.data.heldout_size,
            seed=config.data.heldout_seed,
            gold_extraction=config.data.gold_extraction,
        ), "difficulty"
    return data_lib.build_local_file(
        data_dir,
        config.data.path,
        problem_field=config.data.problem_field,
        answer_field=config.data.answer_field,
        heldout_size=config.data.heldout_size,
        seed=config.data.heldout_seed,
        gold_extraction=config.data.gold_extraction,
        max_solution_steps=config.data.max_solution_steps,
    ), "difficulty"


def load_task(
    config: ml_collections.ConfigDict,
    workdir: str,
    encoder: data_lib.PromptEncoder,
    code_encoder: data_lib.PromptEncoder | None = None,
) -> TaskData:
    """The train prompts and evaluation sets of every domain of `data.mixture` (math alone when
    it is empty), in its order: `load_math_task` and `load_code_task`."""
    weights = domain_weights(config)
    per_domain = bool(config.data.mixture)
    parts: list[TaskData] = []
    for domain in weights:
        if domain == MATH:
            parts.append(load_math_task(config, workdir, encoder, heldout_name="eval/math" if per_domain else "eval"))
        else:
            if code_encoder is None:
                raise ConfigError("config key `data.mixture` has a 'code' weight but the config no `code` section")
            parts.append(load_code_task(config, workdir, code_encoder, heldout_name="eval/code"))
    train_code = {}
    offset = 0
    for part in parts:
        train_code.update({offset + i: problem for i, problem in part.train_code.items()})
        offset += len(part.train_prompts)
    return TaskData(
        [p for part in parts for p in part.train_problems],
        [p for part in parts for p in part.train_prompts],
        [g for part in parts for g in part.train_golds],
        [s for part in parts for s in part.eval_sets],
        sum(part.num_too_long for part in parts),
        {domain: len(part.train_prompts) for domain, part in zip(weights, parts)},
        weights,
        train_code,
        per_domain,
    )


def _require_train_prompts(config: ml_collections.ConfigDict, kept: int, total: int, template_key: str) -> None:
    """ConfigError when none of a domain's `total` training prompts fit `data.max_prompt_tokens`."""
    if not kept:
        raise ConfigError(
            f"config key `data.max_prompt_tokens` = {config.data.max_prompt_tokens}: all {total} training prompts "
            f"are longer (after the prompt template); raise it or shorten `{template_key}`"
        )


def load_code_task(
    config: ml_collections.ConfigDict, workdir: str, encoder: data_lib.PromptEncoder, *, heldout_name: str
) -> TaskData:
    """The code domain: generated puzzles (`code.task='puzzles'`: train and held-out splits, the
    level as each held-out prompt's label) or `code.path` through its TFDS builder (MBPP: its
    train split trains, its test split is held out)."""
    if config.code.task == PUZZLES:
        splits = generate_puzzles(puzzle_config(config))
        train = [p.code_problem(i) for i, p in enumerate(splits["train"])]
        heldout = [p.code_problem(i) for i, p in enumerate(splits["heldout"])][: config.eval.num_prompts]
        labels: list[str] | None = [str(p.level) for p in splits["heldout"]][: config.eval.num_prompts]
    else:
        data_dir = config.data.data_dir or os.path.join(workdir, "tfds")
        builder = build_code_file(data_dir, config.code.path)
        if "train" not in builder.info.splits:
            raise ConfigError(
                f"config key `code.path` = {config.code.path!r}: the file has no training split (HumanEval is an "
                "evaluation set: train on MBPP, evaluate HumanEval with `scalerl evaluate`)"
            )
        train = [code_problem_of_row(row) for row in data_lib.read_split(builder, "train")]
        heldout = [code_problem_of_row(row) for row in data_lib.read_split(builder, "heldout")]
        heldout, labels = heldout[: config.eval.num_prompts], None
    train_set, train_too_long = _encode_code(train, encoder, "train", None)
    heldout_set, heldout_too_long = _encode_code(heldout, encoder, heldout_name, labels)
    _require_train_prompts(config, len(train_set.prompts), len(train), "code.prompt_template")
    assert train_set.code is not None  # a code set
    return TaskData(
        train_set.problems,
        train_set.prompts,
        train_set.golds,
        [heldout_set],
        train_too_long + heldout_too_long,
        train_code=dict(enumerate(train_set.code)),
    )


def load_math_task(
    config: ml_collections.ConfigDict, workdir: str, encoder: data_lib.PromptEncoder, *, heldout_name: str = "eval"
) -> TaskData:
    """Builds the configured TFDS dataset, encodes train / held-out splits (the held-out one named
    `heldout_name`) and the extra eval sets: the ladder's `transfer` split (rungs never trained,
    `eval_transfer`) and `eval.extra`'s files."""
    builder, label = dataset_builder(config, workdir)
    train_rows = data_lib.read_split(builder, "train")
    heldout_rows = data_lib.read_split(builder, "heldout")[: config.eval.num_prompts]
    heldout_rows = [dict(row, **{label: row.get(label, "")}) for row in heldout_rows]
    train, train_too_long = _encode_rows(train_rows, encoder, "train", None)
    heldout, heldout_too_long = _encode_rows(heldout_rows, encoder, heldout_name, label)
    _require_train_prompts(config, len(train.prompts), len(train_rows), "data.prompt_template")
    extra_sets, extra_too_long = [], 0
    if TRANSFER_SPLIT in builder.info.splits:
        transfer, extra_too_long = _encode_rows(
            data_lib.read_split(builder, TRANSFER_SPLIT), encoder, "eval_transfer", label
        )
        extra_sets.append(transfer)
    for name, path in sorted(config.eval.extra.items()):
        fields = {"problem": config.data.problem_field, "answer": config.data.answer_field}
        gold_rows = with_extracted_golds(
            read_rows(path, fields), config.data.gold_extraction, path=path, field=fields["answer"]
        )
        rows = [row.fields for row in gold_rows]
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


def prompt_pool(config: ml_collections.ConfigDict, task: TaskData) -> data_lib.PromptPool | MixturePool:
    """The run's prompt pool: one `PromptPool` over the train prompts, or with a configured
    mixture a `MixturePool` drawing each domain by its weight; No-Positive-Resampling per prompt."""
    npr = config.rl.positive_pass_rate if config.rl.no_positive_resampling else None
    if not task.per_domain:
        return data_lib.PromptPool(len(task.train_prompts), seed=config.seed, npr_threshold=npr)
    return MixturePool(task.domain_sizes, task.weights, seed=config.seed, npr_threshold=npr)


# ---------------------------------------------------------------------------------------------
# Devices, trainer, generator
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
    """The policy's graph, its train state on the trainer mesh, and the train step (`RunTrainStep`)."""

    graphdef: Any
    model_config: ModelConfig
    state: Any
    step_fn: Any


class RunTrainStep:
    """The run's train step: a jitted step (`make_train_step`) whose programs may be compiled
    ahead in a background thread, and whose metrics carry the process's compile counts.

    `compile_ahead_in_background(state, rows, lengths, threads=N)` starts a thread that compiles
    every program a batch of `rows` rows and length buckets `lengths` can run (`compile_ahead` of
    the step, N at once) while the caller goes on (sampler warm-up, first generations); the first call waits
    for it (at most `timeout_s`) and re-raises its error. `close()` drops the programs not yet
    compiling (a run that stops before its first step; else the interpreter's exit would wait for
    every queued compile of the pool). Each call adds to the step's metrics,
    from the process's `CompileLog` (every thread's compiles, generator included):
      compile/count, compile/seconds   compiles (and their seconds) since the log was installed
      compile/in_step                  compiles while this step ran
      compile/after_step0              compiles since this process's first train step began
                                       (metrics step 1; 0 in a run whose programs were all
                                       compiled before it)
      compile/ahead_wait_s             seconds this call waited for the ahead-of-time compiles
                                       (first step only; part of its pipeline/step_s)
    and from the first call on every compile is logged as a warning naming the program.
    """

    def __init__(self, step: Any, *, log: CompileLog, timeout_s: float):
        self.step = step
        self.batch_sharding = step.batch_sharding  # where the run places batches
        self._log = log
        self._timeout_s = timeout_s
        self._thread: threading.Thread | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._errors = FirstError()
        self._first_step_count: int | None = None  # the log's count when the first step began

    def compile_ahead_in_background(self, state: Any, rows: int, lengths: tuple[int, ...], *, threads: int) -> None:
        """Starts compiling the step's programs for `rows` rows and every length in `lengths`
        (the class docstring), `threads` programs at once; `state` is only read for its shapes and
        shardings."""
        compile_ahead = getattr(self.step, "compile_ahead", None)
        if compile_ahead is None:  # a step without programs to compile (e.g. a test's stand-in)
            logging.info("train step: %s has no programs to compile ahead", type(self.step).__name__)
            return
        abstract = abstract_state(state)
        pool = self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="train-compile-ahead")

        def work() -> None:
            start, before = time.perf_counter(), self._log.count()
            try:
                programs = compile_ahead(abstract, rows, lengths, compile_map=pool.map)
            except (concurrent.futures.CancelledError, RuntimeError):
                if not self._closed:
                    raise
                # `close()` cancelled the queue (CancelledError) or shut the pool before the programs
                # were handed to it (RuntimeError: no new futures after shutdown).
                logging.info("train step: compiling ahead stopped with the run")
                return
            finally:
                pool.shutdown(wait=False)
            logging.info(
                "train step: %d programs compiled ahead in %.1f s, %d at once (%d rows, %d length buckets "
                "%d..%d; %.1f s of XLA compiles in this process meanwhile)",
                programs,
                time.perf_counter() - start,
                threads,
                rows,
                len(lengths),
                min(lengths),
                max(lengths),
                self._log.seconds(before),
            )

        self._thread = threading.Thread(
            target=self._errors.guarded("train-compile-ahead", work), name="train-compile-ahead", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Drops the programs still queued to compile ahead; those compiling finish (the pool's
        threads are joined at the interpreter's exit). Idempotent; the step itself stays usable."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def wait_compiled(self) -> float:
        """Waits for the ahead-of-time compiles, if any are running (seconds waited); re-raises
        their error."""
        thread = self._thread
        if thread is None:
            return 0.0
        start = time.perf_counter()
        thread.join(self._timeout_s)
        if thread.is_alive():
            raise TimeoutError(
                f"train step: the ahead-of-time compiles did not finish within {self._timeout_s:.0f} s "
                "(config key `distributed.reply_timeout_s`; `train.compile_ahead=False` compiles at first use)"
            )
        self._thread = None
        self._errors.raise_first()
        waited = time.perf_counter() - start
        logging.info("train step: waited %.1f s for the programs compiled ahead", waited)
        return waited

    def __call__(self, state: Any, batch: dict) -> tuple[Any, dict]:
        waited = self.wait_compiled()
        before = self._log.count()
        if self._first_step_count is None:
            self._first_step_count = before
            logging.info("compiles before the first train step: %s", summary(self._log.events()) if before else "none")
            self._log.warn_from_now("the first train step began")
        state, metrics = self.step(state, batch)
        in_step = self._log.events(before)
        if in_step:
            logging.warning("train step compiled (%s)", summary(in_step))
        metrics = dict(metrics)
        metrics.update(
            {
                "compile/count": float(before + len(in_step)),
                "compile/seconds": self._log.seconds(),
                "compile/in_step": float(len(in_step)),
                "compile/after_step0": float(self._log.count() - self._first_step_count),
                "compile/ahead_wait_s": waited,
            }
        )
        return state, metrics


def build_trainer(config: ml_collections.ConfigDict, checkpoint_dir: str, mesh: jax.sharding.Mesh) -> Trainer:
    """Loads the policy onto the trainer mesh, with the recipe's AdamW and train step; with
    `train.compile_ahead`, the step's programs for every length bucket of the run's batches
    start compiling in a background thread (`RunTrainStep`)."""
    log = compile_log()  # counts this process's compiles from here on
    model = load_hf(checkpoint_dir, mesh=mesh, **run_model_overrides(config))
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(optimizer_config_of(config))
    state, state_shardings = init_train_state(params, optimizer, mesh=mesh)
    step = RunTrainStep(
        build_train_step(config, model.config, graphdef, optimizer, mesh, state_shardings),
        log=log,
        timeout_s=config.distributed.reply_timeout_s,
    )
    if config.train.compile_ahead:
        rows = config.batch.prompts_per_step * config.batch.generations_per_prompt
        threads = config.train.compile_threads or max(1, (os.cpu_count() or 1) // 2)
        step.compile_ahead_in_background(state, rows, train_length_buckets(config), threads=threads)
    return Trainer(graphdef, model.config, state, step)


def train_length_buckets(config: ml_collections.ConfigDict) -> tuple[int, ...]:
    """Every padded row length the run's batch builder can produce: `batch.length_buckets_per_octave`
    buckets to an octave from `MIN_LENGTH_BUCKET` to the longest sequence."""
    max_len = max_sequence_length(config)
    return octave_buckets(min(MIN_LENGTH_BUCKET, max_len), max_len, config.batch.length_buckets_per_octave)


def build_train_step(
    config: ml_collections.ConfigDict,
    model_config: ModelConfig,
    graphdef: Any,
    optimizer: Any,
    mesh: jax.sharding.Mesh,
    state_shardings: Any,
):
    """The run's jitted train step on `mesh` for a state on `state_shardings` (`make_train_step`
    with the config's step settings and the optimizer's learning-rate schedule for 'train/lr')."""
    return make_train_step(
        graphdef,
        optimizer,
        train_step_config_of(config, model_config),
        mesh=mesh,
        state_shardings=state_shardings,
        learning_rate_schedule=learning_rate_schedule(optimizer_config_of(config)),
    )


def build_engine(
    config: ml_collections.ConfigDict, policy: AbstractPolicy, tokens: CheckpointTokenizer, mesh: jax.sharding.Mesh
) -> Engine:
    """The generator's decode engine: slots, cache length, sampling knobs, stop ids, interruption."""
    return Engine(policy.graphdef, policy.model_config, engine_config_of(config, tokens), mesh=mesh)


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


def pipeline_config(
    config: ml_collections.ConfigDict, tokens: CheckpointTokenizer, trainer: Trainer, roles: Roles, start_step: int
) -> PipelineConfig:
    """The leader's pipeline: the run config's schedule and batch, with the MFU denominators of
    its model on the trainer devices and the train step's layout of the sampler's routing."""
    devices = list(roles.trainer_devices)
    return pipeline_config_of(
        config,
        stop_tokens=tokens.stop_ids,
        start_step=start_step,
        train_step_flops=functools.partial(train_step_flops, trainer.model_config),
        peak_flops_per_s=devices_peak_flops_per_s(devices) if devices else None,
        routing=train_step_config_of(config, trainer.model_config).routing,
    )


def generator_sampling(config: ml_collections.ConfigDict, tokens: CheckpointTokenizer) -> SamplingSettings:
    """What every generator's requests share (the same on every process)."""
    return sampling_settings(pipeline_config_of(config, stop_tokens=tokens.stop_ids, start_step=0))


# ---------------------------------------------------------------------------------------------
# Reward
# ---------------------------------------------------------------------------------------------


def code_verifier_of(config: ml_collections.ConfigDict) -> CodeVerifier | None:
    """The run's code verifier (a run with a code domain): its sandbox limits and pool size from
    the `code` section. Built at start-up, before any compile: a machine that cannot contain a
    program as configured (no bubblewrap, no network namespace where one is required) stops the
    run here with SandboxUnavailable saying why."""
    if CODE not in domain_weights(config):
        return None
    c = config.code
    limits = SandboxLimits(wall_s=c.wall_s, cpu_s=c.cpu_s, memory_bytes=c.memory_mb << 20, workers=c.workers)
    return CodeVerifier(limits, require_network_isolation=c.require_network_isolation)


def score_code(
    config: ml_collections.ConfigDict,
    verifier: CodeVerifier | None,
    texts: Sequence[str],
    problems: Sequence[CodeProblem],
) -> data_lib.ScoredBatch:
    """`texts[i]` scored against code problem `problems[i]` in the sandbox, with the run's rewards."""
    if verifier is None:
        raise RuntimeError("a code prompt in a run without a code verifier")
    return score_code_completions(
        texts,
        problems,
        verifier,
        whole_text_when_unfenced=not config.code.fenced_only,
        correct_reward=config.data.reward_correct,
        incorrect_reward=config.data.reward_incorrect,
    )


def make_reward_fn(
    config: ml_collections.ConfigDict,
    tokens: CheckpointTokenizer,
    reward_config: data_lib.RewardConfig,
    verify_pool: data_lib.VerifyPool,
    pool: data_lib.PromptPool | MixturePool,
    task: TaskData,
    tallies: RewardTallies,
    code_verifier: CodeVerifier | None = None,
) -> Callable[[Prompt, Sequence[Any]], list[float]]:
    """`(prompt, completions) -> rewards`: verify the answers (a code prompt's programs in the
    sandbox), shape lengths, update the pool history, count the items the reward failed on in
    `tallies.training` (`data/reward_*`, `data/code_*`)."""
    length_shaping = config.rl.length_control == "length_penalty"

    def reward_fn(prompt: Prompt, completions: Sequence[Any]) -> list[float]:
        index = prompt.key
        assert isinstance(index, int)  # the run's prompt source keys prompts by their index in the task
        texts = [tokens.tokenizer.decode(list(c.tokens)) for c in completions]
        problems = [task.train_problems[index]] * len(texts)
        golds = [task.train_golds[index]] * len(texts)
        code = task.train_code.get(index)
        if code is None:
            scored = data_lib.score_completions(texts, golds, reward_config, pool=verify_pool, problems=problems)
        else:
            scored = score_code(config, code_verifier, texts, [code] * len(texts))
        tallies.training.add(scored, problems, golds, code=code is not None)
        rewards = np.asarray(scored.rewards, np.float32)
        if length_shaping:
            lengths = jnp.asarray([len(c.tokens) for c in completions], jnp.float32)
            penalty = np.asarray(
                length_penalty(lengths, l_max=config.rl.length_penalty_max, l_cache=config.rl.length_penalty_cache)
            )
            rewards = rewards + np.where(scored.correct, penalty, 0.0)
        pool.record(index, int(scored.correct.sum()), len(completions))
        return rewards.tolist()

    return reward_fn


# ---------------------------------------------------------------------------------------------
# Weight transfer between processes
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
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

    def targets(processes: Sequence[int]) -> dict[int, Any]:
        return {g: param_shardings(abstract_params, generator_mesh(config, roles, g)) for g in processes}

    offer: Callable[[str, int, Any], None] | None = None
    if roles.is_trainer:
        assert trainer_mesh is not None  # a trainer process has trainer devices
        senders = {TRAIN: ParamsSender(trainer_mesh, server, targets(routes.transfer_generators))}

        def offer_to_senders(purpose: str, ident: int, params: Any) -> None:
            senders[purpose].offer(params, ident)

        offer = offer_to_senders

    pull = None
    if needs_pull:
        addresses = trainer_transfer_addresses(roles, timeout_s=config.distributed.connect_timeout_s)
        receiver = ParamsReceiver(targets([roles.process])[roles.process], abstract_params, server, addresses)
        pull = receiver.pull
    return TransferSide(offer, pull)
