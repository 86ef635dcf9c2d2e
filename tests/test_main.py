"""The main job end to end on the tiny config (a handful of steps), and its bad-input errors."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.join(os.path.dirname(__file__), "..")
SMALL = [
    "--config.warm_start.steps=8", "--config.warm_start.batch_size=16", "--config.synthetic.sft_size=64",
    "--config.synthetic.train_size=64", "--config.synthetic.heldout_size=8", "--config.num_steps=3",
    "--config.batch.prompts_per_step=4", "--config.batch.generations_per_prompt=2",
    "--config.sampler.num_slots=8", "--config.eval.every=2", "--config.eval.num_prompts=4",
    "--config.eval.samples_per_prompt=2", "--config.checkpoint.every=2",
]


def run_main(workdir, *overrides, timeout=600):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={workdir}", *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_tiny_run_writes_metrics_and_checkpoints(tmp_path):
    result = run_main(tmp_path, *SMALL)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0 is the initial evaluation
    required = ("compute/device_hours", "train/loss", "pipeline/lag_max", "pipeline/lag_mean",
                "sampler/tokens_per_s", "sampler/interrupted_frac", "sampler/truncated_frac",
                "data/zero_variance_dropped", "data/pool_remaining")
    for row in rows[1:]:
        assert all(key in row for key in required), sorted(set(required) - set(row))
        assert isinstance(row["train/loss"], float)  # non-finite values are written as strings
        assert 0 <= row["pipeline/lag_max"] <= 2  # tiny config: PipelineRL-2
    assert "eval/pass_rate" in rows[0] and "eval/pass_rate" in rows[2] and "eval/pass_rate" in rows[3]
    hours = [r["compute/device_hours"] for r in rows]
    assert hours == sorted(hours) and hours[-1] > 0
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3"]
    assert json.load(open(tmp_path / "config.json"))["rl"]["objective"] == "cispo"
    assert os.listdir(tmp_path / "tb")
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_config_key_fails_before_anything_heavy(tmp_path):
    result = run_main(tmp_path, "--config.rl.objectve=dapo", timeout=120)
    assert result.returncode != 0
    assert "objectve" in result.stderr


def test_missing_dataset_path_names_the_key(tmp_path):
    result = run_main(tmp_path, "--config.data.dataset=polaris_53k",
                      f"--config.data.path={tmp_path / 'missing.jsonl'}", timeout=120)
    assert result.returncode != 0
    assert "data.path" in result.stderr
