"""Rendezvous between the processes of one run, through jax.distributed's key-value store.

`jax.distributed.initialize` starts a coordination service (on process 0) that every process
reaches over gRPC. Its client offers barriers with a timeout and a string key-value store with
blocking reads; this module puts names, bounded waits and clear errors on top of them:

- `barrier(name, timeout_s)`: every process waits until all have arrived. Each call of a name
  gets its own barrier id `scalerl/{name}/{n}` (n counts this process's calls of that name), so
  every process must call a given name the same number of times, in the same order, from one
  thread. Before waiting, each process writes an arrival key; on timeout the keys say which
  processes never arrived, and CoordinationTimeout names them.
- `publish` / `lookup`: write-once keys, and a read that waits for the key with a timeout.
- `gather(name, value)`: every process's value, the same list everywhere.
- `run_once(name, fn)`: a side effect on process 0 (build a dataset, write a warm start) while
  the others wait for its status key, which says "ok" or "error: <one line>": a failure on
  process 0 reaches the others at once instead of after their timeout.
- `shared_secret()`: 32 random bytes drawn on process 0 and read by all (the channel's HMAC key).

With one process (or before `jax.distributed.initialize`) barriers return at once, `run_once`
just calls fn, and publish/lookup use a dict in this process.

Dead processes. The coordination service also watches heartbeats: when a process dies,
after `heartbeat_timeout_seconds` (an argument of `jax.distributed.initialize`, default 100 s)
it reports the error to every process and jax terminates them all. So a barrier never outlives
a dead peer by more than that; a peer that is alive but never arrives is what CoordinationTimeout
reports. (The client's `get_live_nodes` is itself a rendezvous of the live processes it names, so
it blocks on a hung one and cannot be used to name it.)
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

_PREFIX = "scalerl"
_calls_lock = threading.Lock()
_calls: dict[tuple[str, str], int] = {}  # (kind, name) -> how many times this process used it
_local_store: dict[str, str] = {}  # publish/lookup with a single process


class CoordinationTimeout(RuntimeError):
    """A barrier or key lookup did not complete in time; the message names it and, for barriers,
    the processes that did not arrive."""


def distributed_client():
    """jax.distributed's key-value client, or None with a single process or before initialize."""
    from jax._src import distributed  # the public API exposes no handle on the client

    client = distributed.global_state.client
    if client is None:
        return None
    import jax

    return client if jax.process_count() > 1 else None


def _process_index() -> int:
    import jax

    return jax.process_index()


def _next_call(kind: str, name: str) -> int:
    """0, 1, 2, ... for successive calls of (kind, name) in this process."""
    with _calls_lock:
        count = _calls.get((kind, name), 0)
        _calls[(kind, name)] = count + 1
    return count


def _timeout_ms(timeout_s: float) -> int:
    return max(1, int(timeout_s * 1000))


