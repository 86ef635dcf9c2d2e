"""Injected faults and what the run does about each: one test (or parametrized group) per class.

Metrics resume (scalerl_jax.telemetry.metrics.MetricsWriter)
  M1 checkpointed offset past the end of metrics.jsonl (tail lost): cut at the last complete row, no NULs
  M2 half-written last row before the offset: cut before it, reported as damaged
  M3 zero-filled tail (what a crash can leave on ext4): cut before the NULs, reported as damaged
  M4 rows logged after the checkpoint: dropped (they are replayed), their steps reported, rows kept once
Workdir lock (scalerl_jax.contracts.workdir_lock)
  L1 a second run while another process holds the workdir: WorkdirLockedError naming pid, host, lock file
  L2 the holder killed with SIGKILL: its stale lock file does not block the next run
  L3 a second hold inside the same process: refused too; released on exit
Checkpoints (scalerl_jax.train.checkpoint.RunCheckpointer)
  C1 bytes flipped in the newest checkpoint's array files: falls back to the previous step, reported
  C2 the newest checkpoint's array files truncated: same
  C3 array data replaced by another step's (readable, finite, wrong): caught by the checksums
  C4 every checkpoint damaged: CheckpointError listing each step and why, never a fresh start
  C5 saved params contain NaN: refused as non-finite, naming the leaf
  C6 the integrity record missing: refused; saved_config() falls back to the previous checkpoint
  C7 disk full while saving: one CheckpointError naming the path, step, OS reason and last good step
  C8 read-only filesystem while saving: same
Fit CLI (python -m scalerl_jax.cli.fit)
  F1 --plot into a missing or read-only directory: one line naming the path, exit 2, before fitting
  F2 numeric flags out of range or non-finite: argparse error naming the flag and the allowed range
  F3 --fit-end not above --fit-start: argparse error
  F4 malformed metrics rows (NUL padding, a JSON array): error naming the file and line
Config values and run start-up (scalerl_jax.config.validation, scalerl_jax.run, scalerl_jax.main)
  V1 NaN / inf / out-of-range values (28 cases: lr, eps, betas, temperature, eps_low, workers, ...): named
  V2 several problems at once: one ConfigError listing every one
  R1 resume with config.json deleted or malformed and a changed config: refused from the checkpoint's
     stored config, naming the key, before any work
  R2 checkpoints with no record of their config at all: refused, never resumed blind
  R3 every training prompt over data.max_prompt_tokens: error naming the key
  R4 interruption on a tokenizer without the think-end tag: error naming the keys and the fix
  R5 data.use_chat_template on a checkpoint without a chat template: error naming the key
  R6 main on a workdir held by another run: exit 1, one line naming the holder's pid
  R7 main on a read-only workdir: exit 1, one line naming the path
  R8 a custom reward that cannot be imported: named at start-up, before any work
Signals (tests/faults/test_faults_signals.py: scalerl_jax.run.signals.StopSignals, the pipeline, the study driver)
  S1 SIGTERM to a one-process run: the current step (PPO: its phase) finishes, its row and a checkpoint
     are written, exit 0 with 'signal SIGTERM' in the summary; the rerun resumes there, rows once, PPO losses
     equal to an uninterrupted run to 1e-6
  S2 a second SIGINT: exit 130 at once, one line on stderr, no traceback or abort; the rerun resumes from
     the last complete checkpoint, rows once
  S3 SIGTERM to both processes of a 2-process run: the leader picks one stop step, one checkpoint, both
     exit 0; the rerun resumes there
  S4 SIGTERM to the study: passed on to its run (which checkpoints), one line, exit 143, no orphan run
  S5 a run's workdir held by another process: not launched, logged as refused (not an end, not a killed
     launch, not in minutes per run); a second study on one directory: refused at once
Input mistakes at the entry points (tests/faults/test_faults_input.py; SCALERL_DEBUG=1 shows the traceback)
  I1 main on a bad data file (malformed line, missing/empty/non-string answer, empty file, binary, too few
     rows for data.heldout_size): exit 2, one line naming the file, row and line or field
  I2 evaluate --data on the same bad files: exit 2, one line
  I3 a config file missing, a directory, not Python, or whose get_config() raises: exit 2, one line naming
     the file and line
  I4 an unknown --config.KEY (the nearest key suggested) or a value that does not parse: exit 2, one line,
     no workdir created
  I5 main without --workdir or with an unknown flag: exit 2, one usage line
  I6 a truncated tokenizer.json: exit 2, one line naming the file
  I7 config.json's vocab_size disagreeing with the weights: exit 2, one line naming both files and shapes
  I8 export to a read-only directory: exit 1, one line naming the path, no staging directory left
  I9 tired-user inputs (missing, directory or wrong-suffix files, missing --out directory, run without
     checkpoints, missing --step, empty study dir, study config raising, non-UTF-8 metrics, --workdir a
     file, data.path pointing nowhere): exit 2, one line each
  I10 main on a checkpoint missing tokenizer.json, or whose config.json has a field that is not a number:
     exit 2, one line naming the file (and field)
Nothing silent (tests/faults/test_faults_silent.py: config.relevance.check_irrelevant, data.rewards.RewardTallies,
sampling_setup.check_token_ids)
  N1 model.checkpoint beside a warm_start section: refused at start-up (exit 2) naming both keys
  N2 settings the config makes irrelevant: refused (data.path under the synthetic task, refill without the
     filter) or one warning line each naming both keys (eps under cispo, eps_max under dapo,
     positive_pass_rate without NPR, interruption/think_end under plain, a length penalty past
     max_new_tokens, reward_correct beside a custom reward, wandb_mode without a project); shipped
     configs get neither
  N3 a custom reward raising on training and evaluation items: data/reward_errors and eval/reward_errors in
     every metrics row, cumulative, restored on resume; the first item logged once; the progress line
     shows the count
  N4 a custom reward past the verifier's time limit on training items: data/reward_timeouts, logged once
  N5 a custom reward that kills its worker: data/reward_crashes, logged once
  N6 math-verify cannot parse an answer: data/reward_unparsable, logged once
  N7 special, stop or think-end token ids at or past config.json's vocab_size: ConfigError naming the ids
     and files (exit 2)
Also covered elsewhere: kill -9 then resume (tests/e2e/test_main.py, rows once, PPO losses equal), NaN loss
policies (tests/e2e/test_main.py), unbounded answer extraction (tests/unit/data/test_rewards_last_boxed.py), custom
reward timeouts and crashes (tests/unit/data/test_rewards_custom.py, tests/unit/data/test_rewards_formats.py), malformed
config.json / safetensors / tokenizer files (tests/unit/models/test_checkpoint_tokens.py).
"""

