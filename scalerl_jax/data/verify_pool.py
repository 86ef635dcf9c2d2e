"""A pool of scoring worker processes with a hard per-item time limit, usable from any thread.

Every completion is scored in a worker process (``verify_worker.py``, a plain script talking
JSON lines over pipes): answer extraction by the request's answer styles, the numeric fast path,
exact comparison, math-verify or a custom reward function (``answers.score_item``). The pool kills and replaces any worker
that has not answered an item ``time_limit_s`` after starting it, so a pathological completion
(a quadratic parse, a hung verifier or user function, a C routine that never returns to the
interpreter) costs one timeout, never a hung run. Workers also give math-verify its own signal
timeout (``soft_timeout_s``, by default ``time_limit_s`` rounded up to whole seconds), which
often ends a slow item without a restart; both count as timeouts (``PoolStats.kills`` counts the
restarts).

Items go to a worker in chunks of up to ``chunk_items`` (one pipe message; the worker answers
each item as it finishes it), so the per-item cost of the round trip is shared; item ``i`` of a
chunk is timed from the answer to item ``i - 1`` (the first from the send). When a worker is
killed or dies, the item it was on gets ``TIMEOUT`` or ``CRASH`` and the rest of its chunk is
scored by the others.

A custom reward function (``reward_fn='package.module:function'``) is imported by every worker
at start-up and called once on ``answers.CHECK_ITEM`` when the pool starts: an import error or a
bad return value raises ``ValueError`` naming the spec. Workers get this process's ``sys.path``
as ``PYTHONPATH``, so a module importable here is importable there.

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
from typing import IO

from absl import logging

from scalerl_jax.data import answers
from scalerl_jax.data.answers import CRASH, CUSTOM, ERROR, TIMEOUT

_WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verify_worker.py")


@dataclasses.dataclass(frozen=True)
class ItemResult:
    """One scored item: its outcome (``answers.OUTCOMES``), the custom reward (only for
    ``CUSTOM``), the extracted answer (None on a format failure, timeout or crash), a detail
    (why an error, a timeout or an unparsable side) and the answer style that found the answer."""

    status: str
    reward: float | None = None
    prediction: str | None = None
    detail: str = ""
    style: str | None = None


def _worker_env() -> dict[str, str]:
    """This process's environment with ``PYTHONPATH`` set to its ``sys.path`` (absolute)."""
    paths = list(dict.fromkeys(os.path.abspath(p) for p in sys.path))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