def _is_deadline(err: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(err)


def barrier(name: str, timeout_s: float, processes: Sequence[int] | None = None) -> None:
    """Wait until every process (or every one of `processes`) reaches barrier `name`.

    Raises CoordinationTimeout after `timeout_s` naming the barrier, the call number and the
    processes that never arrived. Single process: returns at once.
    """
    client = distributed_client()
    if client is None:
        return
    import jax

    me = _process_index()
    members = sorted(range(jax.process_count()) if processes is None else set(processes))
    if me not in members:
        raise ValueError(f"process {me} called barrier {name!r} for processes {members}, which exclude it")
    call = _next_call("barrier", name)
    barrier_id = f"{_PREFIX}/{name}/{call}"
    arrivals = f"{_PREFIX}/arrived/{name}/{call}/"
    client.key_value_set(f"{arrivals}{me}", "1")
    try:
        client.wait_at_barrier(barrier_id, _timeout_ms(timeout_s), None if processes is None else members)
    except Exception as err:  # jax raises JaxRuntimeError, whose class is not public API
        if not _is_deadline(err):
            raise RuntimeError(f"barrier {name!r} (call {call}) failed on process {me}: {err}") from err
        missing = _missing(client, arrivals, members)
        raise CoordinationTimeout(
            f"barrier {name!r} (call {call}) of processes {members} timed out after "
            f"{float(timeout_s)} s on process {me}: {missing}"
        ) from err
    client.key_value_delete(f"{arrivals}{me}")


def _missing(client, arrivals: str, members: Sequence[int]) -> str:
    """'processes [..] did not arrive' from the arrival keys, or why that is unknown."""
    try:
        arrived = {int(key.rsplit("/", 1)[-1]) for key, _ in client.key_value_dir_get(arrivals)}
    except Exception as err:  # noqa: BLE001 - the service itself may be failing: still raise the timeout
        return f"could not read who arrived ({err})"
    absent = [p for p in members if p not in arrived]
    return f"processes {absent} did not arrive" if absent else "all arrived late"


def publish(key: str, value: str, *, overwrite: bool = False) -> None:
    """Store `value` under `key` for every process; a second publish of a key is an error unless
    `overwrite`. Single process: a dict in this process."""
    if not isinstance(value, str):
        raise TypeError(f"publish({key!r}): values are str, got {type(value).__name__}")
    client = distributed_client()
    if client is None:
        if key in _local_store and not overwrite:
            raise ValueError(f"key {key!r} is already published")
        _local_store[key] = value
        return
    try:
        client.key_value_set(f"{_PREFIX}/kv/{key}", value, allow_overwrite=overwrite)
    except Exception as err:
        raise RuntimeError(f"process {_process_index()} could not publish key {key!r}: {err}") from err


def lookup(key: str, timeout_s: float) -> str:
    """The value published under `key`, waiting up to `timeout_s` for it to appear.

    CoordinationTimeout names the key and the timeout. Single process: only this process could
    have published it, so a missing key fails at once.
    """
    client = distributed_client()
    if client is None:
        if key not in _local_store:
            raise CoordinationTimeout(f"key {key!r} was never published (single process: nobody else can)")
        return _local_store[key]
    try:
        return client.blocking_key_value_get(f"{_PREFIX}/kv/{key}", _timeout_ms(timeout_s))
    except Exception as err:
        if not _is_deadline(err):
            raise RuntimeError(f"process {_process_index()} could not look up key {key!r}: {err}") from err
        raise CoordinationTimeout(
            f"process {_process_index()}: key {key!r} was not published within {float(timeout_s)} s"
        ) from err


def gather(name: str, value: str, timeout_s: float) -> list[str]:
    """Every process's `value` for `name`, in process order, the same list on every process: each
    publishes its own and waits (up to `timeout_s` in all) for the others'. Every process must call
    a given name the same number of times. CoordinationTimeout names the first value missing.
    Single process: [value]."""
    client = distributed_client()
    if client is None:
        return [value]
    import jax

    call = _next_call("gather", name)
    prefix = f"gather/{name}/{call}"
    publish(f"{prefix}/{_process_index()}", value)
    deadline = time.monotonic() + timeout_s
    return [
        lookup(f"{prefix}/{process}", max(0.001, deadline - time.monotonic())) for process in range(jax.process_count())
    ]


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:500]


def run_once(name: str, fn: Callable[[], T], *, timeout_s: float) -> None:
    """Run `fn` on process 0 only; every other process waits until it has finished.

    Process 0 publishes key "{name}/status" (per call of this name) = "ok", or
    "error: <type>: <first line>" before re-raising fn's exception; the others raise
    RuntimeError("{name} failed on process 0: ...") as soon as that status appears, or
    CoordinationTimeout if none does within `timeout_s`. Single process: calls fn.
    """
    client = distributed_client()
    if client is None:
        fn()
        return
    call = _next_call("run_once", name)
    status_key = f"{_PREFIX}/run_once/{name}/{call}/status"
    if _process_index() == 0:
        try:
            fn()
        except BaseException as err:
            client.key_value_set(status_key, f"error: {_one_line(err)}")
            raise
        client.key_value_set(status_key, "ok")
        return
    try:
        status = client.blocking_key_value_get(status_key, _timeout_ms(timeout_s))
    except Exception as err:
        if not _is_deadline(err):
            raise RuntimeError(f"{name}: process {_process_index()} could not read its status: {err}") from err
        raise CoordinationTimeout(
            f"{name} did not finish on process 0 within {float(timeout_s)} s (process {_process_index()} waited for it)"
        ) from err
    if status != "ok":
        raise RuntimeError(f"{name} failed on process 0: {status.removeprefix('error: ')}")


def shared_secret(timeout_s: float) -> bytes:
    """The same 32 random bytes on every process: drawn on process 0, shared as hex through the
    key-value store (readable by anyone who can reach the coordinator, like the job itself)."""
    client = distributed_client()
    if client is None:
        return secrets.token_bytes(32)
    call = _next_call("shared_secret", "")
    key = f"{_PREFIX}/shared_secret/{call}"
    if _process_index() == 0:
        secret = secrets.token_bytes(32)
        client.key_value_set(key, secret.hex())
        return secret
    try:
        return bytes.fromhex(client.blocking_key_value_get(key, _timeout_ms(timeout_s)))
    except Exception as err:
        if not _is_deadline(err):
            raise
        raise CoordinationTimeout(
            f"process {_process_index()}: process 0 did not share the channel secret within {float(timeout_s)} s"
        ) from err
