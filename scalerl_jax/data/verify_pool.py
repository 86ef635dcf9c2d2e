"""A pool of math-verify worker processes with a hard per-item time limit, usable from any thread.

math-verify's own timeouts use ``signal.alarm``, which only works on a main thread and only
bounds each of its calls separately (a C routine that never returns to the interpreter would
outlive it too). So each item runs in a worker process (``verify_worker.py``, a plain script
talking JSON lines over pipes), and the pool kills and replaces any worker still busy
``time_limit_s`` after it got an item: a pathological answer costs one timeout, never a hung
run. Workers also get math-verify's own signal timeout (``soft_timeout_s``, by default
``time_limit_s`` rounded up to whole seconds), which often ends a slow item without a restart;
both count as timeouts (``PoolStats.kills`` counts the restarts).

Thread safety: a call checks out idle workers under a lock (waiting if none is idle), drives
them with a selector on its own thread, and checks them back in, so concurrent calls from
different threads share the workers without sharing any I/O.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence

from absl import logging

_WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verify_worker.py")

EQUAL = "equal"
NOT_EQUAL = "not_equal"
UNPARSABLE = "unparsable"
TIMEOUT = "timeout"
ERROR = "error"
CRASH = "crash"
STATUSES = (EQUAL, NOT_EQUAL, UNPARSABLE, TIMEOUT, ERROR, CRASH)


class _Worker:
    """One worker process and the partial line read from its stdout."""

    def __init__(self, soft_timeout_s: int):
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-u", _WORKER_SCRIPT, str(soft_timeout_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
        )
        self.started_at = time.monotonic()
        self.ready = False
        self._buffer = b""

    def fileno(self) -> int:
        return self.process.stdout.fileno()

    def send(self, gold: str, pred: str) -> bool:
        """Writes one request; False if the worker is gone (broken pipe)."""
        line = json.dumps({"gold": gold, "pred": pred}) + "\n"
        try:
            self.process.stdin.write(line.encode("utf-8"))
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            return False
        return True

    def read_messages(self) -> list[dict] | None:
        """Complete JSON messages now readable, or None at end of stream (the worker died)."""
        chunk = os.read(self.fileno(), 65536)
        if not chunk:
            return None
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        return [json.loads(line) for line in lines if line]

    def stop(self, grace_s: float) -> None:
        """Closes stdin (the worker exits at end of input), then kills it after ``grace_s``."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process.stdin.close()
        self.process.stdout.close()


def _stop_all(workers: list[_Worker]) -> None:
    """Finalizer: kills every worker still listed (used if the pool is never closed)."""
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.kill()


@dataclasses.dataclass
class PoolStats:
    """Cumulative counts since the pool started (read with ``VerifyPool.stats()``)."""

    items: int = 0
    timeouts: int = 0
    kills: int = 0
    errors: int = 0
    crashes: int = 0


