"""Run a study, then analyze it; or analyze an existing study directory.

  python -m scalerl_jax.cli.study --config=configs/tiny.py --variants=baseline,dapo,no_fp32_head,ppo_off_policy,sample_avg \
      --seeds=3 --workdir=studies/tiny [--config.key=value ...]
  python -m scalerl_jax.cli.study --analyze studies/tiny

Variants: 'baseline' (the --config as given) or names of config.recipes.LEAVE_ONE_OUT applied on top of
it; 'loo' is the baseline and every leave-one-out variant. `--config.key=value` flags go to every
run (after the variant's change). Each (variant, seed) runs as `python -m scalerl_jax.main` in
WORKDIR/<variant>/seed<k> (`driver`), then the analysis (`analysis`, `report`) prints its tables
and writes WORKDIR/study.md, curves.png, params.png and extrapolation.png.

Fit windows: each curve is fitted from fit_start (the `fit` convention, or --fit-start-fraction x
C_end) to --cut x C_end for the detailed tables and figures, and to each of --fit-ends x C_end
(default: the --cut alone) for the comparison of fit-window ends, sigmoid against power law.

Exit status: 0 done; 1 a run failed or was refused (its workdir in use; the same command resumes)
or a curve could not be fitted; 2 bad input (flags, study directory, metrics files), with one line
naming it (`SCALERL_DEBUG=1` prints the traceback too); 143 / 130 stopped by SIGTERM / SIGINT,
passed on to the running run (`driver`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from scalerl_jax.cli.errors import EXIT_INPUT_ERROR, report_error
from scalerl_jax.config.argv import line_in_file
from scalerl_jax.config.variants import expand_variants
from scalerl_jax.scaling.runs import PASS_RATE_KEY
from scalerl_jax.study import driver, report
from scalerl_jax.study.analysis import (
    DEFAULT_CUT_FRACTION,
    FitEndResult,
    VariantResult,
    analyze_variant,
    pair_orders,
    parse_fractions,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scalerl_jax.cli.study", description=(__doc__ or "").split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--config", help="base config file ('file.py' or 'file.py:arg'), as main's --config")
    parser.add_argument("--variants", default="baseline", help="comma-separated: baseline, leave-one-out names, loo")
    parser.add_argument("--seeds", type=int, default=1, help="runs per variant (config.seed = 0 .. seeds-1)")
    parser.add_argument("--workdir", help="the study directory")
    parser.add_argument("--analyze", metavar="DIR", help="only analyze this study directory")
    parser.add_argument(
        "--cut",
        type=float,
        default=DEFAULT_CUT_FRACTION,
        help="fit up to this fraction of each curve's last compute (default 0.5)",
    )
    parser.add_argument(
        "--fit-ends",
        help="comma-separated fit-window ends (fractions of each curve's last compute) to compare, e.g. "
        "0.25,0.5,0.75 (default: --cut)",
    )
    parser.add_argument(
        "--fit-start-fraction",
        type=float,
        help="fit from this fraction of each curve's last compute (default: the `fit` convention, 0.09375)",
    )
    parser.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples per variant fit (0: none)")
    parser.add_argument("--a-range", help="A grid LO,HI (default: the runs' eval.fit_a_range)")
    parser.add_argument(
        "--metric",
        default=PASS_RATE_KEY,
        help="the curve to fit: eval/pass_rate, or one domain's of a math+code study (eval/code/pass_rate: "
        "its report goes to DIR/eval_code_pass_rate/)",
    )
    return parser


def analyze(
    study_dir: Path,
    *,
    cut_fraction: float,
    fit_ends: Sequence[float] | None = None,
    fit_start_fraction: float | None = None,
    bootstrap: int,
    a_range: tuple[float, float] | None,
    metric: str = PASS_RATE_KEY,
) -> int:
    """Fits, prints and writes the study's report (of `metric`'s curves: the default's into
    `study_dir`, another's into a directory named after it there); 1 when some variant curve
    could not be fitted (at the cut or at a fit end)."""
    runs = report.read_study(study_dir, metric=metric)
    out_dir = study_dir if metric == PASS_RATE_KEY else study_dir / metric.replace("/", "_")
    a_range = a_range or report.study_a_range(study_dir, runs)

    def analyze_at(fit_end: float, bootstrap: int) -> list[VariantResult]:
        return [
            analyze_variant(
                name,
                curves,
                cut_fraction=fit_end,
                fit_start_fraction=fit_start_fraction,
                a_range=a_range,
                bootstrap=bootstrap,
            )
            for name, curves in runs.items()
        ]

    results = analyze_at(cut_fraction, bootstrap)
    # The fit-end comparison reads the per-seed fits and the mean-curve fits, not their bootstrap.
    sweep = [
        FitEndResult(end, tuple(results if end == cut_fraction else analyze_at(end, 0)))
        for end in (fit_ends or [cut_fraction])
    ]
    text = report.write_report(
        study_dir,
        results,
        pair_orders(results),
        sweep,
        cut_fraction=cut_fraction,
        fit_start_fraction=fit_start_fraction,
        a_range=a_range,
        bootstrap=bootstrap,
        out_dir=out_dir,
    )
    print(text)
    figures = (report.CURVES_FIGURE, report.PARAMS_FIGURE, report.EXTRAPOLATION_FIGURE)
    print(f"wrote {out_dir / report.REPORT_FILE}, " + ", ".join(str(out_dir / f) for f in figures))
    fitted = all(v.mean_fit.fit is not None for end in sweep for v in end.variants)
    return 0 if fitted and all(r.mean_fit.fit is not None for r in results) else 1


def _a_range(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:  # not two numbers
        raise ValueError(f"--a-range must be LO,HI with 0 <= LO <= HI <= 1, got {text!r}") from None
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"--a-range must be LO,HI with 0 <= LO <= HI <= 1, got {text!r}")
    return low, high


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    try:
        if not 0.0 < args.cut < 1.0:
            raise ValueError(f"--cut must be in (0, 1), got {args.cut}")
        if args.bootstrap < 0:
            raise ValueError(f"--bootstrap must be >= 0, got {args.bootstrap}")
        a_range = _a_range(args.a_range)
        fit_ends = None if args.fit_ends is None else parse_fractions(args.fit_ends, "--fit-ends")
        lowest_end = min([args.cut, *(fit_ends or [])])
        if args.fit_start_fraction is not None and not 0.0 < args.fit_start_fraction < lowest_end:
            raise ValueError(
                f"--fit-start-fraction must be in (0, {lowest_end:g}) (below --cut and every --fit-ends), "
                f"got {args.fit_start_fraction}"
            )
        if args.analyze:
            if overrides or args.config or args.workdir:
                raise ValueError("--analyze DIR takes no --config, --workdir or config overrides")
            study_dir = Path(args.analyze)
        else:
            if not args.config or not args.workdir:
                raise ValueError("a study needs --config and --workdir (or --analyze DIR)")
            if args.seeds < 1:
                raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
            study = driver.StudySpec(
                study_dir=Path(args.workdir).absolute(),
                base=driver.absolute_base(args.config),
                variants=tuple(expand_variants(args.variants)),
                num_seeds=args.seeds,
                overrides=driver.check_overrides(overrides, base=args.config),
            )
            status = driver.run_study(study)
            if status != 0:
                return status
            study_dir = study.study_dir
        return analyze(
            study_dir,
            cut_fraction=args.cut,
            fit_ends=fit_ends,
            fit_start_fraction=args.fit_start_fraction,
            bootstrap=args.bootstrap,
            a_range=a_range,
            metric=args.metric,
        )
    except ValueError as error:
        return report_error(f"error: {error}", EXIT_INPUT_ERROR)
    except (KeyError, AttributeError, TypeError) as error:  # only when the base config file raised it
        base = (args.config or "").partition(":")[0]
        line = line_in_file(error, base) if base else None
        if line is None:
            raise
        message = f"error: --config {base}: get_config() raised {type(error).__name__}: {error} (line {line})"
        return report_error(message, EXIT_INPUT_ERROR)
    except SyntaxError as error:  # the base config file is not Python
        where = f"{error.filename}, line {error.lineno}" if error.lineno else error.filename
        return report_error(f"error: --config {where}: {error.msg} (expected a Python file)", EXIT_INPUT_ERROR)


if __name__ == "__main__":
    sys.exit(main())
