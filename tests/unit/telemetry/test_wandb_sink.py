"""The optional Weights & Biases sink in offline mode: no network, a local run file with the metrics."""

import glob

import pytest

pytest.importorskip("wandb")

from scalerl_jax.telemetry.wandb_sink import WandbSink  # noqa: E402


def test_offline_run_records_the_numeric_metrics(tmp_path):
    sink = WandbSink(
        project="scalerl-test", mode="offline", workdir=str(tmp_path), config={"rl": {"objective": "cispo"}}
    )
    sink.write(0, {"eval/pass_rate": 0.25, "compute/unit": "device_hours"})
    sink.write(1, {"train/loss": -0.5})
    sink.close()
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(run_file, "rb").read()
    assert b"eval/pass_rate" in data and b"train/loss" in data
    assert b"compute/unit" not in data  # strings stay in metrics.jsonl only


def test_an_evaluation_row_written_after_later_steps_keeps_its_step(tmp_path):
    sink = WandbSink(project="scalerl-test", mode="offline", workdir=str(tmp_path), config={})
    sink.write(4, {"train/loss": -0.5})
    sink.write(5, {"train/loss": -0.4})
    sink.write(4, {"eval/pass_rate": 0.625, "eval_aime/pass_rate": 0.125})  # evaluated beside training
    sink.close()
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(run_file, "rb").read()
    # W&B drops a row logged at an older step: it went in at step 5, its own step 4 as step_evaluated.
    assert b"eval/pass_rate" in data and b"eval_aime/pass_rate" in data and b"step_evaluated" in data
