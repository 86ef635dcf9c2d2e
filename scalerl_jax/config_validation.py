"""Checks a run config before anything heavy starts; every error names the offending key."""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

import ml_collections

from scalerl_jax import recipe

# Sections only some configs carry (the tiny run's warm start and synthetic task).
OPTIONAL_SECTIONS = ("warm_start", "synthetic")

CHOICES = {
    "rl.objective": ("cispo", "dapo", "grpo", "gspo"),
    "rl.aggregation": ("prompt", "sample", "token"),
    "rl.advantage_normalization": ("batch", "prompt", "none"),
    "rl.length_control": ("interruption", "length_penalty", "none"),
    "schedule.kind": ("pipeline", "ppo_off_policy"),
    "data.dataset": ("polaris_53k", "synthetic", "jsonl"),
    "model.dtype": ("float32", "bfloat16"),
    "nan_policy": ("skip", "stop"),
}
POSITIVE_INTS = (
    "num_steps", "batch.prompts_per_step", "batch.generations_per_prompt", "batch.microbatches",
    "sampler.num_slots", "sampler.chunk_steps", "sampler.max_new_tokens", "sampler.answer_budget",
    "schedule.k", "eval.every", "eval.num_prompts",
    "eval.samples_per_prompt", "checkpoint.every", "checkpoint.keep", "data.max_prompt_tokens",
    "model.logprob_chunk",
)


class ConfigError(ValueError):
    """A config value that cannot run; the message starts with the key."""


def _get(config: ml_collections.ConfigDict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if part not in node:
            raise ConfigError(f"config key `{dotted}` is missing")
        node = node[part]
    return node


def _flat_keys(config: Any, prefix: str = "") -> Iterable[str]:
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, (ml_collections.ConfigDict, dict)):
            yield from _flat_keys(value, path + ".")
        else:
            yield path


def check_known_keys(config: ml_collections.ConfigDict) -> None:
    """Every key must be one the baseline recipe defines (or lie in an optional section)."""
    known = set(_flat_keys(recipe.scalerl_8b()))
    for key in _flat_keys(config):
        if key in known or key.split(".")[0] in OPTIONAL_SECTIONS:
            continue
        raise ConfigError(f"config key `{key}` is unknown (not in scalerl_jax/recipe.py's baseline)")
    for key in known:
        _get(config, key)


def check_values(config: ml_collections.ConfigDict) -> None:
    """Enumerations, positive sizes, budgets that fit and batches that divide."""
    for key, allowed in CHOICES.items():
        value = _get(config, key)
        if value not in allowed:
            raise ConfigError(f"config key `{key}` = {value!r}; expected one of {allowed}")
    for key in POSITIVE_INTS:
        value = _get(config, key)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"config key `{key}` = {value!r}; expected a positive integer")
    s, b = config.sampler, config.batch
    if not 0 < s.think_budget_min <= s.think_budget_max <= s.max_new_tokens:
        raise ConfigError(
            "config keys `sampler.think_budget_min` <= `sampler.think_budget_max` <= "
            f"`sampler.max_new_tokens` must hold, got {s.think_budget_min}, {s.think_budget_max}, {s.max_new_tokens}"
        )
    if s.temperature <= 0:
        raise ConfigError(f"config key `sampler.temperature` = {s.temperature}; sampling needs > 0")
    if not 0 < s.top_p <= 1:
        raise ConfigError(f"config key `sampler.top_p` = {s.top_p}; expected 0 < top_p <= 1")
    if b.generations_per_prompt < 2:
        raise ConfigError("config key `batch.generations_per_prompt` must be >= 2 (advantages are per-prompt differences)")
    if (b.prompts_per_step * b.generations_per_prompt) % b.microbatches:
        raise ConfigError(
            f"config key `batch.microbatches` = {b.microbatches} must divide the batch's "
            f"{b.prompts_per_step * b.generations_per_prompt} sequences (`batch.prompts_per_step` x `batch.generations_per_prompt`)"
        )
    if not isinstance(config.schedule.queue_groups, int) or config.schedule.queue_groups < 0:
        raise ConfigError(f"config key `schedule.queue_groups` = {config.schedule.queue_groups!r}; expected an int >= 0 (0: automatic)")
    if not 0 < config.mesh.generator_fraction < 1:
        raise ConfigError(f"config key `mesh.generator_fraction` = {config.mesh.generator_fraction}; expected in (0, 1)")
    if not 0 < config.rl.positive_pass_rate <= 1:
        raise ConfigError(f"config key `rl.positive_pass_rate` = {config.rl.positive_pass_rate}; expected in (0, 1]")
    if config.optimizer.lr <= 0 or config.optimizer.eps <= 0:
        raise ConfigError("config keys `optimizer.lr` and `optimizer.eps` must be > 0")
    a_range = tuple(config.eval.fit_a_range)
    if len(a_range) != 2 or not 0 <= a_range[0] < a_range[1] <= 1:
        raise ConfigError(f"config key `eval.fit_a_range` = {a_range!r}; expected (low, high) with 0 <= low < high <= 1")


