"""A run's policy exported as a Hugging Face checkpoint directory (`scalerl_jax.cli.export` is its
command line).

The params come from the run's orbax checkpoint at a step (default: the latest); the architecture
and the tokenizer from the run's base checkpoint (its warm start, or `model.checkpoint`). The
directory receives `config.json` and `model.safetensors` (sharded with
`model.safetensors.index.json` above 5 GiB) in the run's `model.dtype`, the base's tokenizer files
(`TOKENIZER_FILES` that exist there) and `generation_config.json` (the base's, or one with the
model's bos/eos ids), loadable by `transformers.AutoModelForCausalLM` and `AutoTokenizer`. It is
written under `DIR.tmp` and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil

from flax import nnx

from scalerl_jax.models import save_hf
from scalerl_jax.models.config import ModelConfig
from scalerl_jax.run import policy_source

# Copied from the base checkpoint when present (tokenizer.json is required).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


GENERATION_CONFIG_FILE = "generation_config.json"


EXPORT_INFO_FILE = "scalerl_export.json"


class ExportError(ValueError):
    """An export that cannot proceed; the message names the path."""


def check_out_dir(out_dir: str, *, overwrite: bool) -> None:
    """Refuse an existing non-empty `out_dir` unless `overwrite` (a file there is always refused)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"--out {out_dir!r} exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ExportError(f"--out {out_dir!r} exists and is not empty; pass --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise ExportError(f"--out {out_dir!r}: the directory {parent!r} does not exist")


def copy_tokenizer_files(base_dir: str, out_dir: str) -> list[str]:
    """Copies the base's `TOKENIZER_FILES` that exist into `out_dir`; returns their names."""
    if not os.path.isfile(os.path.join(base_dir, "tokenizer.json")):
        raise ExportError(f"base checkpoint {base_dir!r} has no tokenizer.json")
    copied = []
    for name in TOKENIZER_FILES:
        source = os.path.join(base_dir, name)
        if os.path.isfile(source):
            shutil.copyfile(source, os.path.join(out_dir, name))
            copied.append(name)
    return copied


def write_generation_config(base_dir: str, out_dir: str, model_config: ModelConfig) -> None:
    """The base's generation_config.json, or, when it has none, one naming the model's bos/eos ids."""
    source = os.path.join(base_dir, GENERATION_CONFIG_FILE)
    target = os.path.join(out_dir, GENERATION_CONFIG_FILE)
    if os.path.isfile(source):
        shutil.copyfile(source, target)
        return
    eos = model_config.eos_token_id
    with open(target, "w") as f:
        json.dump(
            {"bos_token_id": model_config.bos_token_id, "eos_token_id": list(eos) if isinstance(eos, tuple) else eos},
            f,
            indent=2,
        )


def export_run(run_dir: str, out_dir: str, *, step: int | None = None, overwrite: bool = False) -> str:
    """Writes the policy of `run_dir` at checkpoint `step` (default: latest) as an HF directory
    `out_dir` (see the module docstring); returns `out_dir`."""
    config = policy_source.load_run_config(run_dir)
    base_dir = policy_source.base_checkpoint_dir(config, run_dir)
    step = policy_source.resolve_step(run_dir, step)
    check_out_dir(out_dir, overwrite=overwrite)
    policy = policy_source.load_run_policy(run_dir, config, step=step)
    staging = out_dir.rstrip(os.sep) + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        save_hf(nnx.merge(policy.graphdef, policy.params), staging, dtype=config.model.dtype)
        copy_tokenizer_files(base_dir, staging)
        write_generation_config(base_dir, staging, policy.model_config)
        with open(os.path.join(staging, EXPORT_INFO_FILE), "w") as f:
            json.dump(
                {
                    "run_dir": os.path.abspath(run_dir),
                    "step": step,
                    "base_checkpoint": os.path.abspath(base_dir),
                    "dtype": config.model.dtype,
                },
                f,
                indent=2,
            )
    except OSError:  # a read-only or full disk: leave no half-written staging directory
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)
    return out_dir
