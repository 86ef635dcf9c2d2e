"""One line for a user's mistake at every entry point (main, evaluate, export, fit, study).

A known bad input (a config key, a data row, a checkpoint file, a flag) ends the command with one
line naming what and where, exit status `EXIT_INPUT_ERROR` (2); a run-time failure (a file that
cannot be written, a locked workdir) with one line and `EXIT_RUN_ERROR` (1). The traceback behind
the line is printed too when `SCALERL_DEBUG=1` is set (`main` also logs it with `--verbosity=1`).
Each entry point catches its known error types once; anything else keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback

DEBUG_ENV = "SCALERL_DEBUG"
EXIT_INPUT_ERROR = 2
EXIT_RUN_ERROR = 1


def debug_enabled() -> bool:
    """True when `SCALERL_DEBUG` is set to anything but '', '0' or 'false'."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false")


def report_error(message: str, status: int) -> int:
    """Prints `message` on stderr (after the traceback of the exception being handled, when
    `debug_enabled()`); returns `status` for the caller to exit with."""
    if debug_enabled() and sys.exc_info()[0] is not None:
        traceback.print_exc()
    print(message, file=sys.stderr, flush=True)
    return status
