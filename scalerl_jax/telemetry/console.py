"""The run's console shows the run: library chatter below ERROR is kept out of it.

TFDS (dataset configuration notices, "Reusing dataset") and orbax (checkpoint manager option
dumps, per-save INFO lines) log through absl at INFO and WARNING on every start and save. A
filter on absl's handler drops those records unless absl's verbosity asks for debug output
(`--verbosity=1`); errors always pass. The run's own lines are untouched.
"""

from __future__ import annotations

import logging as std_logging
import os

from absl import logging

LIBRARY_PACKAGES = ("tensorflow_datasets", "orbax", "tensorstore")


class LibraryNoiseFilter(std_logging.Filter):
    """Passes a record unless it comes from a `LIBRARY_PACKAGES` module below ERROR."""

    def __init__(self, packages: tuple[str, ...] = LIBRARY_PACKAGES):
        super().__init__()
        self._markers = tuple(f"{os.sep}{name}{os.sep}" for name in packages)

    def filter(self, record: std_logging.LogRecord) -> bool:
        if record.levelno >= std_logging.ERROR or logging.get_verbosity() >= logging.DEBUG:
            return True
        return not any(marker in record.pathname for marker in self._markers)


def quiet_library_logs() -> None:
    """Installs `LibraryNoiseFilter` on absl's handler once (idempotent)."""
    handler = logging.get_absl_handler()
    if not any(isinstance(f, LibraryNoiseFilter) for f in handler.filters):
        handler.addFilter(LibraryNoiseFilter())