import contextlib
import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from repo_paths import REPO

from scalerl_jax import run as run_lib
from scalerl_jax.cli import fit as fit_cli
from scalerl_jax.config import recipes
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.resume import flat_config
from scalerl_jax.config.validation import validate
from scalerl_jax.contracts.workdir_lock import LOCK_FILE, WorkdirLockedError, hold_workdir
from scalerl_jax.models import load_checkpoint_tokenizer
from scalerl_jax.run import sampling_setup
from scalerl_jax.run.build import load_task
from scalerl_jax.telemetry.metrics import MetricsWriter
from scalerl_jax.train.checkpoint import CheckpointError, RunCheckpointer

# ----------------------------------------------------------------------------------------------
# Metrics resume
# ----------------------------------------------------------------------------------------------


def write_rows(workdir, steps):
    """Rows for `steps` through MetricsWriter; returns the byte offset after each row."""
    writer = MetricsWriter(str(workdir))
    offsets = []
    for step in steps:
        writer.write(step, {"train/loss": 0.5 + step})
        offsets.append(writer.offset())
    writer.close()
    return offsets


def metrics_bytes(workdir) -> bytes:
    return (workdir / "metrics.jsonl").read_bytes()


def expected_rows(steps) -> bytes:
    """The JSONL the writer produces for `steps`, built by hand."""
    return b"".join(json.dumps({"step": s, "train/loss": 0.5 + s}, sort_keys=True).encode() + b"\n" for s in steps)


def test_m1_offset_past_end_of_file_cuts_without_padding(tmp_path):
    offsets = write_rows(tmp_path, range(5))
    full = metrics_bytes(tmp_path)
    (tmp_path / "metrics.jsonl").write_bytes(full[: len(full) - 30])  # the last 30 bytes never hit disk
    writer = MetricsWriter(str(tmp_path), resume_offset=offsets[4])
    report = writer.resume_report
    assert report is not None
    writer.write(4, {"train/loss": 4.5})  # the lost step is replayed
    writer.close()
    data = metrics_bytes(tmp_path)
    assert b"\x00" not in data
    assert data == expected_rows(range(5))
    assert report.kept_rows == 4 and report.kept_bytes == offsets[3]
    assert report.lost_bytes == offsets[4] - offsets[3]
    assert report.damaged_bytes == len(full) - 30 - offsets[3] and report.replayed_steps == ()


