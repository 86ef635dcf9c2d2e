"""The fit report of training runs: each run's sigmoid (with a bootstrap interval on A), its
extrapolation error on held-out points, the power law beside it, the computes where fitted curves
cross, and a figure. `scalerl_jax.cli.fit` is its command line; a run reports on its own workdir.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys
from collections.abc import Sequence

import numpy as np
from matplotlib.backend_bases import FigureCanvasBase

from scalerl_jax.scaling import (
    PAPER_A_RUN_TO_RUN,
    BootstrapIntervals,
    ExtrapolationError,
    PlotSeries,
    PowerLawFit,
    RunCurve,
    SigmoidFit,
    bootstrap_sigmoid,
    crossing_computes,
    extrapolation_error,
    fit_power_law,
    fit_sigmoid,
    plot_scaling,
    read_runs,
)
from scalerl_jax.scaling.fitting import PAPER_A_RANGE
from scalerl_jax.scaling.plot import DEFAULT_EXTEND, format_compute, unit_label
from scalerl_jax.scaling.runs import METRICS_FILENAME, PASS_RATE_KEY


class FitInputError(ValueError):
    """Runs that cannot be fitted as given: unreadable metrics or a malformed run config."""


LEADER_PROBE_FACTOR = 1.01  # which curve leads is read 1% past a crossing
RUN_CONFIG_FILENAME = "config.json"  # a run directory's config, written by scalerl_jax.main


def plot_path_problem(path: str) -> str | None:
    """Why the figure cannot be written to `path` (missing or read-only directory, unknown format), or None."""
    directory = os.path.dirname(os.path.abspath(path))
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if not os.path.isdir(directory):
        return f"directory {directory} does not exist"
    if os.path.isdir(path):
        return "it is a directory"
    if not os.access(directory, os.W_OK):
        return f"directory {directory} is not writable"
    if suffix and suffix not in formats:
        return f"unknown image format {suffix!r} (one of {', '.join(sorted(formats))})"
    return None


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """How runs are fitted and reported (the command line's flags, module docstring)."""

    names: tuple[str, ...] | None = None  # run names (default: directory names)
    fit_start: float | None = None
    fit_end: float | None = None
    method: str = "grid"
    unit: str | None = None
    r0: float | None = None
    a_range: tuple[float, float] | None = None  # None: each run's own (`run_a_range`), else the paper's
    bootstrap: int = 200
    level: float = 0.95
    seed: int = 0
    plot: str | None = None
    title: str | None = None
    extend: float = DEFAULT_EXTEND
    allow_partial_last_line: bool = False
    metric: str = PASS_RATE_KEY  # the curve: eval/pass_rate, or a domain's (eval/code/pass_rate)


DEFAULTS = FitOptions()


@dataclasses.dataclass(frozen=True)
class RunReport:
    """Everything the table and plot show for one run."""

    run: RunCurve
    fit: SigmoidFit | None = None
    interval: BootstrapIntervals | None = None
    extrapolation: ExtrapolationError | None = None
    power_law: PowerLawFit | None = None
    power_law_extrapolation: ExtrapolationError | None = None
    error: str = ""
    notes: tuple[str, ...] = ()


def run_a_range(path: str) -> tuple[float, float] | None:
    """The A grid a run fitted its own curve with: `eval.fit_a_range` of the `config.json` (written
    by `scalerl_jax.main`) beside the run's metrics (`path`: the run directory or its metrics
    file); None when there is no such file or key (e.g. a bare metrics file). ValueError naming the
    file when it is not JSON or the range is not 0 <= LO < HI <= 1."""
    directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    config_file = os.path.join(directory, RUN_CONFIG_FILENAME)
    if not os.path.isfile(config_file):
        return None
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file}: cannot read the run's config ({e})") from e
    value = config.get("eval", {}).get("fit_a_range") if isinstance(config, dict) else None
    if value is None:
        return None
    try:
        low, high = (float(x) for x in value)
    except (TypeError, ValueError):
        low = high = math.nan
    if not 0.0 <= low < high <= 1.0:  # False for NaN
        raise ValueError(f"{config_file}: eval.fit_a_range = {value!r}; expected [LO, HI] with 0 <= LO < HI <= 1")
    return low, high


