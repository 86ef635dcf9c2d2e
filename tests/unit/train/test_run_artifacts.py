"""Metrics JSONL with resume truncation, and orbax checkpoints that round-trip exactly (faults: test_faults)."""

import json
import math
import os

import jax.numpy as jnp
import numpy as np

from scalerl_jax.telemetry.metrics import MetricsWriter, format_progress
from scalerl_jax.train.checkpoint import RunCheckpointer


def test_metrics_lines_and_resume_truncation(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.write(1, {"train/loss": np.float32(0.5), "note": "x"})
    offset = writer.offset()
    writer.write(2, {"train/loss": float("nan")})
    writer.close()
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert lines == [{"step": 1, "train/loss": 0.5, "note": "x"}, {"step": 2, "train/loss": "nan"}]
    resumed = MetricsWriter(str(tmp_path), resume_offset=offset)  # step 2 is replayed after a resume
    resumed.write(2, {"train/loss": 0.25})
    resumed.close()
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [row["step"] for row in lines] == [1, 2] and lines[1]["train/loss"] == 0.25
    assert os.listdir(tmp_path / "tb")


def test_progress_line_shows_the_watched_numbers():
    line = format_progress(3, 10, {"eval/pass_rate": 0.25, "pipeline/lag_max": 2, "compute/device_hours": 0.5}, 120.0)
    assert "step 3/10" in line and "pass 0.250" in line and "eta 2.0m" in line and "dev-h 0.5000" in line
    line = format_progress(4, 10, {"train/reward_mean": -0.5}, None, last_eval=(3, 0.25))
    assert "pass 0.250@3" in line and "reward -0.500" in line and "eta -" in line


def test_checkpoint_round_trip_and_incomplete_is_ignored(tmp_path):
    checkpointer = RunCheckpointer(str(tmp_path), keep=2)
    state = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.int32(3)}
    run_state = {"version": 3, "pool": {"history": [[1, 2], [3, 4]]}, "metrics_offset": 17}
    checkpointer.save(3, state, run_state, config={"checkpoint.keep": 2})
    # A save killed midway leaves only orbax's temporary directory behind.
    os.makedirs(tmp_path / "checkpoints" / "7.orbax-checkpoint-tmp-1")
    reopened = RunCheckpointer(str(tmp_path), keep=2)
    assert reopened.latest_step() == 3
    restored, restored_run = reopened.restore(3, state)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(6.0).reshape(2, 3))
    assert int(restored["step"]) == 3 and restored_run == run_state
    assert math.isclose(float(restored["w"][1, 2]), 5.0)
    assert reopened.saved_config() == {"checkpoint.keep": 2}
