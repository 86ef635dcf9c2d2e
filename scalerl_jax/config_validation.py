"""Checks a run config before anything heavy starts.

Every check appends problems to one list instead of stopping at the first, so a person sees
everything that is wrong at once: `validate` raises one `ConfigError` whose message has a line
per problem, each naming the key, its value and what is expected. Numbers are checked with
comparisons that are False for NaN (`low <= x`), so NaN and infinity never slip through a
bound written as `x <= 0`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import ml_collections
from absl import logging

from scalerl_jax import recipe
from scalerl_jax.data.answers import ANSWER_FORMATS, ANSWER_STYLES, BOXED, HASHES, parse_styles
from scalerl_jax.data.builders import DATASET_CHOICES, POLARIS_FILENAME, dataset_kind
from scalerl_jax.models.config import ATTENTION_IMPLS, HEAD_PRECISIONS, REMAT_POLICIES, RUN_DTYPES
from scalerl_jax.models.layers import DECODE_KERNELS
from scalerl_jax.models.sharding import split_devices
from scalerl_jax.pipeline.lag import SCHEDULES
from scalerl_jax.rl import AGGREGATIONS, NORMALIZATIONS, OBJECTIVES
from scalerl_jax.rl.length_penalty import LENGTH_CONTROLS
from scalerl_jax.sampler.engine_config import interrupts, max_sequence_length
from scalerl_jax.train.step_config import NAN_POLICIES
from scalerl_jax.wandb_sink import WANDB_MODES

# Sections only some configs carry (the tiny run's warm start and synthetic task), and free-form
# sections whose keys the user names (extra evaluation sets).
OPTIONAL_SECTIONS = ("warm_start", "synthetic")
OPEN_SECTIONS = ("eval.extra",)

# Each choice list is the constant of the module that interprets the key.
CHOICES = {
    "rl.objective": OBJECTIVES,
    "rl.aggregation": AGGREGATIONS,
    "rl.advantage_normalization": NORMALIZATIONS,
    "rl.length_control": LENGTH_CONTROLS,
    "schedule.kind": SCHEDULES,
    "data.dataset": DATASET_CHOICES,
    "data.answer_format": ANSWER_FORMATS,
    "model.dtype": RUN_DTYPES,
    "model.head_precision": HEAD_PRECISIONS,
    "model.attention_impl": ATTENTION_IMPLS,
    "model.remat_policy": REMAT_POLICIES,
    "sampler.decode_kernel": DECODE_KERNELS,
    "nan_policy": NAN_POLICIES,
    "logging.wandb_mode": WANDB_MODES,
}
BOOLS = (
    "model.fp32_head",
    "model.scan_layers",
    "data.use_chat_template",
    "rl.zero_variance_filter",
    "rl.refill_zero_variance",
    "rl.no_positive_resampling",
    "rl.mask_truncated_completions",
    "batch.sort_by_length",
    "mesh.require_accelerator",
    "sampler.compile_ahead",
    "eval.concurrent",
    "train.compile_ahead",
)
STRINGS = (
    "model.preset",
    "model.checkpoint",
    "data.path",
    "data.data_dir",
    "data.problem_field",
    "data.answer_field",
    "data.prompt_template",
    "data.reward_fn",
    "data.answer_extraction",
    "data.gold_extraction",
    "sampler.interruption_phrase",
    "sampler.think_end",
    "logging.wandb_project",
)


@dataclasses.dataclass(frozen=True)
class Bound:
    """A numeric range: `low` <(=) x <(=) `high` (None: unbounded), optionally integers only."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def admits(self, value: Any) -> bool:
        """True when `value` is a finite number (an int if `integer`) inside the range."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return kind + (" " + " and ".join(parts) if parts else "")


COUNT = Bound(1, integer=True)
NON_NEGATIVE_INT = Bound(0, integer=True)
POSITIVE = Bound(0, low_open=True)
NON_NEGATIVE = Bound(0)
PROBABILITY = Bound(0, 1)
BETA = Bound(0, 1, high_open=True)
FINITE = Bound()

NUMBERS: dict[str, Bound] = {
    "seed": NON_NEGATIVE_INT,
    "num_steps": COUNT,
    "model.logprob_chunk": COUNT,
    "data.heldout_size": COUNT,
    "data.heldout_seed": NON_NEGATIVE_INT,
    "data.max_solution_steps": NON_NEGATIVE_INT,
    "data.max_prompt_tokens": COUNT,
    "data.reward_correct": FINITE,
    "data.reward_incorrect": FINITE,
    "data.verify_timeout_s": POSITIVE,
    "data.verify_workers": COUNT,
    "batch.prompts_per_step": COUNT,
    "batch.generations_per_prompt": Bound(2, integer=True),
    "batch.microbatches": COUNT,
    "batch.length_buckets_per_octave": COUNT,
    "rl.eps_max": POSITIVE,
    "rl.eps_low": BETA,
    "rl.eps_high": NON_NEGATIVE,
    "rl.positive_pass_rate": Bound(0, 1, low_open=True),
    "rl.length_penalty_max": COUNT,
    "rl.length_penalty_cache": COUNT,
    "sampler.temperature": POSITIVE,
    "sampler.top_p": Bound(0, 1, low_open=True),
    "sampler.top_k": NON_NEGATIVE_INT,
    "sampler.num_slots": COUNT,
    "sampler.chunk_steps": COUNT,
    "sampler.max_new_tokens": COUNT,
    "sampler.think_budget_min": COUNT,
    "sampler.think_budget_max": COUNT,
    "sampler.answer_budget": COUNT,
    "sampler.page_size": COUNT,
    "sampler.num_pages": NON_NEGATIVE_INT,
    "train.compile_threads": NON_NEGATIVE_INT,
    "schedule.k": COUNT,
    "schedule.queue_groups": NON_NEGATIVE_INT,
    "optimizer.lr": POSITIVE,
    "optimizer.warmup_steps": NON_NEGATIVE_INT,
    "optimizer.b1": BETA,
    "optimizer.b2": BETA,
    "optimizer.eps": POSITIVE,
    "optimizer.weight_decay": NON_NEGATIVE,
    "optimizer.max_grad_norm": NON_NEGATIVE,
    "mesh.cpu_devices": NON_NEGATIVE_INT,
    "distributed.connect_timeout_s": POSITIVE,
    "distributed.heartbeat_s": POSITIVE,
    "distributed.heartbeat_timeout_s": POSITIVE,
    "distributed.reply_timeout_s": POSITIVE,
    "eval.every": COUNT,
    "eval.num_prompts": COUNT,
    "eval.samples_per_prompt": COUNT,
    "eval.samples_logged": NON_NEGATIVE_INT,
    "checkpoint.every": COUNT,
    "checkpoint.keep": COUNT,
}
OPTIONAL_NUMBERS: dict[str, Bound] = {
    "warm_start.seed": NON_NEGATIVE_INT,
    "warm_start.steps": COUNT,
    "warm_start.batch_size": COUNT,
    "warm_start.lr": POSITIVE,
    "warm_start.warmup_steps": NON_NEGATIVE_INT,
    "warm_start.weight_decay": NON_NEGATIVE,
    "warm_start.direct_answer_fraction": PROBABILITY,
    "warm_start.max_len": COUNT,
    "warm_start.tokenizer_vocab_size": Bound(259, integer=True),
    "warm_start.log_every": COUNT,
    "synthetic.seed": NON_NEGATIVE_INT,
    "synthetic.heldout_size": COUNT,
    "synthetic.sft_size": COUNT,
    "synthetic.train_size": COUNT,
}


class ConfigError(ValueError):
    """Config values that cannot run; `problems` holds one line per problem, each naming its key."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} config problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


