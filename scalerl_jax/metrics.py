"""Run metrics: one JSON object per step in `WORKDIR/metrics.jsonl`, TensorBoard events in
`WORKDIR/tb`, and the one-line progress report a person watches.

Resuming from a checkpoint truncates `metrics.jsonl` back to the byte offset recorded with that
checkpoint, so the steps replayed after a crash are logged once, not twice.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import numpy as np
from tensorboardX import SummaryWriter

METRICS_FILE = "metrics.jsonl"


def _to_json_value(value: Any) -> Any:
    """A plain Python number/str for one metric value (numpy and jax scalars included)."""
    if isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    array = np.asarray(value)
    if array.ndim == 0:
        number = float(array)
        return number if math.isfinite(number) else repr(number)
    raise ValueError(f"metric values must be scalars, got shape {array.shape}")


def tensorboard_tag(key: str) -> str:
    """`key` as a TensorBoard tag: '@' (as in 'eval/pass@1') is not allowed there, so 'pass_at_1'."""
    return key.replace("@", "_at_")


class MetricsWriter:
    """Appends step metrics to JSONL and TensorBoard; `offset()` marks a resumable position."""

    def __init__(self, workdir: str, *, resume_offset: int | None = None):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, METRICS_FILE)
        if resume_offset is not None and os.path.exists(self.path):
            with open(self.path, "r+b") as f:
                f.truncate(resume_offset)
        elif resume_offset is None and os.path.exists(self.path):
            os.remove(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = SummaryWriter(os.path.join(workdir, "tb"))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes one line `{"step": step, **metrics}` and the numeric values to TensorBoard."""
        row = {"step": int(step)}
        for key, value in metrics.items():
            row[key] = _to_json_value(value)
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        self._file.flush()
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(tensorboard_tag(key), value, global_step=int(step))

    def offset(self) -> int:
        """Byte length of the JSONL file so far (flushed); saved with every checkpoint."""
        self._file.flush()
        return self._file.tell()

    def close(self) -> None:
        self._file.close()
        self._tb.close()


def format_progress(step: int, num_steps: int, metrics: Mapping[str, Any], eta_s: float | None,
                    last_eval: tuple[int, float] | None = None) -> str:
    """The per-step progress line: step, pass rate, reward, loss and policy entropy, response length
    (mean/max completion tokens), tokens/s, lag, length control, compute, ETA; '-' for a missing
    number.

    The pass rate is this step's held-out evaluation, else `last_eval` = (its step, its pass rate).
    """

    def get(key: str, fmt: str) -> str:
        value = metrics.get(key)
        if value is None or isinstance(value, str):
            return "-"
        return format(float(value), fmt)

    eta = "-" if eta_s is None else f"{eta_s / 60:.1f}m"
    pass_rate = get("eval/pass_rate", ".3f")
    if pass_rate == "-" and last_eval is not None:
        pass_rate = f"{last_eval[1]:.3f}@{last_eval[0]}"
    return (
        f"step {step}/{num_steps} | pass {pass_rate} | reward {get('train/reward_mean', '+.3f')}"
        f" | loss {get('train/loss', '+.4f')} ent {get('train/entropy', '.3f')}"
        f" | len {get('train/completion_len_mean', '.0f')}/{get('train/completion_len_max', '.0f')}"
        f" | tok/s {get('sampler/tokens_per_s', '.0f')}"
        f" | lag {get('pipeline/lag_mean', '.2f')}/{get('pipeline/lag_max', '.0f')}"
        f" | interrupted {get('sampler/interrupted_frac', '.2f')} truncated {get('sampler/truncated_frac', '.2f')}"
        f" | zv-dropped {get('data/zero_variance_dropped', '.0f')} | dev-h {get('compute/device_hours', '.4f')} | eta {eta}"
    )
