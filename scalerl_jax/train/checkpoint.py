"""Orbax checkpoints of a run: the train state (params, optimizer state, step) as arrays, the
host-side run state (versions, compute meter, prompt pool, RNG, metrics offset) as JSON, and an
integrity record (JSON) that lets a resume trust what it loads.

Orbax writes each step into a temporary directory and renames it when complete, so a run killed
mid-save leaves no directory that `latest_step()` would return: an incomplete checkpoint is never
loaded. Completion is not integrity, though: array files can be damaged later (a bad disk, a
copy cut short). So each checkpoint also stores

  leaf_sha256: {leaf path: sha256 over dtype name, shape and the C-order bytes of the full array},
    computed from the host values being saved. Hashing the full array (not per-shard bytes) makes
    the checksum independent of the sharding it is restored into. Cost: one device->host read of
    each leaf per save and per restore, one leaf at a time (peak host memory: the largest leaf),
    plus sha256 at about 1 GB/s per core. Leaves that are not fully addressable (multi-host) are
    recorded as null: they are not checksummed, only checked for finiteness.
  run_state_sha256: sha256 of the run state as canonical JSON (sorted keys).
  config: the caller's config fingerprint, the flat {dotted_key: value} dict of the run config.

`restore_latest` verifies the checksums and that every floating-point leaf is finite, and falls
back from a damaged or unreadable newest checkpoint to the previous complete one, saying which and
why; when checkpoints exist but none is usable it raises CheckpointError listing each step and
the reason, never a silent start from scratch. Restore must ask for the dtypes that were saved
(the checksums cover the bytes). A failed save raises one CheckpointError naming the path, the
step, the OS reason and the newest complete checkpoint. Orbax's own log lines are muted during
save and restore; its errors reach the caller as those messages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import json
import logging as std_logging
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from orbax.checkpoint._src.metadata import array_metadata_store  # no public path; the version is locked

TRAIN_STATE, RUN_STATE, INTEGRITY = "train_state", "run_state", "integrity"
_OS_ERROR_CODE = re.compile(r"\[os_error_code='?(\d+)'?\]")
_LOCAL_FILE = re.compile(r'local file "([^"]+)"')
_MAX_REASON_CHARS = 300
_SAVE_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax writes a step into STEP.orbax-checkpoint-tmp*, then renames it


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none of the existing ones can be used."""


@dataclasses.dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint `restore_latest` passed over, and why."""

    step: int
    reason: str


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """The checkpoint a resume uses: its step, states, and the newer ones skipped (newest first)."""

    step: int
    train_state: Any
    run_state: dict
    skipped: tuple[SkippedCheckpoint, ...]


class _Unusable(Exception):
    """Internal: checkpoint `step` cannot be used, for `reason`."""


def _sha256(header: str, payload: bytes) -> str:
    digest = hashlib.sha256(header.encode())
    digest.update(payload)
    return digest.hexdigest()


def _host_array(leaf: Any) -> np.ndarray | None:
    """The full value of `leaf` on the host, or None when this process cannot see all of it."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return None
    return np.ascontiguousarray(np.asarray(jax.device_get(leaf)))


def leaf_checksum(host: np.ndarray) -> str:
    """sha256 over 'dtype name + shape' and the C-order bytes of `host`."""
    return _sha256(f"{host.dtype.name}{host.shape}", host.tobytes())


def run_state_checksum(run_state: Mapping[str, Any]) -> str:
    """sha256 of `run_state` as canonical JSON (sorted keys, no spaces)."""
    return _sha256("", json.dumps(run_state, sort_keys=True, separators=(",", ":")).encode())


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def tree_checksums(tree: Any) -> dict[str, str | None]:
    """{leaf path: leaf_checksum} of every leaf of `tree` (None where not fully addressable)."""
    sums = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        host = _host_array(leaf)
        sums[jax.tree_util.keystr(path)] = None if host is None else leaf_checksum(host)
    return sums


