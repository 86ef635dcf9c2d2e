"""SIGTERM and SIGINT for a run's life: the first asks for a graceful stop (the current step
finishes, is written and checkpointed), a second SIGINT ends the process at once. The run's only
signal handling: the pipeline installs none, it stops when `StopSignals` calls its `request_stop`."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from absl import logging

EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's status for a run stopped by Ctrl-C


class StopSignals:
    """SIGTERM / SIGINT for the run's life (installed from the main thread by `run`).

    The first SIGTERM or SIGINT asks for a graceful stop: on the leader, the pipeline finishes
    its current step, writes its metrics row and checkpoints the state after it (every trainer
    process saves with the leader), then the run ends normally (exit 0, the stop reason in the
    summary). Followers and generator processes only log it: the leader decides the step at which
    every process stops (SLURM signals all of them), so none stops on its own and leaves a
    collective half issued. A later SIGTERM is logged and ignored. A later SIGINT (a second
    Ctrl-C) ends the process at once: one line on stderr, logs flushed, `os._exit(130)`, without
    the interpreter's teardown (XLA's threads abort it mid-step); the next run resumes from the
    last complete checkpoint. A stop asked for before the pipeline exists is kept and passed on
    when it registers (`on_stop`)."""

    def __init__(self, *, leader: bool) -> None:
        self.leader = leader
        self.reason: str | None = None  # 'signal SIGTERM' once a stop was asked for
        self._stop: Callable[[str], None] | None = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, self.handle)

    def on_stop(self, stop: Callable[[str], None]) -> None:
        """`stop(reason)` is called on the first signal (at once if one came already)."""
        self._stop = stop  # handlers run in the main thread, between its bytecodes: no lock needed
        if self.reason is not None:
            stop(self.reason)

    def handle(self, signum: int, frame: object = None) -> None:
        name = signal.Signals(signum).name
        first = self.reason is None
        if first:
            self.reason = f"signal {name}"
        if not first:
            if signum == signal.SIGINT:
                exit_now(
                    f"stopped at once by a second {name}; the next run resumes from the last complete checkpoint",
                    EXIT_INTERRUPTED,
                )
            logging.warning("%s received again: already stopping after the current step", name)
            return
        if not self.leader:
            logging.warning("%s received: the leader (process 0) chooses the step at which every process stops", name)
            return
        logging.warning("%s received: stopping after the current step, with a checkpoint", name)
        if self._stop is not None:
            self._stop(f"signal {name}")


@contextlib.contextmanager
def preserved_signal_handlers() -> Iterator[None]:
    """Restores the SIGINT / SIGTERM handlers found on entry (the caller keeps its Ctrl-C)."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:
                signal.signal(signum, handler)


def exit_now(message: str, status: int) -> None:
    """Ends the process at once: `message` on stderr, logs flushed, `os._exit(status)`."""
    print(message, file=sys.stderr, flush=True)
    logging.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(status)
