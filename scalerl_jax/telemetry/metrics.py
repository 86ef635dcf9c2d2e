"""Run metrics: one JSON object per step in `WORKDIR/metrics.jsonl`, TensorBoard events in
`WORKDIR/tb`, and the one-line progress report a person watches.

Resuming from a checkpoint cuts `metrics.jsonl` back to the byte offset recorded with that
checkpoint, so the steps replayed after a crash are logged once, not twice. The cut never extends
the file (a crash may have lost its tail) and never keeps a damaged row: it lands at the end of the
last complete row (a line ending in a newline that parses as a JSON object) at or before the
offset. What was dropped is logged and kept in `MetricsWriter.resume_report`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from absl import logging
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


@dataclasses.dataclass(frozen=True)
class ResumeReport:
    """What resuming at a checkpoint's metrics offset kept and dropped from `metrics.jsonl`.

    kept_rows/kept_bytes: the complete rows kept (the file's new length is kept_bytes).
    replayed_steps: steps of complete rows after the offset, logged after the checkpoint was
      written; dropped because the resumed run logs them again.
    damaged_bytes: dropped bytes that were no complete row (a torn write, zero-filled blocks).
    lost_bytes: offset - kept_bytes, bytes the checkpoint counted that are not kept (lost with the
      file's tail or damaged); 0 after a clean stop or crash.
    """

    offset: int
    kept_rows: int
    kept_bytes: int
    replayed_steps: tuple[int, ...]
    damaged_bytes: int
    lost_bytes: int

    @property
    def clean(self) -> bool:
        """True when every row the checkpoint counted was kept and nothing damaged was found."""
        return self.damaged_bytes == 0 and self.lost_bytes == 0


def _complete_row(line: bytes) -> dict | None:
    """The JSON object of one newline-terminated line, or None when it is no complete row."""
    if not line.endswith(b"\n"):
        return None
    try:
        row = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return row if isinstance(row, dict) else None


def plan_resume_cut(data: bytes, offset: int) -> ResumeReport:
    """Where to cut `data` (a metrics.jsonl) for a resume at byte `offset`: the end of the longest run
    of complete rows from the start that ends at or before `offset`; the rest is classified."""
    lines = data.splitlines(keepends=True)
    cut = kept_rows = 0
    for line in lines:
        if cut + len(line) > offset or _complete_row(line) is None:
            break
        cut += len(line)
        kept_rows += 1
    replayed, damaged = [], 0
    for line in data[cut:].splitlines(keepends=True):
        row = _complete_row(line)
        if row is not None and isinstance(row.get("step"), int):
            replayed.append(row["step"])
        else:
            damaged += len(line)
    return ResumeReport(
        offset=offset,
        kept_rows=kept_rows,
        kept_bytes=cut,
        replayed_steps=tuple(replayed),
        damaged_bytes=damaged,
        lost_bytes=offset - cut,
    )


class MetricsWriter:
    """Appends step metrics to JSONL and TensorBoard; `offset()` marks a resumable position.

    With `resume_offset` (the offset saved with the checkpoint being resumed), the existing file is
    cut as the module docstring says and `resume_report` tells what was dropped; without it, an
    existing file is replaced and `resume_report` is None.
    """

    def __init__(self, workdir: str, *, resume_offset: int | None = None):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, METRICS_FILE)
        self.resume_report: ResumeReport | None = None
        if resume_offset is not None:
            self.resume_report = self._cut_for_resume(resume_offset)
        elif os.path.exists(self.path):
            os.remove(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = SummaryWriter(os.path.join(workdir, "tb"))

    def _cut_for_resume(self, offset: int) -> ResumeReport:
        if offset < 0:
            raise ValueError(f"{self.path}: resume offset must be >= 0, got {offset}")
        data = b""
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                data = f.read()
        report = plan_resume_cut(data, offset)
        if len(data) != report.kept_bytes:
            with open(self.path, "r+b") as f:
                f.truncate(report.kept_bytes)
        if report.replayed_steps:
            logging.info(
                "%s: dropped %d row(s) logged after the checkpoint (steps %d-%d, replayed)",
                self.path,
                len(report.replayed_steps),
                report.replayed_steps[0],
                report.replayed_steps[-1],
            )
        if not report.clean:
            logging.warning(
                "%s: the checkpoint counted %d bytes; kept %d complete rows (%d bytes), dropped %d "
                "damaged bytes; %d counted bytes are lost",
                self.path,
                offset,
                report.kept_rows,
                report.kept_bytes,
                report.damaged_bytes,
                report.lost_bytes,
            )
        return report

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes one line `{"step": step, **metrics}` and the numeric values to TensorBoard.

        An OSError (a full disk, a read-only filesystem) names the file: the write to an open file
        that raised it names none."""
        row = {"step": int(step)}
        for key, value in metrics.items():
            row[key] = _to_json_value(value)
        try:
            self._file.write(json.dumps(row, sort_keys=True) + "\n")
            self._file.flush()
        except OSError as error:
            raise OSError(error.errno, f"{error.strerror}: could not write the row of step {step}", self.path) from None
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(tensorboard_tag(key), value, global_step=int(step))

    def offset(self) -> int:
        """Byte length of the JSONL file so far, flushed and fsynced: a checkpoint that records it
        never counts rows that are not on disk."""
        self._file.flush()
        os.fsync(self._file.fileno())
        return self._file.tell()

    def close(self) -> None:
        """Closes metrics.jsonl and the TensorBoard writer. When the filesystem failed (full,
        read-only), their final flush fails too: logged in one line, not raised (the write that
        failed was raised where it happened), and the TensorBoard writer is abandoned."""
        problems = []
        try:
            self._file.close()
        except OSError as error:
            problems.append(f"{self.path}: {error.strerror}")
        try:
            self._tb.close()
        except OSError as error:
            problems.append(f"{self._tb.logdir}: {error.strerror}")
            _abandon(self._tb)
        if problems:
            logging.warning("metrics: could not flush on close: %s", "; ".join(problems))


def _abandon(tb: SummaryWriter) -> None:
    """Stops the event writers of `tb` whose flush failed, without flushing. tensorboardX has no
    call for it: its exit hook would retry the flush (a traceback at exit) and its writer thread
    would die on the queue closed under it (another)."""
    for writer in (tb.all_writers or {}).values():
        events = getattr(writer, "event_writer", None)  # none in a writer that does not write
        if events is None or events._closed:
            continue
        if events._worker is not None:
            events._worker.stop()
        if events._event_queue is not None:
            events._event_queue.close()
        events._closed = True


def format_progress(
    step: int,
    num_steps: int,
    metrics: Mapping[str, Any],
    eta_s: float | None,
    last_eval: tuple[int, float] | None = None,
) -> str:
    """The per-step progress line: step, pass rate, reward, loss and policy entropy, response length
    (mean/max completion tokens), tokens/s, lag, length control, compute, ETA; '-' for a missing
    number. Once the reward has failed on a training item (`data/reward_*` of `REWARD_FAILURE_KEYS`
    above 0), the run's count of those items ends the line; a step in whose completions no answer
    style found an answer (`data/step_answer_found_frac` = 0) says so, with the run's count of such
    steps (`data/steps_without_answers`).

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
        (
            f"step {step}/{num_steps} | pass {pass_rate} | reward {get('train/reward_mean', '+.3f')}"
            f" | loss {get('train/loss', '+.4f')} ent {get('train/entropy', '.3f')}"
            f" | len {get('train/completion_len_mean', '.0f')}/{get('train/completion_len_max', '.0f')}"
            f" | tok/s {get('sampler/tokens_per_s', '.0f')}"
            f" | lag {get('pipeline/lag_mean', '.2f')}/{get('pipeline/lag_max', '.0f')}"
            f" | interrupted {get('sampler/interrupted_frac', '.2f')} truncated {get('sampler/truncated_frac', '.2f')}"
            f" | zv-dropped {get('data/zero_variance_dropped', '.0f')} | dev-h {get('compute/device_hours', '.4f')} | eta {eta}"
        )
        + _reward_failures(metrics)
        + _no_answers(metrics)
    )


# The training items the reward failed on (scalerl_jax.data.rewards.FAILURE_METRICS under `data/`).
REWARD_FAILURE_KEYS = ("data/reward_errors", "data/reward_timeouts", "data/reward_crashes", "data/reward_unparsable")


def _no_answers(metrics: Mapping[str, Any]) -> str:
    if metrics.get("data/step_answer_found_frac") != 0:
        return ""
    steps = int(metrics.get("data/steps_without_answers") or 0)
    return (
        " | no answer found in any completion of this step by data.answer_extraction's styles"
        f" ({steps} such step{'s' if steps != 1 else ''} so far)"
    )


def _reward_failures(metrics: Mapping[str, Any]) -> str:
    failures = sum(int(metrics.get(key) or 0) for key in REWARD_FAILURE_KEYS)
    return f" | reward failures {failures}" if failures else ""
