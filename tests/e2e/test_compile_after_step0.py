"""No program compiles after step 0 in a run that evaluates after step 0: every decode-path program
the evaluations and the generation use and every program of the trainer thread (the train step,
the evaluation's push, the checkpoint) is compiled before the first train step.

The runs split 3 CPU devices into 2 generator devices and 1 trainer device: on a generator mesh of
several devices the decode state came back from some calls on other shardings than warm-up
compiled for, and a prefill bucket compiled again during the evaluations after step 0. A trainer
of 2 devices (4 devices, half of them generating) holds replicated arrays, which orbax's
replica-parallel save sliced with programs compiled at the first checkpoint.

The run logs `compile/after_step0` on every training row (compiles since the first train step
began) and a warning 'compile after the first train step began: <program> ...' for each one, which
also covers what no row counts (the last step's evaluation and checkpoint, after its row)."""

import os
import subprocess

import pytest
from main_runs import REPO, SMALL, flags, main_command, main_env, read_metrics, run_main

LATE_COMPILE = "compile after the first train step began"
GSM8K_TRAIN = os.path.join(REPO, "..", "shared", "data", "gsm8k", "train.jsonl")
DEVICES = 3
SPLIT = {"mesh.generator_fraction": 0.67}  # 2 of the 3 devices generate, 1 trains


def assert_nothing_compiled_after_step0(workdir, log: str, evaluated_after_step0: list[int]) -> None:
    rows = read_metrics(workdir)
    evaluated = sorted({r["step"] for r in rows if "eval/pass_rate" in r})
    assert evaluated == [0, *evaluated_after_step0], evaluated
    trained = [r for r in rows if "train/loss" in r]
    assert trained and all("compile/after_step0" in r for r in trained)
    assert [(r["step"], r["compile/after_step0"]) for r in trained] == [(r["step"], 0.0) for r in trained]
    late = [line for line in log.splitlines() if LATE_COMPILE in line]
    assert not late, "\n".join(late)


@pytest.mark.parametrize(
    ("devices", "generator_fraction"),
    [(DEVICES, SPLIT["mesh.generator_fraction"]), (4, 0.5)],
    ids=["one_trainer_device", "two_trainer_devices"],
)
def test_tiny_run_compiles_nothing_after_step0(tmp_path, devices, generator_fraction):
    # Evaluations at steps 0, 1, 2, 3 (every step; the last one after the last row), checkpoints at 2, 3.
    overrides = {**SMALL, "mesh.generator_fraction": generator_fraction, "eval.every": 1}
    result = run_main(tmp_path, *flags(overrides), timeout=900, devices=devices)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_nothing_compiled_after_step0(tmp_path, result.stderr, [1, 2, 3])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(GSM8K_TRAIN), reason=f"GSM8K not found at {GSM8K_TRAIN}")
def test_smollm2_run_compiles_nothing_after_step0(smollm2_dir, tmp_path):
    """configs/smollm2_gsm8k.py on the real checkpoint, made small (2 prompts x 4 samples a step,
    64 new tokens, 4 held-out prompts): evaluations at steps 0, 1, 2 and 3, checkpoints at 2 and 3."""
    overrides = {
        **SPLIT,
        "num_steps": 3,
        "eval.every": 1,
        "checkpoint.every": 2,
        "eval.num_prompts": 4,
        "sampler.max_new_tokens": 64,
        "batch.prompts_per_step": 2,
        "batch.generations_per_prompt": 4,
    }
    command = main_command(
        tmp_path,
        f"--config.model.checkpoint={smollm2_dir}",
        f"--config.data.path={GSM8K_TRAIN}",
        *flags(overrides),
    )
    command[command.index("--config=configs/tiny.py")] = "--config=configs/smollm2_gsm8k.py"
    result = subprocess.run(
        command, cwd=REPO, env=main_env(DEVICES), capture_output=True, text=True, timeout=3600, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert_nothing_compiled_after_step0(tmp_path, result.stderr, [1, 2, 3])
