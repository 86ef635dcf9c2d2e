"""The config schema is the one place that lists keys: docs/config.md is generated from it, every
key the code reads is in it, and the tables that used to be kept by hand (resume rule, program
sizing) are derived from it with the values they had."""

import ast
import pathlib
import re

import pytest
from repo_paths import REPO

from scalerl_jax.config import recipes, schema
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.validation import validate

ROOT = pathlib.Path(REPO)
# Where ConfigDicts are read: the configuration package, the composition root, the entry points and
# the user's config files (the libraries take dataclasses; tests/test_layering.py holds that).
READERS = [path for d in ("config", "run", "cli") for path in sorted((ROOT / "scalerl_jax" / d).rglob("*.py"))]
READERS += sorted((ROOT / "configs").glob("*.py"))
CONFIG_NAMES = {"config", "c", "base", "baseline", "saved"}  # names a ConfigDict goes by in those files
CONFIG_DICT_METHODS = {
    "get",
    "items",
    "keys",
    "values",
    "to_dict",
    "lock",
    "unlock",
    "update",
    "copy_and_resolve_references",
}
SECTIONS = {name.split(".")[0] for name in schema.BY_NAME if "." in name}
TOP_LEVEL = {name for name in schema.BY_NAME if "." not in name}


def chain(node: ast.AST) -> list[str] | None:
    """`a.b.c` -> ['a', 'b', 'c'] for a chain of attributes on a name; None otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def key_of(section: str | None, attributes: list[str]) -> str | None:
    """The config key an attribute chain reads: below a section alias (`s = config.sampler`),
    or from the config itself; None when the chain reads no key (a method, another object)."""
    if section is None:
        if not attributes or attributes[0] in CONFIG_DICT_METHODS:
            return None
        if attributes[0] in TOP_LEVEL:
            return attributes[0]
        if attributes[0] not in SECTIONS:  # another object that goes by a config's name (a ModelConfig)
            return None
        section, attributes = attributes[0], attributes[1:]
    if not attributes or attributes[0] in CONFIG_DICT_METHODS:
        return None
    return f"{section}.{attributes[0]}"


def keys_read(source: str) -> set[str]:
    """Every config key an attribute chain reads in `source`, through `config.section.key` or a
    section bound to a name first in the same function (`s, b = config.sampler, config.batch`)."""
    tree = ast.parse(source)
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    module_level = [node for node in tree.body if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found = set()
    for scope in [*functions, *module_level]:
        found |= _keys_read_in(scope)
    return found


def _keys_read_in(scope: ast.AST) -> set[str]:
    aliases: dict[str, str] = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            targets, values = node.targets[0], node.value
            pairs = (
                zip(targets.elts, values.elts)
                if isinstance(targets, ast.Tuple) and isinstance(values, ast.Tuple)
                else [(targets, values)]
            )
            for target, value in pairs:
                parts = chain(value)
                if isinstance(target, ast.Name) and parts and parts[0] in CONFIG_NAMES and len(parts) == 2:
                    if parts[1] in SECTIONS:
                        aliases[target.id] = parts[1]
    inner = {id(node.value) for node in ast.walk(scope) if isinstance(node, ast.Attribute)}
    found = set()
    for node in ast.walk(scope):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        parts = chain(node)
        if not parts:
            continue
        if parts[0] in CONFIG_NAMES:
            key = key_of(None, parts[1:])
        elif parts[0] in aliases:
            key = key_of(aliases[parts[0]], parts[1:])
        else:
            continue
        if key:
            found.add(key)
    return found


def test_keys_read_follows_attributes_and_section_aliases():
    source = (
        "def f(config):\n"
        "    s, b = config.sampler, config.batch\n"
        "    d = config.data\n"
        "    return s.num_pages + b.microbatches + config.rl.eps_max + config.seed + len(d.get('x'))\n"
        "    config.eval.extra.items()\n"
        "    config.sampler.num_pagez\n"
    )
    assert keys_read(source) == {
        "sampler.num_pages",
        "batch.microbatches",
        "rl.eps_max",
        "seed",
        "eval.extra",
        "sampler.num_pagez",
    }


def test_every_key_the_code_reads_is_in_the_schema():
    unlisted = {
        f"{path.relative_to(ROOT)}: {key}"
        for path in READERS
        for key in keys_read(path.read_text())
        if key not in schema.BY_NAME
    }
    assert sorted(unlisted) == []


def test_every_key_a_message_names_is_in_the_schema():
    """Backquoted dotted names in the checks' strings (`config key \\`sampler.num_pages\\``) are
    keys of the schema (or a section's wildcard, `batch.*`)."""
    named = set()
    for path in sorted((ROOT / "scalerl_jax" / "config").glob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                for name in re.findall(r"`--config\.([a-z_.]+)|`([a-z_]+\.[a-z_.*]+)`", node.value):
                    name = name[0] or name[1]
                    if name.split(".")[0] in SECTIONS:
                        named.add((path.name, name))
    unknown = {f"{file}: {name}" for file, name in named if name not in schema.BY_NAME and not name.endswith(".*")}
    assert sorted(unknown) == []


def test_docs_config_md_is_generated_from_the_schema():
    """`scalerl config-docs --out docs/config.md` regenerates it."""
    assert (ROOT / "docs" / "config.md").read_text() == schema.markdown()


def test_the_baseline_recipe_is_the_schema_defaults():
    config = recipes.scalerl_8b()
    assert sorted(schema.flat_keys(config)) == sorted(
        key.name for key in schema.KEYS if key.name.split(".")[0] not in schema.OPTIONAL_SECTIONS
    )
    assert config.sampler.num_pages == 0 and config.rl.objective == "cispo" and config.optimizer.lr == 5e-7
    assert config.mesh.generator_fraction == 0.8


def test_generator_fraction_takes_a_number_or_auto_from_the_command_line():
    config = recipes.scalerl_8b()
    config.mesh.generator_fraction = "auto"  # a FieldReference of type object: no type error
    assert config.mesh.generator_fraction == "auto"


def test_defaults_pass_their_own_checks():
    validate(recipes.scalerl_8b(), check_files=False)
    validate(recipes.tiny(), check_files=False)


def test_a_section_outside_the_optional_ones_is_refused():
    with pytest.raises(ValueError, match="not an optional section"):
        schema.section_config("sampler")


def test_an_unlisted_key_is_named_with_the_schema():
    config = recipes.tiny()
    config.sampler.num_pagez = 4
    with pytest.raises(ConfigError, match=r"`sampler.num_pagez` is unknown \(not in scalerl_jax/config/schema.py\)"):
        validate(config, check_files=False)


# The tables that were kept by hand before the schema (run/programs.py SIZED_BY and
# config_validation.RESUMABLE_CHANGES at 31388c7), as sets: the schema must give the same.
TRAIN_BATCH_KEYS = {
    "batch.prompts_per_step",
    "batch.generations_per_prompt",
    "batch.microbatches",
    "data.max_prompt_tokens",
    "sampler.max_new_tokens",
    "model.remat_policy",
    "model.attention_impl",
    "model.logprob_chunk",
    "mesh.trainer_shape",
    "mesh.generator_fraction",
}
SIZED_BY_BEFORE = {
    "train/accumulate": TRAIN_BATCH_KEYS,
    "train/step": TRAIN_BATCH_KEYS,
    "train/init_state": {"mesh.trainer_shape", "mesh.generator_fraction", "model.dtype"},
    "generator/prefill": {
        "sampler.num_slots",
        "sampler.num_pages",
        "sampler.prefill_chunk",
        "sampler.max_prefill_rows",
        "data.max_prompt_tokens",
        "mesh.generator_shape",
        "mesh.generator_fraction",
        "eval.concurrent",
    },
    "generator/decode_chunk": {
        "sampler.num_slots",
        "sampler.num_pages",
        "sampler.chunk_steps",
        "sampler.max_new_tokens",
        "mesh.generator_shape",
        "mesh.generator_fraction",
        "eval.concurrent",
    },
    "push/offer": {"mesh.trainer_shape", "mesh.generator_shape", "mesh.generator_fraction"},
}
RESUMABLE_BEFORE = {
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
    "sampler.prefill_chunk",
    "sampler.max_prefill_rows",
    "sampler.share_prompts",
    "sampler.compile_ahead",
    "train.compile_ahead",
    "train.compile_threads",
    "batch.sort_by_length",
    "batch.length_buckets_per_octave",
}


@pytest.mark.parametrize("program", sorted(SIZED_BY_BEFORE))
def test_the_keys_that_size_a_program_are_those_of_the_hand_table(program):
    assert set(schema.sized_by(program)) == SIZED_BY_BEFORE[program]


def test_the_keys_a_resume_may_change_are_those_of_the_hand_list():
    assert set(schema.RESUMABLE) == RESUMABLE_BEFORE
