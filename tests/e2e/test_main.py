"""The main job end to end on the tiny config (a handful of steps), and its bad-input errors."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from main_runs import PPO, REPO, SMALL, flags, main_command, main_env, read_metrics, run_main

from scalerl_jax import run as run_lib
from scalerl_jax.config import recipes
from scalerl_jax.config.validation import validate
from scalerl_jax.run import build as run_build
from scalerl_jax.scaling.runs import read_run


def test_tiny_run_writes_metrics_and_checkpoints(tmp_path):
    result = run_main(tmp_path, *flags(SMALL))
    assert result.returncode == 0, result.stderr[-4000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0 is the initial evaluation
    required = (
        "compute/device_hours",
        "train/loss",
        "pipeline/lag_max",
        "pipeline/lag_mean",
        "sampler/tokens_per_s",
        "sampler/interrupted_frac",
        "sampler/truncated_frac",
        "sampler/prefill_tokens",
        "sampler/shared_prompt_pages",
        "data/zero_variance_dropped",
        "data/pool_remaining",
    )
    for row in rows[1:]:
        assert all(key in row for key in required), sorted(set(required) - set(row))
        assert isinstance(row["train/loss"], float)  # non-finite values are written as strings
        assert 0 <= row["pipeline/lag_max"] <= 2  # tiny config: PipelineRL-2
    assert sum(r["sampler/prefill_tokens"] for r in rows[1:]) > 0
    assert "eval/pass_rate" in rows[0] and "eval/pass_rate" in rows[2] and "eval/pass_rate" in rows[3]
    assert [r["pipeline/version"] for r in rows[1:]] == [1, 2, 3]  # params version after each step
    hours = [r["compute/device_hours"] for r in rows]
    assert hours == sorted(hours) and hours[-1] > 0
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3"]
    assert json.load(open(tmp_path / "config.json"))["rl"]["objective"] == "cispo"
    assert os.listdir(tmp_path / "tb")
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tiny_run_evaluates_beside_training(tmp_path):
    # eval.concurrent: the evaluations of steps 0, 2 and 4 run while training goes on, each written
    # as its own row (its step, the compute of that step) when done; the last step's (5) runs in
    # the trainer thread after them, in that step's row.
    result = run_main(tmp_path, *flags({**SMALL, "eval.concurrent": True, "num_steps": 5}))
    assert result.returncode == 0, result.stderr[-4000:]
    rows = read_metrics(tmp_path)
    train_rows = [r["step"] for r in rows if "train/loss" in r]
    eval_rows = [r for r in rows if "eval/pass_rate" in r]
    assert train_rows == [1, 2, 3, 4, 5]
    assert [r["step"] for r in eval_rows] == [0, 2, 4, 5] and "train/loss" in eval_rows[-1]
    assert all("train/loss" not in r for r in eval_rows[:-1])
    for row in eval_rows[1:-1]:  # the compute of its own step, as that step's training row has it
        (trained,) = [r for r in rows if r["step"] == row["step"] and "train/loss" in r]
        assert row["compute/device_hours"] == trained["compute/device_hours"]
    assert result.stderr.count("(evaluated beside training)") == 3
    curve = read_run(tmp_path)  # the fit's reader takes the late rows: compute rises along them
    assert list(curve.steps) == [0, 2, 4, 5]
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_checkpoint_taken_while_its_evaluation_runs_is_evaluated_on_resume(tmp_path):
    # Step 2's evaluation is submitted just before step 2's checkpoint, so the checkpoint records it
    # as owed. Resumed from that checkpoint (the later one removed), the run evaluates step 2 first:
    # one row for it, with the pass rate the first run measured (same params, same streams).
    overrides = flags({**SMALL, "eval.concurrent": True, "num_steps": 3})
    first = run_main(tmp_path, *overrides)
    assert first.returncode == 0, first.stderr[-4000:]
    before = {r["step"]: r["eval/pass_rate"] for r in read_metrics(tmp_path) if "eval/pass_rate" in r}
    assert sorted(before) == [0, 2, 3]
    shutil.rmtree(tmp_path / "checkpoints" / "3")
    resumed = run_main(tmp_path, *overrides)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from checkpoint step 2" in resumed.stderr
    after = [(r["step"], r["eval/pass_rate"]) for r in read_metrics(tmp_path) if "eval/pass_rate" in r]
    assert [step for step, _ in after] == [0, 2, 3]
    assert dict(after)[2] == before[2]


@pytest.mark.slow
def test_tiny_run_really_learns(tmp_path):
    """The README's first command, in full (about 9 minutes on 2 cores)."""
    result = run_main(tmp_path, timeout=3600)
    assert result.returncode == 0, result.stderr[-4000:]
    passes = [(r["step"], r["eval/pass_rate"]) for r in read_metrics(tmp_path) if "eval/pass_rate" in r]
    start, end = passes[0][1], passes[-1][1]
    assert passes[0][0] == 0 and 0.10 <= start <= 0.60, passes
    assert end >= start + 0.10, passes
    assert "C_mid" in result.stdout  # the fit table is printed
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_config_key_fails_before_anything_heavy(tmp_path):
    # ml_collections refuses an unknown override while absl parses the flags (before main runs).
    result = run_main(tmp_path, "--config.rl.objectve=dapo", timeout=120)
    assert result.returncode != 0
    assert "objectve" in result.stderr and 'Did you mean "objective"' in result.stderr