def _get(config: Any, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if part not in node:
            raise ConfigError(f"config key `{dotted}` is missing")
        node = node[part]
    return node


def _flat_keys(config: Any, prefix: str = "") -> Iterable[str]:
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, (ml_collections.ConfigDict, dict)) and path not in OPEN_SECTIONS:
            yield from _flat_keys(value, path + ".")
        else:
            yield path


def check_known_keys(config: ml_collections.ConfigDict) -> list[str]:
    """Every key must be one the baseline recipe defines (or lie in an optional section)."""
    known = set(_flat_keys(recipe.scalerl_8b()))
    problems = [
        f"config key `{key}` is unknown (not in scalerl_jax/recipe.py's baseline)"
        for key in _flat_keys(config)
        if key not in known and key.split(".")[0] not in OPTIONAL_SECTIONS
    ]
    present = set(_flat_keys(config))
    problems += [f"config key `{key}` is missing" for key in sorted(known - present)]
    return problems


def _check_number(key: str, value: Any, bound: Bound) -> list[str]:
    if bound.admits(value):
        return []
    return [f"config key `{key}` = {value!r}; expected {bound.describe()}"]


# `mesh.generator_fraction`: a number in (0, 1), or this string: the split is picked at start-up
# from measured generation and training rates (`run.device_split`).
AUTO_SPLIT = "auto"
GENERATOR_FRACTION = Bound(0, 1, low_open=True, high_open=True)


def check_generator_fraction(value: Any) -> list[str]:
    """`mesh.generator_fraction` is a number in (0, 1) or 'auto'."""
    if value == AUTO_SPLIT or GENERATOR_FRACTION.admits(value):
        return []
    return [
        f"config key `mesh.generator_fraction` = {value!r}; expected {GENERATOR_FRACTION.describe()}, "
        f"or {AUTO_SPLIT!r} to pick the split at start-up from measured generation and training rates"
    ]


