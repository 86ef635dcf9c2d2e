"""Will the run fit its devices' memory? Estimated from shapes only (`models.memory`): a generator
device's weights and share of the KV pool, a trainer device's train state and activations.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
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
        (mesh_shape(config.mesh.generator_shape, len(generator_devices)) or (len(generator_devices), 1, 1))
        if generator_devices
        else (1, 1, 1)
    )
    trainer_shape = (
        (mesh_shape(config.mesh.trainer_shape, len(trainer_devices)) or (1, len(trainer_devices), 1))
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
