"""Chaos soak of the real training loop: `python -m scalerl_jax.main` run to `--steps` while faults,
drawn from a seeded RNG, hit it; each stopped run is resumed with the same command.

    sudo python benchmarks/soak.py --steps 2000 --seed 0 --workdir /mnt/soak --scratch /tmp/soak

Faults (`--faults`, comma-separated):
  sigterm    SIGTERM to the run (it finishes the step, checkpoints, exits 0); resumed.
  kill9      SIGKILL to the run; resumed from its last complete checkpoint.
  worker     SIGKILL to one of the run's verifier worker processes; the run goes on.
  disk_full  when a checkpoint save starts (its orbax temporary directory appears), a filler file
             takes all but `--headroom-mb` of the workdir's filesystem; the run must stop with one
             line naming the path it could not write, the previous checkpoint intact. The filler
             is removed and the run resumed.
  read_only  the workdir's filesystem turns read-only for `--read-only-s` seconds; the run stops
             with one line (a run still alive after the window gets SIGTERM), then the filesystem
             is made writable again and the run resumed.

The workdir is a filesystem of its own that the soak mounts (root only): an ext4 image on a loop
device, without a journal and with `errors=remount-ro`. Read-only is ext4's forced read-only
(`/sys/fs/ext4/<dev>/trigger_fs_error`): `mount -o remount,ro` is refused (EBUSY) while the run
holds files open for writing, which it always does; the forced state is left by unmounting, so the
filesystem is unmounted, checked (`e2fsck -fy`) and mounted again before the resume. Without a loop
device the workdir is a tmpfs and read_only is skipped; without mount at all both filesystem faults
are skipped; each says so once and the skipped faults are counted.

Timing: a fault is due a uniform(0.5, 1.5) x `--mean-interval` seconds after the run (re)started
training (its first training row), so every fault hits a training loop, not a start-up; the kinds
come in rounds, each a seeded shuffle of all of them. Recovery time: from the fault to the first
training row written after it by a run started after it (for `worker`, by the same run).

End checks (exit 0 only when all hold): training rows exactly once for each step 1..N; evaluation
rows at most once a step; every checkpoint directory complete and verified (its checksums, by the
run's own restore) and no temporary one left; no process left behind (none whose command line names
the workdir, none in a session of a run, no verifier worker seen during the soak); every fault
handled as above; and, when the run reaches `--compare-step`, the held-out pass rate there and the
mean of the last five evaluations up to it within mean +- 2 std (sample std) of the baseline seeds.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("sigterm", "kill9", "worker", "disk_full", "read_only")
FILESYSTEM_KINDS = ("disk_full", "read_only")
STUDY_CONFIG = "configs/study.py:configs/tiny.py,baseline"
STUDY_FLAGS = ("--config.eval.every=20", "--config.eval.samples_per_prompt=8", "--config.eval.samples_logged=128")
BASELINE = os.path.join(REPO, "docs", "results", "study_long_extended", "baseline")
TMP_MARK = ".orbax-checkpoint-tmp"
WORKER_SCRIPT = "verify_worker.py"
LAST_EVALUATIONS = 5


LOG_FILE: list[str] = []  # scratch/soak.log once the scratch directory exists


def log(message: str) -> None:
    """`message` on stdout and in scratch/soak.log (a soak under a test runner is watched there)."""
    line = f"[soak {time.strftime('%H:%M:%S')}] {message}"
    print(line, flush=True)
    for path in LOG_FILE:
        with open(path, "a") as f:
            f.write(line + "\n")


def run_quiet(command: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# The workdir's filesystem


class Filesystem:
    """The filesystem mounted at `mount_point`: 'ext4' (a loop image), 'tmpfs', or 'none' (not
    mounted: the directory as it is). `unavailable` maps a fault kind to why it cannot be done."""

    def __init__(self, mount_point: str, scratch: str, size_mb: int):
        self.mount_point = mount_point
        self.image = os.path.join(scratch, "workdir.ext4")
        self.size_mb = size_mb
        self.kind = "none"
        self.unavailable: dict[str, str] = {}

    def mount(self) -> None:
        os.makedirs(self.mount_point, exist_ok=True)
        if os.path.ismount(self.mount_point):
            raise SystemExit(f"soak: {self.mount_point} is already a mount point; give an empty directory")
        ext4 = self._mount_ext4(fresh=True)
        if ext4 is None:
            self.kind = "ext4"
            if not os.path.exists(self._trigger_file()):
                self.unavailable["read_only"] = f"{self._trigger_file()} does not exist"
            return
        tmpfs = run_quiet(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}M", "tmpfs", self.mount_point])
        if tmpfs.returncode == 0:
            self.kind = "tmpfs"
            self.unavailable["read_only"] = (
                f"no ext4 loop mount ({ext4}); tmpfs refuses remount,ro while the run has files open (EBUSY)"
            )
            return
        reason = f"cannot mount a filesystem at {self.mount_point} (needs root): {tmpfs.stderr.strip() or ext4}"
        self.unavailable = {kind: reason for kind in FILESYSTEM_KINDS}

    def _mount_ext4(self, *, fresh: bool) -> str | None:
        """Mounts the ext4 image (made first when `fresh`); None on success, else why not."""
        if fresh:
            with open(self.image, "wb") as f:
                f.truncate(self.size_mb << 20)
            made = run_quiet(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0", self.image])
            if made.returncode != 0:
                return f"mkfs.ext4: {made.stderr.strip()}"
        mounted = run_quiet(["mount", "-o", "loop,errors=remount-ro", self.image, self.mount_point])
        return None if mounted.returncode == 0 else f"mount -o loop: {mounted.stderr.strip()}"

    def _trigger_file(self) -> str:
        source = run_quiet(["findmnt", "-n", "-o", "SOURCE", self.mount_point]).stdout.strip()
        return f"/sys/fs/ext4/{os.path.basename(source)}/trigger_fs_error"

    def make_read_only(self) -> None:
        """ext4's forced read-only: what it does on a disk error with errors=remount-ro."""
        with open(self._trigger_file(), "w") as f:
            f.write("soak: read-only fault")

    def make_writable(self) -> None:
        """Unmounts (the forced read-only state lasts until then), checks and mounts the image again."""
        self.unmount()
        checked = run_quiet(["e2fsck", "-fy", self.image], timeout=600)
        if checked.returncode not in (0, 1):  # 1: errors corrected
            raise RuntimeError(f"e2fsck {self.image}: status {checked.returncode}: {checked.stdout[-500:]}")
        problem = self._mount_ext4(fresh=False)
        if problem is not None:
            raise RuntimeError(problem)

    def fill(self, headroom_bytes: int) -> str:
        """A filler file taking all but about `headroom_bytes` of the free space; its path."""
        path = os.path.join(self.mount_point, "soak-filler")
        stats = os.statvfs(self.mount_point)
        size = stats.f_bavail * stats.f_frsize - headroom_bytes
        with open(path, "wb") as f:
            while size > 0:
                try:
                    os.posix_fallocate(f.fileno(), 0, size)
                    break
                except OSError:  # the run wrote meanwhile: take a little less
                    size -= 1 << 20
        return path

    def free_bytes(self) -> int:
        stats = os.statvfs(self.mount_point)
        return stats.f_bavail * stats.f_frsize

    def unmount(self) -> None:
        if self.kind == "none":
            return
        for _ in range(30):
            if run_quiet(["umount", self.mount_point]).returncode == 0:
                return
            time.sleep(1)
        raise RuntimeError(f"cannot unmount {self.mount_point}: still busy after 30 s")