def check_values(config: ml_collections.ConfigDict) -> list[str]:
    """Enumerations, booleans, strings, finite numbers in range, ordered budgets (those of forced
    interruption only when it applies: `sampler.engine_config.interrupts`), dividing batches."""
    problems: list[str] = []
    flat = set(_flat_keys(config))
    for key, allowed in CHOICES.items():
        if key in flat and _get(config, key) not in allowed:
            problems.append(f"config key `{key}` = {_get(config, key)!r}; expected one of {allowed}")
    for key in BOOLS:
        if key in flat and not isinstance(_get(config, key), bool):
            problems.append(f"config key `{key}` = {_get(config, key)!r}; expected True or False")
    for key in STRINGS:
        if key in flat and not isinstance(_get(config, key), str):
            problems.append(f"config key `{key}` = {_get(config, key)!r}; expected a string")
    for key, bound in {**NUMBERS, **OPTIONAL_NUMBERS}.items():
        if key in flat:
            problems += _check_number(key, _get(config, key), bound)
    problems += check_generator_fraction(config.mesh.generator_fraction)
    problems += check_answer_extraction(config.data)
    if problems:  # the relations below assume well-typed values
        return problems
    s, b, rl = config.sampler, config.batch, config.rl
    # The think and answer budgets size forced interruption only; without it no code reads them.
    if interrupts(config) and not s.think_budget_min <= s.think_budget_max <= s.max_new_tokens:
        problems.append(
            "config keys `sampler.think_budget_min` <= `sampler.think_budget_max` <= `sampler.max_new_tokens` "
            f"must hold, got {s.think_budget_min}, {s.think_budget_max}, {s.max_new_tokens}"
        )
    if interrupts(config) and s.answer_budget > s.max_new_tokens:
        problems.append(
            f"config key `sampler.answer_budget` = {s.answer_budget} exceeds "
            f"`sampler.max_new_tokens` = {s.max_new_tokens}"
        )
    if rl.length_penalty_cache > rl.length_penalty_max:
        problems.append(
            f"config key `rl.length_penalty_cache` = {rl.length_penalty_cache} exceeds "
            f"`rl.length_penalty_max` = {rl.length_penalty_max}"
        )
    if config.data.reward_correct <= config.data.reward_incorrect:
        problems.append(
            f"config keys `data.reward_correct` = {config.data.reward_correct} must exceed "
            f"`data.reward_incorrect` = {config.data.reward_incorrect}"
        )
    if (b.prompts_per_step * b.generations_per_prompt) % b.microbatches:
        problems.append(
            f"config key `batch.microbatches` = {b.microbatches} must divide the batch's "
            f"{b.prompts_per_step * b.generations_per_prompt} sequences (`batch.prompts_per_step` x "
            "`batch.generations_per_prompt`)"
        )
    if "{problem}" not in config.data.prompt_template:
        problems.append(
            f"config key `data.prompt_template` = {config.data.prompt_template!r} has no {{problem}} placeholder"
        )
    if config.data.reward_fn and ":" not in config.data.reward_fn:
        problems.append(f"config key `data.reward_fn` = {config.data.reward_fn!r}; expected 'package.module:function'")
    a_range = tuple(config.eval.fit_a_range)
    if len(a_range) != 2 or not all(PROBABILITY.admits(x) for x in a_range) or not a_range[0] < a_range[1]:
        problems.append(f"config key `eval.fit_a_range` = {a_range!r}; expected (low, high) with 0 <= low < high <= 1")
    for name, path in config.eval.extra.items():
        if not isinstance(path, str) or not path:
            problems.append(f"config key `eval.extra.{name}` = {path!r}; expected a path to a jsonl or parquet file")
    if "warm_start" in config and config.warm_start.max_len < 2:
        problems.append(f"config key `warm_start.max_len` = {config.warm_start.max_len}; expected >= 2")
    return problems


def check_answer_extraction(data: ml_collections.ConfigDict) -> list[str]:
    """`data.answer_extraction` is a style list (`answers.parse_styles`: known, distinct, none
    empty) and `data.gold_extraction` is '' or one; a line per bad key (other types are reported
    by the string check)."""
    problems = []
    allowed = ", ".join(ANSWER_STYLES)
    for key, empty_ok in (("answer_extraction", False), ("gold_extraction", True)):
        value = data.get(key)
        if not isinstance(value, str) or (empty_ok and value == ""):
            continue
        try:
            parse_styles(value)
        except ValueError:
            problems.append(
                f"config key `data.{key}` = {value!r}; expected a comma-separated list of distinct answer styles "
                f"from {allowed}" + (", or '' for the answer field as is" if empty_ok else "")
            )
    return problems


