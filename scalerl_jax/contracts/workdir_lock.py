"""One run per workdir: an exclusive lock on `WORKDIR/run.lock` held for the run's life.

The lock is `fcntl.flock(LOCK_EX | LOCK_NB)` on an open file descriptor, so the kernel releases it
when the holder exits in any way, SIGKILL included: a lock file left behind by a killed run is
stale data, never a held lock, and does not block the next run. The file records the holder's pid,
host and start time as JSON, only to name the holder in the error a second run gets; the file is
never deleted (deleting it would let a third process lock a new inode while the old one is still
held). flock is per open file description, so a second `hold_workdir` of the same workdir inside
one process is refused as well. On NFS, Linux maps flock to byte-range locks that all clients see.
In a multi-host run only one process (process 0) should hold the workdir.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator

LOCK_FILE = "run.lock"


class WorkdirLockedError(RuntimeError):
    """Another live process holds the workdir."""


def _holder_text(path: str) -> str:
    """'pid P on host H since T' from the lock file, or why that is unknown."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        return f"pid {record['pid']} on host {record['host']} since {record['started']}"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"a process whose record is unreadable ({type(error).__name__}; it may be starting)"


def workdir_holder(workdir: str) -> str | None:
    """Who holds `workdir` right now ('pid P on host H since T'), or None when nobody does (the
    lock is taken and released at once; a missing workdir or lock file is not held)."""
    path = os.path.abspath(os.path.join(workdir, LOCK_FILE))
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder_text(path)
    finally:
        os.close(fd)
    return None


@contextlib.contextmanager
def hold_workdir(workdir: str) -> Iterator[str]:
    """Holds `workdir` exclusively for the `with` block; yields the lock file's path.

    Raises WorkdirLockedError at once (no waiting) naming the holder's pid and host and the lock
    file when another process, or another `hold_workdir` in this one, holds it.
    """
    os.makedirs(workdir, exist_ok=True)
    path = os.path.abspath(os.path.join(workdir, LOCK_FILE))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkdirLockedError(
                f"workdir {os.path.abspath(workdir)} is in use by {_holder_text(path)} (lock file {path}); "
                "wait for that run to end or use another workdir"
            ) from None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        yield path
    finally:
        os.close(fd)  # releases the lock