def fit_run(run: RunCurve, options: FitOptions) -> RunReport:
    """Sigmoid fit, bootstrap interval, power-law comparison and extrapolation errors of a run,
    its A grid `options.a_range`, else the run's own (`run_a_range`), else the paper's."""
    start, end, name = options.fit_start, options.fit_end, f"run {run.name!r}"
    try:
        fit = fit_sigmoid(
            run.compute,
            run.pass_rate,
            r0=options.r0,
            method=options.method,
            a_range=options.a_range or run_a_range(run.path) or PAPER_A_RANGE,
            fit_start=start,
            fit_end=end,
            unit=run.unit,
            name=name,
        )
    except ValueError as error:
        return RunReport(run=run, error=str(error))
    interval, notes = None, ()
    if options.bootstrap > 0:
        try:
            interval = bootstrap_sigmoid(
                run.compute, run.pass_rate, fit, num_samples=options.bootstrap, level=options.level, seed=options.seed
            )
        except ValueError as error:
            notes = (f"no bootstrap: {error}",)
    power = fit_power_law(run.compute, run.pass_rate, fit_start=start, fit_end=end, unit=run.unit, name=name)
    return RunReport(
        run=run,
        fit=fit,
        interval=interval,
        extrapolation=extrapolation_error(fit, run.compute, run.pass_rate),
        power_law=power,
        power_law_extrapolation=extrapolation_error(power, run.compute, run.pass_rate),
        notes=notes,
    )


def _mae_text(error: ExtrapolationError | None) -> str:
    if error is None or error.num_points == 0:
        return "-"
    return f"{error.mae:.4f} (n={error.num_points})"


def table_rows(reports: Sequence[RunReport]) -> list[list[str]]:
    """Header plus one row of strings per run."""
    rows = [
        [
            "run",
            "unit",
            "R0",
            "A",
            "±A",
            "B",
            "C_mid",
            "fit window",
            "points",
            "extrap MAE",
            "power-law A",
            "power-law MAE",
            "status",
        ]
    ]
    for r in reports:
        if r.fit is None:
            rows.append([r.run.name, r.run.unit] + ["-"] * 10 + [f"NO FIT: {r.error}"])
            continue
        f, power = r.fit, r.power_law
        assert power is not None, "fit_run fits the power law whenever the sigmoid fits"
        end = format_compute(f.fit_end) if f.fit_end is not None else "end"
        status = "; ".join(("ok" if f.reliable else "UNRELIABLE: " + "; ".join(f.warnings),) + r.notes)
        rows.append(
            [
                r.run.name,
                f.unit,
                f"{f.r0:.3f}",
                f"{f.a:.3f}",
                f"{r.interval.a_half_width:.3f}" if r.interval else "-",
                f"{f.b:.2f}",
                format_compute(f.c_mid),
                f"[{format_compute(f.fit_start)}, {end}]",
                f"{f.num_points} (-{f.num_before_start} before, -{f.num_after_end} after)",
                _mae_text(r.extrapolation),
                f"{power.a:.3f}",
                _mae_text(r.power_law_extrapolation),
                status,
            ]
        )
    return rows


