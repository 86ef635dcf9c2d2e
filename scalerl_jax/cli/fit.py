"""Fit ScaleRL sigmoids to training runs: ``python -m scalerl_jax.cli.fit RUN [RUN ...]``.

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
import math
import sys
from collections.abc import Callable, Sequence

from scalerl_jax.cli.errors import EXIT_INPUT_ERROR, report_error
from scalerl_jax.scaling.fitting import METHODS
from scalerl_jax.scaling.report import DEFAULTS, FitInputError, FitOptions, report


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


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(prog="python -m scalerl_jax.cli.fit", description=(__doc__ or "").split("\n\n")[0])
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
    parser.add_argument(
        "--metric",
        default=DEFAULTS.metric,
        help="the pass-rate curve to fit: eval/pass_rate, or one domain's of a math+code run (eval/code/pass_rate)",
    )
    return parser


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
    try:
        return report(args.runs, options)
    except FitInputError as error:
        return report_error(f"error: {error}", EXIT_INPUT_ERROR)


if __name__ == "__main__":
    sys.exit(main())