def answer_style_warnings(config: ml_collections.ConfigDict) -> list[str]:
    """One line each: the prompt template asks for a `\\boxed{}` answer but `boxed` is not among
    `data.answer_extraction`'s styles, or for a `####` line without `hashes` (the reward would not
    read what the model is told to write); `data.gold_extraction` under the synthetic task (its
    golds are generated). Assumes `check_values` passed."""
    warnings = []
    d = config.data
    styles = parse_styles(d.answer_extraction)
    for marker, asked, style in (("\\boxed", "\\boxed{}", BOXED), ("####", "####", HASHES)):
        if marker in d.prompt_template and style not in styles:
            warnings.append(
                f"config key `data.prompt_template` asks for {asked} but `data.answer_extraction` = "
                f"{d.answer_extraction!r} does not read it; add {style!r} to `data.answer_extraction` or change "
                "the template"
            )
    if d.gold_extraction and d.dataset == "synthetic":
        warnings.append(
            f"config key `data.gold_extraction` = {d.gold_extraction!r} has no effect: `data.dataset` = "
            "'synthetic' generates its gold answers"
        )
    return warnings


def check_irrelevant(config: ml_collections.ConfigDict) -> tuple[list[str], list[str]]:
    """Settings that another key makes irrelevant: `(problems, warnings)`, each naming both keys.

    Refused (problems): a setting whose being ignored changes what the run trains, so the run
    would not be the one asked for: `model.checkpoint` beside a `warm_start` section (the
    warm-started policy is trained instead), `data.path` under the synthetic task (the generated
    task is trained instead), `rl.refill_zero_variance` with `rl.zero_variance_filter` off (the
    refill filters anyway). Warned about (one line each): a value the run ignores without
    changing what it trains: clip ranges of an objective that does not read them, the positive
    pass rate without No-Positive-Resampling, interruption or a think-end tag under
    `answer_format='plain'`, a length penalty that starts past `sampler.max_new_tokens`,
    `data.reward_correct` beside a custom reward, a wandb mode without a project. Keys with a
    default are flagged only when they differ from the baseline recipe's value, so a config that
    merely carries the defaults (every shipped one) gets no line. Assumes `check_values` passed.
    """
    problems: list[str] = []
    warnings: list[str] = []
    baseline = recipe.scalerl_8b()
    d, rl, s = config.data, config.rl, config.sampler

    def changed(key: str) -> bool:
        return _get(config, key) != _get(baseline, key)

    if "warm_start" in config and config.model.checkpoint:
        problems.append(
            f"config key `model.checkpoint` = {config.model.checkpoint!r} is not used: this config has a "
            "`warm_start` section, which builds and trains its own policy (configs/tiny.py). To train that "
            "checkpoint, use a config without `warm_start` (e.g. configs/scalerl_8b.py); to train the "
            "warm-started policy, leave `model.checkpoint` empty"
        )
    if d.dataset == "synthetic" and d.path:
        problems.append(
            f"config key `data.path` = {d.path!r} is not used: `data.dataset` = 'synthetic' trains on the "
            "generated arithmetic task; set `data.dataset` to 'jsonl' or 'polaris_53k' to train on the file"
        )
    if d.max_solution_steps and dataset_kind(d.dataset, d.path) != "jsonl":
        problems.append(
            f"config key `data.max_solution_steps` = {d.max_solution_steps} is not used: it narrows a local "
            f"jsonl/parquet file of worked solutions, and `data.dataset` = {d.dataset!r} with `data.path` = "
            f"{d.path!r} reads {dataset_kind(d.dataset, d.path)!r}; set it to 0"
        )
    if rl.refill_zero_variance and not rl.zero_variance_filter:
        problems.append(
            "config keys `rl.refill_zero_variance` = True and `rl.zero_variance_filter` = False contradict each "
            "other: refilling drops zero-variance groups and samples new ones, so the run would filter them. "
            "Set `rl.zero_variance_filter` = True for DAPO's dynamic sampling, or `rl.refill_zero_variance` = "
            "False to train on every group"
        )
    if rl.objective == "cispo":
        for key in ("rl.eps_low", "rl.eps_high"):
            if changed(key):
                warnings.append(
                    f"config key `{key}` = {_get(config, key)!r} has no effect: `rl.objective` = 'cispo' "
                    "truncates the importance weight at `rl.eps_max` and clips nothing"
                )
    elif changed("rl.eps_max"):
        warnings.append(
            f"config key `rl.eps_max` = {rl.eps_max!r} has no effect: `rl.objective` = {rl.objective!r} clips "
            "the ratio at `rl.eps_low` / `rl.eps_high`; only cispo reads `rl.eps_max`"
        )
    if not rl.no_positive_resampling and changed("rl.positive_pass_rate"):
        warnings.append(
            f"config key `rl.positive_pass_rate` = {rl.positive_pass_rate!r} has no effect: "
            "`rl.no_positive_resampling` = False retires no prompts"
        )
    if d.answer_format == "plain":
        if rl.length_control == "interruption":
            warnings.append(
                "config key `rl.length_control` = 'interruption' has no effect: `data.answer_format` = 'plain' "
                "has no think phase to interrupt, so completions end only at `sampler.max_new_tokens`; set "
                "`rl.length_control` to 'none' or 'length_penalty' to say so"
            )
        if changed("sampler.think_end"):
            warnings.append(
                f"config key `sampler.think_end` = {s.think_end!r} has no effect: `data.answer_format` = "
                "'plain' takes the last box of the whole completion and nothing interrupts thinking"
            )
    start = rl.length_penalty_max - rl.length_penalty_cache
    if rl.length_control == "length_penalty" and start >= s.max_new_tokens:
        warnings.append(
            f"config keys `rl.length_penalty_max` = {rl.length_penalty_max} and `rl.length_penalty_cache` = "
            f"{rl.length_penalty_cache} have no effect: the penalty starts past {start} tokens, and "
            f"`sampler.max_new_tokens` = {s.max_new_tokens} ends every completion before that"
        )
    if d.reward_fn and changed("data.reward_correct"):
        warnings.append(
            f"config key `data.reward_correct` = {d.reward_correct!r} has no effect: the custom reward "
            f"`data.reward_fn` = {d.reward_fn!r} gives every reward (`data.reward_incorrect` still scores "
            "its failures)"
        )
    if not config.logging.wandb_project and changed("logging.wandb_mode"):
        warnings.append(
            f"config key `logging.wandb_mode` = {config.logging.wandb_mode!r} has no effect: "
            "`logging.wandb_project` is empty, so nothing is sent to Weights & Biases"
        )
    return problems, warnings


