"""The workdir's filesystem failing under a checkpointer, beyond the save itself (C7, C8 in
test_faults.py): what comes after a failed save.

D1 a save that failed on a full disk in one thread (the run's trainer thread), then `close()` in
   another (the run's `finally`, in the main thread): no exception and nothing on stderr (orbax
   raises a failed save once in each thread that waits for it, and logs its traceback); the
   previous checkpoint restores
"""

import logging
import os
import threading

from test_faults import CONFIG, assert_state_is_step, big_state, tiny_tmpfs, train_state

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
