"""Whether a config can run on a number of devices: the split into generator and trainer devices
(`models.split_devices`), each microbatch's rows over the trainers, the mesh shapes, the decode
slots over each generator process's devices; and the backend a recipe requires.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from typing import Any

import ml_collections

from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.schema import AUTO_SPLIT
from scalerl_jax.models.sharding import split_devices


def mesh_shape(shape: Any, num_devices: int) -> tuple[int, ...] | None:
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
    trainer_mesh = mesh_shape(m.trainer_shape, num_trainers)
    if trainer_mesh is None:
        return f"`mesh.trainer_shape` {tuple(m.trainer_shape)} does not fit {num_trainers} trainer devices"
    row_devices = batch_devices(trainer_mesh)
    if rows_per_microbatch % row_devices:
        return (
            f"{rows_per_microbatch} sequences per microbatch do not divide over the {row_devices} "
            f"batch devices (data x fsdp) of {num_trainers} trainer devices"
        )
    for local in sorted(set(generators_per_process) - {0}):
        shape = mesh_shape(m.generator_shape, local)
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
    trainer_mesh = mesh_shape(config.mesh.trainer_shape, trainers)
    row_devices = trainers if trainer_mesh is None else batch_devices(trainer_mesh)
    if rows_per_microbatch % row_devices:
        raise ConfigError(
            f"config keys `batch.*`: {rows_per_microbatch} sequences per microbatch do not divide "
            f"over the {row_devices} batch devices (data x fsdp) of {trainers} trainer devices "
            f"(`mesh.generator_fraction` = {config.mesh.generator_fraction} of {num_devices} devices, "
            f"`mesh.trainer_shape` = {tuple(config.mesh.trainer_shape)})"
        )
    return generators, trainers


def batch_devices(mesh: tuple[int, ...]) -> int:
    """Devices a (data, fsdp, tensor) mesh splits the batch rows over: data x fsdp (tensor splits
    heads and widths, each of its devices sees the same rows)."""
    return mesh[0] * mesh[1]


def check_backend(config: ml_collections.ConfigDict, platform: str) -> None:
    """A recipe meant for accelerators (`mesh.require_accelerator`) refuses the CPU backend."""
    if platform == "cpu" and config.mesh.require_accelerator:
        raise ConfigError(
            "config key `mesh.require_accelerator` = True, but JAX found only the CPU backend. This "
            "recipe is meant for GPUs: install the CUDA plugin (pip install -e '.[cuda]', see docs/guides/gpu_cluster.md) "
            "and check `nvidia-smi`, or set --config.mesh.require_accelerator=False to run it on CPU anyway"
        )
