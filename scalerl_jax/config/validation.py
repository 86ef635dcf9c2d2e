"""Checks a run config before anything heavy starts.

Every check appends problems to one list instead of stopping at the first, so a person sees
everything that is wrong at once: `validate` raises one `ConfigError` whose message has a line
per problem, each naming the key, its value and what is expected. Numbers are checked with
comparisons that are False for NaN (`low <= x`), so NaN and infinity never slip through a
bound written as `x <= 0`.
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections
from absl import logging

from scalerl_jax.config import schema
from scalerl_jax.config.adapters import domain_weights, interrupts, ladder_config, puzzle_config
from scalerl_jax.config.devices import check_devices
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.relevance import answer_style_warnings, check_irrelevant
from scalerl_jax.config.schema import AUTO_SPLIT, OPEN_UNIT, PROBABILITY, flat_keys, get_key
from scalerl_jax.data.answers import ANSWER_STYLES, parse_styles
from scalerl_jax.data.builders import POLARIS_FILENAME, dataset_kind
from scalerl_jax.data.mixture import CODE, DOMAINS, MATH

GENERATOR_FRACTION = OPEN_UNIT  # `mesh.generator_fraction` when a number


def check_known_keys(config: ml_collections.ConfigDict) -> list[str]:
    """Every key is one the schema lists, and every key of a non-optional section is present."""
    present = set(flat_keys(config))
    problems = [
        f"config key `{key}` is unknown (not in scalerl_jax/config/schema.py)"
        for key in sorted(present)
        if key not in schema.BY_NAME
    ]
    required = {key.name for key in schema.KEYS if key.name.split(".")[0] not in schema.OPTIONAL_SECTIONS}
    problems += [f"config key `{key}` is missing" for key in sorted(required - present)]
    return problems


def check_type(key: schema.Key, value: Any) -> list[str]:
    """One line when `value` is not what `key` takes (its type, choices or bound); else none."""
    if key.type == schema.CHOICE:
        ok = value in key.choices
        expected = f"one of {key.choices!r}"
    elif key.type == schema.BOOL:
        ok, expected = isinstance(value, bool), "True or False"
    elif key.type == schema.STR:
        ok, expected = isinstance(value, str), "a string"
    elif key.type == schema.NUMBER:
        assert key.bound is not None
        ok, expected = key.bound.admits(value), key.bound.describe()
    elif key.type == schema.FRACTION_OR_AUTO:
        ok = value == AUTO_SPLIT or GENERATOR_FRACTION.admits(value)
        expected = (
            f"{GENERATOR_FRACTION.describe()}, or {AUTO_SPLIT!r} to pick the split at start-up from measured "
            "generation and training rates"
        )
    else:  # sequences and mappings: their relations are checked below
        ok, expected = True, ""
    return [] if ok else [f"config key `{key.name}` = {value!r}; expected {expected}"]


def check_values(config: ml_collections.ConfigDict) -> list[str]:
    """Each key's type, choices and bound (`check_type`), ordered budgets (those of forced
    interruption only when it applies: `sampler.engine_config.interrupts`), dividing batches."""
    problems: list[str] = []
    flat = set(flat_keys(config))
    for key in schema.KEYS:
        if key.name in flat:
            problems += check_type(key, get_key(config, key.name))
    problems += check_answer_extraction(config.data)
    problems += check_ladder(config)
    problems += check_mixture(config)
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


def check_ladder(config: ml_collections.ConfigDict) -> list[str]:
    """`data.dataset` = 'ladder' needs a `ladder` section, whose levels are the ladder's rungs
    and whose held-out size leaves every rung problems to train on (`ladder.LadderConfig`)."""
    if config.data.dataset != "ladder":
        return []
    if "ladder" not in config:
        return [
            "config key `data.dataset` = 'ladder' needs a `ladder` section (configs/smollm2_arith.py has one: "
            "`c.ladder = schema.section_config('ladder')`)"
        ]
    try:
        ladder_config(config)
    except ValueError as e:
        return [f"config key {e}"]
    return []


def check_mixture(config: ml_collections.ConfigDict) -> list[str]:
    """`data.mixture` names known domains with weights > 0; a `code` domain needs the `code`
    section, and a `code` section a `code` domain; the code task's levels are well formed."""
    problems = []
    for name, weight in config.data.mixture.items():
        if name not in DOMAINS:
            problems.append(f"config key `data.mixture.{name}`: no such domain; the domains are {', '.join(DOMAINS)}")
        elif isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
            problems.append(f"config key `data.mixture.{name}` = {weight!r}; expected a weight > 0")
    has_code_domain = CODE in config.data.mixture
    if has_code_domain and "code" not in config:
        problems.append(
            "config key `data.mixture` has a 'code' weight but the config no `code` section "
            "(configs/tiny_math_code.py has one: "
            "`c.code = schema.section_config('code')`)"
        )
    if "code" in config and not has_code_domain:
        problems.append(
            "the `code` section is set but `data.mixture` has no `code` weight: add one, or drop the section"
        )
    if "code" in config:
        try:
            puzzle_config(config)
        except (ValueError, TypeError) as e:
            problems.append(f"config keys `code.levels` = {config.code.levels!r}, `code.operators`: {e}")
    return problems


def check_paths(config: ml_collections.ConfigDict) -> list[str]:
    """Local inputs exist (nothing is downloaded at run time)."""
    problems = []
    d = config.data
    kind = dataset_kind(d.dataset, d.path) if MATH in domain_weights(config) else None  # no math data read
    if "code" in config and config.code.task == "file" and not os.path.isfile(config.code.path):
        problems.append(
            f"config key `code.path` = {config.code.path!r}: set it to a local MBPP .jsonl "
            "(../shared/data/mbpp/mbpp.jsonl) or HumanEval .jsonl.gz file"
        )
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
