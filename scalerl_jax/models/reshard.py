"""Device-to-device reshard of params inside one process (`push_local`), and the slice geometry
it shares with the cross-process weight push (`distributed.weight_push`).

A sharding lays an array out as slices, one per device, each a box of index ranges (`Bounds`);
devices may hold the same slice. Resharding onto a target sharding makes one fresh array per
distinct target slice from the overlapping source shards (`cut_locally`), then copies it onto every
target device holding that slice (`assemble`). No data passes through the host.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Sharding

from scalerl_jax.models.sharding import AotProgram, Device

Bounds = tuple[tuple[int, int], ...]  # per dimension (start, stop): hashable form of a slice tuple


def bounds_of(index: tuple[slice, ...], shape: Sequence[int]) -> Bounds:
    """(start, stop) per dimension of a `devices_indices_map` index (None bounds made explicit)."""
    bounds = []
    for dim_slice, size in zip(index, shape):
        start, stop, step = dim_slice.indices(size)
        if step != 1:
            raise ValueError(f"strided shard index {dim_slice} (step {step}) is not supported")
        bounds.append((start, stop))
    return tuple(bounds)


def slices_of(bounds: Bounds) -> tuple[slice, ...]:
    """The index tuple of `bounds` (the inverse of `bounds_of`)."""
    return tuple(slice(start, stop) for start, stop in bounds)


def take_slice(leaf: jax.Array, bounds: Bounds) -> jax.Array:
    """`leaf[bounds]` (jit it with `bounds` static)."""
    return leaf[slices_of(bounds)]


def devices_per_slice(sharding: Sharding, shape: tuple[int, ...]) -> dict[Bounds, list[Device]]:
    """{slice bounds: the devices (sorted by id) whose shard of an array of `shape` is that slice}."""
    index_map = sharding.devices_indices_map(shape)
    by_bounds: dict[Bounds, list[Device]] = {}
    for device in sorted(index_map, key=lambda d: d.id):
        by_bounds.setdefault(bounds_of(index_map[device], shape), []).append(device)
    return by_bounds


def assemble(
    shape: tuple[int, ...],
    sharding: Sharding,
    slice_devices: dict[Bounds, list[Device]],
    fresh_slices: Mapping[Bounds, jax.Array],
) -> jax.Array:
    """A `sharding`-laid array from one fresh single-device array per distinct slice.

    Each fresh array is used as is on its own device (it is a new buffer nobody else holds) and
    copied device to device onto every other device whose shard is the same slice.
    """
    shards = []
    for bounds, devices in slice_devices.items():
        fresh = fresh_slices[bounds]
        shards.extend(fresh if fresh.devices() == {device} else jax.device_put(fresh, device) for device in devices)
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def push_local(params: Any, target_shardings: Any) -> Any:
    """Single-process push: a copy of `params` resharded onto `target_shardings`, device to device.

    Per leaf and distinct target slice T: for each distinct source shard S that overlaps T, the
    overlap `T ∩ S` is cut on S's device (a jit there, or S itself when S lies inside T), copied to
    the first target device holding T, and the pieces are placed into T there (one jit); then T is
    copied to the other target devices holding it. Only the overlapping bytes move, nothing is
    replicated over the source devices, and the result never shares buffers with `params` (the
    next train step donates them).

    Not `jax.device_put(params, target_shardings)`: when a target slice is no source shard (rows
    to columns, replicated to split), jax 0.10.2 reshards through `x._value`, a host round trip
    of the whole array, whatever the backend. Every device of both sides must be addressable here.
    """
    leaves, treedef = jax.tree.flatten(params)
    try:
        shardings = treedef.flatten_up_to(target_shardings)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"push_local: target shardings do not have the tree structure of the params: {error}"
        ) from error
    return treedef.unflatten(
        [_push_leaf_local(leaf, sharding, position) for position, (leaf, sharding) in enumerate(zip(leaves, shardings))]
    )


def overlap(a: Bounds, b: Bounds) -> Bounds | None:
    """The intersection of two boxes, or None when empty (scalars: the empty box overlaps itself)."""
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(start < stop for start, stop in box) else None


def _relative(box: Bounds, origin: Bounds) -> Bounds:
    return tuple((start - o, stop - o) for (start, stop), (o, _) in zip(box, origin))


_cut = jax.jit(take_slice, static_argnums=1)  # runs where its single-device input lives


def _place_pieces_fn(
    shape: tuple[int, ...], dtype: Any, offsets: tuple[tuple[int, ...], ...], *pieces: jax.Array
) -> jax.Array:
    out = jax.numpy.zeros(shape, dtype)
    for offset, piece in zip(offsets, pieces):
        out = jax.lax.dynamic_update_slice(out, piece, offset)
    return out


_place_pieces = jax.jit(_place_pieces_fn, static_argnums=(0, 1, 2))


def local_shards(array: jax.Array) -> dict[Bounds, list[jax.Array]]:
    """{bounds: this process's single-device shards of `array` holding exactly that slice}."""
    shards: dict[Bounds, list[jax.Array]] = {}
    for shard in array.addressable_shards:
        shards.setdefault(bounds_of(shard.index, array.shape), []).append(shard.data)
    return shards


def cut_locally(shards: Mapping[Bounds, list[jax.Array]], bounds: Bounds, landing: Device | None) -> jax.Array:
    """A new single-device array `leaf[bounds]` on `landing`, from `shards` = `local_shards(leaf)` only
    (no collective).

    For each distinct shard S overlapping the slice T, the overlap is cut on S's device (S itself
    when it lies inside T), copied to `landing` (None: the device of the first overlapping shard)
    and the pieces are placed into T there (one jit). Never aliases a shard's buffer.
    """
    pieces, offsets = [], []
    for shard_bounds, copies in shards.items():
        box = overlap(bounds, shard_bounds)
        if box is None:
            continue
        if landing is None:
            (landing,) = copies[0].devices()
        source = next((c for c in copies if c.devices() == {landing}), copies[0])
        if box == shard_bounds:  # the whole shard: a copy, never an alias of the source's buffer
            piece = jax.device_put(source, landing, may_alias=False)
        else:
            piece = jax.device_put(_cut(source, _relative(box, shard_bounds)), landing)
        pieces.append(piece)
        offsets.append(tuple(start for start, _ in _relative(box, bounds)))
    if not pieces:
        raise ValueError(f"no local shard overlaps slice {slices_of(bounds)}")
    if len(pieces) == 1:
        return pieces[0]
    size = tuple(stop - start for start, stop in bounds)
    return _place_pieces(size, pieces[0].dtype, tuple(offsets), *pieces)


def _push_leaf_local(leaf: jax.Array, target: Sharding, position: int) -> jax.Array:
    if not (leaf.is_fully_addressable and target.is_fully_addressable):
        raise ValueError(
            f"push_local on process {jax.process_index()}: params leaf {position} or its target spans "
            f"devices of other processes; use distributed.weight_push's ParamsSender/ParamsReceiver"
        )
    shape = tuple(leaf.shape)
    slice_devices = devices_per_slice(target, shape)
    shards = local_shards(leaf)
    fresh_slices = {
        bounds: cut_locally(shards, bounds, landing=devices[0]) for bounds, devices in slice_devices.items()
    }
    return assemble(shape, target, slice_devices, fresh_slices)


def cut_programs(leaf: Any, bounds: Bounds, landing: Device | None, programs: dict[tuple, AotProgram]) -> None:
    """The programs `cut_locally(local_shards(leaf), bounds, landing)` runs, to lower ahead of time,
    into `programs` (keyed by signature, so a shape met twice counts once): a cut on the source
    device of every overlap that is not a whole shard, and the placement of several pieces on the
    landing device. `leaf` may be abstract (a ShapeDtypeStruct with a sharding); every shard of it
    counts as local (the caller decides which process cuts)."""
    shape = tuple(leaf.shape)
    by_bounds: dict[Bounds, Device] = {}
    for device, index in sorted(leaf.sharding.devices_indices_map(shape).items(), key=lambda item: item[0].id):
        by_bounds.setdefault(bounds_of(index, shape), device)
    pieces: list[jax.ShapeDtypeStruct] = []
    offsets = []
    for shard_bounds, device in by_bounds.items():
        box = overlap(bounds, shard_bounds)
        if box is None:
            continue
        landing = device if landing is None else landing
        size = tuple(stop - start for start, stop in box)
        if box != shard_bounds:
            source = jax.ShapeDtypeStruct(
                tuple(stop - start for start, stop in shard_bounds),
                leaf.dtype,
                sharding=jax.sharding.SingleDeviceSharding(device),
            )
            relative = _relative(box, shard_bounds)
            key = ("cut", source.shape, str(leaf.dtype), relative)
            if key not in programs:
                programs[key] = AotProgram(
                    "push/cut", f"{source.shape}->{size}", functools.partial(_cut.lower, source, relative)
                )
        pieces.append(jax.ShapeDtypeStruct(size, leaf.dtype, sharding=jax.sharding.SingleDeviceSharding(landing)))
        offsets.append(tuple(start for start, _ in _relative(box, bounds)))
    if len(pieces) > 1:
        size = tuple(stop - start for start, stop in bounds)
        key = ("place", size, str(leaf.dtype), tuple(offsets), tuple(p.shape for p in pieces))
        if key not in programs:
            programs[key] = AotProgram(
                "push/place_pieces",
                f"{len(pieces)} pieces->{size}",
                functools.partial(_place_pieces.lower, size, leaf.dtype, tuple(offsets), *pieces),
            )


def push_local_programs(params: Any, target_shardings: Any) -> list[AotProgram]:
    """Every program `push_local(params, target_shardings)` runs, to lower ahead of time (one per
    distinct shape); `params` may be abstract (ShapeDtypeStructs with shardings)."""
    programs: dict[tuple, AotProgram] = {}
    leaves, treedef = jax.tree.flatten(params)
    for leaf, target in zip(leaves, treedef.flatten_up_to(target_shardings)):
        for bounds, devices in devices_per_slice(target, tuple(leaf.shape)).items():
            cut_programs(leaf, bounds, devices[0], programs)
    return list(programs.values())
