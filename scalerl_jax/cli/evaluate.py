"""Evaluate a policy on a local benchmark file with the training sampler and verifier:
``python -m scalerl_jax.cli.evaluate --checkpoint DIR_OR_RUN --data FILE [--samples 16] [--k 1,4,16]
[--split test] [--problems START:END]
[--problem-field question] [--answer-field answer] [--group-field level] [--out results.json]
[--config.KEY=VALUE ...]``.

DIR_OR_RUN is a run directory (its config.json gives the sampling settings, as training used them:
temperature, top-p/k, max_new_tokens, length control with its interruption phrase and budgets,
prompt template, chat template use, verifier kind; the params come from its latest checkpoint, or
``--step``) or a Hugging Face directory (settings from ``--config=FILE``, default the recipe's,
``configs/scalerl_8b.py``). ``--config.KEY=VALUE`` overrides apply to either, with or without
``--config=FILE``. Sizes the machine cannot hold (the sampler's KV pool and the weights against
the device's or host's memory) are refused before anything compiles, naming their keys. Progress
(samples and prompts done, completion tokens/s, ETA, compiles) is logged every
``--progress-every`` seconds. FILE is ``.jsonl`` or
``.parquet``; each row needs the problem and answer fields (default: the config's
`data.problem_field` / `data.answer_field`; non-string answers are taken as ``str(value)``, and
`data.gold_extraction` finds the gold inside worked solutions such as GSM8K's ``#### 72``) and,
with ``--group-field``, that field.

A code file (MBPP's ``mbpp.jsonl``, HumanEval's ``HumanEval.jsonl.gz``: `data.code_rows`, told apart
by their fields) is prompted with its layout's template (`code_rows.TEMPLATES`, in place of
`data.prompt_template`) and scored by running each completion's program against the problem's
tests in the code sandbox (`scalerl_jax.sandbox`, `data.verify_workers` at once); ``--split``
takes MBPP's split by task id (``test``: 11-510). The report adds the share of samples of each
verdict kind (``code_passed_frac``, ``code_failed_frac``, ... ``code_unparsable_frac``).

Metrics, for N prompts with K samples each and c_i correct samples of prompt i:
  mean@K = (1/N) sum_i c_i / K   (the paper's metric: mean over prompts of the pass rate)
  pass@k = (1/N) sum_i [1 - C(K - c_i, k) / C(K, k)]   (unbiased estimator, Chen et al. 2021)
and both per value of the group field, with every other metric the evaluation returns (the
fractions of interrupted, truncated and unformatted samples, ...) and the wall time. The JSON
output also holds every sample's correctness.

``--problems START:END`` evaluates only those problems (0-based, in file order, after ``--split``),
so an evaluation longer than one sitting runs in parts; ``scalerl merge-evals`` joins the parts'
reports into the report of the whole (`run.eval_merge`). Each report names its range.

Exit status: 0 on success, 2 on bad input (one line naming the file, row, field or flag), 1 when
the report cannot be written (`SCALERL_DEBUG=1` prints the traceback too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import ml_collections
from absl import flags, logging

from scalerl_jax.cli.errors import EXIT_INPUT_ERROR, EXIT_RUN_ERROR, report_error
from scalerl_jax.config import recipes
from scalerl_jax.config.argv import CONFIG_ARGV_ERRORS, apply_config_overrides, config_argv_problem, parse_config_argv
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.data.rows import DataFileError
from scalerl_jax.models.hf_tokenizer import CheckpointFileError
from scalerl_jax.run import policy_source
from scalerl_jax.run.benchmark import (
    EvaluateError,
    evaluate_policy,
    format_table,
    is_code_file,
    load_policy,
    read_benchmark,
    read_code_benchmark,
)
from scalerl_jax.sandbox import SandboxUnavailable
from scalerl_jax.telemetry.console import quiet_library_logs

# Bad input, each ending the command with one line naming the file, row, field or flag (status 2).
INPUT_ERRORS = (
    EvaluateError,
    ConfigError,
    DataFileError,
    CheckpointFileError,
    policy_source.PolicySourceError,
    FileNotFoundError,
    SandboxUnavailable,
)


# ------------------------------------------------------------------ benchmark files


# ------------------------------------------------------------------ metrics


def parse_ks(text: str, num_samples: int) -> list[int]:
    """The `--k` list ('1,4,16'); each k must lie in [1, --samples]."""
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise EvaluateError(f"--k {text!r} is not a comma-separated list of integers") from e
    bad = [k for k in ks if not 1 <= k <= num_samples]
    if not ks or bad:
        raise EvaluateError(f"--k {text!r}: every k must be in [1, --samples={num_samples}] (bad: {bad})")
    return ks


def parse_problem_range(text: str, num_problems: int) -> tuple[int, int]:
    """The `--problems` range 'START:END' (0-based, END exclusive, either side may be left out) of
    a benchmark with `num_problems` problems; it must hold at least one problem."""
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        start = int(parts[0]) if parts[0].strip() else 0
        end = int(parts[1]) if parts[1].strip() else num_problems
    except ValueError:
        raise EvaluateError(f"--problems {text!r} is not START:END (e.g. 0:250)") from None
    if not 0 <= start < end <= num_problems:
        raise EvaluateError(f"--problems {text!r}: need 0 <= START < END <= {num_problems}, the problems in the file")
    return start, end


# ------------------------------------------------------------------ progress


# ------------------------------------------------------------------ evaluation


# ------------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (``--config`` and ``--config.KEY=VALUE`` are read by ml_collections)."""
    parser = argparse.ArgumentParser(
        prog="python -m scalerl_jax.cli.evaluate",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="--config=FILE [--config.KEY=VALUE ...]: sampling settings for a "
        "Hugging Face directory (default configs/scalerl_8b.py)",
    )
    parser.add_argument("--checkpoint", required=True, help="run directory or Hugging Face directory")
    parser.add_argument(
        "--data", required=True, help="benchmark file (.jsonl or .parquet; code: MBPP .jsonl, HumanEval .jsonl.gz)"
    )
    parser.add_argument(
        "--split", default="", help="MBPP's split by task id: prompt, test or train (default: every row)"
    )
    parser.add_argument(
        "--problems",
        default="",
        help="START:END: only these problems (0-based, END exclusive, after --split), for a long "
        "evaluation run in parts that `scalerl merge-evals` joins",
    )
    parser.add_argument("--samples", type=int, default=16, help="samples per problem, K of mean@K")
    parser.add_argument("--k", default="1", help="comma-separated k values of pass@k (each <= --samples)")
    parser.add_argument("--problem-field", help="the problem's row field (default: the config's data.problem_field)")
    parser.add_argument("--answer-field", help="the gold's row field (default: the config's data.answer_field)")
    parser.add_argument("--group-field", help="a row field to break the metrics down by (e.g. level)")
    parser.add_argument("--step", type=int, help="run checkpoint step (default: the latest)")
    parser.add_argument("--seed", type=int, default=0, help="sampler seed")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--completions", action="store_true", help="include completion texts in the JSON")
    parser.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    return parser