def check_paths(config: ml_collections.ConfigDict) -> list[str]:
    """Local inputs exist (nothing is downloaded at run time)."""
    problems = []
    d = config.data
    kind = dataset_kind(d.dataset, d.path)
    if kind in ("polaris_53k", "jsonl") and not os.path.isfile(d.path):
        problems.append(
            f"config key `data.path` = {d.path!r}: set it to a local .jsonl or .parquet file "
            "(polaris-data-53K.jsonl, with fields problem, answer, difficulty, is read as Polaris-53K)"
        )
    elif kind == "polaris_53k" and os.path.basename(d.path) != POLARIS_FILENAME:
        problems.append(
            f"config key `data.dataset` = 'polaris_53k' reads a file named {POLARIS_FILENAME}, but `data.path` = "
            f"{d.path!r}; set `data.dataset` to '' (the reader follows `data.path`) to train on this file"
        )
    if "warm_start" not in config:
        checkpoint = config.model.checkpoint
        if not checkpoint or not os.path.isfile(os.path.join(checkpoint, "config.json")):
            problems.append(
                f"config key `model.checkpoint` = {checkpoint!r}: set it to a local Hugging Face "
                "directory holding config.json, *.safetensors and tokenizer.json"
            )
    for name, path in config.eval.extra.items():
        if isinstance(path, str) and path and not os.path.isfile(path):
            problems.append(f"config key `eval.extra.{name}` = {path!r}: no such file")
    return problems


def _mesh_shape(shape: Any, num_devices: int) -> tuple[int, ...] | None:
    """`shape` (one entry may be -1: the rest) resolved for `num_devices`, None if they do not fit
    (the rule of `models.make_mesh`)."""
    shape = [int(s) for s in shape]
    known = math.prod(s for s in shape if s != -1)
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape) or num_devices % known:
        return None
    if -1 in shape:
        shape[shape.index(-1)] = num_devices // known
    return tuple(shape) if math.prod(shape) == num_devices else None


def split_problem(
    config: ml_collections.ConfigDict, num_generators: int, num_trainers: int, generators_per_process: Iterable[int]
) -> str | None:
    """Why `num_generators` / `num_trainers` devices cannot run `config` (None: they can): each
    microbatch's rows divide over the trainers, the trainer mesh shape fits them, and each
    generator process's local devices fit the generator mesh shape and split the decode slots
    (and KV pages) into equal groups, one per device of its batch axes (data x fsdp)."""
    b, m, s = config.batch, config.mesh, config.sampler
    rows_per_microbatch = b.prompts_per_step * b.generations_per_prompt // b.microbatches
    if rows_per_microbatch % num_trainers:
        return f"{rows_per_microbatch} sequences per microbatch do not divide over {num_trainers} trainer devices"
    if _mesh_shape(m.trainer_shape, num_trainers) is None:
        return f"`mesh.trainer_shape` {tuple(m.trainer_shape)} does not fit {num_trainers} trainer devices"
    for local in sorted(set(generators_per_process) - {0}):
        shape = _mesh_shape(m.generator_shape, local)
        if shape is None:
            return f"`mesh.generator_shape` {tuple(m.generator_shape)} does not fit {local} generator devices"
        groups = shape[0] * shape[1]
        if s.num_slots % groups or s.num_pages % groups:
            return f"`sampler.num_slots` / `sampler.num_pages` do not split over {groups} generator devices"
    return None


