"""Orbax checkpoints of a run: the train state (params, optimizer state, step) as arrays, and
the host-side run state (versions, compute meter, prompt pool, RNG, metrics offset) as JSON.

Orbax writes each step into a temporary directory and renames it when complete, so a run killed
mid-save leaves no directory that `latest_step()` would return: an incomplete checkpoint is never
loaded.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging


class RunCheckpointer:
    """Saves and restores `(train_state, run_state)` pairs under `WORKDIR/checkpoints`."""

    def __init__(self, workdir: str, *, keep: int):
        if keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def save(self, step: int, train_state: Any, run_state: dict) -> None:
        """Writes one checkpoint and waits until it is complete on disk (orbax's INFO lines muted)."""
        verbosity = logging.get_verbosity()
        logging.set_verbosity(logging.WARNING)
        try:
            self._save(step, train_state, run_state)
        finally:
            logging.set_verbosity(verbosity)
        logging.info("checkpoint: saved step %d to %s", step, self.directory)

    def _save(self, step: int, train_state: Any, run_state: dict) -> None:
        self._manager.save(
            step,
            args=ocp.args.Composite(
                train_state=ocp.args.StandardSave(train_state),
                run_state=ocp.args.JsonSave(run_state),
            ),
        )
        self._manager.wait_until_finished()

    def restore(self, step: int, abstract_train_state: Any) -> tuple[Any, dict]:
        """Reads checkpoint `step` into arrays shaped and sharded like `abstract_train_state`."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            abstract_train_state,
        )
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                train_state=ocp.args.StandardRestore(abstract),
                run_state=ocp.args.JsonRestore(),
            ),
        )
        return restored["train_state"], dict(restored["run_state"])

    def close(self) -> None:
        self._manager.close()
