"""Where a trained policy comes from: a run directory or a Hugging Face checkpoint directory.

A run directory (`python -m scalerl_jax.main --workdir=RUN`) holds `RUN/config.json` (the run's
resolved config), orbax checkpoints `RUN/checkpoints/<step>` of the train state
(`TrainState(params, opt_state, step)`) and, for configs with a `warm_start` section, the
warm-started base checkpoint `RUN/warm_start/<digest>`; otherwise the base is
`config.model.checkpoint`. The base HF directory supplies the architecture (config.json) and
the tokenizer; the run's checkpoint supplies the params.

Restoring builds the train state abstractly (`nnx.eval_shape` + `jax.eval_shape`: no weights are
allocated before orbax reads them), sharded over a mesh by the same rules as training, so an
8B state is spread over the given devices rather than gathered on one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from scalerl_jax.config.adapters import optimizer_config_of
from scalerl_jax.models import Transformer, load_hf, make_mesh, param_shardings
from scalerl_jax.models.config import ModelConfig
from scalerl_jax.models.hf import load_hf_config
from scalerl_jax.run import warm_start
from scalerl_jax.train import create_train_state, make_optimizer, train_state_shardings
from scalerl_jax.train.checkpoint import RunCheckpointer

RUN_CONFIG_FILE = "config.json"
CHECKPOINTS_DIR = "checkpoints"


class PolicySourceError(ValueError):
    """A run or checkpoint directory that cannot supply a policy; the message names the path."""


def is_run_dir(path: str) -> bool:
    """True when `path/config.json` is a run config (a `model` and a `sampler` section), False
    when it is a Hugging Face model config (`model_type`); PolicySourceError otherwise."""
    config_file = os.path.join(path, RUN_CONFIG_FILE)
    if not os.path.isdir(path):
        raise PolicySourceError(f"{path!r} does not exist or is not a directory")
    if not os.path.isfile(config_file):
        raise PolicySourceError(
            f"{path!r} has no {RUN_CONFIG_FILE}: neither a run directory nor a Hugging Face checkpoint directory"
        )
    with open(config_file) as f:
        try:
            content = json.load(f)
        except json.JSONDecodeError as e:
            raise PolicySourceError(f"{config_file} is not valid JSON: {e}") from e
    if isinstance(content, dict) and isinstance(content.get("model"), dict) and "sampler" in content:
        return True
    if isinstance(content, dict) and "model_type" in content:
        return False
    raise PolicySourceError(
        f"{config_file} is neither a run config (with `model` and `sampler`) "
        "nor a Hugging Face model config (with `model_type`)"
    )


def load_run_config(run_dir: str) -> ml_collections.ConfigDict:
    """The run's resolved config from `run_dir/config.json` (lists where the config had tuples)."""
    if not os.path.isdir(run_dir):
        raise PolicySourceError(f"run directory {run_dir!r} does not exist")
    config_file = os.path.join(run_dir, RUN_CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise PolicySourceError(
            f"run directory {run_dir!r} has no {RUN_CONFIG_FILE} "
            "(written by `python -m scalerl_jax.main` at the start of a run)"
        )
    if not is_run_dir(run_dir):
        raise PolicySourceError(f"{config_file} is a Hugging Face model config, not a run config")
    with open(config_file) as f:
        return ml_collections.ConfigDict(json.load(f))


def base_checkpoint_dir(config: ml_collections.ConfigDict, run_dir: str) -> str:
    """The run's base HF directory: its warm start (`warm_start.checkpoint_dir`) when the config
    has a `warm_start` section, else `config.model.checkpoint`; it must exist."""
    if "warm_start" in config:
        path, key = warm_start.checkpoint_dir(config, run_dir), "warm_start"
    else:
        path, key = config.model.checkpoint, "model.checkpoint"
    if not path or not os.path.isdir(path):
        raise PolicySourceError(
            f"the run's base checkpoint ({key}: {path!r}) is not a directory; it "
            "supplies the architecture and the tokenizer"
        )
    return path


def checkpoint_steps(run_dir: str) -> list[int]:
    """Steps of the complete orbax checkpoints under `run_dir/checkpoints`, ascending."""
    directory = os.path.join(run_dir, CHECKPOINTS_DIR)
    steps = sorted(ocp.utils.checkpoint_steps(directory)) if os.path.isdir(directory) else []
    if not steps:
        raise PolicySourceError(f"run directory {run_dir!r} has no checkpoints under {directory}")
    return steps


def resolve_step(run_dir: str, step: int | None) -> int:
    """`step` if the run has a checkpoint at it, the latest checkpoint's step when None."""
    steps = checkpoint_steps(run_dir)
    if step is None:
        return steps[-1]
    if step not in steps:
        raise PolicySourceError(f"run directory {run_dir!r} has no checkpoint at step {step}; available steps: {steps}")
    return step


def run_model_overrides(config: ml_collections.ConfigDict) -> dict:
    """What a run sets over a checkpoint's config.json: dtype, fp32 head and its matmul algorithm,
    layer scan, remat policy, attention implementation, experts' implementation (MoE only)."""
    m = config.model
    return dict(
        dtype=m.dtype,
        fp32_head=m.fp32_head,
        head_precision=m.head_precision,
        scan_layers=m.scan_layers,
        remat_policy=m.remat_policy,
        attention_impl=m.attention_impl,
        moe_impl=m.moe_impl,
    )


def run_model_config(config: ml_collections.ConfigDict, base_dir: str) -> ModelConfig:
    """The policy's ModelConfig as the run built it (`run_model_overrides` over the base's config.json)."""
    return load_hf_config(base_dir, **run_model_overrides(config))


def run_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """The run's optimizer from `config.optimizer` (its state's structure is part of a checkpoint)."""
    return make_optimizer(optimizer_config_of(config))


def restore_params(
    run_dir: str, config: ml_collections.ConfigDict, model_config: ModelConfig, step: int, *, mesh: Mesh
) -> tuple[nnx.GraphDef, Any]:
    """(graphdef, params) of checkpoint `step`, params sharded over `mesh` by the default rules.

    The abstract train state has the run's structure (model from `model_config`, optimizer state
    of `run_optimizer(config)`); the whole state is read (orbax's standard restore reads every
    array of the item) and everything but the params is dropped.
    """
    abstract_model = nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract_model)
    optimizer = run_optimizer(config)
    abstract_state = jax.eval_shape(lambda p: create_train_state(p, optimizer), abstract_params)
    shardings = train_state_shardings(abstract_state, optimizer, param_shardings(abstract_params, mesh), mesh)
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, shardings
    )
    checkpointer = RunCheckpointer(run_dir, keep=1, writes=False)
    try:
        train_state, _ = checkpointer.restore(step, abstract_state)
    finally:
        checkpointer.close()
    return graphdef, train_state.params


