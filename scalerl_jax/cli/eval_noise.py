"""`python -m scalerl_jax.cli.eval_noise STUDY/VARIANT` (`scalerl eval-noise`): how much of a study's
scatter is evaluation noise, from one run evaluated at N prompts x K samples read as disjoint
replicas of N x s (`scalerl_jax.study.eval_noise` defines every column)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from scalerl_jax.cli.errors import EXIT_INPUT_ERROR, report_error
from scalerl_jax.study import eval_noise
from scalerl_jax.study import report as study_report
from scalerl_jax.study.analysis import parse_fractions


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m scalerl_jax.cli.eval_noise STUDY/VARIANT [--sizes 2,4,8] [--fit-ends ...]`:
    prints the table (and writes it to --out); exit 2 with one line on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m scalerl_jax.cli.eval_noise", description=(eval_noise.__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("variant_dir", help="a study variant's directory, holding seed<k>/ runs")
    parser.add_argument("--sizes", help="samples per prompt to compare, dividing the runs' K (default: every divisor)")
    parser.add_argument("--fit-ends", default="0.25,0.5,0.75", help="fit-window ends, fractions of C_end")
    parser.add_argument("--fit-start-fraction", type=float, help="fit start as a fraction of C_end (default: `fit`'s)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    try:
        variant_dir = Path(args.variant_dir)
        seeds = sorted(p for p in variant_dir.glob("seed*") if p.is_dir()) if variant_dir.is_dir() else []
        if not seeds:
            raise ValueError(f"{variant_dir}: no seed<k>/ run directories")
        runs = [eval_noise.load_run(seed) for seed in seeds]
        shapes = {run.correct.shape[1:] for run in runs}
        if len(shapes) != 1:
            raise ValueError(f"{variant_dir}: the runs evaluated different N x K: {sorted(shapes)}")
        num_prompts, num_samples = shapes.pop()
        if args.sizes:
            try:
                sizes = sorted({int(x) for x in args.sizes.split(",")})
            except ValueError:  # not integers
                raise ValueError(f"--sizes must be comma-separated integers, got {args.sizes!r}") from None
        else:
            sizes = [s for s in range(1, num_samples + 1) if num_samples % s == 0]
        fit_ends = parse_fractions(args.fit_ends, "--fit-ends")
        a_range = study_report.study_a_range(variant_dir, {variant_dir.name: [run.curve for run in runs]})
        results = [
            eval_noise.analyze_size(
                runs, size, fit_end=end, fit_start_fraction=args.fit_start_fraction, a_range=a_range
            )
            for end in fit_ends
            for size in sizes
        ]
    except ValueError as error:
        return report_error(f"error: {error}", EXIT_INPUT_ERROR)
    text = "\n\n".join(
        [
            f"# Evaluation noise: {variant_dir}",
            f"{len(runs)} runs evaluated on {num_prompts} prompts x {num_samples} samples, each read as disjoint "
            f"replicas of {num_prompts} x s samples (`python -m scalerl_jax.cli.eval_noise`; the module docstring "
            "defines every column). Fit windows start at "
            + ("the `fit` convention" if args.fit_start_fraction is None else f"{args.fit_start_fraction:g} C_end")
            + f"; A grid {a_range[0]:g}..{a_range[1]:g}.",
            eval_noise.report_table(results, num_prompts),
        ]
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
