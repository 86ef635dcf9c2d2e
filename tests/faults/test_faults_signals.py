"""Signals (what SLURM and Ctrl-C send) and what the run and the study do about each: one test a class.

S1 SIGTERM to a one-process run (PPO-off-policy-2, deterministic): the step under way and the rest
   of its phase finish, their rows are written, a checkpoint of the state after them; exit 0,
   'signal SIGTERM' in the summary; the rerun resumes there, rows once, losses equal to an
   uninterrupted run to 1e-6
S2 a second SIGINT: exit 130 at once, one line on stderr, no traceback or abort; the rerun
   resumes from the last complete checkpoint, rows once
S3 SIGTERM to both processes of a 2-process run: one agreed stop step, one checkpoint, both exit 0;
   the rerun resumes there
S4 SIGTERM to the study: passed on to its run, which checkpoints and exits 0; the study says so
   in one line and exits 143; no run left behind
S5 a run's workdir held by another process: the study does not launch it, says so, logs it as
   refused (not a launch's end, not a killed launch); a second study on one directory is refused
S6 SIGTERM while the run starts (sampler warm-up, train programs compiling ahead beside it): the
   start-up finishes, step 0 is evaluated, exit 0 with 'signal SIGTERM'; the train programs still
   queued are dropped, not compiled at the interpreter's exit after the run's last line (the hang
   it was); the rerun writes every row once
S7 SIGTERM to the leader alone of a 2-process run (a follower trainer) while it starts: both
   exit 0, the leader with 'signal SIGTERM' and row 0; both processes drop their queued
   train programs
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from main_runs import PPO, REPO, SMALL, flags, main_command, main_env, read_metrics, run_main
from multihost import TINY, full_log, logs, start, wait

from scalerl_jax.contracts.workdir_lock import hold_workdir
from scalerl_jax.study import driver, report


def rows_written(workdir) -> int:
    path = os.path.join(workdir, "metrics.jsonl")
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def wait_for_rows(workdir, count: int, procs, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while rows_written(workdir) < count:
        assert all(p.poll() is None for p in procs), "the run ended before it was signalled"
        assert time.monotonic() < deadline, f"no {count} metrics rows within {timeout} s"
        time.sleep(0.05)


def checkpoints(workdir) -> list[int]:
    return sorted(int(name) for name in os.listdir(os.path.join(workdir, "checkpoints")) if name.isdigit())


def resumed_step(log: str) -> int:
    found = re.search(r"resumed from checkpoint step (\d+)", log)
    assert found is not None, log[-4000:]
    return int(found.group(1))


def test_s1_sigterm_finishes_the_step_checkpoints_and_resumes_exactly(tmp_path):
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    overrides = flags({**PPO, "checkpoint.every": 100})  # no periodic checkpoint before the end
    result = run_main(full, *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    stopped.mkdir()
    for name in ("warm_start", "tfds"):
        shutil.copytree(full / name, stopped / name)

    process = subprocess.Popen(
        main_command(stopped, *overrides), cwd=REPO, env=main_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    wait_for_rows(stopped, 4, [process])  # steps 0..3 written: step 4 (the end of phase 2) is under way
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=300)
    text = err.decode()
    assert process.returncode == 0, text[-4000:]
    assert "'stop_reason': 'signal SIGTERM'" in text
    stop_step = checkpoints(stopped)[-1]
    assert stop_step in (4, 6) and checkpoints(stopped) == [stop_step]  # a phase end, saved at the stop
    assert [r["step"] for r in read_metrics(stopped)] == list(range(stop_step + 1))

    resumed = run_main(stopped, *overrides)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert resumed_step(resumed.stderr) == stop_step
    expected, got = read_metrics(full), read_metrics(stopped)
    assert [r["step"] for r in got] == list(range(9))  # every row once
    assert sum(r["train/loss"] != 0 for r in expected[1:]) >= 3  # the comparison has teeth
    for a, b in zip(expected[1:], got[1:]):
        for key in ("train/loss", "train/entropy", "train/reward_mean"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), (a["step"], key)
    for a, b in zip(expected, got):
        if "eval/pass_rate" in a:
            assert b["eval/pass_rate"] == a["eval/pass_rate"], a["step"]


def test_s2_second_sigint_exits_at_once_cleanly_and_the_rerun_resumes(tmp_path):
    overrides = flags({**SMALL, "num_steps": 6, "eval.every": 100})
    process = subprocess.Popen(
        main_command(tmp_path, *overrides), cwd=REPO, env=main_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    wait_for_rows(tmp_path, 4, [process])  # steps 0..3 written, checkpoint 2 complete
    process.send_signal(signal.SIGINT)
    time.sleep(0.5)  # the first one is handled (a graceful stop is under way)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    text = err.decode()
    assert process.returncode == 130, text[-4000:]
    for crash in ("Traceback", "KeyboardInterrupt", "Fatal Python error", "terminate called", "Segmentation"):
        assert crash not in text, text[-4000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("stopped at once by a second SIGINT") and "last complete checkpoint" in last

    resumed = run_main(tmp_path, *overrides)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert resumed_step(resumed.stderr) >= 2
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(7))  # every row once


def test_s3_sigterm_to_every_process_stops_at_one_step_with_one_checkpoint(tmp_path):
    workdir = str(tmp_path / "run")
    overrides = {
        **TINY,
        "mesh.generator_fraction": 0.25,  # trainer spans both processes: a follower trainer
        "mesh.trainer_shape": "(-1,1,1)",
        "batch.prompts_per_step": 3,
        "num_steps": 6,
        "checkpoint.every": 100,
        "eval.every": 100,
    }
    procs = start(workdir, overrides, processes=2)
    try:
        wait_for_rows(workdir, 3, procs, timeout=400)  # steps 0..2 written
    except AssertionError:
        wait(procs, timeout=1)
        raise AssertionError(logs(workdir, 2)) from None
    for proc in procs:  # SLURM signals every process of the job
        proc.send_signal(signal.SIGTERM)
    codes = wait(procs, timeout=180)
    assert codes == [0, 0], logs(workdir, 2)
    stop_step = checkpoints(workdir)[-1]
    # Step 2's row may be on disk while its reporting still runs: the signal then stops at step 2.
    assert 2 <= stop_step < 6 and checkpoints(workdir) == [stop_step], logs(workdir, 2)
    assert [r["step"] for r in read_metrics(workdir)] == list(range(stop_step + 1))
    assert "'stop_reason': 'signal SIGTERM'" in full_log(workdir, 0)
    assert "the leader (process 0) chooses the step" in full_log(workdir, 1)

    rerun = str(tmp_path / "rerun")
    codes = wait(start(workdir, overrides, processes=2, log_dir=rerun), timeout=400)
    assert codes == [0, 0], logs(rerun, 2)
    assert resumed_step(full_log(rerun, 0)) == stop_step
    assert [r["step"] for r in read_metrics(workdir)] == list(range(7))


def test_s6_sigterm_while_starting_drops_the_train_programs_still_to_compile(tmp_path):
    # 8 length buckets per octave: 15 buckets, 18 train programs to compile ahead on one thread,
    # far more than are done when the sampler's warm-up and the step-0 evaluation end.
    overrides = flags(
        {**SMALL, "batch.length_buckets_per_octave": 8, "train.compile_threads": 1, "num_steps": 2, "eval.every": 2}
    )
    process = subprocess.Popen(
        main_command(tmp_path, *overrides),
        cwd=REPO,
        env=main_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    warming_up = threading.Event()

    stderr = process.stderr
    assert stderr is not None

    def read() -> None:
        for line in stderr:
            lines.append(line)
            if "sampler engine: compiling" in line:  # the warm-up; the train programs compile beside it
                warming_up.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert warming_up.wait(600), "".join(lines)[-4000:]
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=600)  # generous: it has to exit at all
        except subprocess.TimeoutExpired:
            pytest.fail("no exit within 600 s of the SIGTERM; its last lines:\n" + "".join(lines[-20:]))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(timeout=30)
    text = "".join(lines)
    assert process.returncode == 0, text[-4000:]
    assert "'stop_reason': 'signal SIGTERM'" in text and "before its first train step" in text, text[-4000:]
    assert "train step: compiling ahead stopped with the run" in text, text[-4000:]
    assert "programs compiled ahead in" not in text, text[-4000:]  # none compiled after the stop
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]
    assert not os.path.isdir(os.path.join(tmp_path, "checkpoints")) or checkpoints(tmp_path) == []

    # The rerun (no checkpoint yet: from the start) with the usual 3 buckets (a resumable key).
    resumed = run_main(tmp_path, *flags({**SMALL, "num_steps": 2, "eval.every": 2}), timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]  # every row once


@pytest.mark.slow
def test_s7_sigterm_to_the_leader_while_starting_stops_both_processes(tmp_path):
    workdir = str(tmp_path / "run")
    overrides = {
        **TINY,
        "mesh.generator_fraction": 0.25,  # trainer spans both processes: a follower trainer
        "mesh.trainer_shape": "(-1,1,1)",
        "batch.prompts_per_step": 3,
        "batch.length_buckets_per_octave": 8,  # 18 train programs to compile ahead, one at a time
        "train.compile_threads": 1,
        "num_steps": 6,
        "distributed.heartbeat_timeout_s": 60,  # a loaded host's compiles may starve a heartbeat for 20 s
    }
    procs = start(workdir, overrides, processes=2)
    deadline = time.monotonic() + 600
    while "warm start: reusing" not in full_log(workdir, 0):  # the shared files are ready: the start-up goes on
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            wait(procs, timeout=1)
            raise AssertionError(logs(workdir, 2))
        time.sleep(0.5)
    procs[0].send_signal(signal.SIGTERM)  # the leader only: it stops every process
    codes = wait(procs, timeout=600)  # generous: they have to exit at all
    assert codes == [0, 0], logs(workdir, 2)
    assert "'stop_reason': 'signal SIGTERM'" in full_log(workdir, 0), logs(workdir, 2)
    assert [r["step"] for r in read_metrics(workdir)] == [0]
    for rank in range(2):
        log = full_log(workdir, rank)
        assert "train step: compiling ahead stopped with the run" in log and "programs compiled ahead in" not in log


# A stand-in for main: records its pid, then waits; SIGTERM makes it "checkpoint" and exit 0.
SIGNAL_CHILD = """#!{python}
import os, signal, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
workdir = args["--workdir"]
def stop(signum, frame):
    open(os.path.join(workdir, "stopped_by"), "w").write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
