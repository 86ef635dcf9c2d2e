"""This process's XLA compiles, counted from JAX's own compile events.

JAX records every backend compile (the XLA compile of a traced program, whether from a jitted call,
an eager op's first use, or `Lowered.compile()`) as the duration event `BACKEND_COMPILE_EVENT`
with the program's name. `compile_log()` installs one listener for the process (once) and returns
the `CompileLog` it fills: how many compiles, how many seconds, which program and in which thread
(the pipeline's threads are named, so a compile is attributed to the trainer or the generator by
its thread). After `CompileLog.warn_from_now(what)`, each compile also logs a warning naming the
program, so a steady-state compile shows in the log as it happens.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
from absl import logging

# jax._src.dispatch.BACKEND_COMPILE_EVENT (jax 0.10), recorded with fun_name=<program name>.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass(frozen=True)
class CompileEvent:
    """One backend compile: the program's name as JAX gives it (e.g. 'jit_accumulate_microbatch'),
    its compile seconds, the name of the thread that compiled it and when it ended (time.time())."""

    program: str
    seconds: float
    thread: str
    end_time: float


class CompileLog:
    """Thread-safe record of the compiles seen by `record` (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[CompileEvent] = []
        self._warn_after: str | None = None

    def record(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        """A `jax.monitoring` duration listener: keeps the backend-compile events."""
        if event != BACKEND_COMPILE_EVENT:
            return
        compile_event = CompileEvent(
            str(kwargs.get("fun_name", "?")), float(duration_secs), threading.current_thread().name, time.time()
        )
        with self._lock:
            self._events.append(compile_event)
            warn_after = self._warn_after
        if warn_after is not None:
            logging.warning(
                "compile after %s: %s (%.2f s, thread %s)",
                warn_after,
                compile_event.program,
                compile_event.seconds,
                compile_event.thread,
            )

    def count(self) -> int:
        """Compiles recorded so far."""
        with self._lock:
            return len(self._events)

    def events(self, start: int = 0) -> list[CompileEvent]:
        """The compiles from the `start`-th on (a `count()` taken earlier)."""
        with self._lock:
            return self._events[start:]

    def seconds(self, start: int = 0) -> float:
        """Compile seconds from the `start`-th compile on."""
        return sum(e.seconds for e in self.events(start))

    def warn_from_now(self, what: str) -> None:
        """Log a warning for every later compile, as 'compile after <what>: <program> ...'."""
        with self._lock:
            self._warn_after = what


_INSTALL_LOCK = threading.Lock()
_LOG: CompileLog | None = None


def compile_log() -> CompileLog:
    """The process's `CompileLog`, its listener installed with `jax.monitoring` on the first call."""
    global _LOG
    with _INSTALL_LOCK:
        if _LOG is None:
            log = CompileLog()
            jax.monitoring.register_event_duration_secs_listener(log.record)
            _LOG = log
        return _LOG


def summary(events: list[CompileEvent]) -> str:
    """'N compiles, X s' with the programs by count, e.g. '3 compiles, 1.2 s: jit_f x2, jit_g'."""
    if not events:
        return "0 compiles"
    counts: dict[str, int] = {}
    for e in events:
        counts[e.program] = counts.get(e.program, 0) + 1
    names = ", ".join(name if n == 1 else f"{name} x{n}" for name, n in counts.items())
    return f"{len(events)} compiles, {sum(e.seconds for e in events):.1f} s: {names}"