def test_m2_half_written_row_before_offset_is_cut_and_reported(tmp_path):
    offsets = write_rows(tmp_path, range(3))
    data = metrics_bytes(tmp_path)
    torn = data[: offsets[1]] + data[offsets[1] : offsets[2] - 10]  # row 2 torn, no newline
    (tmp_path / "metrics.jsonl").write_bytes(torn)
    writer = MetricsWriter(str(tmp_path), resume_offset=offsets[2])
    assert writer.offset() == offsets[1]
    report = writer.resume_report
    assert report is not None
    writer.close()
    assert metrics_bytes(tmp_path) == expected_rows(range(2))
    assert (report.kept_rows, report.damaged_bytes, report.lost_bytes) == (
        2,
        offsets[2] - 10 - offsets[1],
        offsets[2] - offsets[1],
    )


def test_m3_zero_filled_tail_is_cut_before_the_nuls(tmp_path):
    offsets = write_rows(tmp_path, range(4))
    data = metrics_bytes(tmp_path)
    zeroed = data[: offsets[1]] + b"\x00" * (len(data) - offsets[1])  # same length, rows 2-3 zeroed
    (tmp_path / "metrics.jsonl").write_bytes(zeroed)
    writer = MetricsWriter(str(tmp_path), resume_offset=offsets[3])
    report = writer.resume_report
    assert report is not None
    writer.close()
    assert metrics_bytes(tmp_path) == expected_rows(range(2))
    assert report.kept_rows == 2 and report.damaged_bytes == len(data) - offsets[1]
    assert not report.clean


def test_m4_rows_after_the_checkpoint_are_dropped_and_kept_once(tmp_path):
    offsets = write_rows(tmp_path, range(6))
    writer = MetricsWriter(str(tmp_path), resume_offset=offsets[2])  # checkpoint after step 2
    report = writer.resume_report
    assert report is not None
    for step in (3, 4, 5):  # replayed
        writer.write(step, {"train/loss": 0.5 + step})
    writer.close()
    assert metrics_bytes(tmp_path) == expected_rows(range(6))
    assert report.replayed_steps == (3, 4, 5) and report.kept_rows == 3
    assert report.damaged_bytes == 0 and report.lost_bytes == 0 and report.clean


# ----------------------------------------------------------------------------------------------
# Workdir lock
# ----------------------------------------------------------------------------------------------

HOLDER = "import sys, time\nfrom scalerl_jax.contracts.workdir_lock import hold_workdir\nwith hold_workdir(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)\n"
WAIT_S = 20.0