# ---------------------------------------------------------------------------------------------
# The run and what it writes


@dataclasses.dataclass
class Row:
    seen: float  # monotonic time the soak read it
    run: int  # index of the run process alive when it was read
    data: dict


def is_training(row: dict) -> bool:
    return any(key.startswith("train/") for key in row)


def is_evaluation(row: dict) -> bool:
    return "eval/pass_rate" in row


class MetricsTail:
    """New complete rows of `metrics.jsonl` as they appear. A resume cuts the file back; the rows
    the cut keeps were seen already and are not reported again."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.last_training_step = 0

    def poll(self, run: int) -> list[Row]:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return []
        fresh = True
        if size < self.offset:  # cut back by a resume
            self.offset, fresh = 0, False
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        rows = []
        for line in data[:end].splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict):
                    rows.append(row)
        self.offset += end
        now = time.monotonic()
        training = [row["step"] for row in rows if is_training(row)]
        if training:
            self.last_training_step = training[-1]
        return [Row(now, run, row) for row in rows] if fresh else []


@dataclasses.dataclass(frozen=True)
class Proc:
    """A process as /proc shows it; (pid, start) names it across pid reuse."""

    pid: int
    parent: int
    session: int
    state: str
    start: int  # clock ticks after boot
    cmdline: str


def process_table() -> dict[int, Proc]:
    """{pid: Proc} of every process readable in /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        pid = int(entry)
        table[pid] = Proc(pid, int(fields[1]), int(fields[3]), fields[0], int(fields[19]), cmdline)
    return table