def load_config(path: str, extra: Sequence[str]) -> tuple[bool, ml_collections.ConfigDict]:
    """(whether `path` is a run directory, its sampling config): a run's config.json, or for a
    Hugging Face directory the config of `--config=FILE` (default: the recipe's), each with the
    `--config.KEY=VALUE` overrides in `extra` applied in order."""
    unknown = [a for a in extra if not a.startswith("--config")]
    if unknown:
        raise EvaluateError(f"unrecognized arguments: {' '.join(unknown)}")
    is_run = policy_source.is_run_dir(path)
    argv = ["evaluate", *extra]
    has_file = any(a == "--config" or a.startswith("--config=") for a in extra)
    if is_run and has_file:
        raise EvaluateError(
            f"--config=FILE is for Hugging Face directories; the run {path!r} uses its config.json "
            "(--config.KEY=VALUE overrides it)"
        )
    base = None if has_file else policy_source.load_run_config(path) if is_run else recipes.scalerl_8b()
    try:
        config = parse_config_argv(argv) if base is None else apply_config_overrides(base, argv)
    except CONFIG_ARGV_ERRORS as e:
        raise EvaluateError(config_argv_problem(argv, e, base=base)) from e
    assert config is not None  # parse_config_argv returns None only without --config=FILE
    return is_run, config


def use_absl_logging() -> None:
    """Progress and compile lines (absl INFO and up) to stderr, as `main` logs them."""
    flags.FLAGS.mark_as_parsed()  # this CLI parses its own flags; absl's are at their defaults
    logging.use_absl_handler()
    logging.set_verbosity(logging.INFO)
    quiet_library_logs()


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (2 on bad input, with the reason on stderr)."""
    args, extra = build_parser().parse_known_args(argv)
    started = time.perf_counter()
    use_absl_logging()
    try:
        if args.samples < 1:
            raise EvaluateError(f"--samples must be >= 1, got {args.samples}")
        if not args.progress_every > 0:
            raise EvaluateError(f"--progress-every must be > 0 seconds, got {args.progress_every}")
        ks = parse_ks(args.k, args.samples)
        if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
            raise EvaluateError(f"--out {args.out!r}: the directory {os.path.dirname(args.out)!r} does not exist")
        is_run, config = load_config(args.checkpoint, extra)
        if is_code_file(args.data):
            if args.group_field:
                raise EvaluateError("--group-field is for math files; a code file's metrics are per file")
            benchmark = read_code_benchmark(args.data, split=args.split)
        elif args.split:
            raise EvaluateError(f"--split {args.split!r}: splits are MBPP's; {args.data} is not a code file")
        else:
            benchmark = read_benchmark(
                args.data,
                problem_field=args.problem_field or config.data.problem_field,
                answer_field=args.answer_field or config.data.answer_field,
                group_field=args.group_field,
                gold_extraction=config.data.gold_extraction,
                max_solution_steps=config.data.max_solution_steps,
            )
        num_problems = len(benchmark.problems)
        problem_range = parse_problem_range(args.problems or ":", num_problems)
        benchmark = benchmark.take(*problem_range)
        policy = load_policy(args.checkpoint, is_run, config, step=args.step)
        report = evaluate_policy(
            policy,
            config,
            benchmark,
            num_samples=args.samples,
            ks=ks,
            seed=args.seed,
            keep_texts=args.completions,
            progress_every_s=args.progress_every,
        )
    except INPUT_ERRORS as e:
        return report_error(f"error: {e}", EXIT_INPUT_ERROR)
    report = {
        "checkpoint": os.path.abspath(args.checkpoint),
        "step": policy.step,
        "data": os.path.abspath(args.data),
        "group_field": args.group_field,
        "split": args.split,
        "problems": {"start": problem_range[0], "end": problem_range[1], "of": num_problems},
        "wall_seconds": time.perf_counter() - started,
        **report,
    }
    print(format_table(report, args.group_field))
    return write_report(report, args.out)


def write_report(report: dict, out: str | None) -> int:
    """Writes `report` as JSON to `out` (when given) and says so; the exit status (1 when it
    cannot be written)."""
    if out:
        try:
            with open(out, "w") as f:
                json.dump(report, f, indent=2)
        except OSError as e:
            return report_error(f"error: cannot write {out}: {e.strerror or e}", EXIT_RUN_ERROR)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