@contextlib.contextmanager
def lock_holder(workdir):
    """A child process holding `workdir` (waits, bounded, until it says so); killed on exit."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(workdir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        selector = selectors.DefaultSelector()
        assert process.stdout is not None and process.stderr is not None  # both piped above
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout=WAIT_S):
            raise AssertionError(f"lock holder did not start within {WAIT_S} s")
        assert process.stdout.readline() == "held\n", process.stderr.read()
        yield process
    finally:
        process.kill()
        process.wait(timeout=WAIT_S)


def test_l1_second_run_fails_naming_the_holder(tmp_path):
    with lock_holder(tmp_path) as holder:
        started = time.monotonic()
        with pytest.raises(WorkdirLockedError) as error:
            with hold_workdir(str(tmp_path)):
                pass
        assert time.monotonic() - started < 1.0  # at once, no waiting
    message = str(error.value)
    assert f"pid {holder.pid}" in message and socket.gethostname() in message
    assert str(tmp_path / LOCK_FILE) in message


def test_l2_stale_lock_of_a_killed_run_does_not_block(tmp_path):
    with lock_holder(tmp_path) as holder:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=WAIT_S)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # the stale record remains
    with hold_workdir(str(tmp_path)):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_l3_same_process_second_hold_refused_then_released(tmp_path):
    with hold_workdir(str(tmp_path)):
        with pytest.raises(WorkdirLockedError, match=f"pid {os.getpid()}"):
            with hold_workdir(str(tmp_path)):
                pass
    with hold_workdir(str(tmp_path)):  # released at exit
        pass


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------

CONFIG = {"optimizer.lr": 1e-3, "rl.objective": "cispo", "num_steps": 3}


def train_state(step: int, *, nan: bool = False):
    """params + adamw state whose values depend on `step` (and the numpy reference for them)."""
    w = np.arange(64, dtype=np.float32).reshape(8, 8) * step
    if nan:
        w[3, 5] = np.nan
    params = {"w": jnp.asarray(w), "b": jnp.full((8,), float(step), jnp.float32)}
    state = {"params": params, "opt_state": optax.adamw(1e-3).init(params), "step": jnp.int32(step)}
    return state, w


def save_steps(workdir, steps, *, nan_steps=()):
    checkpointer = RunCheckpointer(str(workdir), keep=5)
    for step in steps:
        checkpointer.save(
            step, train_state(step, nan=step in nan_steps)[0], {"version": step}, config={**CONFIG, "num_steps": step}
        )
    return checkpointer


def array_files(workdir, step):
    """The tensorstore data files of checkpoint `step` (OCDBT: `d/*` chunks)."""
    root = workdir / "checkpoints" / str(step) / "train_state"
    files = [p for p in root.rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, f"no array data files under {root}"
    return files


def flip_bytes(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 4, len(data), max(1, len(data) // 8)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate_half(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def assert_state_is_step(result, step):
    assert result.step == step and result.run_state == {"version": step}
    np.testing.assert_array_equal(np.asarray(result.train_state["params"]["w"]), train_state(step)[1])
    np.testing.assert_array_equal(np.asarray(result.train_state["params"]["b"]), np.full(8, step, np.float32))


@pytest.mark.parametrize("damage", [flip_bytes, truncate_half], ids=["C1-flipped", "C2-truncated"])
def test_c1_c2_damaged_newest_falls_back_to_previous(tmp_path, damage):
    save_steps(tmp_path, (1, 2, 3)).close()
    for path in array_files(tmp_path, 3):
        damage(path)
    checkpointer = RunCheckpointer(str(tmp_path), keep=5)
    result = checkpointer.restore_latest(train_state(0)[0])
    assert result is not None
    assert_state_is_step(result, 2)
    assert [s.step for s in result.skipped] == [3] and result.skipped[0].reason


def test_c3_substituted_array_data_fails_the_checksum(tmp_path):
    save_steps(tmp_path, (1, 2)).close()
    ckpt = tmp_path / "checkpoints"
    shutil.rmtree(ckpt / "2" / "train_state")
    shutil.copytree(ckpt / "1" / "train_state", ckpt / "2" / "train_state")  # readable, finite, wrong
    result = RunCheckpointer(str(tmp_path), keep=5).restore_latest(train_state(0)[0])
    assert result is not None
    assert_state_is_step(result, 1)
    assert result.skipped[0].step == 2 and "checksum" in result.skipped[0].reason


def test_c4_every_checkpoint_damaged_is_an_error_naming_each_step(tmp_path):
    save_steps(tmp_path, (1, 2)).close()
    for path in array_files(tmp_path, 2):
        truncate_half(path)
    for path in array_files(tmp_path, 1):
        flip_bytes(path)
    with pytest.raises(CheckpointError) as error:
        RunCheckpointer(str(tmp_path), keep=5).restore_latest(train_state(0)[0])
    message = str(error.value)
    assert "step 1:" in message and "step 2:" in message and str(tmp_path / "checkpoints") in message
    assert len(message.splitlines()) <= 6  # one line per step, not a tensorstore traceback


def test_c5_non_finite_params_are_refused(tmp_path):
    save_steps(tmp_path, (1, 2), nan_steps=(2,)).close()
    result = RunCheckpointer(str(tmp_path), keep=5).restore_latest(train_state(0)[0])
    assert result is not None
    assert_state_is_step(result, 1)
    assert result.skipped[0].step == 2 and re.search(r"non-finite.*params.*w", result.skipped[0].reason)


def test_c6_missing_integrity_record_is_refused_and_saved_config_falls_back(tmp_path):
    checkpointer = save_steps(tmp_path, (1, 2))
    assert checkpointer.saved_config() == {**CONFIG, "num_steps": 2}
    assert checkpointer.saved_config(step=1) == {**CONFIG, "num_steps": 1}
    checkpointer.close()
    shutil.rmtree(tmp_path / "checkpoints" / "2" / "integrity")
    reopened = RunCheckpointer(str(tmp_path), keep=5)
    assert reopened.saved_config() == {**CONFIG, "num_steps": 1}
    result = reopened.restore_latest(train_state(0)[0])
    assert result is not None
    assert_state_is_step(result, 1)
    assert result.skipped[0].step == 2
    assert RunCheckpointer(str(tmp_path / "empty"), keep=1).restore_latest(train_state(0)[0]) is None


@contextlib.contextmanager
def tiny_tmpfs(path, size_kib):
    """A `size_kib` tmpfs mounted at `path` (root only); skips the test when mount is refused."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        timeout=10,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


