"""The first failure among cooperating threads, re-raised in the thread that joins them.

A worker thread's exception does not reach the thread that started it. `FirstError.guarded`
wraps a thread's target so that the first exception raised by any of the threads it guards is
kept (later ones are logged), an `on_exit` callback runs however the target ends (to wake the
other threads), and `raise_first()` re-raises the kept exception, with its traceback, in the
joining thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from absl import logging


class FirstError:
    """Keeps the first exception raised by any guarded thread target."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    def guarded(
        self,
        name: str,
        target: Callable[[], None],
        *,
        expected: tuple[type[BaseException], ...] = (),
        on_error: Callable[[BaseException], None] | None = None,
        on_exit: Callable[[], None] | None = None,
    ) -> Callable[[], None]:
        """A thread target that runs `target()`; an exception of the `expected` types ends it
        quietly, any other is recorded (the first one kept, with `on_error(error)` called once for
        it); `on_exit()` runs in every case."""

        def run() -> None:
            try:
                target()
            except expected:
                pass
            except BaseException as error:  # noqa: BLE001 - kept for raise_first() in the joining thread
                self._record(name, error, on_error)
            finally:
                if on_exit is not None:
                    on_exit()

        return run

    def _record(self, name: str, error: BaseException, on_error: Callable[[BaseException], None] | None) -> None:
        with self._lock:
            first = self.error is None
            if first:
                self.error = error
        if first:
            logging.error("%s thread failed: %r", name, error)
            if on_error is not None:
                on_error(error)
        else:
            logging.error("%s thread also failed: %r", name, error)

    def raise_first(self) -> None:
        """Re-raises the first recorded exception, if any."""
        if self.error is not None:
            raise self.error
