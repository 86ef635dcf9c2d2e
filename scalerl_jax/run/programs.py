"""Every program a run executes, to compile ahead of time for the run's devices, attached or not.

Given the run config and all devices of the run (e.g. a deviceless TPU or GPU topology), the
devices are split and meshed as `main` does (`assign_roles`, `build_meshes`'s shapes, the same
logical-axis rules), and each program is given with abstract inputs (ShapeDtypeStructs with the
run's shardings), to lower (trace) only when asked, one at a time:

- trainer (the trainer mesh, SPMD over every trainer process): the train step's programs for the
  batch of B = prompts_per_step x generations_per_prompt rows and every length bucket the batch
  builder can produce (`SortedTrainStep.aot_programs`: one microbatch gradient per bucket);
- generator (one generator process's local mesh, one per distinct generator mesh size): every
  decode-path program (`sampler.engine_programs.aot_programs`: prefill + insert per (rows, length)
  bucket, decode per window, eviction). Evaluation runs through these same programs (the evaluator
  samples with the generators' batchers), so it adds none;
- push: the weight push from the trainer layout to the generator layout, as the run does it
  (`push_local` on one process, `ParamsSender.offer` between processes).

Each program also carries the bytes per device that stay resident while it runs without being its
argument (the train state's optimizer moments during a microbatch gradient, the generator's params
while a push assembles the new ones; with `eval.concurrent`, the other batcher's decode state and
the evaluated params the generator keeps beside its own), so that a program's XLA peak plus those
bytes is what its device must hold.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import ml_collections
from flax import nnx

from scalerl_jax.config.adapters import interrupts, optimizer_config_of, sampler_engine_config_of
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.schema import AUTO_SPLIT
from scalerl_jax.distributed.roles import Roles, assign_roles
from scalerl_jax.distributed.transport import plan_routes
from scalerl_jax.distributed.weight_push import sender_programs
from scalerl_jax.models import Transformer, get_preset, param_shardings
from scalerl_jax.models.config import ModelConfig
from scalerl_jax.models.hf import load_hf_config
from scalerl_jax.models.reshard import push_local_programs
from scalerl_jax.models.sharding import AotProgram
from scalerl_jax.pipeline.generator import RETAINED_EVAL_VERSIONS
from scalerl_jax.run.build import build_meshes, build_train_step, generator_mesh, train_length_buckets
from scalerl_jax.run.policy_source import run_model_overrides
from scalerl_jax.sampler import Engine, EngineConfig
from scalerl_jax.sampler.engine_config import InterruptionConfig
from scalerl_jax.sampler.engine_programs import abstract_decode_state, aot_programs
from scalerl_jax.train import create_train_state, make_optimizer
from scalerl_jax.train.compiled import train_state_shardings


@dataclasses.dataclass(frozen=True)
class RunProgram:
    """A program of the run, where it runs, and what else its devices hold meanwhile."""

    role: str  # 'trainer' | 'generator' | 'push:trainer' | 'push:generator' (the push, on that side's devices)
    program: AotProgram
    devices: int  # devices the program runs on
    resident_bytes: int  # per device: long-lived buffers that are not among its arguments


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of abstract arrays with shardings: for each leaf, the
    largest shard, prod(shard shape) x itemsize (leaves without a sharding count whole)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(tuple(leaf.shape)) if sharding is not None else tuple(leaf.shape)
        total += math.prod(shape) * leaf.dtype.itemsize  # a PRNG key dtype has an itemsize too
    return total


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """`abstract` (ShapeDtypeStructs, or arrays) with each leaf on the matching sharding."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def model_config_of(config: ml_collections.ConfigDict) -> ModelConfig:
    """The policy's architecture as the run builds it, without its weights: the checkpoint's
    config.json when `model.checkpoint` is set, else the warm start's model (the preset with
    `warm_start.model_overrides` and the tokenizer's vocabulary size), else the preset; with the
    run's overrides (dtype, head, scan, remat, attention)."""
    overrides = run_model_overrides(config)
    if config.model.checkpoint and "warm_start" not in config:
        return load_hf_config(config.model.checkpoint, **overrides)
    if "warm_start" in config:
        ws = config.warm_start
        return get_preset(
            config.model.preset, **ws.model_overrides.to_dict(), vocab_size=ws.tokenizer_vocab_size, **overrides
        )
    return get_preset(config.model.preset, **overrides)


def engine_config_of(
    config: ml_collections.ConfigDict, stop_tokens: int, interruption_lengths: tuple[int, int]
) -> EngineConfig:
    """`config.adapters.engine_config_of` with token counts instead of a tokenizer: `stop_tokens` stop ids,
    and an interruption phrase and think-end tag of `interruption_lengths` tokens (they size
    constant arrays of the decode program only)."""
    phrase, end_think = interruption_lengths
    s = config.sampler
    interruption = (
        InterruptionConfig(
            tuple(range(1, phrase + 1)),
            tuple(range(1, end_think + 1)),
            s.think_budget_min,
            s.think_budget_max,
            s.answer_budget,
        )
        if interrupts(config)
        else None
    )
    return sampler_engine_config_of(config, max_stop_tokens=stop_tokens, interruption=interruption)