def big_state(seed):
    """Random (incompressible) params of about 1 MiB with adamw state: does not fit in 512 KiB."""
    params = {"w": jax.random.normal(jax.random.key(seed), (512, 512), jnp.float32)}
    return {"params": params, "opt_state": optax.adamw(1e-3).init(params), "step": jnp.int32(seed)}


def test_c7_disk_full_is_one_clear_error_and_the_previous_checkpoint_survives(tmp_path, capfd):
    with tiny_tmpfs(tmp_path / "mnt", 512) as mount:
        checkpointer = RunCheckpointer(str(mount), keep=5)
        small, _ = train_state(1)
        checkpointer.save(1, small, {"version": 1}, config=CONFIG)
        capfd.readouterr()
        with pytest.raises(CheckpointError) as error:
            checkpointer.save(2, big_state(2), {"version": 2}, config=CONFIG)
        message = str(error.value)
        assert str(mount / "checkpoints" / "2") in message and "step 2" in message
        assert "No space left on device" in message and "step 1" in message
        assert len(capfd.readouterr().err.splitlines()) < 20  # no traceback spew
        result = RunCheckpointer(str(mount), keep=5).restore_latest(small)
        assert result is not None
        assert_state_is_step(result, 1)
        assert result.skipped == ()


def test_c8_read_only_filesystem_is_one_clear_error(tmp_path):
    with tiny_tmpfs(tmp_path / "mnt", 1024) as mount:
        checkpointer = RunCheckpointer(str(mount), keep=5)
        small, _ = train_state(1)
        checkpointer.save(1, small, {"version": 1}, config=CONFIG)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, timeout=10)
        with pytest.raises(CheckpointError) as error:
            checkpointer.save(2, train_state(2)[0], {"version": 2}, config=CONFIG)
        message = str(error.value)
        assert str(mount / "checkpoints") in message and "step 2" in message
        assert "Read-only file system" in message and "step 1" in message


# ----------------------------------------------------------------------------------------------
# Fit CLI
# ----------------------------------------------------------------------------------------------


def write_curve(directory, num_evals=30):
    """A run whose pass rate follows 0.3 + 0.3 / (1 + (5000 / C)^2) at C = 500, 1000, ... GPU-hours."""
    directory.mkdir()
    with open(directory / "metrics.jsonl", "w") as f:
        for i in range(num_evals + 1):
            c = 500.0 * i
            rate = 0.3 + 0.3 / (1 + (5000.0 / c) ** 2) if c > 0 else 0.3
            f.write(
                json.dumps({"step": i, "compute/device_hours": c, "compute/unit": "gpu_hours", "eval/pass_rate": rate})
                + "\n"
            )
    return directory


@pytest.mark.parametrize("plot", ["missing/dir/x.png", "ro/x.png"], ids=["missing-dir", "read-only-dir"])
def test_f1_unwritable_plot_path_fails_before_fitting(tmp_path, capsys, plot):
    run = write_curve(tmp_path / "run")
    target = tmp_path / plot
    if plot.startswith("ro/"):
        with tiny_tmpfs(tmp_path / "ro", 64):
            subprocess.run(["mount", "-o", "remount,ro", str(tmp_path / "ro")], check=True, timeout=10)
            status = fit_cli.main([str(run), "--bootstrap", "0", "--plot", str(target)])
    else:
        status = fit_cli.main([str(run), "--bootstrap", "0", "--plot", str(target)])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""  # refused before the table
    assert captured.err.count("\n") == 1 and str(target) in captured.err


