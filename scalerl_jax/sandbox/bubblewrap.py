"""How a process is contained: the bubblewrap (`bwrap`) command line, the user it runs as, and the
start-up probe that says what this machine allows.

bubblewrap is the sandbox Flatpak runs applications in: it puts one command in new namespaces
(user, PID, network, mount, IPC, UTS, cgroup) with a filesystem built from its arguments. Inside
ours a program sees:
  - `/` read-only (the interpreter and the standard library), `/dev` a minimal read-only device
    set, `/proc` of its own PID namespace (no other process of the machine is visible);
  - `/tmp`, its working directory: an empty tmpfs of `work_bytes`, gone with the sandbox;
  - no network but its own loopback (its own network namespace; `isolate_network=False` keeps the
    machine's where the kernel refuses a new one);
  - an environment of PATH, HOME, TMPDIR and LANG only, no inherited descriptor but stdout, stderr
    and the report pipe, no capabilities, no further user namespaces, a new session (setsid);
  - the user `sandbox_uid()`: as root, an unprivileged uid of its own, never root (the kernel
    exempts root from the process limit, and a fork bomb must meet it).
The command itself is PID 1 of its namespace (`--as-pid-1`: bwrap waits for it directly, so no
reaper of bwrap's is left to an init that may not reap it). When it exits, or is killed, the kernel
kills every other process of the namespace, `setsid` escapes and daemons included; with
`--die-with-parent` it is killed when bwrap is.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import subprocess
import sys

# Where the uids of sandboxed processes start when this process is root: far above any account.
ROOT_UID_BASE = 1_600_000_000
UIDS_PER_PROCESS = 100
SANDBOX_PATH = "/usr/bin:/bin"


class SandboxUnavailable(RuntimeError):
    """The machine cannot contain a program as configured (no bwrap, no namespaces, no
    interpreter the sandbox user may run); the message says which and what to change."""


@dataclasses.dataclass(frozen=True)
class Containment:
    """What the start-up probe found: the bwrap binary, the interpreter run inside, and whether
    the program gets its own network namespace."""

    bwrap: str
    python: str
    isolate_network: bool


def sandbox_uid(slot: int) -> int | None:
    """The uid the sandbox of pool slot `slot` runs as: `ROOT_UID_BASE + (pid mod 10^5) * 100 +
    slot` when this process is root (each slot its own user, so one sandbox can never signal or
    share a process count with another), None (this process's own uid) otherwise."""
    if os.geteuid() != 0:
        return None
    if not 0 <= slot < UIDS_PER_PROCESS:
        raise ValueError(f"sandbox slot {slot} outside 0..{UIDS_PER_PROCESS - 1}")
    return ROOT_UID_BASE + (os.getpid() % 100_000) * UIDS_PER_PROCESS + slot


def world_runnable(path: str) -> bool:
    """True when a user with no relation to the file's owner may run `path`: the file readable
    and executable by others and every directory above it searchable by others."""
    real = os.path.realpath(path)
    try:
        if stat.S_IMODE(os.stat(real).st_mode) & 0o005 != 0o005:
            return False
        parent = os.path.dirname(real)
        while parent != os.path.dirname(parent):
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            parent = os.path.dirname(parent)
    except OSError:
        return False
    return True


def sandbox_python(configured: str) -> str:
    """The interpreter the sandbox runs: `configured` when set, else this process's own when any
    user may run it, else the system's `python3` on PATH's usual places."""
    if configured:
        return configured
    if world_runnable(sys.executable):
        return os.path.realpath(sys.executable)
    system = shutil.which("python3", path=SANDBOX_PATH)
    if system and world_runnable(system):
        return os.path.realpath(system)
    raise SandboxUnavailable(
        f"code sandbox: no Python interpreter that an unprivileged user may run ({sys.executable} is not; "
        "set the sandbox's `python` to one, e.g. /usr/bin/python3)"
    )


def command(containment: Containment, *, work_bytes: int, argv: list[str]) -> list[str]:
    """The bwrap command line that runs `argv` contained (the module docstring)."""
    network = [] if containment.isolate_network else ["--share-net"]
    return [
        containment.bwrap,
        "--unshare-all",
        *network,
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--as-pid-1",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--ro-bind",
        "/",
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--remount-ro",
        "/dev",
        "--size",
        str(work_bytes),
        "--perms",
        "0700",
        "--tmpfs",
        "/tmp",
        "--chdir",
        "/tmp",
        "--clearenv",
        "--setenv",
        "PATH",
        SANDBOX_PATH,
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "TMPDIR",
        "/tmp",
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--",
        *argv,
    ]


def run_probe(containment: Containment, uid: int | None) -> subprocess.CompletedProcess:
    """Runs `python -c pass` contained, as `uid`; the completed process (its stderr says why
    bwrap refused, if it did)."""
    argv = command(containment, work_bytes=1 << 20, argv=[containment.python, "-I", "-S", "-c", "pass"])
    return subprocess.run(
        argv,
        user=uid,
        group=uid,
        extra_groups=[] if uid is not None else None,
        env={"PATH": SANDBOX_PATH},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def probe(*, python: str, require_network_isolation: bool) -> Containment:
    """Finds what this machine allows, once at start-up: bwrap on PATH, an interpreter the sandbox
    user may run, and a network namespace of its own. Raises SandboxUnavailable with the reason
    when bwrap cannot run at all, or cannot isolate the network and `require_network_isolation`;
    the returned Containment's `isolate_network` says which was chosen."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "code sandbox: bubblewrap (`bwrap`) is not on PATH; install it (Debian/Ubuntu: apt-get install bubblewrap)"
        )
    isolated = Containment(bwrap=bwrap, python=sandbox_python(python), isolate_network=True)
    uid = sandbox_uid(0)
    result = run_probe(isolated, uid)
    if result.returncode == 0:
        return isolated
    shared = dataclasses.replace(isolated, isolate_network=False)
    fallback = run_probe(shared, uid)
    if fallback.returncode != 0:
        raise SandboxUnavailable(
            f"code sandbox: bubblewrap cannot start a sandbox here (exit {result.returncode}: "
            f"{result.stderr.strip()[-300:]}); user namespaces may be disabled for this user"
        )
    if require_network_isolation:
        raise SandboxUnavailable(
            "code sandbox: the kernel refuses a network namespace for the sandbox "
            f"({result.stderr.strip()[-300:]}); set the sandbox's `require_network_isolation=False` "
            "to run programs with this machine's network"
        )
    return shared
