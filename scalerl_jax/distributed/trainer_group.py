"""The trainer processes as one SPMD program: the leader decides, the followers repeat.

Every trainer process must issue the same collective programs in the same order (train step,
weight offer, checkpoint save). The leader sends each operation to every follower over its
*trainer* connection before doing it itself; a follower (`follow`) does exactly the operations
it receives, in order, until "stop". A train batch enters the step as a global array built with
`jax.make_array_from_process_local_data`: each process supplies the rows its own devices hold
(`process_rows`), which the leader cuts out of the batch it built and sends along. The train
message carries every array's global shape: in the length-sorted layout
(`batch_layout.split_sorted_batch`) the keys and shapes are the microbatch plan, so a follower's
step issues the same jitted calls, in the same order and with the same shapes, as the leader's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from scalerl_jax.distributed.channel import Connection


def process_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...], process: int) -> list[slice]:
    """The row ranges (dimension 0) of a `global_shape` array that `process`'s devices hold under
    `sharding`, sorted and without repeats: concatenated, they are that process's local data."""
    starts = set()
    for device, index in sharding.devices_indices_map(global_shape).items():
        if device.process_index == process:
            rows = index[0]
            starts.add((rows.start or 0, global_shape[0] if rows.stop is None else rows.stop))
    return [slice(start, stop) for start, stop in sorted(starts)]


def local_rows(batch: Mapping[str, np.ndarray], sharding: jax.sharding.Sharding, process: int) -> dict[str, np.ndarray]:
    """`process`'s part of a host batch: its `process_rows` of every array, concatenated."""
    out = {}
    for name, array in batch.items():
        slices = process_rows(sharding, array.shape, process)
        out[name] = np.concatenate([array[s] for s in slices]) if slices else array[:0]
    return out


def global_batch(
    rows: Mapping[str, np.ndarray], shapes: Mapping[str, Sequence[int]], sharding: jax.sharding.Sharding
) -> dict[str, jax.Array]:
    """The global batch arrays, from this process's rows (`local_rows`) and the global shapes."""
    return {name: jax.make_array_from_process_local_data(sharding, rows[name], tuple(shapes[name])) for name in rows}


@dataclasses.dataclass
class TrainerOps:
    """What one trainer process does for each operation (the same functions on every process)."""

    train: Callable[[dict[str, jax.Array]], None]  # runs the step on the process's current state
    offer: Callable[[int, str], None]  # (transfer id, purpose) -> offers the current params
    checkpoint: Callable[[int], None]  # step -> saves the current state


class TrainerGroup:
    """The leader's handle on all trainer processes (module docstring).

    `train_step(state, batch)` has the signature of the pipeline's train step: it sends each
    follower its rows, then runs `step_fn` on the global batch. `offer` and `checkpoint` likewise
    tell the followers first.
    """

    def __init__(
        self, followers: Sequence[Connection], *, process: int, step_fn: Callable, batch_sharding: jax.sharding.Sharding
    ):
        self._followers, self._process = list(followers), process
        self._step_fn, self._sharding = step_fn, batch_sharding

    def _tell(self, message: dict[str, Any]) -> None:
        for follower in self._followers:
            follower.send(message)

    def train_step(self, state: Any, batch: Mapping[str, np.ndarray]) -> tuple[Any, dict]:
        shapes = {name: list(array.shape) for name, array in batch.items()}
        for follower in self._followers:
            follower.send(
                {"op": "train", "shapes": shapes, "rows": local_rows(batch, self._sharding, follower.peer_process)}
            )
        rows = local_rows(batch, self._sharding, self._process)
        return self._step_fn(state, global_batch(rows, shapes, self._sharding))

    def offer(self, transfer_id: int, purpose: str, run: Callable[[], None]) -> None:
        self._tell({"op": "offer", "transfer_id": transfer_id, "purpose": purpose})
        run()

    def checkpoint(self, step: int, run: Callable[[], None]) -> None:
        self._tell({"op": "checkpoint", "step": step})
        run()

    def stop(self) -> None:
        self._tell({"op": "stop"})

    def check_restored(self, step: int | None, *, timeout_s: float) -> None:
        """Every follower resumed from the same checkpoint step as the leader (`report_restored`)."""
        for follower in self._followers:
            reply = follower.recv(timeout_s, "the step it restored")
            theirs = None if reply["step"] < 0 else int(reply["step"])
            if theirs != step:
                raise RuntimeError(
                    f"{follower.peer} restored checkpoint step {theirs} but the leader restored "
                    f"{step}: the trainer processes see different checkpoints"
                )


def report_restored(leader: Connection, step: int | None) -> None:
    """A follower tells the leader which checkpoint step it restored (None: none)."""
    leader.send({"op": "restored", "step": -1 if step is None else step})


def follow(leader: Connection, *, batch_sharding: jax.sharding.Sharding, ops: TrainerOps, timeout_s: float) -> int:
    """A follower's loop: repeat the leader's operations until "stop"; returns how many steps ran."""
    steps = 0
    while True:
        message = leader.recv(timeout_s, "the leader's next operation")
        op = message["op"]
        if op == "stop":
            return steps
        if op == "train":
            ops.train(global_batch(message["rows"], message["shapes"], batch_sharding))
            steps += 1
        elif op == "offer":
            ops.offer(int(message["transfer_id"]), message["purpose"])
        elif op == "checkpoint":
            ops.checkpoint(int(message["step"]))
        else:
            raise ValueError(f"unknown operation {op!r} from the leader")