def check_paths(config: ml_collections.ConfigDict) -> None:
    """Local inputs exist (nothing is downloaded at run time)."""
    if config.data.dataset in ("polaris_53k", "jsonl") and not os.path.isfile(config.data.path):
        raise ConfigError(
            f"config key `data.path` = {config.data.path!r}: set it to a local jsonl file "
            "(for polaris_53k: polaris-data-53K.jsonl with fields problem, answer, difficulty)"
        )
    if "warm_start" not in config:
        checkpoint = config.model.checkpoint
        if not checkpoint or not os.path.isfile(os.path.join(checkpoint, "config.json")):
            raise ConfigError(
                f"config key `model.checkpoint` = {checkpoint!r}: set it to a local Hugging Face "
                "directory holding config.json, *.safetensors and tokenizer.json"
            )


def check_devices(config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int]:
    """Splits devices into generator and trainer sets and checks the batch divides the trainers.

    Returns (generator_devices, trainer_devices). With one device, both roles share it.
    """
    if num_devices == 1:
        return 1, 1
    generators = max(1, min(num_devices - 1, round(num_devices * config.mesh.generator_fraction)))
    trainers = num_devices - generators
    rows = config.batch.prompts_per_step * config.batch.generations_per_prompt
    rows_per_microbatch = rows // config.batch.microbatches
    if rows_per_microbatch % trainers:
        raise ConfigError(
            f"config keys `batch.*`: {rows_per_microbatch} sequences per microbatch do not divide "
            f"over {trainers} trainer devices (`mesh.generator_fraction` = {config.mesh.generator_fraction} "
            f"of {num_devices} devices)"
        )
    return generators, trainers


# Keys a resumed run may change: how long it runs and how often it evaluates and saves.
RESUMABLE_CHANGES = ("num_steps", "eval.every", "checkpoint.every", "checkpoint.keep")


def config_json(config: ml_collections.ConfigDict) -> dict:
    """The config as written to `WORKDIR/config.json` (tuples become lists)."""
    return json.loads(json.dumps(config.to_dict(), sort_keys=True, default=str))


def check_resume(config: ml_collections.ConfigDict, workdir: str) -> None:
    """A workdir holding checkpoints is resumed only with the config it was started with.

    Raises ConfigError naming the keys that differ from `WORKDIR/config.json` (other than
    `RESUMABLE_CHANGES`), instead of silently continuing another run's checkpoints.
    """
    saved_path = os.path.join(workdir, "config.json")
    checkpoints = os.path.join(workdir, "checkpoints")
    if not (os.path.isfile(saved_path) and os.path.isdir(checkpoints) and os.listdir(checkpoints)):
        return
    with open(saved_path) as f:
        saved = json.load(f)
    new = config_json(config)
    old_flat = {key: _get(saved, key) for key in _flat_keys(saved)}
    new_flat = {key: _get(new, key) for key in _flat_keys(new)}
    changed = sorted(k for k in set(old_flat) | set(new_flat)
                     if old_flat.get(k) != new_flat.get(k) and k not in RESUMABLE_CHANGES)
    if changed:
        raise ConfigError(
            f"workdir {workdir!r} holds checkpoints of a run with a different config; changed keys: "
            f"{', '.join(f'`{k}` ({old_flat.get(k)!r} -> {new_flat.get(k)!r})' for k in changed[:8])}"
            f"{' ...' if len(changed) > 8 else ''}. Use a new --workdir, or the config of that run "
            f"(only {', '.join(RESUMABLE_CHANGES)} may change on resume)")


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None, check_files: bool = True) -> None:
    """All checks; raises ConfigError naming the first bad key."""
    check_known_keys(config)
    check_values(config)
    if check_files:
        check_paths(config)
    if num_devices is not None:
        check_devices(config, num_devices)