@pytest.mark.parametrize(
    "flag, value, allowed",
    [
        ("--level", "5", "(0, 1)"),
        ("--level", "nan", "(0, 1)"),
        ("--bootstrap", "-3", ">= 0"),
        ("--seed", "-1", ">= 0"),
        ("--extend", "0.5", ">= 1"),
        ("--extend", "inf", ">= 1"),
        ("--r0", "1.5", "[0, 1]"),
        ("--fit-start", "-10", ">= 0"),
        ("--fit-end", "nan", "> 0"),
        ("--a-range", "0.9,0.5", "0 <= LO <= HI <= 1"),
    ],
)
def test_f2_out_of_range_numeric_flags_are_refused(tmp_path, capsys, flag, value, allowed):
    run = write_curve(tmp_path / "run")
    with pytest.raises(SystemExit) as exit_info:
        fit_cli.main([str(run), f"{flag}={value}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and allowed in err and value in err


def test_f3_fit_end_not_above_fit_start_is_refused(tmp_path, capsys):
    run = write_curve(tmp_path / "run")
    with pytest.raises(SystemExit):
        fit_cli.main([str(run), "--fit-start", "2000", "--fit-end", "1000"])
    assert "--fit-end 1000.0 must exceed --fit-start 2000.0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bad, what", [(b"\x00" * 40 + b"\n", "malformed JSON"), (b"[1, 2]\n", "expected a JSON object")]
)
def test_f4_malformed_rows_name_file_and_line(tmp_path, capsys, bad, what):
    run = write_curve(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    lines.insert(7, bad)  # becomes line 8
    (run / "metrics.jsonl").write_bytes(b"".join(lines))
    assert fit_cli.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'metrics.jsonl'} line 8: {what}" in err


# ----------------------------------------------------------------------------------------------
# Config values (scalerl_jax.config.validation) and the run's start-up refusals (scalerl_jax.run)
# ----------------------------------------------------------------------------------------------

BAD_VALUES = [
    ("optimizer.lr", float("nan")),
    ("optimizer.lr", float("inf")),
    ("optimizer.lr", -1e-6),
    ("optimizer.eps", float("nan")),
    ("optimizer.b1", 2.0),
    ("optimizer.b2", 1.0),
    ("optimizer.weight_decay", -0.1),
    ("optimizer.max_grad_norm", float("nan")),
    ("sampler.temperature", float("nan")),
    ("sampler.temperature", 0.0),
    ("sampler.top_p", 1.5),
    ("sampler.top_k", -1),
    ("rl.eps_low", -0.2),
    ("rl.eps_low", 1.0),
    ("rl.eps_high", float("inf")),
    ("rl.eps_max", 0.0),
    ("rl.positive_pass_rate", 1.5),
    ("data.verify_workers", 0),
    ("data.verify_timeout_s", float("nan")),
    ("data.reward_correct", float("nan")),
    ("mesh.generator_fraction", float("nan")),
    ("checkpoint.keep", 0),
    ("batch.generations_per_prompt", 1),
    ("warm_start.steps", 0),
    ("warm_start.direct_answer_fraction", 1.5),
    ("eval.samples_per_prompt", 0),
    ("data.answer_format", "boxed"),
    ("data.reward_fn", "no_colon"),
]


@pytest.mark.parametrize("key,value", BAD_VALUES)
def test_v1_bad_value_is_refused_naming_the_key(key, value):
    config = recipes.tiny()
    *sections, name = key.split(".")
    node = config
    for part in sections:
        node = node[part]
    setattr(node, name, value)
    with pytest.raises(ConfigError, match=re.escape(f"`{key}`")):
        validate(config, check_files=False)


def test_v2_every_problem_is_listed_in_one_error():
    config = recipes.tiny()
    config.optimizer.lr = float("nan")
    config.sampler.top_p = 2.0
    config.rl.aggregation = "mean"
    with pytest.raises(ConfigError) as raised:
        validate(config, check_files=False)
    assert str(raised.value).startswith("3 config problems:")
    for key in ("`optimizer.lr` = nan", "`sampler.top_p` = 2.0", "`rl.aggregation` = 'mean'"):
        assert key in str(raised.value)


def workdir_with_checkpoint(workdir, config):
    """A workdir holding one real checkpoint of `config`'s run (a small train state), no config.json."""
    state, _ = train_state(1)
    checkpointer = RunCheckpointer(str(workdir), keep=2)
    checkpointer.save(1, state, {"version": 1}, config=flat_config(config))
    checkpointer.close()


@pytest.mark.parametrize("config_json_text", [None, "{not json"], ids=["deleted", "malformed"])
def test_r1_resume_without_a_readable_config_json_checks_the_checkpoint_fingerprint(tmp_path, config_json_text):
    config = recipes.tiny()
    workdir_with_checkpoint(tmp_path, config)
    if config_json_text is not None:
        (tmp_path / "config.json").write_text(config_json_text)
    changed = recipes.tiny()
    changed.rl.objective = "dapo"
    with pytest.raises(ConfigError, match=r"`rl.objective` \('cispo' -> 'dapo'\)"):
        run_lib.run(changed, str(tmp_path))
    assert not (tmp_path / "warm_start").exists()  # refused before any work
    if config_json_text is not None:
        assert (tmp_path / "config.json").read_text() == config_json_text  # not overwritten


def test_r2_checkpoints_with_no_record_of_their_config_are_not_resumed_blind(tmp_path):
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)  # e.g. copied from elsewhere without config.json
    with pytest.raises(CheckpointError, match="(?s)no readable config record.*step 3"):
        run_lib.run(recipes.tiny(), str(tmp_path))