def verifier_workers(run_pid: int) -> list[Proc]:
    """The live verifier worker processes of the run `run_pid` (its children running the worker script)."""
    return sorted(
        (p for p in process_table().values() if p.parent == run_pid and WORKER_SCRIPT in p.cmdline and p.state != "Z"),
        key=lambda p: p.pid,
    )


def left_behind(table: dict[int, Proc], runs: dict[int, int], workers: set[tuple[int, int]], text: str) -> list[Proc]:
    """Processes of `table` that belong to a finished soak: in the session of a run (`runs`: {pid:
    start}; a session whose leader's pid was reused since is another one), a verifier worker seen
    (`workers`: {(pid, start)}), or naming `text` (the workdir) in their command line."""
    found = []
    for proc in table.values():
        leader = table.get(proc.session)
        ours = proc.session in runs and proc.start >= runs[proc.session]
        if ours and leader is not None and leader.start != runs[proc.session]:
            ours = False
        if ours or (proc.pid, proc.start) in workers or text in proc.cmdline:
            found.append(proc)
    return found


class Run:
    """One `python -m scalerl_jax.main` process (its own session), stderr and stdout to `log_path`."""

    def __init__(self, command: list[str], log_path: str, index: int):
        self.index = index
        self.log_path = log_path
        self.started = time.monotonic()
        self.trained = False  # wrote a training row
        with open(log_path, "wb") as out:
            self.process = subprocess.Popen(
                command,
                cwd=REPO,
                env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        own = process_table().get(self.process.pid)
        self.start_ticks = own.start if own is not None else 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_size(self) -> int:
        return os.path.getsize(self.log_path)

    def log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def one_line_error(text: str, path: str) -> str | None:
    """Why the output of a stopped run is not one error line naming a path under `path` (None if it is):
    no traceback, the last line an 'error: ...' line that names the path."""
    if "Traceback (most recent call last)" in text:
        return "a traceback"
    line = last_line(text)
    if not line.startswith("error:"):
        return f"last line is not an error line: {line[:200]!r}"
    if path not in line:
        return f"the error line names no path under {path}: {line[:200]!r}"
    return None


# ---------------------------------------------------------------------------------------------
# The soak


@dataclasses.dataclass
class Fault:
    kind: str
    at: float  # seconds since the soak started
    step: int  # the last training step logged when it hit
    outcome: str = ""
    problem: str | None = None  # what went wrong; None when handled as required
    line: str = ""  # the run's last line, for faults that stop it
    recovery_s: float | None = None
    resumed_by: int = -1  # index of the run whose training rows end its recovery
    _started: float = 0.0


def add_problem(fault: Fault, problem: str | None) -> None:
    """Adds `problem` (if any) to what went wrong with `fault`."""
    if problem:
        fault.problem = f"{fault.problem}; {problem}" if fault.problem else problem


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.t0 = time.monotonic()
        self.run_dir = os.path.join(args.workdir, "run")
        self.fs = Filesystem(args.workdir, args.scratch, args.fs_size_mb)
        self.kinds = [k for k in args.faults.split(",") if k]
        self.tail = MetricsTail(os.path.join(self.run_dir, "metrics.jsonl"))
        self.rows: list[Row] = []
        self.runs: list[Run] = []
        self.faults: list[Fault] = []
        self.skipped: collections.Counter[str] = collections.Counter()
        self.unplanned_exits: list[str] = []
        self.workers: set[tuple[int, int]] = set()  # (pid, start) of every verifier worker seen
        self.plan: list[str] = []
        self.due: float | None = None
        self.stop_asked: str | None = None  # SIGINT / SIGTERM to the soak: stop early, then check
        self.stopped_at: int | None = None  # the last training step of a soak stopped early

    # -- the run ------------------------------------------------------------------------------
    @property
    def run(self) -> Run:
        return self.runs[-1]

    def command(self) -> list[str]:
        args = self.args
        return [
            sys.executable,
            "-m",
            "scalerl_jax.main",
            f"--config={args.config}",
            f"--workdir={self.run_dir}",
            f"--config.num_steps={args.steps}",
            f"--config.seed={args.seed}",
            *args.override,
        ]

    def place_warm_start(self) -> None:
        """Copies `--warm-start` (a warm start directory built for the same config) under the run's
        workdir, where the run finds and reuses it instead of training it again."""
        source = os.path.abspath(self.args.warm_start)
        shutil.copytree(source, os.path.join(self.run_dir, "warm_start", os.path.basename(source)))
        log(f"warm start {source} placed in {self.run_dir}/warm_start")

    def start_run(self) -> None:
        index = len(self.runs)
        self.runs.append(Run(self.command(), os.path.join(self.args.scratch, f"run{index}.log"), index))
        self.due = None
        log(f"run {index} started (pid {self.run.pid})")

    def poll(self) -> None:
        """Reads new rows; closes the recovery of faults a training row ends; notes the verifier workers."""
        for row in self.tail.poll(self.run.index):
            self.rows.append(row)
            if not is_training(row.data):
                continue
            self.run.trained = True
            for fault in self.faults:
                if fault.recovery_s is None and fault.resumed_by <= row.run and row.seen > fault._started:
                    fault.recovery_s = row.seen - fault._started
        if self.run.alive():
            self.workers.update((p.pid, p.start) for p in verifier_workers(self.run.pid))

    def wait_exit(self, timeout: float) -> int | None:
        """The run's exit status once it ends within `timeout` seconds (None if it did not)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if not self.run.alive():
                self.poll()
                return self.run.process.returncode
            time.sleep(0.5)
        return None

    def stop_run(self, fault: Fault | None = None) -> None:
        """SIGTERM to the run (its workers are its to stop), then SIGKILL to its whole session
        after `--exit-timeout` seconds; notes a hang in `fault`."""
        if not self.run.alive():
            return
        os.kill(self.run.pid, signal.SIGTERM)
        if self.wait_exit(self.args.exit_timeout) is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.run.pid, signal.SIGKILL)
            self.run.process.wait(timeout=60)
            if fault is not None:
                add_problem(fault, f"no exit {self.args.exit_timeout:.0f} s after SIGTERM")

    # -- faults -------------------------------------------------------------------------------
    def next_kind(self) -> str:
        if not self.plan:
            self.plan = list(self.kinds)
            self.rng.shuffle(self.plan)
        return self.plan.pop(0)

    def inject(self, kind: str) -> None:
        if kind in self.fs.unavailable:
            self.skipped[kind] += 1
            log(f"fault {kind} skipped: {self.fs.unavailable[kind]}")
            return
        now = time.monotonic()
        fault = Fault(kind, now - self.t0, self.tail.last_training_step, _started=now)
        # recovery ends with a training row of the run after this one (the stopped run may still
        # log the step it is in), or of this one for a killed worker
        fault.resumed_by = self.run.index + (kind != "worker")
        self.faults.append(fault)
        log(f"fault {len(self.faults)}: {kind} at step {fault.step}")
        getattr(self, f"fault_{kind}")(fault)
        log(
            f"fault {len(self.faults)}: {kind}: {fault.outcome}"
            + (f" PROBLEM: {fault.problem}" if fault.problem else "")
        )

    def resume(self, fault: Fault) -> None:
        self.start_run()

    def fault_sigterm(self, fault: Fault) -> None:
        os.kill(self.run.pid, signal.SIGTERM)
        status = self.wait_exit(self.args.exit_timeout)
        fault.outcome = f"exit {status}"
        if status != 0:
            fault.problem = f"exit status {status} after SIGTERM (expected 0)"
            self.stop_run(fault)
        self.resume(fault)

    def fault_kill9(self, fault: Fault) -> None:
        os.kill(self.run.pid, signal.SIGKILL)
        status = self.wait_exit(60)
        fault.outcome = f"exit {status}"
        self.resume(fault)

    def fault_worker(self, fault: Fault) -> None:
        workers = verifier_workers(self.run.pid)
        if not workers:
            fault.outcome, fault.problem = "no verifier worker alive", "no verifier worker to kill"
            return
        victim = self.rng.choice(workers)
        os.kill(victim.pid, signal.SIGKILL)
        fault.outcome = f"killed worker {victim.pid} of {len(workers)}"

    def wait_for_save(self, timeout: float) -> bool:
        """Polls (every millisecond) until a checkpoint save's temporary directory exists."""
        directory = os.path.join(self.run_dir, "checkpoints")
        deadline = time.monotonic() + timeout
        next_poll = 0.0
        while time.monotonic() < deadline and self.run.alive():
            with contextlib.suppress(OSError):
                if any(TMP_MARK in name for name in os.listdir(directory)):
                    return True
            if time.monotonic() > next_poll:
                self.poll()
                next_poll = time.monotonic() + 0.5
            time.sleep(0.001)
        return False

    def fault_disk_full(self, fault: Fault) -> None:
        if not self.wait_for_save(self.args.save_wait):
            fault.outcome = "no checkpoint save started"
            fault.problem = f"no save within {self.args.save_wait:.0f} s (or the run ended)"
            fault.recovery_s = 0.0
            return
        offset = self.run.log_size()
        filler = self.fs.fill(self.args.headroom_mb << 20)
        fault._started = time.monotonic()  # the disk is full from here
        fault.at, fault.step = fault._started - self.t0, self.tail.last_training_step
        fault.outcome = f"filled ({self.fs.free_bytes() >> 10} KiB left)"
        status = self.wait_exit(self.args.full_wait)
        if status is None:
            fault.problem = f"the run did not stop within {self.args.full_wait:.0f} s of a full disk"
            self.stop_run(fault)
            status = self.run.process.returncode
        text = self.run.log_since(offset)
        fault.line = last_line(text)
        fault.outcome += f", exit {status}"
        if status == 0:
            fault.problem = "exit status 0 on a full disk"
        else:
            fault.problem = one_line_error(text, self.args.workdir)
        os.remove(filler)
        self.resume(fault)

    def fault_read_only(self, fault: Fault) -> None:
        offset = self.run.log_size()
        self.fs.make_read_only()
        status = self.wait_exit(self.args.read_only_s)
        remaining = self.args.read_only_s - (time.monotonic() - fault._started)
        if remaining > 0:
            time.sleep(remaining)
        if status is None:
            fault.outcome = f"survived {self.args.read_only_s:.0f} s read-only; SIGTERM"
            self.stop_run(fault)
            status = self.run.process.returncode
        else:
            fault.outcome = "stopped by itself"
        fault.outcome += f", exit {status}"
        text = self.run.log_since(offset)
        fault.line = last_line(text)
        if status == 0:  # a stop checkpoints, which a read-only filesystem refuses
            fault.problem = "exit status 0 although the workdir was read-only"
        else:
            add_problem(fault, one_line_error(text, self.args.workdir))
        self.fs.make_writable()
        self.resume(fault)

    # -- the loop -----------------------------------------------------------------------------
    def drive(self) -> None:
        args = self.args
        if args.warm_start:
            self.place_warm_start()
        self.start_run()
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            self.poll()
            if self.stop_asked is not None:
                self.stop_early()
                return
            if not self.run.alive():
                status = self.run.process.returncode
                if status == 0 and self.tail.last_training_step >= args.steps:
                    log(f"run {self.run.index} finished at step {self.tail.last_training_step}")
                    return
                line = last_line(self.run.log_since(0))
                self.unplanned_exits.append(f"run {self.run.index}: exit {status}: {line[:300]}")
                log(f"run {self.run.index} ended unasked, exit {status}: {line[:300]}")
                if len(self.unplanned_exits) > args.max_unplanned:
                    return
                self.start_run()
                continue
            if self.run.trained and self.due is None:
                self.due = time.monotonic() + self.rng.uniform(0.5, 1.5) * args.mean_interval
            late = self.tail.last_training_step >= args.steps - args.quiet_steps
            fault_budget = args.max_faults <= 0 or len(self.faults) + sum(self.skipped.values()) < args.max_faults
            if self.due is not None and time.monotonic() >= self.due and not late and fault_budget:
                self.inject(self.next_kind())
                self.due = None
            time.sleep(0.5)
        log(f"soak timed out after {args.timeout:.0f} s")
        self.unplanned_exits.append(f"the soak timed out after {args.timeout:.0f} s")
        self.stop_run()

    def ask_stop(self, signum: int, frame: object = None) -> None:
        """The soak's SIGINT / SIGTERM handler: no more faults; the run is stopped and checked."""
        self.stop_asked = signal.Signals(signum).name

    def stop_early(self) -> None:
        """Stops the run as SIGTERM does (it checkpoints its step) and checks the steps reached."""
        log(f"{self.stop_asked}: stopping the run and checking the steps it reached")
        self.stop_run()
        self.poll()
        self.stopped_at = self.tail.last_training_step
        log(f"stopped early at step {self.stopped_at} of {self.args.steps}")

    # -- the end checks -----------------------------------------------------------------------
    def final_rows(self) -> list[dict]:
        with open(os.path.join(self.run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]

    def check_rows(self, rows: list[dict]) -> list[str]:
        problems = []
        training = collections.Counter(row["step"] for row in rows if is_training(row))
        expected = set(range(1, (self.stopped_at or self.args.steps) + 1))
        missing = sorted(expected - set(training))
        twice = sorted(step for step, count in training.items() if count > 1)
        extra = sorted(set(training) - expected)
        if missing or twice or extra:
            problems.append(
                f"training rows: missing {missing[:20]}, more than once {twice[:20]}, unexpected {extra[:20]}"
            )
        evaluations = collections.Counter(row["step"] for row in rows if is_evaluation(row))
        twice = sorted(step for step, count in evaluations.items() if count > 1)
        if twice:
            problems.append(f"evaluation rows more than once at steps {twice[:20]}")
        return problems

    def check_checkpoints(self) -> tuple[dict[str, str], list[str]]:
        """{entry: 'verified' or why not} of the checkpoints directory, by the run's own restore."""
        directory = os.path.join(self.run_dir, "checkpoints")
        verify = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--verify-checkpoints", self.run_dir],
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"),
            capture_output=True,
            text=True,
            timeout=1800,
        )
        try:
            result = json.loads(verify.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            return {}, [f"checkpoint verification failed: {verify.stderr[-1000:]}"]
        problems = [f"checkpoint {name}: {status}" for name, status in result.items() if status != "verified"]
        if not result:
            problems.append(f"no checkpoint in {directory}")
        return result, problems

    def check_leftovers(self) -> list[str]:
        table = process_table()
        table.pop(os.getpid(), None)
        runs = {run.pid: run.start_ticks for run in self.runs}
        return [
            f"process left behind: pid {p.pid} ({p.state}): {p.cmdline[:200]}"
            for p in left_behind(table, runs, self.workers, self.run_dir)
        ]

    def compare_pass_rate(self, rows: list[dict]) -> tuple[dict, list[str]]:
        step = self.args.compare_step
        evaluations = {row["step"]: row["eval/pass_rate"] for row in rows if is_evaluation(row)}
        if (self.stopped_at or self.args.steps) < step or not os.path.isdir(self.args.baseline):
            return {"compared": False, "why": f"the soak ends before step {step} or has no baseline"}, []
        seeds = sorted(d for d in os.listdir(self.args.baseline) if d.startswith("seed"))
        baseline = []
        for seed in seeds:
            with open(os.path.join(self.args.baseline, seed, "metrics.jsonl")) as f:
                baseline.append({r["step"]: r["eval/pass_rate"] for r in map(json.loads, f) if is_evaluation(r)})
        result: dict = {"compared": True, "seeds": seeds, "step": step}
        problems = []
        for name, value_of in (("at_step", at_step(step)), ("last_five_mean", last_mean(step, LAST_EVALUATIONS))):
            soak = value_of(evaluations)
            values = [v for v in map(value_of, baseline) if v is not None]
            mean, std = statistics.mean(values), statistics.stdev(values)
            entry = {
                "soak": soak,
                "seeds": values,
                "min": min(values),
                "max": max(values),
                "mean": mean,
                "std": std,
                "low": mean - 2 * std,
                "high": mean + 2 * std,
            }
            entry["within"] = soak is not None and entry["low"] <= soak <= entry["high"]
            if not entry["within"]:
                problems.append(
                    f"pass rate {name} {soak} outside mean +- 2 std [{entry['low']:.3f}, {entry['high']:.3f}]"
                )
            result[name] = entry
        return result, problems

    def finish(self) -> int:
        rows = self.final_rows() if os.path.exists(os.path.join(self.run_dir, "metrics.jsonl")) else []
        problems = list(self.unplanned_exits)
        problems += self.check_rows(rows) if rows else ["no metrics.jsonl"]
        for number, fault in enumerate(self.faults, 1):
            if fault.problem:
                problems.append(f"fault {number} ({fault.kind}): {fault.problem}")
            if fault.recovery_s is None:
                problems.append(f"fault {number} ({fault.kind}): no training row after it")
        checkpoints, found = self.check_checkpoints()
        problems += found
        problems += self.check_leftovers()
        pass_rate, found = self.compare_pass_rate(rows)
        problems += found
        summary = self.summary(rows, checkpoints, pass_rate, problems)
        with open(os.path.join(self.args.scratch, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        with contextlib.suppress(OSError):
            shutil.copy(os.path.join(self.run_dir, "metrics.jsonl"), os.path.join(self.args.scratch, "metrics.jsonl"))
        print_summary(summary)
        return 0 if not problems else 1

    def summary(self, rows: list[dict], checkpoints: dict, pass_rate: dict, problems: list[str]) -> dict:
        by_kind = {}
        for kind in self.kinds:
            faults = [f for f in self.faults if f.kind == kind]
            times = sorted(f.recovery_s for f in faults if f.recovery_s is not None)
            by_kind[kind] = {
                "count": len(faults),
                "skipped": self.skipped[kind],
                "recovery_median_s": statistics.median(times) if times else None,
                "recovery_max_s": times[-1] if times else None,
            }
        return {
            "command": self.command(),
            "filesystem": self.fs.kind,
            "unavailable": self.fs.unavailable,
            "wall_s": time.monotonic() - self.t0,
            "runs": len(self.runs),
            "steps": self.args.steps,
            "stopped_at": self.stopped_at,
            "training_rows": sum(1 for row in rows if is_training(row)),
            "evaluation_rows": sum(1 for row in rows if is_evaluation(row)),
            "faults": [{k: v for k, v in dataclasses.asdict(f).items() if not k.startswith("_")} for f in self.faults],
            "by_kind": by_kind,
            "checkpoints": checkpoints,
            "verifier_workers_seen": len(self.workers),
            "pass_rate": pass_rate,
            "problems": problems,
        }


def at_step(step: int):
    """The evaluation at `step` of a {step: pass rate} map (None when there is none)."""
    return lambda evaluations: evaluations.get(step)


def last_mean(step: int, count: int):
    """The mean of the last `count` evaluations at or before `step` (None when there are fewer)."""

    def value(evaluations: dict) -> float | None:
        steps = sorted(s for s in evaluations if 0 < s <= step)[-count:]
        return statistics.mean(evaluations[s] for s in steps) if len(steps) == count else None

    return value


def print_summary(summary: dict) -> None:
    early = f" (stopped early at step {summary['stopped_at']})" if summary["stopped_at"] is not None else ""
    print(
        f"\nsoak: {summary['steps']} steps{early}, {summary['runs']} run starts, {summary['wall_s'] / 60:.1f} min wall"
    )
    print(f"filesystem: {summary['filesystem']}" + "".join(f"; {k}: {v}" for k, v in summary["unavailable"].items()))
    print("| fault | count | skipped | recovery median s | recovery max s |")
    print("|---|---|---|---|---|")
    for kind, entry in summary["by_kind"].items():
        median, worst = entry["recovery_median_s"], entry["recovery_max_s"]
        print(
            f"| {kind} | {entry['count']} | {entry['skipped']} | "
            f"{'-' if median is None else f'{median:.1f}'} | {'-' if worst is None else f'{worst:.1f}'} |"
        )
    print("\n| # | at s | kind | step | recovery s | outcome | last line |")
    print("|---|---|---|---|---|---|---|")
    for number, fault in enumerate(summary["faults"], 1):
        recovery = "-" if fault["recovery_s"] is None else f"{fault['recovery_s']:.1f}"
        print(
            f"| {number} | {fault['at']:.0f} | {fault['kind']} | {fault['step']} | {recovery} | "
            f"{fault['outcome']} | {fault['line'][:160]} |"
        )
    print(f"\ntraining rows {summary['training_rows']}, evaluation rows {summary['evaluation_rows']}")
    print(f"checkpoints: {summary['checkpoints']}")
    print(f"pass rate: {json.dumps(summary['pass_rate'])}")
    print("end checks: " + ("all hold" if not summary["problems"] else "FAILED"))
    for problem in summary["problems"]:
        print(f"  - {problem}")


def verify_checkpoints(run_dir: str) -> None:
    """Prints {entry: 'verified' or why not} for each entry of `run_dir/checkpoints` (one JSON line):
    a temporary directory is an unfinished save; a step directory is restored and verified as the
    run restores it (checksums of every array and of the run state, finite floats)."""
    from scalerl_jax.run.policy_source import load_run_config, load_run_policy
    from scalerl_jax.train.checkpoint import CheckpointError

    config = load_run_config(run_dir)
    result = {}
    directory = os.path.join(run_dir, "checkpoints")
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if TMP_MARK in name:
            result[name] = "unfinished save (temporary directory left)"
        elif name.isdigit():
            try:
                load_run_policy(run_dir, config, step=int(name))
                result[name] = "verified"
            except CheckpointError as error:
                result[name] = str(error)
        else:
            result[name] = "unexpected entry"
    print(json.dumps(result))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0, help="the faults' RNG seed and the run's config.seed")
    parser.add_argument("--workdir", help="an empty directory: the soak mounts the run's filesystem there")
    parser.add_argument("--scratch", help="the run's logs, the filesystem image and summary.json (not on --workdir)")
    parser.add_argument("--faults", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--mean-interval", type=float, default=300.0, help="seconds of training between faults")
    parser.add_argument("--max-faults", type=int, default=0, help="stop injecting after this many (0: no limit)")
    parser.add_argument("--quiet-steps", type=int, default=20, help="no fault in the last this many steps")
    parser.add_argument("--config", default=STUDY_CONFIG)
    parser.add_argument("--override", action="append", default=None, help="a --config.KEY=VALUE flag for the run")
    parser.add_argument(
        "--warm-start", help="a warm start directory (WORKDIR/warm_start/HASH) of the same config to reuse"
    )
    parser.add_argument("--fs-size-mb", type=int, default=2048)
    parser.add_argument("--headroom-mb", type=int, default=1, help="free space a full disk leaves")
    parser.add_argument("--read-only-s", type=float, default=60.0)
    parser.add_argument("--save-wait", type=float, default=900.0, help="longest wait for a save to start")
    parser.add_argument("--full-wait", type=float, default=600.0, help="longest wait for a run on a full disk to stop")
    parser.add_argument("--exit-timeout", type=float, default=300.0, help="longest wait for a run to exit on SIGTERM")
    parser.add_argument("--max-unplanned", type=int, default=3, help="unasked run exits before the soak gives up")
    parser.add_argument("--timeout", type=float, default=4 * 3600.0, help="the soak's own time limit, seconds")
    parser.add_argument("--compare-step", type=int, default=1920)
    parser.add_argument("--baseline", default=BASELINE, help="a directory of seed*/metrics.jsonl to compare with")
    parser.add_argument("--verify-checkpoints", metavar="RUN_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.override is None:
        args.override = list(STUDY_FLAGS) if args.config == STUDY_CONFIG else []
    if args.verify_checkpoints is None:
        if not args.workdir or not args.scratch:
            parser.error("--workdir and --scratch are required")
        unknown = sorted(set(args.faults.split(",")) - set(KINDS) - {""})
        if unknown:
            parser.error(f"--faults: unknown kinds {unknown}; expected some of {', '.join(KINDS)}")
        args.workdir, args.scratch = os.path.abspath(args.workdir), os.path.abspath(args.scratch)
    return args


@contextlib.contextmanager
def mounted(fs: Filesystem) -> Iterator[None]:
    fs.mount()
    for kind, why in fs.unavailable.items():
        log(f"{kind} faults cannot be made here and are skipped: {why}")
    try:
        yield
    finally:
        with contextlib.suppress(RuntimeError):
            fs.unmount()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verify_checkpoints:
        verify_checkpoints(args.verify_checkpoints)
        return 0
    os.makedirs(args.scratch, exist_ok=True)
    LOG_FILE.append(os.path.join(args.scratch, "soak.log"))
    soak = Soak(args)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, soak.ask_stop)
    with mounted(soak.fs):
        try:
            soak.drive()
        finally:
            soak.stop_run()
        return soak.finish()


if __name__ == "__main__":
    sys.exit(main())