def run_roles(config: ml_collections.ConfigDict, devices: Sequence[Any]) -> Roles:
    """The run's split of `devices` (all processes', ordered by process then id), seen from process 0.
    A numeric `mesh.generator_fraction` only: 'auto' is measured at a run's start, on its devices."""
    if config.mesh.generator_fraction == AUTO_SPLIT:
        raise ConfigError(
            "config key `mesh.generator_fraction` = 'auto' is picked at a run's start from rates measured on "
            "its devices; to compile for a topology, set the number (benchmarks/sim_cluster.py --pick_split "
            "simulates the splits of a cluster)"
        )
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    num_processes = len({d.process_index for d in ordered})
    return assign_roles(ordered, config.mesh.generator_fraction, 0, num_processes)


def run_programs(
    config: ml_collections.ConfigDict,
    devices: Sequence[Any],
    *,
    model_config: ModelConfig,
    stop_tokens: int,
    interruption_lengths: tuple[int, int],
) -> Iterator[RunProgram]:
    """Every program of the run on `devices`, one at a time (module docstring)."""
    roles = run_roles(config, devices)
    trainer_mesh = build_meshes(config, roles).trainer
    assert trainer_mesh is not None  # process 0 always holds trainer devices (`assign_roles`)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0))))
    trainer_params = with_shardings(abstract, param_shardings(abstract, trainer_mesh))

    optimizer = make_optimizer(optimizer_config_of(config))
    abstract_state = jax.eval_shape(lambda p: create_train_state(p, optimizer), trainer_params)
    state_shardings = train_state_shardings(
        abstract_state, optimizer, param_shardings(abstract, trainer_mesh), trainer_mesh
    )
    state = with_shardings(abstract_state, state_shardings)
    step = build_train_step(config, model_config, graphdef, optimizer, trainer_mesh, state_shardings)
    rows = config.batch.prompts_per_step * config.batch.generations_per_prompt
    state_bytes = per_device_bytes(state)
    params_bytes = per_device_bytes(trainer_params)
    # What each train program takes of the resident state: the update takes all of it, the
    # zeros and the microbatch gradient take the params, the row preparation none.
    state_in_args = {"train/update": state_bytes, "train/step": state_bytes, "train/prepare_rows": 0}
    for aot in step.aot_programs(state, rows, train_length_buckets(config)):
        resident = state_bytes - state_in_args.get(aot.name, params_bytes)
        yield RunProgram("trainer", aot, trainer_mesh.size, resident)

    engine_config = engine_config_of(config, stop_tokens, interruption_lengths)
    generator_meshes = {}
    for process in roles.generator_processes:
        local = roles.local_generator_devices(process)
        generator_meshes.setdefault(len(local), generator_mesh(config, roles, process))
    generator_resident = 0
    for mesh in generator_meshes.values():
        engine = Engine(graphdef, model_config, engine_config, mesh=mesh)
        generator_params = with_shardings(abstract, param_shardings(abstract, mesh))
        decode_state = abstract_decode_state(engine)
        params_bytes = per_device_bytes(generator_params)
        # Concurrent evaluation: the evaluation batcher's decode state and params, and the retained
        # versions beside them (`run.processes.evaluation_batcher`), whichever batcher decodes.
        beside = (
            per_device_bytes(decode_state) + (1 + RETAINED_EVAL_VERSIONS) * params_bytes
            if config.eval.concurrent
            else 0
        )
        generator_resident = max(generator_resident, params_bytes + per_device_bytes(decode_state) + beside)
        for aot in aot_programs(
            engine, generator_params, decode_state, max_prompt_length=config.data.max_prompt_tokens
        ):
            # Every decode-path program takes the params and the decode state, but eviction the state only.
            resident = (params_bytes if aot.name == "generator/evict" else 0) + beside
            yield RunProgram("generator", aot, mesh.size, resident)

    # A push runs beside each side's whole state: the old params and decode state stay on the
    # generator devices until the new params are in place.
    resident = {"trainer": state_bytes, "generator": generator_resident}
    for side, aot in push_programs(config, roles, abstract, trainer_params, trainer_mesh):
        collective = aot.name == "push/replicate_slice"
        yield RunProgram(f"push:{side}", aot, trainer_mesh.size if collective else 1, resident[side])


def push_programs(
    config: ml_collections.ConfigDict, roles: Roles, abstract: Any, trainer_params: Any, trainer_mesh: jax.sharding.Mesh
) -> list[tuple[str, AotProgram]]:
    """The weight push's programs, each with the side whose devices run it ('trainer' or
    'generator'): `ParamsSender.offer`'s for the generator processes fed by transfer (all on
    trainer devices), `push_local`'s for a generator process that holds every trainer device
    (cuts on trainer devices, placements on generator devices)."""
    routes = plan_routes(roles)
    by_transfer = set(routes.transfer_generators)
    targets = {g: param_shardings(abstract, generator_mesh(config, roles, g)) for g in roles.generator_processes}
    programs = []
    if by_transfer:
        sent = sender_programs(trainer_params, trainer_mesh, {g: targets[g] for g in sorted(by_transfer)})
        programs += [("trainer", program) for program in sent]
    local = [g for g in roles.generator_processes if g not in by_transfer]
    if local:
        placed = push_local_programs(trainer_params, targets[local[0]])
        programs += [("generator" if p.name == "push/place_pieces" else "trainer", p) for p in placed]
    return programs
