"""The study driver: every (variant, seed) as an ordinary `main` run, one after another, resumable.

Layout of a study directory STUDY:
  STUDY/study.json            base config, overrides, variants and seeds of the study
  STUDY/study_log.jsonl       one line when a run is launched and one when it ends (return code, minutes)
  STUDY/warm_start/<digest>/  the warm-started policy: built by the first run, reused by all others
  STUDY/<variant>/seed<k>/    an ordinary run directory (config.json, metrics.jsonl, checkpoints/, ...)
                              plus main.log (the run's output) and warm_start -> ../../warm_start

Each run is a fresh process with main's own command line:
  python -m scalerl_jax.main --config=configs/study.py:BASE,VARIANT --config.seed=k [overrides]
      --workdir=STUDY/VARIANT/seed<k>
so `config.seed = k` (prompt order, sampling, evaluation draws) is the only difference between
the seeds of a variant. Runs go seed by seed (every variant at seed 0, then every variant at
seed 1, ...), so that a study cut short still compares every variant.

Finished, resumed, new. A run is finished when its metrics.jsonl holds an evaluation at step
`num_steps` of its own config.json; finished runs are skipped. A started run that is not
finished (a killed study) is resumed by launching main again on its workdir: main resumes from
the run's last checkpoint and cuts metrics.jsonl back to it.

Signals and locks. The study holds STUDY/run.lock for its life, so a second study on the same
directory is refused at once, before it launches anything. A run whose workdir another process
holds (a `main` started by hand) is not launched: the refusal is logged as a "refused" event,
neither a launch nor a run's end. On SIGTERM or SIGINT the study passes a graceful stop to the
running `main` (SIGTERM: it finishes its step and checkpoints; a SIGINT is passed on as SIGTERM
too, since a terminal's Ctrl-C reaches the run as well and a second SIGINT would end it at once),
waits for it (at most `CHILD_STOP_TIMEOUT_S`, then kills it), logs the launch's end, says in one
line what it did and exits with 128 + the signal number (143, 130). A second SIGINT is passed on
as SIGINT: the run ends at once.

Shared warm start. A run builds or reuses WORKDIR/warm_start/<digest>, the digest covering
the synthetic task, the warm-start keys and the prompt template. Every run's WORKDIR/warm_start
is a link to STUDY/warm_start; variants change none of the digested keys and seeds set
`config.seed` (not `warm_start.seed`), so every run of a study has the same digest: the first run
builds the policy, every later one finds it complete and loads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from scalerl_jax.config.argv import CONFIG_ARGV_ERRORS, parse_config_argv
from scalerl_jax.config.variants import study_config
from scalerl_jax.contracts.workdir_lock import LOCK_FILE, WorkdirLockedError, hold_workdir, workdir_holder
from scalerl_jax.scaling.runs import PASS_RATE_KEY
from scalerl_jax.telemetry.metrics import METRICS_FILE

STUDY_CONFIG_FILE = Path(__file__).resolve().parents[2] / "configs" / "study.py"
STUDY_FILE = "study.json"
STUDY_LOG = "study_log.jsonl"
RUN_LOG = "main.log"
WARM_START = "warm_start"
RUN_CONFIG_FILE = "config.json"
SEED_OVERRIDE = "--config.seed"
CHILD_STOP_TIMEOUT_S = 600.0  # a signalled run's graceful stop: its current step and a checkpoint


@dataclasses.dataclass(frozen=True)
class StudySpec:
    """What a study runs: `base` is a config file as `--config` takes it ('file.py' or
    'file.py:arg'), `overrides` are `--config.key=value` flags given to every run."""

    study_dir: Path
    base: str
    variants: tuple[str, ...]
    num_seeds: int
    overrides: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a study."""

    variant: str
    seed: int
    workdir: Path

    @property
    def name(self) -> str:
        return f"{self.variant}/seed{self.seed}"


def absolute_base(base: str) -> str:
    """The base config spec with its file made absolute (runs do not depend on the working directory)."""
    path, sep, arg = base.partition(":")
    return os.path.abspath(path) + sep + arg


def check_overrides(overrides: Sequence[str], *, base: str) -> tuple[str, ...]:
    """`--config.key=value` flags as given, once main's own parser accepts them on `base`'s
    baseline; anything else, a seed (set by the study), an unknown key or a value of the wrong
    type is a ValueError naming the flag."""
    for flag in overrides:
        if not flag.startswith("--config.") or "=" not in flag:
            raise ValueError(f"expected config overrides as --config.key=value, got {flag!r}")
        key = flag.split("=", 1)[0]
        if key == SEED_OVERRIDE:
            raise ValueError(f"{flag!r}: the study sets config.seed of run k to k (--seeds)")
        try:
            parse_config_argv(["main", f"--config={STUDY_CONFIG_FILE}:{absolute_base(base)},baseline", flag])
        except (KeyError, AttributeError) as error:
            missing = key.removeprefix("--config.")
            raise ValueError(f"{flag!r}: the config of {base!r} has no key {missing!r}") from error
        except CONFIG_ARGV_ERRORS as error:
            raise ValueError(f"{flag!r} is refused by main's config parser: {error}") from error
    return tuple(overrides)


