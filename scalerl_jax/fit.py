"""Fit ScaleRL sigmoids to training runs: ``python -m scalerl_jax.fit RUN [RUN ...]``.

Each RUN is a run directory (holding metrics.jsonl) or a .jsonl path. Prints one table row per
run (R0, A with its bootstrap interval, B, C_mid, fit window, points used, extrapolation error
on held-out points, the power-law comparison, reliability), the computes at which fitted
curves cross, and optionally writes a plot (``--plot out.png``).

Exit status: 0 when every run was fitted, 1 when some run could not be fitted (its row says
why), 2 on bad input: unreadable metrics (the message names the file and line), a numeric flag
out of range (argparse names the flag and the allowed range), or a plot path that cannot be
written (checked before fitting).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Sequence

import numpy as np
from matplotlib.backend_bases import FigureCanvasBase

from scalerl_jax.cli_errors import EXIT_INPUT_ERROR, report_error
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
from scalerl_jax.scaling.fitting import METHODS, PAPER_A_RANGE
from scalerl_jax.scaling.plot import DEFAULT_EXTEND, format_compute, unit_label
from scalerl_jax.scaling.runs import METRICS_FILENAME

LEADER_PROBE_FACTOR = 1.01  # which curve leads is read 1% past a crossing
RUN_CONFIG_FILENAME = "config.json"  # a run directory's config, written by scalerl_jax.main


def _checked(kind: type, accept: Callable[[float], bool], allowed: str) -> Callable[[str], float]:
    """An argparse `type`: `kind(text)` when it is finite and `accept`s, else an error naming `allowed`."""
    noun = "an integer" if kind is int else "a finite number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun} {allowed}, got {text!r}") from None
        if not (math.isfinite(value) and accept(value)):
            raise argparse.ArgumentTypeError(f"expected {noun} {allowed}, got {text!r}")
        return value

    return parse


def _a_range(text: str) -> tuple[float, float]:
    """`LO,HI` with 0 <= LO <= HI <= 1."""
    parts = text.split(",")
    try:
        low, high = (float(part) for part in parts) if len(parts) == 2 else (math.nan, math.nan)
    except ValueError:
        low = high = math.nan
    if not 0.0 <= low <= high <= 1.0:  # False for NaN
        raise argparse.ArgumentTypeError(f"expected LO,HI with 0 <= LO <= HI <= 1, got {text!r}")
    return low, high


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


DEFAULTS = FitOptions()


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(prog="python -m scalerl_jax.fit", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (with metrics.jsonl) or .jsonl files")
    parser.add_argument("--names", help="comma-separated run names (default: directory names)")
    parser.add_argument(
        "--fit-start",
        type=_checked(float, lambda x: x >= 0, ">= 0"),
        help="first fitted compute (default: 1,500 GPU-hours; other units: 0.09375 x largest fitted compute)",
    )
    parser.add_argument(
        "--fit-end",
        type=_checked(float, lambda x: x > 0, "> 0"),
        help="last fitted compute; later points are held out and scored",
    )
    parser.add_argument("--method", choices=METHODS, default=DEFAULTS.method)
    parser.add_argument(
        "--unit",
        help="compute unit (default: as logged, else device_hours); 'gpu_hours' selects the paper's grids",
    )
    parser.add_argument(
        "--r0",
        type=_checked(float, lambda x: 0 <= x <= 1, "in [0, 1]"),
        help="start pass rate (default: the one at the smallest compute)",
    )
    parser.add_argument(
        "--a-range",
        type=_a_range,
        default=DEFAULTS.a_range,
        help="A grid LO,HI (default: a run directory's eval.fit_a_range from its config.json, else 0.45,0.8)",
    )
    parser.add_argument(
        "--bootstrap",
        type=_checked(int, lambda x: x >= 0, ">= 0"),
        default=DEFAULTS.bootstrap,
        help="bootstrap resamples for the A interval (0: none)",
    )
    parser.add_argument(
        "--level",
        type=_checked(float, lambda x: 0 < x < 1, "in (0, 1)"),
        default=DEFAULTS.level,
        help="bootstrap percentile interval level, e.g. 0.95",
    )
    parser.add_argument(
        "--seed", type=_checked(int, lambda x: x >= 0, ">= 0"), default=DEFAULTS.seed, help="bootstrap seed"
    )
    parser.add_argument("--plot", help="write the figure here (e.g. out.png)")
    parser.add_argument("--title", help="figure title")
    parser.add_argument(
        "--extend",
        type=_checked(float, lambda x: x >= 1, ">= 1"),
        default=DEFAULTS.extend,
        help="plot up to this factor x the largest compute",
    )
    parser.add_argument(
        "--allow-partial-last-line", action="store_true", help="skip a half-written last line (live runs)"
    )
    return parser


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fit_start is not None and args.fit_end is not None and args.fit_end <= args.fit_start:
        parser.error(f"--fit-end {args.fit_end} must exceed --fit-start {args.fit_start}")
    fields = {f.name for f in dataclasses.fields(FitOptions)} - {"names"}
    options = FitOptions(
        names=tuple(args.names.split(",")) if args.names else None, **{name: getattr(args, name) for name in fields}
    )
    return report(args.runs, options)


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
    the figure; returns the exit status (module docstring)."""
    if options.plot and (problem := plot_path_problem(options.plot)):
        print(f"error: cannot write the plot to {options.plot}: {problem}", file=sys.stderr)
        return 2
    try:
        runs = read_runs(
            paths,
            names=list(options.names) if options.names else None,
            unit=options.unit,
            allow_partial_last_line=options.allow_partial_last_line,
        )
    except UnicodeDecodeError as error:  # names neither file nor line: find them
        return report_error(f"error: {undecodable_metrics(paths) or error}", EXIT_INPUT_ERROR)
    except ValueError as error:
        return report_error(f"error: {error}", EXIT_INPUT_ERROR)
    if options.a_range is None:
        try:
            ranges = {run.name: run_a_range(run.path) for run in runs}
        except ValueError as error:
            return report_error(f"error: {error}", EXIT_INPUT_ERROR)
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


if __name__ == "__main__":
    sys.exit(main())