def verify_tree(tree: Any, expected: Mapping[str, str | None]) -> str | None:
    """Why `tree` does not match the saved checksums or holds a non-finite float, or None if it is sound."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [jax.tree_util.keystr(path) for path, _ in leaves]
    if sorted(paths) != sorted(expected):
        return f"train state leaves {sorted(set(paths) ^ set(expected))} differ from the saved record"
    for key, (_, leaf) in zip(paths, leaves):
        host = _host_array(leaf)
        if host is None:
            finite = not _is_float(leaf.dtype) or bool(jax.jit(lambda x: jnp.isfinite(x).all())(leaf))
        else:
            if expected[key] is not None and leaf_checksum(host) != expected[key]:
                return f"checksum mismatch in {key} (array data changed after the save)"
            finite = not _is_float(host.dtype) or bool(np.isfinite(host).all())
        if not finite:
            return f"non-finite values in {key}"
    return None


def _short_reason(error: BaseException) -> str:
    """One line for `error`: an OS error spelled out, or a tensorstore error's innermost cause and the
    local file it names (its JSON specs dropped), or its type and first line."""
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror} [errno {error.errno}]"
    text = str(error).split(" [tensorstore_spec")[0].strip()
    code = _OS_ERROR_CODE.search(text)
    if code:
        return f"{os.strerror(int(code.group(1)))} [errno {code.group(1)}]"
    files = _LOCAL_FILE.findall(text)
    if files:
        return f"{text.rsplit(': ', 1)[-1]} (in {files[-1]})"
    first = text.splitlines()[0] if text else ""
    if len(first) > _MAX_REASON_CHARS:
        first = first[:_MAX_REASON_CHARS] + "..."
    return f"{type(error).__name__}: {first}"


def _drop_closed_loop_reports(unraisable: Any, fallback: Callable[[Any], None]) -> None:
    """An unraisablehook: tensorstore callbacks that fire after orbax closed its event loop (after
    a failed read or write) raise 'Event loop is closed'; those are dropped, the rest reported."""
    if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
        return
    fallback(unraisable)


class _FromOrbax(std_logging.Filter):
    """Drops the records that orbax (and the etils it logs through) writes, from any thread."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        path = record.pathname.replace("\\", "/")
        return "/orbax/" not in path and "/etils/" not in path


class _AbortedOrbaxTasks(std_logging.Filter):
    """Drops asyncio's '<Task, Future or _GatheringFuture> exception was never retrieved' reports
    of a failed save's aborted writes (those that were not the first to fail). They are reported
    when the task or future is collected, which can be at the process's exit, after the failure
    was raised as one line. A save's: the report names an orbax coroutine (a task's) or a file
    in a save's temporary directory (tensorstore's futures, raised without Python frames), or the
    exception was raised in orbax's code (a gathering future's)."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        message = record.getMessage()
        if "exception was never retrieved" not in message:
            return True
        if "/orbax/" in message or _SAVE_TMP_SUFFIX in message:
            return False
        error = record.exc_info[1] if record.exc_info else None
        frames = traceback.walk_tb(error.__traceback__) if error is not None else ()
        return not any("/orbax/" in frame.f_code.co_filename for frame, _ in frames)


_ABORTED_TASKS = _AbortedOrbaxTasks()


def _drop_closed_loop_prints(exc_type: Any, value: BaseException, tb: Any, fallback: Callable[..., None]) -> None:
    """A sys.excepthook: tensorstore prints (PyErr_Print, which calls the hook) what its completion
    callbacks raise; those of a failed save's aborted writes come after orbax closed its event
    loop ('Event loop is closed') and are dropped; anything else goes to `fallback`."""
    if isinstance(value, RuntimeError) and "Event loop is closed" in str(value):
        return
    fallback(exc_type, value, tb)


def _quiet_aborted_writes() -> None:
    """After a failed save, for the rest of the process: drops the reports of its aborted writes
    (asyncio's, and tensorstore's, through sys.excepthook and the unraisable hook), which can come
    after the failure was raised as one line."""
    asyncio_logger = std_logging.getLogger("asyncio")
    if _ABORTED_TASKS not in asyncio_logger.filters:
        asyncio_logger.addFilter(_ABORTED_TASKS)
        sys.excepthook = functools.partial(_drop_closed_loop_prints, fallback=sys.excepthook)
        sys.unraisablehook = functools.partial(_drop_closed_loop_reports, fallback=sys.unraisablehook)


@contextlib.contextmanager
def _orbax_muted() -> Iterator[None]:
    """Silences orbax for the block: its absl logging (INFO chatter and error tracebacks; other
    threads' records, an evaluation's or a generator's, still pass), asyncio's 'Future exception
    was never retrieved' and the closed-event-loop reports of failed operations (collected before
    leaving, so they and the never-awaited coroutines of an aborted operation do not surface later)."""
    absl_logger = logging.get_absl_logger()
    orbax_filter = _FromOrbax()
    asyncio_logger = std_logging.getLogger("asyncio")
    asyncio_level = asyncio_logger.level
    hook = sys.unraisablehook
    excepthook = sys.excepthook
    absl_logger.addFilter(orbax_filter)
    asyncio_logger.setLevel(std_logging.CRITICAL)
    sys.unraisablehook = functools.partial(_drop_closed_loop_reports, fallback=hook)
    sys.excepthook = functools.partial(_drop_closed_loop_prints, fallback=excepthook)
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
            gc.collect()
        sys.unraisablehook = hook
        sys.excepthook = excepthook
        asyncio_logger.setLevel(asyncio_level)
        absl_logger.removeFilter(orbax_filter)


def _array_handlers() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's handlers for the train state's leaves. Replica-parallel saving (orbax's default off
    GPU) splits each replicated array into one slice per replica so that several hosts share its
    write; it slices with a `jit(slice)` program per shape and offset, compiled at the first save,
    after the first train step. It pays only when the replicas sit on several processes, so a
    single-process run writes each array from replica 0 whole; a multi-process run keeps orbax's
    default (and compiles those slices at its first save)."""
    return ocp.type_handlers.create_type_handler_registry(
        (int, ocp.type_handlers.ScalarHandler()),
        (float, ocp.type_handlers.ScalarHandler()),
        (np.number, ocp.type_handlers.ScalarHandler()),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (
            jax.Array,
            ocp.type_handlers.ArrayHandler(
                use_replica_parallel=None if jax.process_count() > 1 else False,
                array_metadata_store=array_metadata_store.Store(),
            ),
        ),
    )