open(os.path.join(workdir, "pid"), "w").write(str(os.getpid()))
time.sleep(120)
sys.exit(3)
"""

STUDY_SCRIPT = """
import sys
from pathlib import Path
from scalerl_jax.study import driver
study = driver.StudySpec(study_dir=Path(sys.argv[1]), base=driver.absolute_base("configs/tiny.py"),
                         variants=("baseline",), num_seeds=1, overrides=())
sys.exit(driver.run_study(study, python=sys.argv[2], stop_timeout_s=30))
"""


def fake_main(tmp_path, source: str) -> str:
    path = tmp_path / "fake_main"
    path.write_text(source.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def test_s4_sigterm_to_the_study_is_passed_to_its_run(tmp_path):
    study_dir = tmp_path / "study"
    run_dir = study_dir / "baseline" / "seed0"
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(STUDY_SCRIPT), str(study_dir), fake_main(tmp_path, SIGNAL_CHILD)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (run_dir / "pid").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    time.sleep(0.2)
    child = int((run_dir / "pid").read_text())
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, out + err
    lines = [line for line in out.splitlines() if "SIGTERM" in line]
    assert len(lines) == 1 and "passed it on to run baseline/seed0" in lines[0], out
    assert "exit status 0" in lines[0] and "the same command resumes" in lines[0]
    assert (run_dir / "stopped_by").read_text() == "SIGTERM"
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # no run left behind
    ends = [r for r in driver.read_log(study_dir) if r["event"] == "end"]
    assert len(ends) == 1 and ends[0]["returncode"] == 0 and ends[0]["signal"] == "SIGTERM"


def test_s5_a_run_whose_workdir_is_held_is_refused_not_ended(tmp_path, capsys):
    study = driver.StudySpec(
        study_dir=tmp_path / "study",
        base=driver.absolute_base("configs/tiny.py"),
        variants=("baseline",),
        num_seeds=1,
        overrides=(),
    )
    run_dir = study.study_dir / "baseline" / "seed0"
    child = fake_main(tmp_path, SIGNAL_CHILD)
    with hold_workdir(str(run_dir)):  # a main started by hand on the run's workdir
        assert driver.run_study(study, python=child) == 1
    out = capsys.readouterr().out
    assert f"study: run baseline/seed0 not launched: its workdir is in use by pid {os.getpid()}" in out
    assert "failed with exit status" not in out
    assert not (run_dir / "pid").exists()  # nothing launched
    log = driver.read_log(study.study_dir)
    assert [r["event"] for r in log] == ["refused"]
    assert driver.minutes_per_run(log, {"baseline/seed0"}) is None
    timing = report.timing_line(study.study_dir)
    assert "killed" not in timing and "1 launch(es) refused" in timing

    with hold_workdir(str(study.study_dir)):  # another study on the same directory
        assert driver.run_study(study, python=child) == 1
    out = capsys.readouterr().out
    assert out.startswith("study: refused: workdir") and f"pid {os.getpid()}" in out
    assert [r["event"] for r in driver.read_log(study.study_dir)] == ["refused"]
    json.loads((study.study_dir / "study.json").read_text())  # the first study's record, intact
