"""Optional Weights & Biases logging of the run's metrics (`--config.logging.wandb_project=NAME`).

JSONL and TensorBoard stay the record of a run; this is a third sink for those who use W&B.
W&B drops a row logged at a step older than one it has seen, and an evaluation that ran beside
training (`eval.concurrent`) writes its row after later steps' rows: such a row is logged at the
newest step seen, with its own step as `step_evaluated`, the x-axis W&B is told to use for the
evaluation metrics (`eval*`: `eval/...`, `eval_<set>/...`). It runs offline by default (`logging.wandb_mode='offline'`: files under `WORKDIR/wandb`, synced
later with `wandb sync`), so nothing needs the network. The package is an optional extra
(`pip install -e '.[wandb]'`); asking for W&B without it is a clear error at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

# The modes wandb.init accepts (the config schema allows logging.wandb_mode offline, online, disabled).
WandbMode = Literal["online", "offline", "disabled", "shared"]

WANDB_MODES = ("offline", "online", "disabled")  # `wandb.init(mode=...)` values a run may pass
EVAL_STEP_KEY = "step_evaluated"  # the step an evaluation row belongs to (module docstring)


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
        self._run.define_metric(EVAL_STEP_KEY)
        self._run.define_metric("eval*", step_metric=EVAL_STEP_KEY)  # W&B takes suffix globs only
        self._newest_step = -1

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Logs the numeric values of one step's metrics row at `step` (an evaluation row older than
        the newest step at that step, with `step_evaluated`: module docstring)."""
        numbers = {
            key: value
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        if any(key.startswith("eval/") or (key.startswith("eval_") and "/" in key) for key in numbers):
            numbers[EVAL_STEP_KEY] = int(step)
        self._newest_step = max(self._newest_step, int(step))
        self._run.log(numbers, step=self._newest_step)

    def close(self) -> None:
        """Finishes the run and shuts W&B's service process down, which returns only once the run
        file is complete on disk (`finish` alone can return before the offline writer flushes)."""
        import wandb

        self._run.finish()
        wandb.teardown()
