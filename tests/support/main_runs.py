"""The main job as a person runs it, for the end-to-end and fault suites: `python -m
scalerl_jax.main` on configs/tiny.py from the repository root, with small overrides."""

import json
import os
import subprocess
import sys

from repo_paths import REPO

SMALL = {
    "warm_start.steps": 8,
    "warm_start.batch_size": 16,
    "synthetic.sft_size": 64,
    "synthetic.train_size": 64,
    "synthetic.heldout_size": 8,
    "num_steps": 3,
    "batch.prompts_per_step": 4,
    "batch.generations_per_prompt": 2,
    "sampler.num_slots": 8,
    "eval.every": 2,
    "eval.num_prompts": 4,
    "eval.samples_per_prompt": 2,
    "eval.concurrent": False,  # one row per step: evaluations in the trainer thread
    "batch.length_buckets_per_octave": 1,  # 3 train buckets (32, 64, 112) to compile ahead, not 15
    "checkpoint.every": 2,
}


def flags(overrides: dict) -> list[str]:
    return [f"--config.{key}={value}" for key, value in overrides.items()]


def main_command(workdir, *overrides):
    return [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={workdir}", *overrides]


def main_env(devices: int = 2) -> dict:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")


def run_main(workdir, *overrides, timeout=600, devices=2):
    return subprocess.run(
        main_command(workdir, *overrides),
        cwd=REPO,
        env=main_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# One-operation problems and 80 warm-start steps, so that some samples are right and the losses are
# not all zero; zero-variance groups stay in the loss, so every step's entropy depends on its samples.
PPO = {
    **SMALL,
    "schedule.kind": "ppo_off_policy",
    "schedule.k": 2,
    "num_steps": 8,
    "warm_start.steps": 80,
    "synthetic.levels": ((1, 9),),
    "batch.generations_per_prompt": 4,
    "sampler.num_slots": 16,
    "rl.zero_variance_filter": False,
}
