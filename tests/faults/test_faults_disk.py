"""The workdir's filesystem failing under a checkpointer, beyond the save itself (C7, C8 in
test_faults.py): what comes after a failed save.

D1 a save that failed on a full disk in one thread (the run's trainer thread), then `close()` in
   another (the run's `finally`, in the main thread): no exception and nothing on stderr (orbax
   raises a failed save once in each thread that waits for it, and logs its traceback); the
   previous checkpoint restores
D2 a metrics row that does not fit on a full disk: the OSError names metrics.jsonl (a write to an
   open file has no file name of its own, and the run's one line would name nothing)
D3 MetricsWriter.close() after writes failed on a full disk, then the process's exit: no exception
   and no traceback (TensorBoard's writer thread and exit hook retry the flush that cannot succeed)
"""

import errno
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from repo_paths import REPO
from test_faults import CONFIG, assert_state_is_step, big_state, tiny_tmpfs, train_state

from scalerl_jax.telemetry.metrics import MetricsWriter
from scalerl_jax.train.checkpoint import CheckpointError, RunCheckpointer


def test_d1_close_after_a_failed_save_is_silent_and_the_previous_checkpoint_restores(tmp_path, capfd, caplog):
    with tiny_tmpfs(tmp_path / "mnt", 8192) as mount:
        checkpointer = RunCheckpointer(str(mount), keep=5)
        small, _ = train_state(1)
        checkpointer.save(1, small, {"version": 1}, config=CONFIG)
        fill_leaving(mount, 256 << 10)  # the metadata fits, the random 1 MiB array does not
        errors = []

        def save_in_a_thread():
            try:
                checkpointer.save(2, big_state(2), {"version": 2}, config=CONFIG)
            except CheckpointError as error:
                errors.append(str(error))

        thread = threading.Thread(target=save_in_a_thread)
        thread.start()
        thread.join(timeout=120)
        assert len(errors) == 1 and "No space left on device" in errors[0], errors
        capfd.readouterr()
        caplog.clear()
        checkpointer.close()
        assert capfd.readouterr().err == ""
        assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == []
        result = RunCheckpointer(str(mount), keep=5, writes=False).restore_latest(small)
        assert result is not None
        assert_state_is_step(result, 1)


def fill_leaving(mount, free_bytes: int) -> None:
    """A file taking all of `mount`'s free space but `free_bytes`."""
    stats = os.statvfs(mount)
    with open(mount / "filler", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, stats.f_bavail * stats.f_frsize - free_bytes)


def test_d2_a_metrics_row_that_cannot_be_written_names_the_file(tmp_path):
    with tiny_tmpfs(tmp_path / "mnt", 256) as mount:
        writer = MetricsWriter(str(mount))
        writer.write(1, {"train/loss": 0.5})
        fill_leaving(mount, 0)
        with pytest.raises(OSError) as error:
            for step in range(2, 200):  # the page holding the first rows fills, the next has no room
                writer.write(step, {"train/loss": 0.5, "note": "x" * 200})
        assert error.value.errno == errno.ENOSPC
        assert str(mount / "metrics.jsonl") in str(error.value), str(error.value)
        writer.close()


def test_d3_metrics_writer_on_a_full_disk_closes_and_exits_without_tracebacks(tmp_path):
    with tiny_tmpfs(tmp_path / "mnt", 256) as mount:
        script = textwrap.dedent(
            f"""
            import os
            from scalerl_jax.telemetry.metrics import MetricsWriter
            writer = MetricsWriter({str(mount)!r})
            writer.write(1, {{"train/loss": 0.5}})
            stats = os.statvfs({str(mount)!r})
            with open({str(mount / "filler")!r}, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, stats.f_bavail * stats.f_frsize)
            try:
                for step in range(2, 400):
                    writer.write(step, {{"train/loss": 0.5, "note": "x" * 200}})
            except OSError as error:
                print("write failed:", error)
            writer.close()
            print("closed")
            """
        )
        result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "write failed: [Errno 28]" in result.stdout and "closed" in result.stdout, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr, result.stderr
    assert result.returncode == 0