def test_r3_all_prompts_too_long_names_the_key(tmp_path):
    from family_checkpoints import make_family_checkpoint

    checkpoint = make_family_checkpoint("qwen2.5", str(tmp_path / "model"))
    data = tmp_path / "problems.jsonl"
    data.write_text(
        "".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(6))
    )
    config = recipes.scalerl_8b()
    config.update_from_flattened_dict(
        {
            "model.checkpoint": checkpoint,
            "data.dataset": "jsonl",
            "data.path": str(data),
            "data.heldout_size": 2,
            "data.max_prompt_tokens": 8,
        }
    )
    tokens = load_checkpoint_tokenizer(checkpoint)
    encoder = sampling_setup.make_prompt_encoder(config, tokens, checkpoint)
    with pytest.raises(ConfigError, match=r"`data.max_prompt_tokens` = 8: all 4 training prompts are longer"):
        load_task(config, str(tmp_path / "run"), encoder)


def test_r4_interruption_on_a_tokenizer_without_the_think_end_tag_names_the_keys(tmp_path):
    from family_checkpoints import make_family_checkpoint

    checkpoint = make_family_checkpoint("llama3.1", str(tmp_path / "llama"))  # no </think> token
    config = recipes.scalerl_8b()
    tokens = load_checkpoint_tokenizer(checkpoint)
    with pytest.raises(ConfigError, match=r"`rl.length_control` = 'interruption'.*answer_format=plain"):
        sampling_setup.check_think_end(config, tokens, checkpoint)
    config.data.answer_format = "plain"
    sampling_setup.check_think_end(config, tokens, checkpoint)  # plain: no interruption, nothing to check
    qwen3 = make_family_checkpoint("qwen3", str(tmp_path / "qwen3"))  # ships </think>
    config.data.answer_format = "think"
    sampling_setup.check_think_end(config, load_checkpoint_tokenizer(qwen3), qwen3)


def test_r5_chat_template_asked_for_on_a_checkpoint_without_one(tmp_path):
    from family_checkpoints import make_family_checkpoint

    checkpoint = make_family_checkpoint("qwen2.5", str(tmp_path / "model"))
    tokenizer_config = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    del tokenizer_config["chat_template"]
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = recipes.scalerl_8b()
    with pytest.raises(ConfigError, match="`data.use_chat_template` = True"):
        sampling_setup.make_prompt_encoder(config, load_checkpoint_tokenizer(checkpoint), checkpoint)


def test_r6_a_locked_workdir_stops_main_with_one_line(tmp_path):
    with hold_workdir(str(tmp_path)):
        result = subprocess.run(
            [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={tmp_path}"],
            cwd=REPO,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    assert f"pid {os.getpid()}" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "warm_start").exists()


def test_r7_read_only_workdir_stops_main_with_one_line_naming_the_path(tmp_path):
    with tiny_tmpfs(tmp_path / "mnt", 64) as mount:
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, timeout=10)
        result = subprocess.run(
            [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={mount / 'run'}"],
            cwd=REPO,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    assert "Read-only file system" in result.stderr and str(mount / "run") in result.stderr
    assert "Traceback" not in result.stderr


def test_r8_a_bad_custom_reward_is_named_at_start_up(tmp_path):
    config = recipes.tiny()
    config.data.reward_fn = "custom_rewards:no_such_function"
    with pytest.raises(ConfigError, match=r"`data.reward_fn` = 'custom_rewards:no_such_function'"):
        run_lib.run(config, str(tmp_path))
    assert not (tmp_path / "warm_start").exists()
