"""Roles of each process for a device split, the routes params take, and each process's batch rows."""

import dataclasses
from typing import cast

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from scalerl_jax.distributed.roles import assign_roles
from scalerl_jax.distributed.trainer_group import local_rows, process_rows
from scalerl_jax.distributed.transport import plan_routes
from scalerl_jax.models import split_devices


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def devices(processes: int, per_process: int) -> list[FakeDevice]:
    return [FakeDevice(p * 100 + i, p) for p in range(processes) for i in range(per_process)]


# (devices, generator_fraction) -> (generator ids, trainer ids), worked out by hand: round(n x f)
# generators clipped to [1, n - 1], taken from the end; Python rounds 2.5 to 2.
SPLITS = {
    (80, 0.8): (list(range(16, 80)), list(range(16))),  # the paper's 64 generators, 16 trainers
    (5, 0.5): ([3, 4], [0, 1, 2]),
    (4, 0.25): ([3], [0, 1, 2]),
    (4, 0.01): ([3], [0, 1, 2]),  # round to 0, but each side keeps one device
    (4, 0.99): ([1, 2, 3], [0]),  # round to 4, but the trainer keeps one
    (1, 0.5): ([0], [0]),  # one device: both roles share it
}


@pytest.mark.parametrize("num_devices,fraction", sorted(SPLITS))
def test_split_puts_trainers_first_and_generators_last(num_devices, fraction):
    assert split_devices(range(num_devices), fraction) == SPLITS[num_devices, fraction]


def test_split_refuses_a_fraction_outside_the_open_unit_interval():
    for fraction in (0.0, 1.0):
        with pytest.raises(ValueError, match=f"generator_fraction={fraction}"):
            split_devices(range(4), fraction)


def test_roles_follow_the_split():
    # 3 processes x 2 devices at 0.5: devices 0, 1, 100 train; 101, 200, 201 generate (hand split).
    roles = assign_roles(devices(3, 2), 0.5, 1, 3)
    assert [d.id for d in roles.trainer_devices] == [0, 1, 100]
    assert [d.id for d in roles.generator_devices] == [101, 200, 201]
    assert roles.trainer_processes == (0, 1) and roles.generator_processes == (1, 2) and roles.leader == 0


def test_trainer_on_one_process_generator_on_the_other():
    roles = [assign_roles(devices(2, 2), 0.5, p, 2) for p in range(2)]
    assert roles[0].trainer_processes == (0,) and roles[0].generator_processes == (1,)
    assert [r.is_leader for r in roles] == [True, False]
    assert roles[1].is_generator and not roles[1].is_trainer and roles[0].followers == ()
    routes = plan_routes(roles[0])
    assert routes.transfer_generators == (1,)


def test_trainer_spanning_both_processes_has_a_follower_that_also_generates():
    roles = [assign_roles(devices(2, 2), 0.25, p, 2) for p in range(2)]
    assert [len(r.local_generator_devices()) for r in roles] == [0, 1]
    assert [d.id for d in roles[0].trainer_devices] == [0, 1, 100]
    assert roles[0].trainer_processes == (0, 1) and roles[0].is_leader and not roles[0].is_generator
    assert roles[1].followers == (1,) and roles[1].is_generator and not roles[1].is_leader
    routes = plan_routes(roles[0])
    assert routes.transfer_generators == (1,)  # the trainer is not all on process 1


def test_generators_spanning_both_processes():
    roles = [assign_roles(devices(2, 2), 0.75, p, 2) for p in range(2)]
    assert roles[0].generator_processes == (0, 1) and roles[0].trainer_processes == (0,)
    assert roles[0].is_leader and roles[0].is_generator
    assert [d.id for d in roles[0].trainer_devices] == [0]  # the trainer is all on process 0
    routes = plan_routes(roles[0])
    assert routes.transfer_generators == (1,)  # process 0's generator is fed in place


def test_one_process_is_everything_and_transfers_nothing():
    roles = assign_roles(devices(1, 2), 0.5, 0, 1)
    assert roles.is_leader and roles.is_generator and roles.is_trainer and not roles.distributed
    assert plan_routes(roles).transfer_generators == ()


def test_a_process_without_devices_of_either_set_is_refused():
    # four processes, but only processes 0..2 show devices
    with pytest.raises(ValueError, match=r"processes \[3\] without a generator or trainer device"):
        assign_roles(devices(3, 1), 0.5, 0, 4)


def test_process_rows_follow_the_batch_sharding():
    # 8 host devices (conftest): a mesh over devices 2..7, rows sharded 6 ways; every device here
    # is process 0, so process 0 holds all rows and process 1 none.
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[2:8]), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    assert process_rows(sharding, (12, 5), 0) == [slice(2 * i, 2 * i + 2) for i in range(6)]
    assert process_rows(sharding, (12, 5), 1) == []
    batch = {"tokens": np.arange(60).reshape(12, 5)}
    np.testing.assert_array_equal(local_rows(batch, sharding, 0)["tokens"], batch["tokens"])
    assert local_rows(batch, sharding, 1)["tokens"].shape == (0, 5)


class FakeSharding:
    """Just `devices_indices_map`, as a 3-device row sharding over two processes would give it."""

    def __init__(self, assignment):
        self._assignment = assignment

    def devices_indices_map(self, shape):
        return {device: (rows, slice(None)) for device, rows in self._assignment}


def fake_sharding(assignment) -> Sharding:
    """A `FakeSharding` typed as the `Sharding` it stands in for (process_rows reads only its map)."""
    return cast(Sharding, FakeSharding(assignment))


def test_process_rows_across_processes_in_order_and_without_repeats():
    a, b, c = FakeDevice(0, 0), FakeDevice(100, 1), FakeDevice(101, 1)
    sharding = fake_sharding([(c, slice(4, 6)), (a, slice(0, 2)), (b, slice(2, 4))])
    assert process_rows(sharding, (6, 3), 0) == [slice(0, 2)]
    assert process_rows(sharding, (6, 3), 1) == [slice(2, 4), slice(4, 6)]
    batch = {"x": np.arange(18).reshape(6, 3)}
    np.testing.assert_array_equal(local_rows(batch, sharding, 1)["x"], np.arange(6, 18).reshape(4, 3))
    replicated = fake_sharding([(b, slice(None)), (c, slice(None))])
    assert process_rows(replicated, (6, 3), 1) == [slice(0, 6)]