def test_config_errors_are_listed_together_with_exit_code_2(tmp_path):
    result = run_main(
        tmp_path,
        "--config.optimizer.lr=nan",
        "--config.sampler.top_p=1.5",
        "--config.data.verify_workers=0",
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "3 config problems" in result.stderr
    for key in ("`optimizer.lr` = nan", "`sampler.top_p` = 1.5", "`data.verify_workers` = 0"):
        assert key in result.stderr
    assert not os.path.exists(tmp_path / "warm_start")


def test_cpu_backend_is_split_into_the_configured_devices_without_xla_flags(tmp_path):
    # 4 devices x generator_fraction 0.25 -> 1 generator and 3 trainers, which 128 rows do not divide:
    # the refusal names the device count, proving the host was split before JAX started.
    env = {k: v for k, v in main_env().items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        main_command(tmp_path, "--config.mesh.cpu_devices=4", "--config.mesh.generator_fraction=0.25"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "3 trainer devices" in result.stderr and "of 4 devices" in result.stderr


def test_accelerator_recipe_refuses_the_cpu_backend(tmp_path):
    model, data = tmp_path / "model", tmp_path / "polaris.jsonl"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data.write_text('{"problem": "1+1", "answer": "2", "difficulty": 1}\n')
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "scalerl_jax.main",
            "--config=configs/scalerl_8b.py",
            f"--workdir={tmp_path / 'run'}",
            f"--config.model.checkpoint={model}",
            f"--config.data.path={data}",
        ],
        cwd=REPO,
        env=main_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "mesh.require_accelerator" in result.stderr and "CPU backend" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_dataset_path_names_the_key(tmp_path):
    result = run_main(
        tmp_path, "--config.data.dataset=polaris_53k", f"--config.data.path={tmp_path / 'missing.jsonl'}", timeout=120
    )
    assert result.returncode != 0
    assert "data.path" in result.stderr


def test_batch_that_does_not_divide_the_trainer_devices_names_the_keys(tmp_path):
    # 4 devices x generator_fraction 0.25 -> 1 generator, 3 trainers; 16 x 8 = 128 rows, 128 % 3 = 2.
    result = run_main(tmp_path, "--config.mesh.generator_fraction=0.25", devices=4, timeout=120)
    assert result.returncode != 0
    assert "batch.*" in result.stderr and "3 trainer devices" in result.stderr
    assert not os.path.exists(tmp_path / "warm_start")  # failed before anything heavy


def test_sigkill_then_resume_reproduces_the_uninterrupted_run(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    result = run_main(full, *flags(PPO))
    assert result.returncode == 0, result.stderr[-4000:]
    # Same warm start and dataset for both runs (each is deterministic; copying saves the time).
    killed.mkdir()
    for name in ("warm_start", "tfds"):
        shutil.copytree(full / name, killed / name)

    process = subprocess.Popen(
        main_command(killed, *flags(PPO)),
        cwd=REPO,
        env=main_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    while not (killed / "checkpoints" / "4").is_dir():  # orbax renames the directory when complete
        assert process.poll() is None, "the run ended before its step-4 checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL

    resumed = run_main(killed, *flags(PPO))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    found = re.search(r"resumed from checkpoint step (\d+)", resumed.stderr)
    assert found is not None, resumed.stderr[-4000:]
    resumed_from = int(found.group(1))
    assert 4 <= resumed_from < 8  # at least one step ran after the resume

    expected, got = read_metrics(full), read_metrics(killed)
    assert [r["step"] for r in got] == list(range(9))  # rows written after the checkpoint were dropped
    assert sum(r["train/loss"] != 0 for r in expected[1:]) >= 3  # the comparison has teeth
    for a, b in zip(expected[1:], got[1:]):
        for key in ("train/loss", "train/entropy", "train/reward_mean"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), (a["step"], key)
    for a, b in zip(expected, got):
        if "eval/pass_rate" in a:  # the pass-rate history before and after the kill
            assert b["eval/pass_rate"] == a["eval/pass_rate"], a["step"]
    assert [r["step"] for r in got if "eval/pass_rate" in r] == [0, 2, 4, 6, 8]


@pytest.fixture(autouse=True)
def signal_handlers_are_restored():
    """An in-process run (scalerl_jax.run.run) hands back the caller's SIGINT / SIGTERM handlers, so Ctrl-C
    keeps working in the caller afterwards (the run installs its own while it runs: `run.signals.StopSignals`)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    assert {s: signal.getsignal(s) for s in saved} == saved


def poison_second_step(monkeypatch):
    """Makes the run's train step see NaN rewards at its second call (so a NaN loss at step 2)."""
    real_make_train_step = run_build.make_train_step

    def make_poisoned(*args, **kwargs):
        step = real_make_train_step(*args, **kwargs)
        calls = []

        def poisoned(state, batch):
            calls.append(None)
            if len(calls) == 2:
                batch = dict(batch, rewards=np.full_like(batch["rewards"], np.nan))
            return step(state, batch)

        poisoned.batch_sharding = step.batch_sharding  # where the run places batches
        return poisoned

    monkeypatch.setattr(run_build, "make_train_step", make_poisoned)


def small_tiny_config(**overrides):
    """The small tiny run, keeping zero-variance groups in the loss so that every row is trained
    on (after 8 warm-start steps most groups are all wrong, and dropped rows never see the NaN)."""
    config = recipes.tiny()
    overrides = {"rl.zero_variance_filter": False, **overrides}
    config.update_from_flattened_dict({**SMALL, **overrides})
    validate(config, num_devices=len(jax.devices()))
    return config


def test_nan_loss_is_skipped_and_counted(tmp_path, monkeypatch):
    poison_second_step(monkeypatch)
    run_lib.run(small_tiny_config(nan_policy="skip"), str(tmp_path))
    rows = {r["step"]: r for r in read_metrics(tmp_path)}
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[2]["train/finite"] == 0 and rows[2]["train/update_applied"] == 0
    assert rows[2]["train/loss"] == "nan"  # written, not dropped
    assert [rows[s]["train/nonfinite_steps"] for s in (1, 2, 3)] == [0, 1, 1]
    assert rows[3]["train/finite"] == 1 and math.isfinite(rows[3]["train/loss"])


def test_nan_loss_stops_the_run_naming_the_step(tmp_path, monkeypatch):
    poison_second_step(monkeypatch)
    with pytest.raises(FloatingPointError, match="at step 2"):
        run_lib.run(small_tiny_config(nan_policy="stop"), str(tmp_path))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["train/finite"] == 0
    assert not os.path.exists(tmp_path / "checkpoints" / "2")  # the bad state is never saved
