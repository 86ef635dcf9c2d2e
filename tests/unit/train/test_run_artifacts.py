"""Metrics JSONL with resume truncation, and orbax checkpoints that round-trip exactly (faults: test_faults)."""

import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
from repo_paths import REPO

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


def run_script(tmp_path, text: str) -> subprocess.CompletedProcess:
    """Runs `text` as a Python script in a process of its own (the hooks it installs stay there)."""
    script = tmp_path / "script.py"
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


ABORTED_WRITES = """
import asyncio, gc, logging, sys
logging.basicConfig(stream=sys.stderr)  # asyncio reports collected, never-retrieved errors to its logger
from scalerl_jax.train import checkpoint

# A coroutine in orbax's code (by file name) that fails as a write to a full disk does.
orbax = {}
exec(compile("async def write(n):\\n    raise ValueError(f'RESOURCE_EXHAUSTED: write {n}')\\n",
             "/venv/site-packages/orbax/checkpoint/_src/serialization/serialization.py", "exec"), orbax)

async def not_orbax():
    raise ValueError("an error of another library")

async def main():
    gathered = [asyncio.gather(orbax["write"](1), orbax["write"](2)), asyncio.gather(not_orbax())]
    tasks = [asyncio.ensure_future(orbax["write"](3))]
    # tensorstore's future of a write into the save's temporary directory: no Python frame at all
    store_write = asyncio.get_running_loop().create_future()
    store_write.set_exception(ValueError(
        'RESOURCE_EXHAUSTED: Error writing "w/.zarray" in OCDBT database at local file '
        '"/w/checkpoints/4.orbax-checkpoint-tmp/train_state.orbax-checkpoint-tmp/ocdbt.process_0/"'
    ))
    del store_write
    await asyncio.sleep(0.1)  # all of them failed; nobody asks for the errors

checkpoint._quiet_aborted_writes()  # what a failed save installs
asyncio.run(main())
gc.collect()
"""


def test_aborted_orbax_writes_are_not_reported_after_a_failed_save(tmp_path):
    """The gathered writes of a failed save are reported by asyncio when collected (at the run's
    exit, after its one error line): orbax's are dropped, another library's still reported."""
    result = run_script(tmp_path, ABORTED_WRITES)
    assert result.returncode == 0, result.stderr
    assert "RESOURCE_EXHAUSTED" not in result.stderr, result.stderr
    assert result.stderr.count("exception was never retrieved") == 1, result.stderr
    assert "an error of another library" in result.stderr


CLOSED_LOOP_REPORTS = """
import sys
from scalerl_jax.train import checkpoint

class LateCallback:  # raises from __del__, reported as unraisable (as tensorstore reports its callbacks')
    def __init__(self, message):
        self.message = message

    def __del__(self):
        raise RuntimeError(self.message)

checkpoint._quiet_aborted_writes()  # what a failed save installs
LateCallback("Event loop is closed")
sys.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)  # as PyErr_Print reports
LateCallback("another error")
"""


def test_closed_loop_reports_are_dropped_after_a_failed_save(tmp_path):
    """Tensorstore reports what the completion callbacks of a failed save's aborted writes raise
    ('Event loop is closed': orbax closed its loop) through both the unraisable hook and
    sys.excepthook, after the save was raised as one line: dropped; other errors still reported."""
    result = run_script(tmp_path, CLOSED_LOOP_REPORTS)
    assert result.returncode == 0, result.stderr
    assert "Event loop is closed" not in result.stderr, result.stderr
    assert "RuntimeError: another error" in result.stderr, result.stderr