def plan_runs(study: StudySpec) -> list[RunSpec]:
    """Every (variant, seed) of the study, seed by seed (module docstring)."""
    return [
        RunSpec(variant, seed, study.study_dir / variant / f"seed{seed}")
        for seed in range(study.num_seeds)
        for variant in study.variants
    ]


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a jsonl file; a half-written last line (a killed writer) is ignored."""
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(f"{path} line {number}: malformed JSON") from None
    return records


def run_state(workdir: Path) -> str:
    """'finished' (an evaluation at step num_steps of its config.json), 'started' (some of the
    run's files exist) or 'new'."""
    config_path, metrics_path = workdir / RUN_CONFIG_FILE, workdir / METRICS_FILE
    if config_path.is_file() and metrics_path.is_file():
        num_steps = json.loads(config_path.read_text(encoding="utf-8"))["num_steps"]
        if any(r.get("step") == num_steps and PASS_RATE_KEY in r for r in read_jsonl(metrics_path)):
            return "finished"
    if any((workdir / name).exists() for name in (RUN_CONFIG_FILE, METRICS_FILE, "checkpoints")):
        return "started"
    return "new"


def main_command(study: StudySpec, run: RunSpec, python: str = sys.executable) -> list[str]:
    """main's command line for `run` (module docstring); `--config` comes before its overrides."""
    return [
        python,
        "-m",
        "scalerl_jax.main",
        f"--config={STUDY_CONFIG_FILE}:{study.base},{run.variant}",
        f"{SEED_OVERRIDE}={run.seed}",
        *study.overrides,
        f"--workdir={run.workdir}",
    ]


def link_warm_start(study_dir: Path, workdir: Path) -> None:
    """Makes `workdir/warm_start` a relative link to `study_dir/warm_start` (kept if it is one)."""
    shared = study_dir / WARM_START
    shared.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    link = workdir / WARM_START
    target = os.path.relpath(shared, workdir)
    if link.is_symlink() and os.readlink(link) == target:
        return
    if link.exists() or link.is_symlink():
        raise ValueError(
            f"{link} exists and is not a link to the study's shared warm start {shared}; "
            "move it away to run this workdir as part of the study"
        )
    link.symlink_to(target, target_is_directory=True)


def check_study_file(study: StudySpec) -> None:
    """Writes STUDY/study.json; a study resumed with another base config or other overrides is a
    ValueError (its runs would mix two configs). Variants and seeds may be added."""
    path = study.study_dir / STUDY_FILE
    record = {
        "base": study.base,
        "overrides": list(study.overrides),
        "variants": list(study.variants),
        "num_seeds": study.num_seeds,
    }
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        for key in ("base", "overrides"):
            if saved[key] != record[key]:
                raise ValueError(
                    f"{path}: this study was started with {key} {saved[key]!r}, not {record[key]!r}; "
                    "use another --workdir or the same settings"
                )
    study.study_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def append_log(study_dir: Path, record: dict) -> None:
    with open(study_dir / STUDY_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_log(study_dir: Path) -> list[dict]:
    path = study_dir / STUDY_LOG
    return read_jsonl(path) if path.is_file() else []


def minutes_per_run(log: Sequence[dict], finished: set[str]) -> float | None:
    """Mean over the finished runs of the minutes their launches took in all (a resumed run counts
    every launch); None before any finished run was timed."""
    totals: dict[str, float] = {}
    for record in log:
        if record.get("event") == "end" and record["run"] in finished:
            totals[record["run"]] = totals.get(record["run"], 0.0) + record["minutes"]
    return sum(totals.values()) / len(totals) if totals else None


def progress_line(num_finished: int, total: int, mean_minutes: float | None, current: str = "") -> str:
    """'study: 3/10 runs finished, 8.2 min/run, ETA 57 min[; next: dapo/seed1 (resume)]'; the first run's
    minutes include building the shared warm start."""
    if mean_minutes is None:
        timing = "ETA unknown until a run finishes"
    else:
        timing = f"{mean_minutes:.1f} min/run, ETA {mean_minutes * (total - num_finished):.0f} min"
    return f"study: {num_finished}/{total} runs finished, {timing}" + (f"; next: {current}" if current else "")


def echo_now(line: str) -> None:
    print(line, flush=True)


class StudySignals:
    """SIGTERM / SIGINT while a study runs (module docstring): the first is passed on to the
    running `main` as SIGTERM, a second SIGINT as SIGINT; no new run starts after one."""

    def __init__(self) -> None:
        self.first: signal.Signals | None = None
        self.child: subprocess.Popen | None = None

    def handle(self, signum: int, frame: object = None) -> None:
        received = signal.Signals(signum)
        forward = signal.SIGTERM
        if self.first is None:
            self.first = received
        elif received == signal.SIGINT:
            forward = signal.SIGINT
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.child.send_signal(forward)

    @property
    def status(self) -> int:
        """The conventional exit status of a process ended by the first signal."""
        assert self.first is not None
        return 128 + int(self.first)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StudySignals]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        saved = {signum: signal.signal(signum, self.handle) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for signum, handler in saved.items():
                signal.signal(signum, handler)


def wait_for_run(process: subprocess.Popen, signals: StudySignals, timeout_s: float) -> tuple[int, bool]:
    """The run's exit status once it ends; after a signal, waits at most `timeout_s` more, then
    kills it. Returns (status, killed)."""
    deadline = None
    while True:
        try:
            return process.wait(timeout=0.2), False
        except subprocess.TimeoutExpired:
            pass
        if signals.first is not None:
            deadline = deadline if deadline is not None else time.monotonic() + timeout_s
            if time.monotonic() >= deadline:
                process.kill()
                return process.wait(), True


def run_study(
    study: StudySpec,
    *,
    python: str = sys.executable,
    echo: Callable[[str], None] = echo_now,
    stop_timeout_s: float = CHILD_STOP_TIMEOUT_S,
) -> int:
    """Runs every unfinished run of `study` in order; returns 0 when all are finished, 1 when a run
    failed or was refused (the study stops there: its main.log or the line printed says why; the
    same command resumes), 128 + the signal number when stopped by SIGTERM / SIGINT."""
    if not STUDY_CONFIG_FILE.is_file():
        raise ValueError(f"the study's run config {STUDY_CONFIG_FILE} is missing")
    for variant in study.variants:  # a bad base file or variant fails here, before any run
        study_config(f"{study.base},{variant}")
    try:
        with hold_workdir(str(study.study_dir)), StudySignals().installed() as signals:
            return _run_study(study, python, echo, signals, stop_timeout_s)
    except WorkdirLockedError as error:
        echo(f"study: refused: {error}")
        return 1


def _run_study(
    study: StudySpec, python: str, echo: Callable[[str], None], signals: StudySignals, stop_timeout_s: float
) -> int:
    check_study_file(study)
    runs = plan_runs(study)
    finished = {run.name for run in runs if run_state(run.workdir) == "finished"}
    for run in runs:
        state = run_state(run.workdir)
        if state == "finished":
            continue
        action = "resume" if state == "started" else "run"
        echo(
            progress_line(
                len(finished), len(runs), minutes_per_run(read_log(study.study_dir), finished), f"{run.name} ({action})"
            )
        )
        link_warm_start(study.study_dir, run.workdir)
        holder = workdir_holder(str(run.workdir))
        if holder is not None:
            append_log(study.study_dir, {"event": "refused", "run": run.name, "time": time.time(), "holder": holder})
            echo(
                f"study: run {run.name} not launched: its workdir is in use by {holder} "
                f"({run.workdir / LOCK_FILE}); the same command resumes the study once that run ends"
            )
            return 1
        if signals.first is not None:
            break
        command = main_command(study, run, python)
        append_log(
            study.study_dir,
            {"event": "start", "run": run.name, "action": action, "time": time.time(), "command": command},
        )
        started = time.time()
        with open(run.workdir / RUN_LOG, "a", encoding="utf-8") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {action}: {' '.join(command)}\n")
            log.flush()
            signals.child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            try:
                returncode, killed = wait_for_run(signals.child, signals, stop_timeout_s)
            finally:
                signals.child = None
        minutes = (time.time() - started) / 60
        end = {"event": "end", "run": run.name, "returncode": returncode, "minutes": minutes}
        if signals.first is not None:
            end["signal"] = signals.first.name
        append_log(study.study_dir, end)
        if signals.first is not None:
            what = (
                f"killed it after {stop_timeout_s:.0f} s"
                if killed
                else f"it stopped with exit status {returncode}"
                + (" after checkpointing its last step" if returncode == 0 else "")
            )
            echo(
                f"study: {signals.first.name} received: passed it on to run {run.name}, {what} "
                f"({minutes:.1f} min this launch); the same command resumes the study"
            )
            return signals.status
        if returncode != 0:
            echo(
                f"study: run {run.name} failed with exit status {returncode} after {minutes:.1f} min; "
                f"see {run.workdir / RUN_LOG}; the same command resumes the study"
            )
            return 1
        if run_state(run.workdir) != "finished":
            echo(f"study: run {run.name} ended without an evaluation at its num_steps; see {run.workdir / RUN_LOG}")
            return 1
        finished.add(run.name)
        echo(f"study: {run.name} finished in {minutes:.1f} min")
    if signals.first is not None:  # between runs: none was running
        echo(f"study: {signals.first.name} received between runs; no run was running; the same command resumes")
        return signals.status
    echo(progress_line(len(finished), len(runs), minutes_per_run(read_log(study.study_dir), finished)))
    return 0
