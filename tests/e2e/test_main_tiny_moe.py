"""The main job on configs/tiny_moe.py, a mixture-of-experts policy (8 experts, 2 per token): a
few steps with router replay and the routing metrics in every train row, the warm start written
as a Qwen3-MoE checkpoint with one tensor per expert; and (slow) a shortened run that learns."""

import json
import math
import os
import subprocess
import sys

import pytest
from main_runs import SMALL, flags, main_env, read_metrics
from repo_paths import REPO
from safetensors import safe_open

EXPERTS = 8


def run_tiny_moe(workdir, overrides, timeout):
    command = [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny_moe.py", f"--workdir={workdir}"]
    return subprocess.run(
        [*command, *flags(overrides)], cwd=REPO, env=main_env(), capture_output=True, text=True, timeout=timeout
    )


def test_a_moe_policy_runs_with_router_replay_and_its_routing_metrics(tmp_path):
    # Every group stays in the loss (a barely warm-started policy gets all-zero groups, which the
    # zero-variance filter would drop, leaving no token to route).
    overrides = {**SMALL, "rl.zero_variance_filter": False, "rl.router_replay": True}
    result = run_tiny_moe(tmp_path, overrides, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        assert row["moe/dropped_tokens"] == 0
        assert 0 <= row["moe/tokens_per_expert_min"] <= row["moe/tokens_per_expert_max"]
        assert row["moe/tokens_per_expert_max"] > 0
        assert 0 < row["moe/router_entropy"] <= math.log(EXPERTS) + 1e-6
        assert row["moe/aux_loss"] > 0
        # the sampler's routing reached the trainer: some pairs recorded, few of them differing
        assert row["moe/recorded_pairs"] > 0 and 0 <= row["train/routing_mismatch_frac"] < 0.2
    print("routing mismatch per step:", [row["train/routing_mismatch_frac"] for row in rows[1:]])
    base = tmp_path / "warm_start"
    checkpoints = [dirpath for dirpath, _, files in os.walk(base) if "config.json" in files]
    assert checkpoints, sorted(os.listdir(base))
    config = json.load(open(os.path.join(checkpoints[0], "config.json")))
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == EXPERTS
    with safe_open(os.path.join(checkpoints[0], "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert {f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(EXPERTS)} <= names


@pytest.mark.slow  # ~10 minutes on 2 cores: the full warm start, then 40 steps
def test_the_tiny_moe_policy_learns(tmp_path):
    overrides = {"num_steps": 40, "eval.every": 10, "eval.concurrent": False, "checkpoint.every": 40}
    result = run_tiny_moe(tmp_path, overrides, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    rates = {r["step"]: r["eval/pass_rate"] for r in read_metrics(tmp_path) if "eval/pass_rate" in r}
    assert sorted(rates) == [0, 10, 20, 30, 40]
    assert max(rates[20], rates[30], rates[40]) >= rates[0] + 0.08, rates