@dataclasses.dataclass(frozen=True)
class Policy:
    """A policy ready for sampling or export.

    `checkpoint_dir`: the HF directory of its architecture and tokenizer (the run's base, or the
    HF directory itself); `step`: the run checkpoint's step (None for an HF directory).
    """

    graphdef: nnx.GraphDef
    params: Any
    model_config: ModelConfig
    checkpoint_dir: str
    step: int | None


def load_run_policy(
    run_dir: str, config: ml_collections.ConfigDict, *, step: int | None = None, mesh: Mesh | None = None
) -> Policy:
    """The policy of `run_dir` at checkpoint `step` (default: the latest), restored over `mesh`
    (default: `config.mesh.trainer_shape` over all devices, as the trainer shards it)."""
    base = base_checkpoint_dir(config, run_dir)
    step = resolve_step(run_dir, step)
    model_config = run_model_config(config, base)
    mesh = mesh or make_mesh(config.mesh.trainer_shape)
    graphdef, params = restore_params(run_dir, config, model_config, step, mesh=mesh)
    return Policy(graphdef, params, model_config, base, step)


def load_hf_policy(checkpoint_dir: str, config: ml_collections.ConfigDict, *, mesh: Mesh | None = None) -> Policy:
    """The policy of an HF directory, built as a run with `config` would build it."""
    model = load_hf(checkpoint_dir, mesh=mesh, **run_model_overrides(config))
    graphdef, params = nnx.split(model)
    return Policy(graphdef, params, model.config, checkpoint_dir, None)