def split_candidates(
    config: ml_collections.ConfigDict, num_devices: int, device_processes: Iterable[int] | None = None
) -> list[int]:
    """The generator device counts g (1 <= g < n; the rest train) that `config` can run with, for
    `mesh.generator_fraction` = g / n (`split_devices` takes the last g devices, ordered by
    process: `device_processes[i]` is device i's process, default all 0). With one device: [1]
    (both roles share it)."""
    processes = [0] * num_devices if device_processes is None else list(device_processes)
    if len(processes) != num_devices:
        raise ValueError(f"split_candidates: {len(processes)} device processes for {num_devices} devices")
    if num_devices == 1:
        return [1]
    counts = []
    for g in range(1, num_devices):
        local = collections.Counter(processes[num_devices - g :])
        if split_problem(config, g, num_devices - g, local.values()) is None:
            counts.append(g)
    return counts


def check_devices(config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int] | None:
    """Counts the run's generator and trainer devices (`models.split_devices`) and checks that each
    microbatch's rows divide over the trainers.

    Returns (generator_devices, trainer_devices). With one device, both roles share it. With
    `mesh.generator_fraction` = 'auto' the split is picked at start-up (`run.device_split`): this
    checks that some split can run (`split_candidates`) and returns None.
    """
    if config.mesh.generator_fraction == AUTO_SPLIT:
        if not split_candidates(config, num_devices):
            problems = [split_problem(config, g, num_devices - g, [g]) for g in range(1, num_devices)]
            raise ConfigError(
                f"config key `mesh.generator_fraction` = 'auto': no split of {num_devices} devices into "
                f"generators and trainers can run this config ({'; '.join(sorted({p for p in problems if p}))})"
            )
        return None
    generator_devices, trainer_devices = split_devices(range(num_devices), config.mesh.generator_fraction)
    generators, trainers = len(generator_devices), len(trainer_devices)
    rows = config.batch.prompts_per_step * config.batch.generations_per_prompt
    rows_per_microbatch = rows // config.batch.microbatches
    if rows_per_microbatch % trainers:
        raise ConfigError(
            f"config keys `batch.*`: {rows_per_microbatch} sequences per microbatch do not divide "
            f"over {trainers} trainer devices (`mesh.generator_fraction` = {config.mesh.generator_fraction} "
            f"of {num_devices} devices)"
        )
    return generators, trainers


def check_backend(config: ml_collections.ConfigDict, platform: str) -> None:
    """A recipe meant for accelerators (`mesh.require_accelerator`) refuses the CPU backend."""
    if platform == "cpu" and config.mesh.require_accelerator:
        raise ConfigError(
            "config key `mesh.require_accelerator` = True, but JAX found only the CPU backend. This "
            "recipe is meant for GPUs: install the CUDA plugin (pip install -e '.[cuda]', see README) "
            "and check `nvidia-smi`, or set --config.mesh.require_accelerator=False to run it on CPU anyway"
        )


# Keys a resumed run may change: how long it runs, how often it evaluates, saves and logs, how the
# sampler holds and reads its KV cache (not what it samples) and how the trainer lays out a batch
# into microbatches (not what it computes). `log_every` was a key no code read, since removed: a
# workdir whose saved config still has it resumes.
RESUMABLE_CHANGES = (
    "num_steps",
    "eval.every",
    "eval.concurrent",
    "checkpoint.every",
    "checkpoint.keep",
    "log_every",
    "eval.samples_logged",
    "logging.wandb_project",
    "logging.wandb_mode",
    "distributed.connect_timeout_s",
    "distributed.heartbeat_s",
    "distributed.heartbeat_timeout_s",
    "distributed.reply_timeout_s",
    "sampler.page_size",
    "sampler.num_pages",
    "sampler.decode_kernel",
    "sampler.compile_ahead",
    "train.compile_ahead",
    "train.compile_threads",
    "batch.sort_by_length",
    "batch.length_buckets_per_octave",
)


def config_json(config: ml_collections.ConfigDict) -> dict:
    """The config as written to `WORKDIR/config.json` (tuples become lists)."""
    return json.loads(json.dumps(config.to_dict(), sort_keys=True, default=str))


def flat_config(config: Any) -> dict[str, Any]:
    """`{dotted_key: value}` of a config or its JSON form (the fingerprint stored in checkpoints)."""
    as_json = config_json(config) if isinstance(config, ml_collections.ConfigDict) else config
    return {key: _get(as_json, key) for key in _flat_keys(as_json)}


