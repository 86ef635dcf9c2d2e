"""The code verifier: runs a program with its tests in the sandbox and scores it, several at once.

`CodeVerifier(limits).check(program, tests)` is one `Verdict`; `check_many(pairs)` runs them on a
pool of `limits.workers` threads, each driving one sandboxed process at a time (the work is in the
child processes, so threads beside the trainer are enough). Every run:
  - starts bwrap (`bubblewrap.command`) as the pool slot's own user, in a new session, with the
    harness (`harness.py`) as the command, the request on stdin and a pipe for the verdict;
  - waits `limits.wall_s` at most, then kills the sandbox's PID 1, and with it everything the
    program started (`kill_sandbox`);
  - keeps the first `limits.output_bytes` of stdout and of stderr.
Kinds: `passed` (score +1) and the failures `failed` (an exception or an `assert`),
`timeout` (the wall deadline or the CPU limit), `memory` (a MemoryError at the address-space
limit), `crash` (no verdict: a signal, the file-size limit, an exit before the tests finished) and
`unparsable` (the program does not compile).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import queue
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable
from typing import IO

from absl import logging

from scalerl_jax.sandbox import bubblewrap
from scalerl_jax.sandbox.bubblewrap import Containment

PASSED, FAILED, TIMEOUT, MEMORY, CRASH, UNPARSABLE = "passed", "failed", "timeout", "memory", "crash", "unparsable"
RUNNER_KINDS = (PASSED, FAILED, MEMORY, UNPARSABLE)  # the verdicts the harness's runner writes itself
_HARNESS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """What one contained run may use. `wall_s` is the deadline from the start (bwrap and the
    interpreter's start-up included, about 0.05 s); `cpu_s` the CPU limit of the program's process
    (and of each process it starts); `memory_bytes` its address space; `file_bytes` the largest
    file it may write (stdout and stderr included); `work_bytes` the size of its working
    directory; `open_files` and `processes` per sandbox; `output_bytes` how much of stdout and of
    stderr a Verdict keeps; `workers` runs at once in `check_many`."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    work_bytes: int = 64 << 20
    open_files: int = 64
    processes: int = 16
    output_bytes: int = 4096
    workers: int = 2

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if value <= 0:
                raise ValueError(f"code sandbox limit {name}={value} must be > 0")
        if self.workers > bubblewrap.UIDS_PER_PROCESS:
            raise ValueError(f"code sandbox workers={self.workers} above {bubblewrap.UIDS_PER_PROCESS}")
        if self.processes < 2:
            raise ValueError(f"code sandbox processes={self.processes}: bwrap's reaper and the program need 2")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One contained run: `kind` (the module docstring), its wall `seconds`, a one-line `detail` (the exception,
    the signal, the limit met) and the start of the program's `stdout` and `stderr`."""

    kind: str
    seconds: float
    detail: str = ""
    stdout: str = ""
    stderr: str = ""

    @property
    def passed(self) -> bool:
        return self.kind == PASSED

    def as_json(self) -> dict:
        """The verdict as the command line prints it."""
        return {"passed": self.passed, "kind": self.kind, "seconds": round(self.seconds, 3), "detail": self.detail}


def tests_compile_error(tests: str) -> str | None:
    """Why the tests (trusted data, compiled here, never run) do not compile; None when they do."""
    try:
        compile(tests, "<tests>", "exec")
    except (SyntaxError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def verdict_from_reports(
    timed_out: bool, runner: str | None, supervisor: str | None, returncode: int
) -> tuple[str, str]:
    """The kind and detail of a run from what this side saw (`harness.py` writes the lines; here
    without their nonce): the wall deadline passed (`timed_out`), the runner's verdict line, the
    supervisor's line on how the runner ended (`exit N` or `signal NAME`), bwrap's exit status."""
    if timed_out:
        return TIMEOUT, "wall-clock deadline"
    if runner is not None:
        kind, _, detail = runner.partition(" ")
        if kind in RUNNER_KINDS:
            return kind, detail
    if supervisor is None:
        return CRASH, f"the sandbox ended with status {returncode} and no report"
    how, _, value = supervisor.partition(" ")
    if how == "signal" and value == "SIGXCPU":
        return TIMEOUT, "CPU time limit (SIGXCPU)"
    if how == "signal" and value == "SIGKILL":
        return CRASH, "killed by SIGKILL (the hard CPU limit, or the machine out of memory)"
    if how == "signal":
        return CRASH, f"killed by {value}"
    return CRASH, f"exited with status {value} before the tests finished"


def child_pids(pid: int) -> list[int]:
    """The pids whose parent is `pid` (read from /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue  # ended while listed
            # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after its last ')'
            if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
                children.append(int(entry))
    return children


def kill_sandbox(process: subprocess.Popen) -> None:
    """Kills a sandbox at its deadline and reaps it. The sandbox's PID 1 is killed first: bwrap
    then reaps it and exits, and the kernel kills the rest of the namespace. (Killing bwrap first
    would leave PID 1 to die of bwrap's death signal as an orphan, a zombie where the machine's own
    init does not reap.) bwrap and its session are killed outright if it has not exited 5 s later."""
    for child in child_pids(process.pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def read_start(stream: IO[bytes], limit: int) -> str:
    """The first `limit` bytes of a file written by the sandbox, as text."""
    stream.seek(0)
    return stream.read(limit).decode("utf-8", "replace")


class CodeVerifier:
    """Scores programs against their tests in the bubblewrap sandbox (the module docstring).
    Construction runs the start-up probe (`bubblewrap.probe`): it raises SandboxUnavailable before
    any program runs when the machine cannot contain one as configured, and logs once when the
    network stays shared (`require_network_isolation=False` on a kernel that refuses a network
    namespace)."""

    def __init__(self, limits: SandboxLimits, *, python: str = "", require_network_isolation: bool = True):
        self.limits = limits
        self.containment: Containment = bubblewrap.probe(
            python=python, require_network_isolation=require_network_isolation
        )
        if not self.containment.isolate_network:
            logging.warning("code sandbox: programs run WITHOUT network isolation (the kernel refused a namespace)")
        with open(_HARNESS_PATH, encoding="utf-8") as f:
            harness = f.read()
        self._argv = bubblewrap.command(
            self.containment,
            work_bytes=limits.work_bytes,
            argv=[self.containment.python, "-I", "-S", "-B", "-u", "-c", harness],
        )
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(limits.workers):
            self._slots.put(slot)

    def check(self, program: str, tests: str) -> Verdict:
        """Runs `program` then `tests` in one sandbox and scores them (blocks at most about
        `limits.wall_s`); uses one pool slot."""
        error = tests_compile_error(tests)
        if error is not None:
            raise ValueError(f"code verifier: the tests do not compile ({error})")
        slot = self._slots.get()
        try:
            return self._run(program, tests, bubblewrap.sandbox_uid(slot))
        finally:
            self._slots.put(slot)

    def check_many(self, pairs: Iterable[tuple[str, str]]) -> list[Verdict]:
        """`check` of every (program, tests) pair, `limits.workers` at once, in the pairs' order."""
        with concurrent.futures.ThreadPoolExecutor(self.limits.workers, thread_name_prefix="code-verify") as pool:
            return list(pool.map(lambda pair: self.check(*pair), pairs))

    def _request(self, program: str, tests: str, nonce: str, report_fd: int) -> bytes:
        limits = self.limits
        request = {
            "program": program,
            "tests": tests,
            "nonce": nonce,
            "report_fd": report_fd,
            "limits": {
                "address_space": limits.memory_bytes,
                "cpu_s": limits.cpu_s,
                "file_size": limits.file_bytes,
                "open_files": limits.open_files,
                "processes": limits.processes,
            },
        }
        return json.dumps(request).encode("utf-8")

    def _run(self, program: str, tests: str, uid: int | None) -> Verdict:
        nonce = secrets.token_hex(16)
        read_fd, write_fd = os.pipe()
        start = time.perf_counter()
        timed_out = False
        with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
            try:
                process = subprocess.Popen(
                    self._argv,
                    stdin=subprocess.PIPE,
                    stdout=stdout,
                    stderr=stderr,
                    pass_fds=(write_fd,),
                    user=uid,
                    group=uid,
                    extra_groups=[] if uid is not None else None,
                    env={"PATH": bubblewrap.SANDBOX_PATH},
                    start_new_session=True,
                )
            except OSError:
                os.close(read_fd)
                raise
            finally:
                os.close(write_fd)
            try:
                # communicate() writes the request beside waiting, so a sandbox that never reads
                # it still meets the deadline; one that ends before reading it is not an error.
                process.communicate(
                    self._request(program, tests, nonce, write_fd),
                    timeout=max(0.0, self.limits.wall_s - (time.perf_counter() - start)),
                )
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                if process.poll() is None:
                    kill_sandbox(process)
            seconds = time.perf_counter() - start
            runner, supervisor = self._read_reports(read_fd, nonce)
            kind, detail = verdict_from_reports(timed_out, runner, supervisor, process.returncode)
            return Verdict(
                kind=kind,
                seconds=seconds,
                detail=detail,
                stdout=read_start(stdout, self.limits.output_bytes),
                stderr=read_start(stderr, self.limits.output_bytes),
            )

    @staticmethod
    def _read_reports(read_fd: int, nonce: str) -> tuple[str | None, str | None]:
        """The runner's verdict line and the supervisor's line (`harness.py`), without their nonce;
        None for one that did not come. The pipe's writers are all gone (the sandbox is dead), so
        reading ends at its end; at most 64 KiB are read."""
        try:
            data = os.read(read_fd, 1 << 16)
        finally:
            os.close(read_fd)
        prefix = nonce + " "
        runner = supervisor = None
        for line in data.decode("utf-8", "replace").splitlines():
            if not line.startswith(prefix):
                continue
            body = line[len(prefix) :]
            if body.startswith(("exit ", "signal ")):
                supervisor = body
            elif runner is None:
                runner = body
        return runner, supervisor
