"""Trainer -> generator weight push between processes, device to device, with no host round trip.

The trainer's params live on the trainer mesh (possibly spanning several processes, all running
the same SPMD program); each generator process holds the params on its own local mesh. After a
train step every generator process needs the new params in its own layout.

Transport: `jax.experimental.transfer` servers (one per process). A sender offers a list of
arrays under an integer uuid (`await_pull`); a receiver pulls that list by uuid from the sender's
address with the exact shapes, dtypes and shardings to place them on. A pull whose sharding does
not match the offered layout silently returns garbled data, so only single-device arrays are
shipped: one per distinct slice a generator needs, assembled on the receiver. The slice geometry,
the local cut and the assembly are `models.reshard`'s, shared with the single-process
`models.reshard.push_local`.

Both sides compute the same `plan` on their own (it is a pure function of the generator's target
shardings, the param shapes, the generator process id and the trainer process ids), so no
message but "version v is offered" (the caller's protocol) is needed:

    for generator process g, every (leaf, distinct slice of that leaf g needs) gets an owner
    trainer process; the owner serves it as one single-device array.

Owners are assigned by bytes: each slice goes to the trainer process with the fewest planned bytes
so far, ties broken in rotation order starting at position g. With equal slices this is plain
round robin (generator g starts at trainer g mod n), and unequal leaves (an embedding next to a
norm scale) still spread memory and bandwidth evenly.

Sender (`ParamsSender.offer`, every trainer process, same order): each distinct (leaf, slice) is
made once, for all generators that need it. When every owner of the slice holds all trainer
shards overlapping it (always so with one trainer process; replicated leaves), the owner cuts it
from its own shards (pieces copied device to device, placed by a jit; no collective). Otherwise
one jit over the trainer mesh computes `leaf[slice]` fully replicated on the trainer mesh, so
every trainer process holds it locally, and the owner keeps its single-device replica. Finally
each owner offers the list of its slices for g under `transfer_uuid(version, g, owner)`. Only
one replicated slice exists at a time besides what owners keep for pulling.

Receiver (`ParamsReceiver.pull`, a generator process): pulls its slices from every owner (one
thread per owner, connections cached), copies each slice device to device onto every local device
whose shard is that slice, and assembles each leaf with `jax.make_array_from_single_device_arrays`.

Known transport behaviour (jax 0.10.2, CPU): a pull of a uuid that is never offered (or whose
offer expired) blocks forever and ignores the transfer API's own timeout, so `pull(timeout_s=...)`
bounds the wait from Python and raises naming the trainer process; every offer must be pulled by
its generator (or offered with `expire_after_s`), otherwise the owner keeps its buffers.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from scalerl_jax.models.reshard import (
    Bounds,
    Device,
    assemble,
    bounds_of,
    cut_locally,
    cut_programs,
    devices_per_slice,
    local_shards,
    overlap,
    slices_of,
    take_slice,
)
from scalerl_jax.models.sharding import AotProgram

_VERSION_BITS, _PROCESS_BITS = 32, 16


def _sorted_unique_bounds(sharding: Sharding, shape: Sequence[int]) -> list[Bounds]:
    return sorted({bounds_of(index, shape) for index in sharding.devices_indices_map(tuple(shape)).values()})


def unique_slices(sharding: Sharding, shape: Sequence[int]) -> list[tuple[slice, ...]]:
    """The distinct index tuples the devices of `sharding` hold for an array of `shape`, sorted.

    Bounds are explicit (`slice(0, n)`, never `slice(None)`); sorted by (start, stop) per
    dimension, so every process computes the same order. A replicated sharding needs one slice,
    the full array; a scalar needs the empty tuple.
    """
    return [slices_of(bounds) for bounds in _sorted_unique_bounds(sharding, shape)]


@dataclasses.dataclass(frozen=True)
class SliceTransfer:
    """One single-device array a generator pulls: `leaf[index]` of flattened leaf `leaf`, from `owner`."""

    leaf: int
    index: tuple[slice, ...]
    owner: int

    @property
    def bounds(self) -> Bounds:
        return tuple((s.start, s.stop) for s in self.index)


def _slice_nbytes(bounds: Bounds, dtype: Any) -> int:
    return int(np.prod([stop - start for start, stop in bounds], dtype=np.int64)) * np.dtype(dtype).itemsize


def plan(
    shardings: Sequence[Sharding],
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[Any],
    generator: int,
    trainer_processes: Sequence[int],
) -> list[SliceTransfer]:
    """Who serves which slice to generator process `generator`, in leaf order then slice order.

    `shardings`, `shapes`, `dtypes`: the generator's target sharding and the param's shape and
    dtype per flattened leaf. Each (leaf, unique slice) goes to the trainer process with the
    fewest bytes planned so far for this generator; ties go to the first in rotation order
    `sorted(trainer_processes)[generator % n:] + [:generator % n]`. Deterministic in its inputs.
    """
    if not (len(shardings) == len(shapes) == len(dtypes)):
        raise ValueError(f"plan: {len(shardings)} shardings, {len(shapes)} shapes, {len(dtypes)} dtypes")
    owners = sorted(set(trainer_processes))
    if not owners:
        raise ValueError("plan: no trainer processes")
    start = generator % len(owners)
    rotation = owners[start:] + owners[:start]
    planned_bytes = {owner: 0 for owner in owners}
    transfers = []
    for leaf, (sharding, shape, dtype) in enumerate(zip(shardings, shapes, dtypes)):
        for bounds in _sorted_unique_bounds(sharding, shape):
            owner = min(rotation, key=lambda p: planned_bytes[p])  # first minimum in rotation order
            planned_bytes[owner] += _slice_nbytes(bounds, dtype)
            transfers.append(SliceTransfer(leaf, slices_of(bounds), owner))
    return transfers


def transfer_uuid(version: int, generator: int, owner: int) -> int:
    """Transfer id of what trainer process `owner` offers generator process `generator` at `version`.

    `version << 32 | generator << 16 | owner`: unique per triple, fits the transfer API's
    unsigned 64-bit id (version < 2**32, process ids < 2**16).
    """
    if not 0 <= version < 2**_VERSION_BITS:
        raise ValueError(f"transfer_uuid: version {version} outside [0, 2**{_VERSION_BITS})")
    for name, process in (("generator", generator), ("owner", owner)):
        if not 0 <= process < 2**_PROCESS_BITS:
            raise ValueError(f"transfer_uuid: {name} process {process} outside [0, 2**{_PROCESS_BITS})")
    return (version << (2 * _PROCESS_BITS)) | (generator << _PROCESS_BITS) | owner


def start_transfer_server(host: str = "127.0.0.1"):
    """A transfer server on this process's backend, listening on an ephemeral port of `host`.

    Its `.address()` is what receivers connect to (publish it, e.g. through the KV store).
    """
    from jax.experimental import transfer

    backend = jax.local_devices()[0].client
    return transfer.start_transfer_server(backend, f"{host}:0", [f"{host}:0"])


def _flatten_shardings(shardings: Any) -> tuple[list[Sharding], Any]:
    leaves, treedef = jax.tree.flatten(shardings, is_leaf=lambda x: isinstance(x, Sharding))
    for position, leaf in enumerate(leaves):
        if not isinstance(leaf, Sharding):
            raise TypeError(f"target shardings leaf {position} is {type(leaf).__name__}, not a jax Sharding")
    return leaves, treedef


@functools.cache
def _replicated_slicer(mesh: Mesh) -> Callable[[jax.Array, Bounds], jax.Array]:
    """jit of `leaf[bounds]` with the result fully replicated over `mesh` (one per mesh, so cached compiles)."""
    return jax.jit(take_slice, static_argnums=1, out_shardings=NamedSharding(mesh, PartitionSpec()))


class ParamsSender:
    """Offers each new params version to every generator process; built on every trainer process.

    `trainer_mesh`: the mesh the params live on. `server`: this process's transfer server.
    `generator_shardings`: `{generator process: target shardings pytree}` (same tree structure
    as the params, e.g. `models.param_shardings(params, generator_mesh)` as that process builds it).
    All trainer processes must call `offer` with the same versions in the same order: it runs
    collective jits over the trainer mesh.
    """

    def __init__(self, trainer_mesh: Mesh, server: Any, generator_shardings: Mapping[int, Any]):
        if not generator_shardings:
            raise ValueError("ParamsSender: no generator processes")
        self._server = server
        self._process = jax.process_index()
        self._trainer_processes = sorted({d.process_index for d in trainer_mesh.devices.flat})
        if self._process not in self._trainer_processes:
            raise ValueError(
                f"ParamsSender on process {self._process}: it holds no device of the trainer mesh "
                f"(trainer processes {self._trainer_processes})"
            )
        self._targets = {g: _flatten_shardings(tree) for g, tree in sorted(generator_shardings.items())}
        first_g, (_, first_treedef) = next(iter(self._targets.items()))
        for g, (_, treedef) in self._targets.items():
            if treedef != first_treedef:
                raise ValueError(
                    f"ParamsSender on process {self._process}: target shardings of generator process "
                    f"{g} and {first_g} have different tree structures"
                )
        self._replicate = _replicated_slicer(trainer_mesh)
        self._plans: dict[int, list[SliceTransfer]] = {}
        self._layout: tuple | None = None

    @property
    def trainer_processes(self) -> list[int]:
        return list(self._trainer_processes)

    def plans(self, params: Any) -> dict[int, list[SliceTransfer]]:
        """The plan per generator process for params shaped like `params` (computed once, then checked)."""
        layout = tuple((tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in self._flat_params(params))
        if self._layout is None:
            self._layout = layout
            for g, (shardings, _) in self._targets.items():
                self._plans[g] = plan(
                    shardings, [s for s, _ in layout], [d for _, d in layout], g, self._trainer_processes
                )
        elif layout != self._layout:
            raise ValueError(
                f"ParamsSender on process {self._process}: params shapes/dtypes changed since the "
                f"first offer (the generators' plans assume the first layout)"
            )
        return self._plans

    def _flat_params(self, params: Any) -> list[jax.Array]:
        first_g, (_, treedef) = next(iter(self._targets.items()))
        try:
            return treedef.flatten_up_to(params)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"ParamsSender on process {self._process}: params do not have the tree structure "
                f"of generator process {first_g}'s target shardings: {error}"
            ) from error

    def offer(self, params: Any, version: int, *, expire_after_s: float | None = None) -> int:
        """Offer `params` as `version` to every generator process; returns the bytes this process offered.

        Each distinct (leaf, slice) is made once (shared by every generator that needs it) and its
        owner keeps a single-device copy until pulled: cut from the owner's own shards when every
        owner of that slice holds all trainer shards overlapping it (always so with one trainer
        process), else replicated over the trainer mesh by a collective jit. With
        `expire_after_s`, unpulled offers are dropped after that many seconds (a later pull of
        them would block: see the module docstring).
        """
        flat_params = self._flat_params(params)
        plans = self.plans(params)
        owners_of = slice_owners(plans)
        local_copies: dict[tuple[int, Bounds], jax.Array] = {}
        for key in sorted(owners_of):  # identical sequence of collective jits on every trainer process
            leaf, bounds = key
            array, owners = flat_params[leaf], owners_of[key]
            if not needs_collective(array, bounds, owners):
                if self._process in owners:  # no collective needed: cut from this process's own shards
                    local_copies[key] = cut_locally(local_shards(array), bounds, landing=None)
            else:
                replicated = self._replicate(array, bounds)
                if self._process in owners:
                    local_copies[key] = replicated.addressable_shards[0].data
                del replicated  # the other replicas are freed now, not at the end of the offer
        timeout = (
            None if expire_after_s is None else datetime.datetime.now() + datetime.timedelta(seconds=expire_after_s)
        )
        offered_bytes = 0
        for g, transfers in plans.items():
            mine = [local_copies[(t.leaf, t.bounds)] for t in transfers if t.owner == self._process]
            if not mine:
                continue
            uuid = transfer_uuid(version, g, self._process)
            if timeout is None:
                self._server.await_pull(uuid, mine)
            else:
                self._server.await_pull(uuid, mine, timeout=timeout)
            offered_bytes += sum(array.nbytes for array in mine)
        return offered_bytes


def slice_owners(plans: Mapping[int, list[SliceTransfer]]) -> dict[tuple[int, Bounds], set[int]]:
    """{(leaf, slice bounds): the trainer processes serving it to some generator} over all `plans`."""
    owners_of: dict[tuple[int, Bounds], set[int]] = {}
    for transfers in plans.values():
        for transfer in transfers:
            owners_of.setdefault((transfer.leaf, transfer.bounds), set()).add(transfer.owner)
    return owners_of


def needs_collective(array: Any, bounds: Bounds, owners: set[int]) -> bool:
    """Whether a slice must be replicated over the trainer mesh (a collective) before its owners can
    serve it: some owner lacks a trainer shard overlapping it."""
    return not all(_holds_every_overlap(array, bounds, owner) for owner in owners)


def sender_programs(params: Any, trainer_mesh: Mesh, generator_shardings: Mapping[int, Any]) -> list[AotProgram]:
    """Every program `ParamsSender.offer` runs on the trainer processes, to lower ahead of time, one
    per distinct shape: the collective replication of each slice some owner cannot cut alone, and
    the local cuts and placements of the others. `params` may be abstract (ShapeDtypeStructs with
    shardings on `trainer_mesh`); `generator_shardings`: {generator process: target shardings}."""
    leaves, treedef = jax.tree.flatten(params)
    trainer_processes = sorted({d.process_index for d in trainer_mesh.devices.flat})
    plans = {}
    for g, tree in sorted(generator_shardings.items()):
        shardings = treedef.flatten_up_to(tree)
        plans[g] = plan(
            shardings, [leaf.shape for leaf in leaves], [leaf.dtype for leaf in leaves], g, trainer_processes
        )
    replicate = _replicated_slicer(trainer_mesh)
    programs: dict[tuple, AotProgram] = {}
    for (leaf, bounds), owners in sorted(slice_owners(plans).items()):
        array = leaves[leaf]
        if needs_collective(array, bounds, owners):
            key = ("replicate", tuple(array.shape), str(array.dtype), bounds)
            if key not in programs:
                size = tuple(stop - start for start, stop in bounds)
                programs[key] = AotProgram(
                    "push/replicate_slice",
                    f"{tuple(array.shape)}->{size}",
                    functools.partial(replicate.lower, array, bounds),
                )
        else:
            cut_programs(array, bounds, None, programs)
    return list(programs.values())


def _pull_into(connection: Any, uuid: int, structs: list[jax.ShapeDtypeStruct], result: dict) -> None:
    """Thread body: pull `uuid` and wait until its arrays are ready; store arrays or the error."""
    try:
        arrays = connection.pull(uuid, structs)
        jax.block_until_ready(arrays)
        result["arrays"] = arrays
    except BaseException as error:  # noqa: BLE001 - handed to the caller's thread, which re-raises it
        result["error"] = error


class ParamsReceiver:
    """Pulls offered params versions onto this generator process's target shardings.

    `target_shardings`: pytree of shardings on this process's local devices (the tree structure
    of the params). `abstract_params`: same structure, leaves with `.shape` and `.dtype` equal to
    the trainer's params (e.g. `jax.eval_shape` output; dtypes must match the trainer's exactly).
    `server`: this process's transfer server. `trainer_addresses`: `{trainer process: its
    transfer server address}` for exactly the processes of the trainer mesh (the plan is computed
    from these keys; another set would disagree with the senders' plan and the pull would wait).
    """

    def __init__(self, target_shardings: Any, abstract_params: Any, server: Any, trainer_addresses: Mapping[int, str]):
        self._process = jax.process_index()
        self._shardings, self._treedef = _flatten_shardings(target_shardings)
        try:
            abstract = self._treedef.flatten_up_to(abstract_params)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"ParamsReceiver on process {self._process}: abstract_params do not have the tree "
                f"structure of the target shardings: {error}"
            ) from error
        self._shapes = [tuple(a.shape) for a in abstract]
        self._dtypes = [np.dtype(a.dtype) for a in abstract]
        for position, sharding in enumerate(self._shardings):
            if not sharding.is_fully_addressable:
                raise ValueError(
                    f"ParamsReceiver on process {self._process}: target sharding of leaf {position} "
                    f"spans devices of other processes; a generator's mesh must be local"
                )
        if not trainer_addresses:
            raise ValueError(f"ParamsReceiver on process {self._process}: no trainer addresses")
        self._server = server
        self._addresses = dict(trainer_addresses)
        self._plan = plan(self._shardings, self._shapes, self._dtypes, self._process, sorted(self._addresses))
        self._slice_devices = [
            devices_per_slice(sharding, shape) for sharding, shape in zip(self._shardings, self._shapes)
        ]
        self._connections: dict[int, Any] = {}

    @property
    def transfers(self) -> list[SliceTransfer]:
        return list(self._plan)

    def _connection(self, owner: int) -> Any:
        if owner not in self._connections:
            self._connections[owner] = self._server.connect(self._addresses[owner])
        return self._connections[owner]

    def _landing_device(self, transfer: SliceTransfer) -> Device:
        """Where a pulled slice arrives: the first device (by id) whose shard is that slice."""
        return self._slice_devices[transfer.leaf][transfer.bounds][0]

    def _pull_all(self, version: int, timeout_s: float | None) -> list[tuple[SliceTransfer, jax.Array]]:
        """Pull every owner's list concurrently (one daemon thread each); bounded by `timeout_s`."""
        per_owner: dict[int, list[SliceTransfer]] = {}
        for transfer in self._plan:
            per_owner.setdefault(transfer.owner, []).append(transfer)
        jobs = []
        for owner, transfers in per_owner.items():
            structs = [
                jax.ShapeDtypeStruct(
                    tuple(stop - start for start, stop in t.bounds),
                    self._dtypes[t.leaf],
                    sharding=SingleDeviceSharding(self._landing_device(t)),
                )
                for t in transfers
            ]
            result: dict = {}
            thread = threading.Thread(
                target=_pull_into,
                daemon=True,
                name=f"pull v{version} from p{owner}",
                args=(self._connection(owner), transfer_uuid(version, self._process, owner), structs, result),
            )
            thread.start()
            jobs.append((owner, transfers, thread, result))
        deadline = None if timeout_s is None else datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        pulled: list[tuple[SliceTransfer, jax.Array]] = []
        for owner, transfers, thread, result in jobs:
            remaining = None if deadline is None else max(0.0, (deadline - datetime.datetime.now()).total_seconds())
            thread.join(remaining)
            where = (
                f"process {self._process} (generator) pulling params version {version} from trainer "
                f"process {owner} at {self._addresses[owner]}"
            )
            if thread.is_alive():
                raise TimeoutError(f"{where}: not complete after {timeout_s} s (was version {version} offered?)")
            if "error" in result:
                raise RuntimeError(f"{where}: {result['error']}") from result["error"]
            pulled.extend(zip(transfers, result["arrays"]))
        return pulled

    def pull(self, version: int, *, timeout_s: float | None = None) -> Any:
        """The params offered as `version`, on the target shardings (same tree structure).

        Each pulled slice lands on one device and is copied device to device onto every other
        local device whose shard is the same slice; no data passes through the host.
        """
        pulled = self._pull_all(version, timeout_s)
        by_leaf: dict[int, dict[Bounds, jax.Array]] = {}
        for transfer, array in pulled:
            by_leaf.setdefault(transfer.leaf, {})[transfer.bounds] = array
        leaves = [
            assemble(shape, sharding, slice_devices, by_leaf[leaf])
            for leaf, (shape, sharding, slice_devices) in enumerate(
                zip(self._shapes, self._shardings, self._slice_devices)
            )
        ]
        return self._treedef.unflatten(leaves)


def _holds_every_overlap(array: jax.Array, bounds: Bounds, process: int) -> bool:
    """Whether `process` holds, for every distinct shard of `array` overlapping `bounds`, a copy."""
    holders: dict[Bounds, set[int]] = {}
    for device, index in array.sharding.devices_indices_map(tuple(array.shape)).items():
        holders.setdefault(bounds_of(index, array.shape), set()).add(device.process_index)
    return all(
        process in processes for shard_bounds, processes in holders.items() if overlap(bounds, shard_bounds) is not None
    )