def changed_keys(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Keys (other than `RESUMABLE_CHANGES`) whose flat values differ, as '`key` (old -> new)'."""
    keys = sorted(k for k in set(saved) | set(new) if saved.get(k) != new.get(k) and k not in RESUMABLE_CHANGES)
    return [f"`{k}` ({saved.get(k)!r} -> {new.get(k)!r})" for k in keys]


def check_resume(
    config: ml_collections.ConfigDict, workdir: str, saved_fingerprint: dict[str, Any] | None = None
) -> None:
    """A workdir holding checkpoints is resumed only with the config it was started with.

    Compares with `WORKDIR/config.json`, or, when that file is missing or malformed, with
    `saved_fingerprint` (the flat config stored in the newest checkpoint). Raises ConfigError
    naming the keys that differ (other than `RESUMABLE_CHANGES`).
    """
    saved_path = os.path.join(workdir, "config.json")
    checkpoints = os.path.join(workdir, "checkpoints")
    if not (os.path.isdir(checkpoints) and os.listdir(checkpoints)):
        return
    saved, source = None, saved_path
    if os.path.isfile(saved_path):
        try:
            with open(saved_path) as f:
                saved = flat_config(json.load(f))
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            if saved_fingerprint is None:
                raise ConfigError(
                    f"{saved_path} is malformed ({e}) and no checkpoint carries the "
                    "run's config: cannot check that this config matches the run"
                ) from e
    if saved is None:
        if saved_fingerprint is None:
            raise ConfigError(
                f"workdir {workdir!r} holds checkpoints but neither {saved_path} nor a "
                "checkpoint records the run's config: refusing to resume blind"
            )
        saved, source = saved_fingerprint, "the config stored in its newest checkpoint"
    changed = changed_keys(saved, flat_config(config))
    if changed:
        raise ConfigError(
            f"workdir {workdir!r} holds checkpoints of a run with a different config ({source}); "
            f"changed keys: {', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}. Use a new "
            f"--workdir, or the config of that run (only {', '.join(RESUMABLE_CHANGES)} may change on resume)"
        )


def validate(
    config: ml_collections.ConfigDict, *, num_devices: int | None = None, check_files: bool = True
) -> list[str]:
    """All checks; raises one ConfigError listing every problem found. Settings the config makes
    irrelevant (`check_irrelevant`) are problems or warnings; each warning is logged as one
    `config: ...` line, and the warnings are returned."""
    problems = check_known_keys(config)
    warnings: list[str] = []
    if not problems:
        problems += check_values(config)
        if not problems:
            irrelevant, warnings = check_irrelevant(config)
            problems += irrelevant
            warnings += answer_style_warnings(config)
        if check_files:
            problems += check_paths(config)
    if problems:
        raise ConfigError(problems)
    if num_devices is not None:
        check_devices(config, num_devices)
    for warning in warnings:
        logging.warning("config: %s", warning)
    return warnings


# Of a device's memory, the share a run may plan to fill (XLA's workspace, the prefill's and the
# train step's scratch, the host's own processes take the rest).
USABLE_MEMORY_FRACTION = 0.9


def device_memory_bytes(device: Any) -> tuple[int, str]:
    """Memory a JAX `device` has and its name: the allocator's `bytes_limit` when the device
    reports one (GPU, TPU), else the host's physical memory (CPU devices share it)."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 -- a backend without memory statistics raises or returns None
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.platform} device {device.id}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host"


@dataclasses.dataclass(frozen=True)
class MemoryNeed:
    """Estimated bytes of one device's share of a run, from shapes only (`models.memory`):
    `weights` the generator's params, `kv_cache` its KV page pool (`pages` x `page_size` tokens x
    `kv_per_token` bytes, over `kv_groups` devices), `trainer` the train state and activations
    (`MemoryPlan.total`; 0 without a trainer role)."""

    weights: int
    kv_cache: int
    trainer: int
    pages: int
    kv_per_token: int
    kv_groups: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.trainer


