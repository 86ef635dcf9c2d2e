"""RL moves a real pretrained model on this machine: SmolLM2-135M-Instruct on GSM8K, 90 minutes.

`python -m scalerl_jax.main --config=configs/smollm2_gsm8k.py` (the command in docs/guides/your_model_and_task.md) on the real
checkpoint (tests/support/real_models.py) and GSM8K's train file as published, run for `BUDGET_S` of wall
time and then stopped as SLURM stops a job (SIGTERM: the finished steps and evaluations stay on
record). The held-out pass rate (`eval/pass_rate`, 200 two-step problems x 2 samples, evaluated
every 10 steps) must start in [0.05, 0.6], the band where RL has signal, and the last evaluation
must be >= 0.05 above the first (not the best one: the maximum of several noisy evaluations is
biased upward). An hour and a half of the machine: `-m slow`, run by hand. SCALERL_REAL_RL_WORKDIR
keeps the run directory (metrics.jsonl, log) for the results page's curve and fit; SCALERL_REAL_RL_MINUTES
sets a shorter budget (a rise within it is a rise within 90 minutes).
"""

import json
import os
import signal
import subprocess
import sys

import pytest
from repo_paths import REPO as ROOT

GSM8K_TRAIN = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "train.jsonl")
BUDGET_S = 60 * float(os.environ.get("SCALERL_REAL_RL_MINUTES", "90"))
STOP_GRACE_S = 15 * 60  # a SIGTERM'd run finishes its step and its checkpoint, then exits


def evaluations(metrics_file: str) -> list[tuple[int, float]]:
    """(step, eval/pass_rate) of every metrics row that has an evaluation, in step order."""
    with open(metrics_file, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sorted((row["step"], row["eval/pass_rate"]) for row in rows if "eval/pass_rate" in row)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(GSM8K_TRAIN), reason=f"GSM8K not found at {GSM8K_TRAIN}")
def test_rl_raises_smollm2_held_out_pass_rate_on_gsm8k_within_90_minutes(smollm2_dir, tmp_path):
    workdir = os.environ.get("SCALERL_REAL_RL_WORKDIR") or str(tmp_path / "run")
    os.makedirs(workdir, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "scalerl_jax.main",
        "--config=configs/smollm2_gsm8k.py",
        f"--config.model.checkpoint={smollm2_dir}",
        f"--config.data.path={GSM8K_TRAIN}",
        f"--workdir={workdir}",
        "--config.num_steps=10000",  # the wall-time budget ends the run, not the step count
    ]
    with open(os.path.join(workdir, "main.log"), "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            process.wait(timeout=BUDGET_S)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=STOP_GRACE_S)
    assert process.returncode == 0, f"main exited {process.returncode}; see {workdir}/main.log"
    curve = evaluations(os.path.join(workdir, "metrics.jsonl"))
    assert len(curve) >= 3, curve
    (first_step, start), (last_step, last) = curve[0], curve[-1]
    assert first_step == 0
    assert 0.05 <= start <= 0.6, f"held-out pass rate at step 0: {start:.3f}; curve {curve}"
    assert last - start >= 0.05, f"step {last_step}: {last:.3f} vs {start:.3f} at step 0; curve {curve}"
