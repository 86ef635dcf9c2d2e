"""Optional Weights & Biases logging of the run's metrics (`--config.logging.wandb_project=NAME`).

JSONL and TensorBoard stay the record of a run; this is a third sink for those who use W&B. It
runs offline by default (`logging.wandb_mode='offline'`: files under `WORKDIR/wandb`, synced
later with `wandb sync`), so nothing needs the network. The package is an optional extra
(`pip install -e '.[wandb]'`); asking for W&B without it is a clear error at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

# The modes wandb.init accepts (config_validation allows logging.wandb_mode offline, online, disabled).
WandbMode = Literal["online", "offline", "disabled", "shared"]

WANDB_MODES = ("offline", "online", "disabled")  # `wandb.init(mode=...)` values a run may pass


class WandbSink:
    """`write(step, metrics)` to one W&B run whose id is stable across resumes of a workdir."""

    def __init__(self, *, project: str, mode: WandbMode, workdir: str, config: Mapping[str, Any]):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "config key `logging.wandb_project` is set but the wandb package is not "
                "installed: pip install -e '.[wandb]' (or set logging.wandb_project='')"
            ) from e
        run_id = os.path.basename(os.path.abspath(workdir)).replace("/", "_") or "run"
        self._run = wandb.init(
            project=project,
            mode=mode,
            dir=workdir,
            id=run_id,
            resume="allow",
            config=dict(config),
            name=run_id,
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Logs the numeric values of one step's metrics row at `step`."""
        numbers = {
            key: value
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        self._run.log(numbers, step=int(step))

    def close(self) -> None:
        """Finishes the run and shuts W&B's service process down, which returns only once the run
        file is complete on disk (`finish` alone can return before the offline writer flushes)."""
        import wandb

        self._run.finish()
        wandb.teardown()