def memory_need(
    config: ml_collections.ConfigDict,
    model_config: Any,
    *,
    generator_groups: int,
    trainer_shape: tuple[int, ...] | None,
    platform: str,
) -> MemoryNeed:
    """One device's `MemoryNeed`: a generator device holds all weights and 1/`generator_groups`
    of the KV pool (the slots split over the generator mesh's data x fsdp devices); with
    `trainer_shape` (data, fsdp, tensor) it also trains: `plan_memory` at the run's microbatch of
    prompts x generations / microbatches rows of `data.max_prompt_tokens + sampler.max_new_tokens`
    tokens. The KV pool: `sampler.num_pages` pages, or (0) every slot's ceil(max_len / page_size)."""
    from scalerl_jax.models import memory  # shapes of a Transformer: flax, only when a run asks

    s, b = config.sampler, config.batch
    max_len = max_sequence_length(config)
    pages = s.num_pages or s.num_slots * -(-max_len // s.page_size)
    kv_per_token = memory.kv_bytes_per_token(model_config)
    trainer = 0
    if trainer_shape is not None:
        trainer = memory.plan_memory(
            model_config,
            trainer_shape,
            microbatch=b.prompts_per_step * b.generations_per_prompt // b.microbatches,
            seq_len=max_len,
            logprob_chunk=config.model.logprob_chunk,
            platform=platform,
        ).total
    return MemoryNeed(
        weights=memory.generator_weight_bytes(model_config),
        kv_cache=-(-pages // generator_groups) * s.page_size * kv_per_token,
        trainer=trainer,
        pages=pages,
        kv_per_token=kv_per_token,
        kv_groups=generator_groups,
    )


def check_memory(
    config: ml_collections.ConfigDict, need: MemoryNeed, *, devices: int, capacity: int, where: str
) -> None:
    """Raises one ConfigError when `need` (the bytes of `devices` devices that share `capacity`
    bytes of `where`: CPU devices share the host) exceeds `USABLE_MEMORY_FRACTION` of it: one line
    naming the keys that size the sampler's KV pool (and the trainer), with their values and the
    estimate."""
    if need.total <= USABLE_MEMORY_FRACTION * capacity:
        return
    s, b, gb = config.sampler, config.batch, lambda n: f"{n / 1e9:,.1f} GB"
    tokens = (
        f"{need.pages:,} pages x {s.page_size} tokens"
        if s.num_pages
        else f"{s.num_slots} slots x {max_sequence_length(config):,} tokens"
    )
    parts = [
        f"sampler KV pool {gb(need.kv_cache)} ({tokens} x {need.kv_per_token:,} B per token)",
        f"weights {gb(need.weights)}",
    ]
    keys = [
        ("sampler.num_slots", s.num_slots),
        ("sampler.num_pages", s.num_pages),
        ("data.max_prompt_tokens", config.data.max_prompt_tokens),
        ("sampler.max_new_tokens", s.max_new_tokens),
        ("model.dtype", config.model.dtype),
    ]
    if need.trainer:
        parts.append(f"trainer state and activations {gb(need.trainer)}")
        keys += [
            ("batch.prompts_per_step", b.prompts_per_step),
            ("batch.generations_per_prompt", b.generations_per_prompt),
            ("batch.microbatches", b.microbatches),
            ("model.remat_policy", config.model.remat_policy),
        ]
    raise ConfigError(
        f"config keys {', '.join(f'`{k}` = {v!r}' for k, v in keys)} need about {gb(need.total)} "
        f"({' + '.join(parts)}) on {devices} device{'s' if devices > 1 else ''}, more than "
        f"{USABLE_MEMORY_FRACTION:.0%} of the {where}'s {gb(capacity)}: lower `sampler.num_slots`, "
        "`sampler.max_new_tokens` or `data.max_prompt_tokens`, or cap the KV pool with `sampler.num_pages`"
        + (", or train fewer rows per microbatch (more `batch.microbatches`)" if need.trainer else "")
    )


def check_run_memory(
    config: ml_collections.ConfigDict,
    model_config: Any,
    *,
    generator_devices: Sequence[Any],
    trainer_devices: Sequence[Any] = (),
) -> None:
    """`check_memory` for this process's devices: each generator device holds the weights and its
    share of the KV pool (`mesh.generator_shape` over `generator_devices`), each trainer device its
    share of the train state (`mesh.trainer_shape`); a device in both holds both. CPU devices share
    the host's memory, so their needs add up; an accelerator is checked alone, the fullest one."""
    from scalerl_jax.models import memory  # shapes of a Transformer: flax, only when a run asks

    device = (list(generator_devices) + list(trainer_devices))[0]
    platform = device.platform
    # A process without generator devices (a multi-process run's trainer) holds no KV pool; its
    # shape is one group so that the per-device share is defined (and then counted zero times).
    gen_shape = (
        (_mesh_shape(config.mesh.generator_shape, len(generator_devices)) or (len(generator_devices), 1, 1))
        if generator_devices
        else (1, 1, 1)
    )
    trainer_shape = (
        (_mesh_shape(config.mesh.trainer_shape, len(trainer_devices)) or (1, len(trainer_devices), 1))
        if trainer_devices
        else None
    )
    need = memory_need(
        config,
        model_config,
        generator_groups=gen_shape[0] * gen_shape[1],
        trainer_shape=trainer_shape,
        platform=platform if platform in memory.PLATFORMS else "gpu",
    )
    shared = set(generator_devices) & set(trainer_devices)
    capacity, where = device_memory_bytes(device)
    if platform == "cpu":
        gens, trainers = len(generator_devices), len(trainer_devices)
        devices = len(set(generator_devices) | set(trainer_devices))
    else:
        gens = 1 if generator_devices and (shared or need.weights + need.kv_cache >= need.trainer) else 0
        trainers = 1 if trainer_devices and (shared or not gens) else 0
        devices = 1
    check_memory(
        config,
        dataclasses.replace(
            need, weights=gens * need.weights, kv_cache=gens * need.kv_cache, trainer=trainers * need.trainer
        ),
        devices=devices,
        capacity=capacity,
        where=where,
    )