class VerifyPool:
    """``verify(pairs) -> statuses``: math-verify equivalence of (gold, pred) LaTeX strings."""

    def __init__(self, num_workers: int = 2, *, time_limit_s: float = 5.0,
                 soft_timeout_s: int | None = None, startup_timeout_s: float = 120.0):
        """Starts ``num_workers`` processes (they import math-verify in the background).

        Args:
          num_workers: worker processes (items are verified in parallel across them).
          time_limit_s: hard wall-clock limit per item, from sending it to its answer.
          soft_timeout_s: math-verify's own per-call timeout inside the worker (whole seconds;
            default ``ceil(time_limit_s)``).
          startup_timeout_s: how long a new worker may take to import math-verify.
        """
        if num_workers < 1:
            raise ValueError(f"VerifyPool.num_workers must be >= 1, got {num_workers}")
        if time_limit_s <= 0:
            raise ValueError(f"VerifyPool.time_limit_s must be > 0, got {time_limit_s}")
        self._time_limit_s = time_limit_s
        self._startup_timeout_s = startup_timeout_s
        if soft_timeout_s is not None and soft_timeout_s < 1:
            raise ValueError(f"VerifyPool.soft_timeout_s must be >= 1, got {soft_timeout_s}")
        self._soft_timeout_s = (max(1, math.ceil(time_limit_s)) if soft_timeout_s is None
                                else soft_timeout_s)
        self._condition = threading.Condition()
        self._all: list[_Worker] = []
        self._idle: list[_Worker] = []
        self._stats = PoolStats()
        self._closed = False
        for _ in range(num_workers):
            self._idle.append(self._spawn())
        self._finalizer = weakref.finalize(self, _stop_all, self._all)

    def _spawn(self) -> _Worker:
        worker = _Worker(self._soft_timeout_s)
        with self._condition:
            self._all.append(worker)
        return worker

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        with self._condition:
            self._all.remove(worker)

    def stats(self) -> PoolStats:
        """A copy of the cumulative counts."""
        with self._condition:
            return dataclasses.replace(self._stats)

    def _checkout(self, max_count: int) -> list[_Worker]:
        with self._condition:
            while not self._idle and not self._closed:
                self._condition.wait()
            if self._closed:
                raise RuntimeError("VerifyPool is closed")
            taken, self._idle = self._idle[:max_count], self._idle[max_count:]
            return taken

    def _checkin(self, workers: list[_Worker]) -> None:
        with self._condition:
            closed = self._closed
            if not closed:
                self._idle.extend(workers)
                self._condition.notify_all()
        if closed:
            for worker in workers:
                worker.stop(grace_s=1.0)

    def verify(self, pairs: Sequence[tuple[str, str]]) -> list[str]:
        """Statuses (``EQUAL``, ``NOT_EQUAL``, ``UNPARSABLE``, ``TIMEOUT``, ``ERROR``, ``CRASH``).

        ``pairs[i] = (gold, pred)``: LaTeX strings without the surrounding ``\\boxed{}``.
        """
        if not pairs:
            return []
        workers = self._checkout(len(pairs))
        try:
            statuses = self._run(workers, pairs)
        finally:
            self._checkin(workers)
        with self._condition:
            self._stats.items += len(pairs)
            self._stats.timeouts += statuses.count(TIMEOUT)
            self._stats.errors += statuses.count(ERROR)
            self._stats.crashes += statuses.count(CRASH)
        return statuses

    def _run(self, workers: list[_Worker], pairs: Sequence[tuple[str, str]]) -> list[str]:
        """Feeds ``pairs`` to ``workers`` (replacing any that time out or die) until done."""
        statuses: list[str | None] = [None] * len(pairs)
        pending = collections.deque(range(len(pairs)))
        busy: dict[_Worker, tuple[int, float]] = {}
        selector = selectors.DefaultSelector()
        for worker in workers:
            selector.register(worker, selectors.EVENT_READ)

        def replace(worker: _Worker) -> None:
            selector.unregister(worker)
            self._retire(worker)
            fresh = self._spawn()
            workers[workers.index(worker)] = fresh
            selector.register(fresh, selectors.EVENT_READ)

        try:
            while pending or busy:
                now = time.monotonic()
                for worker in list(workers):
                    if worker.ready and worker not in busy and pending:
                        index = pending.popleft()
                        if worker.send(*pairs[index]):
                            busy[worker] = (index, now + self._time_limit_s)
                        else:  # died while idle: the item waits for the replacement
                            pending.appendleft(index)
                            replace(worker)
                deadlines = [deadline for _, deadline in busy.values()]
                deadlines += [w.started_at + self._startup_timeout_s
                              for w in workers if not w.ready]
                wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                for key, _ in selector.select(wait_s):
                    worker = key.fileobj
                    messages = worker.read_messages()
                    if messages is None:
                        if worker in busy:
                            index, _ = busy.pop(worker)
                            statuses[index] = CRASH
                            logging.warning("verify worker died on item %d (gold %r, pred %r)",
                                            index, pairs[index][0][:80], pairs[index][1][:80])
                        elif not worker.ready:
                            raise RuntimeError(
                                f"verify worker exited during start-up with code "
                                f"{worker.process.wait()} (see its stderr); is math-verify "
                                "installed?")
                        replace(worker)
                        continue
                    for message in messages:
                        if message["status"] == "ready":
                            worker.ready = True
                        else:
                            index, _ = busy.pop(worker)
                            statuses[index] = message["status"]
                now = time.monotonic()
                for worker, (index, deadline) in list(busy.items()):
                    if now >= deadline:
                        del busy[worker]
                        statuses[index] = TIMEOUT
                        with self._condition:
                            self._stats.kills += 1
                        replace(worker)
                for worker in workers:
                    if not worker.ready and now >= worker.started_at + self._startup_timeout_s:
                        raise RuntimeError(
                            f"verify worker did not start within startup_timeout_s="
                            f"{self._startup_timeout_s}")
        finally:
            selector.close()
        return statuses

    def close(self) -> None:
        """Stops idle workers now and busy ones when their call returns; later calls raise."""
        with self._condition:
            self._closed = True
            idle, self._idle = self._idle, []
            self._condition.notify_all()
        for worker in idle:
            worker.stop(grace_s=1.0)

    def __enter__(self) -> VerifyPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