def format_table(rows: list[list[str]]) -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1] for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def crossing_lines(reports: Sequence[RunReport], extend: float) -> list[str]:
    """One line per crossing of two fitted curves (same unit) over the plotted compute range."""
    lines = []
    fitted = [(r.run, r.fit) for r in reports if r.fit is not None]
    for (first, first_fit), (second, second_fit) in itertools.combinations(fitted, 2):
        if first_fit.unit != second_fit.unit:
            lines.append(f"{first.name} and {second.name}: different units, not compared")
            continue
        c = np.concatenate([first.compute, second.compute])
        c_lo, c_hi = float(c[c > 0].min()), float(c.max()) * extend
        points = crossing_computes(first_fit.predict, second_fit.predict, c_lo=c_lo, c_hi=c_hi)
        if not points:
            span = f"[{format_compute(c_lo)}, {format_compute(c_hi)}]"
            lines.append(f"{first.name} and {second.name}: no crossing in {span}")
        for point in points:
            after = point * LEADER_PROBE_FACTOR
            leader, other = (first, second) if first_fit.predict(after) > second_fit.predict(after) else (second, first)
            where = f"C = {format_compute(point)} {unit_label(first_fit.unit)}"
            rate = float(first_fit.predict(point))
            lines.append(f"{leader.name} overtakes {other.name} at {where} (pass rate {rate:.3f})")
    return lines


def undecodable_metrics(paths: Sequence[str]) -> str | None:
    """'FILE line N: not UTF-8 text ...' for the first of `paths` (run directories or metrics
    files) that is not UTF-8, or None when each decodes."""
    for path in paths:
        file = os.path.join(path, METRICS_FILENAME) if os.path.isdir(path) else path
        try:
            with open(file, "rb") as f:
                data = f.read()
        except OSError:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            return f"{file} line {line}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); expected JSON lines"
    return None


def report(paths: Sequence[str], options: FitOptions) -> int:
    """Fits the runs at `paths` and prints the table, the crossings and, with `options.plot`, writes
    the figure. Returns 0 when every run was fitted, 1 when some run could not be (its row says
    why), 2 when the plot cannot be written; raises `FitInputError` for metrics that cannot be read
    (naming the file and line) or a run's malformed `eval.fit_a_range`."""
    if options.plot and (problem := plot_path_problem(options.plot)):
        print(f"error: cannot write the plot to {options.plot}: {problem}", file=sys.stderr)
        return 2
    try:
        runs = read_runs(
            paths,
            names=list(options.names) if options.names else None,
            unit=options.unit,
            allow_partial_last_line=options.allow_partial_last_line,
            pass_rate_key=options.metric,
        )
    except UnicodeDecodeError as error:  # names neither file nor line: find them
        raise FitInputError(undecodable_metrics(paths) or str(error)) from error
    except ValueError as error:
        raise FitInputError(str(error)) from error
    if options.a_range is None:
        try:
            ranges = {run.name: run_a_range(run.path) for run in runs}
        except ValueError as error:
            raise FitInputError(str(error)) from error
        for run_name, a_range in ranges.items():
            if a_range is not None:
                print(
                    f"{run_name}: A grid [{a_range[0]:g}, {a_range[1]:g}] from the run's config.json (eval.fit_a_range)"
                )
    reports = [fit_run(run, options) for run in runs]
    print(format_table(table_rows(reports)))
    if options.bootstrap > 0:
        skipped = sum(r.interval.num_skipped for r in reports if r.interval is not None)
        print(
            f"±A: half-width of the {options.level:.0%} bootstrap percentile interval over the fitted points "
            f"({options.bootstrap} resamples per run, {skipped} unfittable skipped); "
            f"the paper's run-to-run spread of A is about ±{PAPER_A_RUN_TO_RUN}."
        )
    for run in runs:
        if run.num_skipped_lines:
            print(f"{run.name}: skipped {run.num_skipped_lines} half-written last line")
    for line in crossing_lines(reports, options.extend):
        print(line)
    if options.plot:
        units = {r.run.unit for r in reports}
        if len(units) != 1:
            print(
                f"error: cannot plot runs with different compute units {sorted(units)}; pass --unit",
                file=sys.stderr,
            )
            return 2
        series = [
            PlotSeries(r.run.name, r.run.compute, r.run.pass_rate, fit=r.fit, interval=r.interval) for r in reports
        ]
        try:
            path = plot_scaling(series, options.plot, unit=units.pop(), title=options.title, extend=options.extend)
        except OSError as error:
            print(f"error: cannot write the plot to {options.plot}: {error.strerror or error}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
    return 0 if all(r.fit is not None for r in reports) else 1