def _serializable(train_state: Any) -> Any:
    """The state as orbax can write it. In a multi-process run whose trainer is one process (0),
    its arrays are fully addressable there, and orbax refuses those ("host local") when there are
    several processes: they are written from host copies instead (what any save reads anyway;
    orbax writes host arrays from process 0); a restore places them back on the abstract state's
    shardings."""
    if jax.process_count() == 1:
        return train_state
    return jax.tree.map(
        lambda leaf: jax.device_get(leaf) if isinstance(leaf, jax.Array) and leaf.is_fully_addressable else leaf,
        train_state,
    )


class RunCheckpointer:
    """Saves and restores `(train_state, run_state)` pairs under `WORKDIR/checkpoints`, verified."""

    def __init__(self, workdir: str, *, keep: int, processes: Sequence[int] | None = None, writes: bool = True):
        """`processes`: the trainer processes of a multi-process run (all of them save and restore
        together; process 0, the leader, writes the JSON items); None: every process (one).
        `writes=False` for a checkpointer that only reads: it leaves the temporary directories of
        interrupted saves to the run that writes (orbax removes them in a background thread that
        `close` does not wait for, and a process that ends just after would print its traceback)."""
        if keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
        self._save_failed = False
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        multiprocessing = ocp.options.MultiprocessingOptions()
        if processes is not None and jax.process_count() > 1:
            if min(processes) != 0:
                raise ValueError(
                    f"RunCheckpointer: the trainer processes {sorted(processes)} must include "
                    "process 0 (orbax writes host arrays from process 0 only)"
                )
            multiprocessing = ocp.options.MultiprocessingOptions(
                primary_host=0, active_processes=set(processes), barrier_sync_key_prefix="trainers"
            )
            os.makedirs(self.directory, exist_ok=True)  # orbax creates it only without active_processes
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                create=multiprocessing.active_processes is None,
                cleanup_tmp_directories=writes,
                multiprocessing_options=multiprocessing,
            ),
            item_handlers={  # the handlers take the same processes (orbax's defaults: all of them)
                TRAIN_STATE: ocp.PyTreeCheckpointHandler(
                    multiprocessing_options=multiprocessing, type_handler_registry=_array_handlers()
                ),
                RUN_STATE: ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing),
                INTEGRITY: ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing),
            },
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None (complete: not verified)."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, train_state: Any, run_state: dict, *, config: Mapping[str, Any]) -> None:
        """Writes checkpoint `step` with its integrity record and waits until it is on disk.

        `config` is the run config as a flat {dotted_key: value} JSON-able dict (see `saved_config`).
        Raises CheckpointError naming the path, step, OS reason and newest complete checkpoint.
        """
        record = {
            "leaf_sha256": tree_checksums(train_state),
            "run_state_sha256": run_state_checksum(run_state),
            "config": dict(config),
        }
        failure = None
        with _orbax_muted():
            try:
                self._probe_writable()
                self._manager.save(
                    step,
                    args=ocp.args.Composite(
                        **{
                            TRAIN_STATE: ocp.args.PyTreeSave(_serializable(train_state)),
                            RUN_STATE: ocp.args.JsonSave(run_state),
                            INTEGRITY: ocp.args.JsonSave(record),
                        }
                    ),
                )
                self._manager.wait_until_finished()
            except Exception as error:  # noqa: BLE001 - orbax/tensorstore raise ValueError, OSError, RuntimeError
                failure = error
        if failure is not None:
            self._save_failed = True
            _quiet_aborted_writes()
            logging.debug("checkpoint save failure", exc_info=failure)
            newest = self._manager.latest_step()
            intact = f"step {newest}" if newest is not None else "none"
            raise CheckpointError(
                f"checkpoint: could not save step {step} to {os.path.join(self.directory, str(step))}: "
                f"{_short_reason(failure)}; newest complete checkpoint: {intact}"
            ) from None
        logging.info("checkpoint: saved step %d to %s", step, self.directory)

    def _probe_writable(self) -> None:
        """Creates and removes an empty file in the checkpoint directory: raises OSError (read-only
        filesystem, no permission) before orbax starts, whose background threads would otherwise
        wait minutes for a step directory that cannot be created."""
        probe = os.path.join(self.directory, f".write-probe-{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.remove(probe)

    def _read_record(self, step: int) -> dict:
        try:
            with _orbax_muted():
                record = self._manager.restore(step, args=ocp.args.Composite(**{INTEGRITY: ocp.args.JsonRestore()}))
        except Exception as error:  # noqa: BLE001 - any failure to read makes the checkpoint unusable
            raise _Unusable(f"integrity record unreadable ({_short_reason(error)})") from None
        record = record[INTEGRITY]
        if not isinstance(record, Mapping) or not {"leaf_sha256", "run_state_sha256", "config"} <= set(record):
            raise _Unusable("integrity record malformed")
        return dict(record)

    def _read_verified(self, step: int, abstract_train_state: Any) -> tuple[Any, dict]:
        record = self._read_record(step)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            abstract_train_state,
        )
        try:
            with _orbax_muted():
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        **{
                            TRAIN_STATE: ocp.args.PyTreeRestore(
                                abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
                            ),
                            RUN_STATE: ocp.args.JsonRestore(),
                        }
                    ),
                )
        except Exception as error:  # noqa: BLE001 - any failure to read makes the checkpoint unusable
            raise _Unusable(f"unreadable ({_short_reason(error)})") from None
        train_state, run_state = restored[TRAIN_STATE], dict(restored[RUN_STATE])
        problem = verify_tree(train_state, record["leaf_sha256"])
        if problem is None and run_state_checksum(run_state) != record["run_state_sha256"]:
            problem = "run state checksum mismatch"
        if problem is not None:
            raise _Unusable(problem)
        return train_state, run_state

    def restore(self, step: int, abstract_train_state: Any) -> tuple[Any, dict]:
        """Reads and verifies checkpoint `step` into arrays shaped and sharded like `abstract_train_state`.

        Raises CheckpointError naming the step and the reason when it is damaged or unreadable.
        """
        try:
            return self._read_verified(step, abstract_train_state)
        except _Unusable as unusable:
            raise CheckpointError(f"checkpoint {self.directory}/{step}: {unusable}") from None

    def restore_latest(self, abstract_train_state: Any) -> RestoreResult | None:
        """The newest checkpoint that reads and verifies; None when there is no checkpoint at all.

        Each newer checkpoint passed over is logged (a warning with its reason) and listed in
        `skipped`; raises CheckpointError listing every step and why when none is usable.
        """
        skipped = []
        for step in reversed(self.all_steps()):
            try:
                train_state, run_state = self._read_verified(step, abstract_train_state)
            except _Unusable as unusable:
                skipped.append(SkippedCheckpoint(step, str(unusable)))
                logging.warning("checkpoint %s/%d is not usable: %s", self.directory, step, unusable)
                continue
            if skipped:
                logging.warning("checkpoint: resuming from step %d instead of step %d", step, skipped[0].step)
            return RestoreResult(step, train_state, run_state, tuple(skipped))
        if skipped:
            lines = "\n".join(f"  step {s.step}: {s.reason}" for s in skipped)
            raise CheckpointError(f"no usable checkpoint in {self.directory}:\n{lines}")
        return None

    def saved_config(self, step: int | None = None) -> dict | None:
        """The config fingerprint saved with checkpoint `step`, or with the newest checkpoint whose
        integrity record reads; None when there is no checkpoint. CheckpointError when none reads."""
        steps = [step] if step is not None else list(reversed(self.all_steps()))
        reasons = []
        for candidate in steps:
            try:
                return self._read_record(candidate)["config"]
            except _Unusable as unusable:
                reasons.append(f"  step {candidate}: {unusable}")
        if reasons:
            raise CheckpointError(f"no readable config record in {self.directory}:\n" + "\n".join(reasons))
        return None

    def close(self) -> None:
        """Waits for the writes under way and releases orbax's threads and files. Orbax raises a
        failed save again in each thread that waits for it (a run saves from its trainer thread and
        closes from the main thread): one that `save` reported already is dropped here, and the
        close is finished by a second call (the failure is raised once per thread)."""
        failure = None
        with _orbax_muted():
            try:
                self._manager.close()
            except Exception as error:  # noqa: BLE001 - whatever the failed write raised
                failure = error
                self._manager.close()
        if failure is None:
            return
        logging.debug("checkpoint close failure", exc_info=failure)
        if not self._save_failed:
            raise CheckpointError(f"checkpoint: could not finish writing to {self.directory}: {_short_reason(failure)}")
