"""Read compute-vs-pass-rate curves from training runs' ``metrics.jsonl``.

A run is a directory holding ``metrics.jsonl`` or the path of a ``.jsonl`` file: one JSON
object per line. Lines with ``eval/pass_rate`` are eval points and must also carry
``compute/device_hours`` and ``step``; lines without it are training steps (counted, not
used). The compute unit is, in order: the caller's ``unit``, else the ``compute/unit`` string
the run logged (every line that has it must agree), else 'device_hours'.

Every problem is a ValueError naming the file and the 1-based line: an empty line, malformed
JSON, a line that is not an object, a missing or non-numeric key, inconsistent units, compute
that is NaN, negative or not increasing, a pass rate outside [0, 1], no eval line at all. One
exception, only when asked (``allow_partial_last_line``): a run still being written can end in
a half-written line without its newline; it is then skipped and counted in
``num_skipped_lines``.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from scalerl_jax.scaling.fitting import check_curve, normalize_unit

COMPUTE_KEY = "compute/device_hours"
PASS_RATE_KEY = "eval/pass_rate"
STEP_KEY = "step"
UNIT_KEY = "compute/unit"
METRICS_FILENAME = "metrics.jsonl"
DEFAULT_UNIT = "device_hours"


@dataclasses.dataclass(frozen=True)
class RunCurve:
    """The eval points of one run, in file order, with where they came from."""

    name: str
    path: str
    unit: str
    steps: np.ndarray
    compute: np.ndarray
    pass_rate: np.ndarray
    lines: tuple[int, ...]
    num_train_lines: int
    num_skipped_lines: int


def metrics_path(path: str | Path) -> Path:
    """``path`` itself if it is a file, ``path/metrics.jsonl`` if it is a directory."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILENAME
    if not path.is_file():
        raise ValueError(f"{path}: no such metrics file")
    return path


def default_run_name(path: Path) -> str:
    """The run directory's name for ``.../RUN/metrics.jsonl``, else the file name's stem."""
    return path.parent.name if path.name == METRICS_FILENAME else path.stem


def _number(record: dict, key: str, where: str) -> float:
    value = record.get(key)
    if value is None:
        raise ValueError(f"{where}: missing {key!r}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{where}: {key!r} must be a number, got {value!r}")
    return float(value)


def read_run(
    path: str | Path,
    *,
    name: str | None = None,
    unit: str | None = None,
    compute_key: str = COMPUTE_KEY,
    pass_rate_key: str = PASS_RATE_KEY,
    step_key: str = STEP_KEY,
    unit_key: str = UNIT_KEY,
    allow_partial_last_line: bool = False,
) -> RunCurve:
    """Read one run's eval points (module docstring for the format and the errors)."""
    file = metrics_path(path)
    name = name or default_run_name(file)
    text = file.read_text(encoding="utf-8")
    raw_lines = text.splitlines()
    ends_with_newline = text.endswith(("\n", "\r"))
    steps, compute, pass_rate, line_numbers = [], [], [], []
    logged_unit: tuple[str, int] | None = None
    num_train_lines = num_skipped_lines = 0
    for number, line in enumerate(raw_lines, start=1):
        where = f"{file} line {number}"
        if not line.strip():
            raise ValueError(f"{where}: empty line")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if allow_partial_last_line and number == len(raw_lines) and not ends_with_newline:
                num_skipped_lines += 1
                continue
            raise ValueError(f"{where}: malformed JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if unit_key in record:
            line_unit = record[unit_key]
            if not isinstance(line_unit, str):
                raise ValueError(f"{where}: {unit_key!r} must be a string, got {line_unit!r}")
            if logged_unit is None:
                logged_unit = (normalize_unit(line_unit), number)
            elif normalize_unit(line_unit) != logged_unit[0]:
                raise ValueError(
                    f"{where}: {unit_key!r} is {line_unit!r} but line {logged_unit[1]} has {logged_unit[0]!r}"
                )
        if pass_rate_key not in record:
            num_train_lines += 1
            continue
        pass_rate.append(_number(record, pass_rate_key, where))
        compute.append(_number(record, compute_key, where))
        step = _number(record, step_key, where)
        if step != int(step):
            raise ValueError(f"{where}: {step_key!r} must be an integer, got {step!r}")
        steps.append(int(step))
        line_numbers.append(number)
    if not pass_rate:
        raise ValueError(f"{file}: no line has {pass_rate_key!r} ({num_train_lines} training lines)")
    labels = [f"{file} line {n}" for n in line_numbers]
    c, y = check_curve(compute, pass_rate, name=f"run {name!r}", labels=labels)
    if unit is not None:
        resolved_unit = normalize_unit(unit)
    elif logged_unit is not None:
        resolved_unit = logged_unit[0]
    else:
        resolved_unit = DEFAULT_UNIT
    return RunCurve(
        name=name,
        path=str(file),
        unit=resolved_unit,
        steps=np.asarray(steps, dtype=np.int64),
        compute=c,
        pass_rate=y,
        lines=tuple(line_numbers),
        num_train_lines=num_train_lines,
        num_skipped_lines=num_skipped_lines,
    )


def read_runs(paths: Sequence[str | Path], *, names: Sequence[str] | None = None, **kwargs) -> list[RunCurve]:
    """``read_run`` for each path; run names must be unique (pass ``names`` to disambiguate)."""
    if names is not None and len(names) != len(paths):
        raise ValueError(f"{len(names)} names for {len(paths)} runs")
    runs = [read_run(p, name=names[i] if names else None, **kwargs) for i, p in enumerate(paths)]
    seen: dict[str, str] = {}
    for run in runs:
        if run.name in seen:
            raise ValueError(f"runs {seen[run.name]} and {run.path} are both named {run.name!r}; give distinct names")
        seen[run.name] = run.path
    return runs
