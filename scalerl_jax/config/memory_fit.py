"""Will the run fit its devices' memory? Estimated from shapes only (`models.memory`): a generator
device's weights and share of the KV pool, a trainer device's train state and activations.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from scalerl_jax.config.adapters import max_sequence_length
from scalerl_jax.config.devices import mesh_shape
from scalerl_jax.config.errors import ConfigError

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
    config: ml_collections.ConfigDict,
    need: MemoryNeed,
    *,
    devices: int,
    capacity: int,
    where: str,
    process: int | None = None,
) -> None:
    """Raises one ConfigError when `need` (the bytes of `devices` devices that share `capacity`
    bytes of `where`: CPU devices share the host) exceeds `USABLE_MEMORY_FRACTION` of it: one line
    naming the keys that size the sampler's KV pool (and the trainer), with their values and the
    estimate, and `process` (the devices' process in a multi-process run)."""
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
    owner = "" if process is None else f" of process {process}"
    raise ConfigError(
        f"config keys {', '.join(f'`{k}` = {v!r}' for k, v in keys)} need about {gb(need.total)} "
        f"({' + '.join(parts)}) on {devices} device{'s' if devices > 1 else ''}{owner}, more than "
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
    capacities: Mapping[int, tuple[int, str]] | None = None,
) -> None:
    """`check_memory` for every process of a run, in process order: the first process whose
    devices cannot hold their share raises the ConfigError. `generator_devices` and
    `trainer_devices` are the run's (all processes', `device.process_index` saying whose);
    `capacities` maps each process to its `device_memory_bytes`, the same on every process, so
    that every process reaches the same verdict (default, for one process: its first device's).

    The meshes are the run's: each generator process's local mesh (`mesh.generator_shape` over its
    generator devices: each holds the weights and 1/(data x fsdp) of the KV pool), the one trainer
    mesh over all trainer devices (`mesh.trainer_shape`: each holds its share of the train state).
    A device in both holds both. CPU devices share their host's memory, so a process's needs add
    up; an accelerator is checked alone, the fullest one. A trainer mesh that does not divide a
    parameter's sharded dimension is a ConfigError too."""
    from scalerl_jax.models import memory  # shapes of a Transformer: flax, only when a run asks

    devices = list(generator_devices) + list(trainer_devices)
    if capacities is None:
        capacity = device_memory_bytes(devices[0])
        capacities = {process: capacity for process in sorted({d.process_index for d in devices})}
    platform = devices[0].platform
    trainer_shape = (
        (mesh_shape(config.mesh.trainer_shape, len(trainer_devices)) or (1, len(trainer_devices), 1))
        if trainer_devices
        else None
    )
    for process in sorted({d.process_index for d in devices}):
        local_generators = [d for d in generator_devices if d.process_index == process]
        local_trainers = [d for d in trainer_devices if d.process_index == process]
        # A process without generator devices (a multi-process run's trainer) holds no KV pool; its
        # shape is one group so that the per-device share is defined (and then counted zero times).
        gen_shape = (
            (mesh_shape(config.mesh.generator_shape, len(local_generators)) or (len(local_generators), 1, 1))
            if local_generators
            else (1, 1, 1)
        )
        try:
            need = memory_need(
                config,
                model_config,
                generator_groups=gen_shape[0] * gen_shape[1],
                trainer_shape=trainer_shape if local_trainers else None,
                platform=platform if platform in memory.PLATFORMS else "gpu",
            )
        except ValueError as e:  # a parameter dimension the trainer mesh does not divide
            raise ConfigError(
                f"config keys `mesh.trainer_shape` = {tuple(config.mesh.trainer_shape)!r}, "
                f"`mesh.generator_fraction` = {config.mesh.generator_fraction!r}: the trainer mesh "
                f"{trainer_shape} (data, fsdp, tensor) over the run's {len(trainer_devices)} trainer devices "
                f"cannot shard the model: {e}"
            ) from e
        capacity, where = capacities[process]
        check_memory(
            config,
            process_share(need, local_generators, local_trainers, one_memory=platform == "cpu"),
            devices=len(set(local_generators) | set(local_trainers)) if platform == "cpu" else 1,
            capacity=capacity,
            where=where,
            process=process if len(capacities) > 1 else None,
        )


def process_share(
    need: MemoryNeed, generators: Sequence[Any], trainers: Sequence[Any], *, one_memory: bool
) -> MemoryNeed:
    """The bytes a process's `generators` and `trainers` devices must fit, each device needing
    `need`: with `one_memory` (CPU devices share the host's) all of them, `len(generators)` x
    (weights + KV share) + `len(trainers)` x trainer share; else (an accelerator, a memory each)
    its fullest device's: both roles where one device holds both, else the larger of the two."""
    if one_memory:
        gens, trainers_held = len(generators), len(trainers)
    else:
        shared = set(generators) & set(trainers)
        gens = 1 if generators and (shared or need.weights + need.kv_cache >= need.trainer) else 0
        trainers_held = 1 if trainers and (shared or not gens) else 0
    return dataclasses.replace(
        need, weights=gens * need.weights, kv_cache=gens * need.kv_cache, trainer=trainers_held * need.trainer
    )