class _Worker:
    """One worker process and the partial line read from its stdout."""

    def __init__(self, soft_timeout_s: int, reward_fn: str | None, env: dict[str, str]):
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-u", _WORKER_SCRIPT, str(soft_timeout_s)] + ([reward_fn] if reward_fn else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env=env,
        )
        assert self.process.stdin is not None and self.process.stdout is not None  # both are PIPE
        self._stdin: IO[bytes] = self.process.stdin
        self._stdout: IO[bytes] = self.process.stdout
        self.started_at = time.monotonic()
        self.ready = False
        self._buffer = b""

    def fileno(self) -> int:
        return self._stdout.fileno()

    def send(self, message: dict) -> bool:
        """Writes one request line; False if the worker is gone (broken pipe)."""
        try:
            self._stdin.write((json.dumps(message) + "\n").encode("utf-8"))
            self._stdin.flush()
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
            self._stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._stdout.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self._stdin.close()
        self._stdout.close()


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
    """``score(items, ...) -> [ItemResult]``: scores (completion, gold, problem) in workers."""

    def __init__(
        self,
        num_workers: int = 2,
        *,
        time_limit_s: float = 5.0,
        soft_timeout_s: int | None = None,
        startup_timeout_s: float = 120.0,
        reward_fn: str | None = None,
        chunk_items: int = 16,
    ):
        """Starts ``num_workers`` processes (they import math-verify in the background).

        Args:
          num_workers: worker processes (items are scored in parallel across them).
          time_limit_s: hard wall-clock limit per item, from starting it to its answer.
          soft_timeout_s: math-verify's own per-call timeout inside the worker (whole seconds;
            default ``ceil(time_limit_s)``).
          startup_timeout_s: how long a new worker may take to start (imports).
          reward_fn: ``'package.module:function'``, a custom reward function
            ``(completion, gold, problem) -> float`` the workers call instead of the built-in
            rules; checked here on one item (ValueError naming the spec if it cannot be imported,
            raises, hangs or returns something other than a finite number).
          chunk_items: most items sent to a worker in one message.
        """
        if num_workers < 1:
            raise ValueError(f"VerifyPool.num_workers must be >= 1, got {num_workers}")
        if time_limit_s <= 0:
            raise ValueError(f"VerifyPool.time_limit_s must be > 0, got {time_limit_s}")
        if soft_timeout_s is not None and soft_timeout_s < 1:
            raise ValueError(f"VerifyPool.soft_timeout_s must be >= 1, got {soft_timeout_s}")
        if chunk_items < 1:
            raise ValueError(f"VerifyPool.chunk_items must be >= 1, got {chunk_items}")
        if reward_fn is not None:
            answers.check_reward_fn_spec(reward_fn)
        self.reward_fn = reward_fn
        self._time_limit_s = time_limit_s
        self._startup_timeout_s = startup_timeout_s
        self._soft_timeout_s = max(1, math.ceil(time_limit_s)) if soft_timeout_s is None else soft_timeout_s
        self._chunk_items = chunk_items
        self._env = _worker_env()
        self._condition = threading.Condition()
        self._all: list[_Worker] = []
        self._idle: list[_Worker] = []
        self._stats = PoolStats()
        self._closed = False
        for _ in range(num_workers):
            self._idle.append(self._spawn())
        self._finalizer = weakref.finalize(self, _stop_all, self._all)
        if reward_fn is not None:
            try:
                self._check_reward_fn()
            except BaseException:
                self.close()
                raise

    def _check_reward_fn(self) -> None:
        """Scores ``answers.CHECK_ITEM`` with the custom function; ValueError unless it returns a
        finite number."""
        [result] = self.score([answers.CHECK_ITEM], kind="exact", answer_format=answers.THINK, think_end="</think>")
        if result.status == CUSTOM:
            return
        what = {
            TIMEOUT: f"did not return within time_limit_s={self._time_limit_s}",
            CRASH: "killed its worker process",
        }.get(result.status, result.detail)
        raise ValueError(f"reward_fn {self.reward_fn!r}: called on a test item {answers.CHECK_ITEM[:2]}, it {what}")

    def _spawn(self) -> _Worker:
        worker = _Worker(self._soft_timeout_s, self.reward_fn, self._env)
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

    def score(
        self,
        items: Sequence[tuple[str, str, str]],
        *,
        kind: str,
        answer_format: str,
        think_end: str,
        styles: Sequence[str] = answers.DEFAULT_STYLES,
    ) -> list[ItemResult]:
        """Scores ``items[i] = (completion, gold, problem)`` (see ``answers.score_item``).

        ``kind``, ``answer_format``, ``think_end`` and ``styles`` (the answer styles, in order)
        are those of ``answers.score_item``; the custom reward function, if any, is the pool's.
        Returns one ``ItemResult`` per item, in order; items the hard limit stopped get
        ``TIMEOUT``, items whose worker died ``CRASH``.
        """
        if kind not in answers.KINDS:
            raise ValueError(f"VerifyPool.score: kind must be one of {answers.KINDS}, got {kind!r}")
        if answer_format not in answers.ANSWER_FORMATS:
            raise ValueError(
                f"VerifyPool.score: answer_format must be one of {answers.ANSWER_FORMATS}, got {answer_format!r}"
            )
        try:
            styles = answers.parse_styles(",".join(styles))
        except (ValueError, TypeError) as e:
            raise ValueError(f"VerifyPool.score: styles {styles!r}: {e}") from None
        if not items:
            return []
        header = {"kind": kind, "answer_format": answer_format, "think_end": think_end, "styles": list(styles)}
        workers = self._checkout(len(items))
        try:
            results = self._run(workers, header, items)
        finally:
            self._checkin(workers)
        statuses = [r.status for r in results]
        with self._condition:
            self._stats.items += len(items)
            self._stats.timeouts += statuses.count(TIMEOUT)
            self._stats.errors += statuses.count(ERROR)
            self._stats.crashes += statuses.count(CRASH)
        return results

    def _run(self, workers: list[_Worker], header: dict, items: Sequence[tuple[str, str, str]]) -> list[ItemResult]:
        """Feeds ``items`` to ``workers`` in chunks (replacing any that time out or die)."""
        results: list[ItemResult | None] = [None] * len(items)
        pending = collections.deque(range(len(items)))
        in_flight: dict[_Worker, collections.deque[int]] = {}  # a worker's unanswered items
        deadlines: dict[_Worker, float] = {}  # when the worker's current item times out
        selector = selectors.DefaultSelector()
        for worker in workers:
            selector.register(worker, selectors.EVENT_READ, data=worker)

        def replace(worker: _Worker) -> None:
            selector.unregister(worker)
            self._retire(worker)
            fresh = self._spawn()
            workers[workers.index(worker)] = fresh
            selector.register(fresh, selectors.EVENT_READ, data=fresh)

        def take_back(worker: _Worker) -> int:
            """Ends ``worker``'s chunk: returns the item it was on; the rest wait again."""
            chunk = in_flight.pop(worker)
            del deadlines[worker]
            current = chunk.popleft()
            pending.extendleft(reversed(chunk))
            return current

        try:
            while pending or in_flight:
                now = time.monotonic()
                for worker in list(workers):
                    if worker.ready and worker not in in_flight and pending:
                        size = min(self._chunk_items, -(-len(pending) // len(workers)))
                        chunk = collections.deque(pending.popleft() for _ in range(size))
                        if worker.send({**header, "items": [items[i] for i in chunk]}):
                            in_flight[worker], deadlines[worker] = chunk, now + self._time_limit_s
                        else:  # died while idle: the chunk waits for the others
                            pending.extendleft(reversed(chunk))
                            replace(worker)
                waits = list(deadlines.values())
                waits += [w.started_at + self._startup_timeout_s for w in workers if not w.ready]
                wait_s = max(0.0, min(waits) - time.monotonic()) if waits else None
                for key, _ in selector.select(wait_s):
                    worker: _Worker = key.data
                    messages = worker.read_messages()
                    if messages is None:
                        if worker in in_flight:
                            index = take_back(worker)
                            results[index] = ItemResult(CRASH, detail="worker died")
                            logging.warning(
                                "scoring worker died on item %d (gold %r, completion %r...)",
                                index,
                                items[index][1][:80],
                                items[index][0][:80],
                            )
                        elif not worker.ready:
                            raise RuntimeError(
                                f"verify worker exited during start-up with code "
                                f"{worker.process.wait()} (see its stderr); is math-verify "
                                "installed?"
                            )
                        replace(worker)
                        continue
                    for message in messages:
                        status = message["status"]
                        if status == "ready":
                            worker.ready = True
                        elif status == "startup_error":
                            raise ValueError(message["detail"])
                        else:
                            chunk = in_flight[worker]
                            results[chunk.popleft()] = ItemResult(
                                status, message["reward"], message["prediction"], message["detail"], message["style"]
                            )
                            if chunk:
                                deadlines[worker] = time.monotonic() + self._time_limit_s
                            else:
                                del in_flight[worker], deadlines[worker]
                now = time.monotonic()
                for worker in [w for w, deadline in deadlines.items() if now >= deadline]:
                    index = take_back(worker)
                    results[index] = ItemResult(TIMEOUT, detail=f"no answer within time_limit_s={self._time_limit_s}")
                    with self._condition:
                        self._stats.kills += 1
                    replace(worker)
                for worker in workers:
                    if not worker.ready and now >= worker.started_at + self._startup_timeout_s:
                        raise RuntimeError(
                            f"verify worker did not start within startup_timeout_s={self._startup_timeout_s}"
                        )
        except BaseException:
            for worker in list(in_flight):  # their late answers must not reach a later call
                in_flight.pop(worker)
                replace(worker)
            raise
        finally:
            selector.close()
        scored = [result for result in results if result is not None]
        assert len(scored) == len(results), "every item is scored once none is pending or in flight"
        return scored

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
