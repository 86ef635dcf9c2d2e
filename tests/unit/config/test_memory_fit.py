"""The run's memory check over all its processes (`config.memory_fit.check_run_memory`)."""

import dataclasses

import pytest

from scalerl_jax.config import recipes
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.memory_fit import check_run_memory, memory_need
from scalerl_jax.distributed.roles import assign_roles
from scalerl_jax.models import get_preset

GB = 10**9


@dataclasses.dataclass(frozen=True)
class CpuDevice:
    """What the check reads of a device of some process: a CPU device elsewhere in a run cannot
    be made in this one process."""

    id: int
    process_index: int
    platform: str = "cpu"


def run_devices(processes: int, per_process: int) -> list[CpuDevice]:
    return [CpuDevice(p * per_process + i, p) for p in range(processes) for i in range(per_process)]


def tiny_config(generator_fraction: float):
    config = recipes.tiny()
    config.batch.prompts_per_step, config.batch.generations_per_prompt, config.sampler.num_slots = 4, 2, 8
    config.mesh.generator_fraction = generator_fraction
    return config


def test_three_devices_per_process_are_judged_on_the_four_device_trainer_mesh():
    # 2 processes x 3 devices, round(6 x 0.34) = 2 generate: trainer p0d0..p0d2 + p1d0, generator
    # p1d1 + p1d2. The trainer mesh is (1, 4, 1): fsdp 4 divides hidden 64; process 0's own 3
    # trainer devices would not (64 / 3).
    model = get_preset("tiny-llama")
    config = tiny_config(0.34)
    roles = assign_roles(run_devices(2, 3), 0.34, 0, 2)
    assert [(d.process_index, d.id) for d in roles.trainer_devices] == [(0, 0), (0, 1), (0, 2), (1, 3)]
    plenty = {0: (64 * GB, "host"), 1: (64 * GB, "host")}
    check_run_memory(
        config,
        model,
        generator_devices=roles.generator_devices,
        trainer_devices=roles.trainer_devices,
        capacities=plenty,
    )

    # Process 1's host is the small one: the line names process 1 and its 3 devices, whichever
    # process runs the check (the check reads no process of its own). Its need by hand: 1 trainer
    # device's share of the (1, 4, 1) mesh + 2 generator devices, each the weights and half the KV
    # pool (the generator mesh (2, 1, 1) splits the slots in 2 groups).
    trainer = memory_need(config, model, generator_groups=1, trainer_shape=(1, 4, 1), platform="cpu").trainer
    generator = memory_need(config, model, generator_groups=2, trainer_shape=None, platform="cpu")
    process1 = trainer + 2 * (generator.weights + generator.kv_cache)
    small = {0: (64 * GB, "host"), 1: (int(process1 / 0.9) - 1, "host")}
    with pytest.raises(ConfigError) as error:
        check_run_memory(
            config,
            model,
            generator_devices=roles.generator_devices,
            trainer_devices=roles.trainer_devices,
            capacities=small,
        )
    line = str(error.value)
    assert "\n" not in line
    assert f"need about {process1 / GB:,.1f} GB" in line and "on 3 devices of process 1" in line, line
    # Enough for process 1's need (just above it / 0.9): the run fits.
    check_run_memory(
        config,
        model,
        generator_devices=roles.generator_devices,
        trainer_devices=roles.trainer_devices,
        capacities={0: (64 * GB, "host"), 1: (int(process1 / 0.9) + 1, "host")},
    )


def test_a_trainer_mesh_that_cannot_shard_the_model_is_one_config_line():
    # One process of 4 devices, 1 generates: the trainer mesh (1, 3, 1) splits hidden 64 over
    # fsdp 3, which does not divide it.
    model = get_preset("tiny-llama")
    config = tiny_config(0.25)
    roles = assign_roles(run_devices(1, 4), 0.25, 0, 1)
    with pytest.raises(ConfigError) as error:
        check_run_memory(
            config,
            model,
            generator_devices=roles.generator_devices,
            trainer_devices=roles.trainer_devices,
            capacities={0: (64 * GB, "host")},
        )
    line = str(error.value)
    assert "\n" not in line
    assert line.startswith("config keys `mesh.trainer_shape` = (1, -1, 1), `mesh.generator_fraction` = 0.25:"), line
    assert "the trainer mesh (1, 3, 1) (data, fsdp, tensor) over the run's 3 trainer devices" in line, line
    assert "size 64) is not divisible by mesh axes ('fsdp',) of total size 3" in line, line
