"""Write the arithmetic ladder of a config as jsonl files:
``python -m scalerl_jax.cli.ladder --config=configs/smollm2_arith.py --out DIR [--config.ladder.KEY=VALUE ...]``.

``DIR`` receives ``heldout.jsonl``, ``train.jsonl`` and (with transfer levels) ``transfer.jsonl``,
one problem per line with fields ``problem``, ``answer`` and ``level``: the same problems, in the
same order, as a run of that config trains and evaluates on (``scalerl_jax.data.ladder``), for
``evaluate --data DIR/heldout.jsonl --group-field level`` and for other trainers.

Exit status: 0 on success, 2 on bad input (one line naming the flag or key), 1 when a file cannot
be written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from scalerl_jax.cli.errors import EXIT_INPUT_ERROR, EXIT_RUN_ERROR, report_error
from scalerl_jax.config.adapters import ladder_config
from scalerl_jax.config.argv import CONFIG_ARGV_ERRORS, config_argv_problem, parse_config_argv
from scalerl_jax.data import ladder


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (the config and its overrides are parsed as `main` parses them)."""
    parser = argparse.ArgumentParser(
        prog="python -m scalerl_jax.cli.ladder", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="directory for heldout.jsonl, train.jsonl, transfer.jsonl")
    return parser


def write_splits(task: ladder.LadderConfig, out: str) -> dict[str, int]:
    """Writes each non-empty split of `task` to `out/<split>.jsonl`; returns the row counts."""
    os.makedirs(out, exist_ok=True)
    counts = {}
    for split, problems in ladder.generate_splits(task).items():
        if not problems:
            continue
        with open(os.path.join(out, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            for problem in problems:
                f.write(json.dumps(problem.row()) + "\n")
        counts[split] = len(problems)
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (module docstring), the reason on stderr."""
    args, extra = build_parser().parse_known_args(argv)
    config_argv = ["ladder", *extra]
    try:
        config = parse_config_argv(config_argv)
    except CONFIG_ARGV_ERRORS as e:
        return report_error(f"error: {config_argv_problem(config_argv, e)}", EXIT_INPUT_ERROR)
    if config is None or "ladder" not in config:
        return report_error("error: --config=FILE must name a config with a `ladder` section", EXIT_INPUT_ERROR)
    try:
        task = ladder_config(config)
    except ValueError as e:
        return report_error(f"error: config key {e}", EXIT_INPUT_ERROR)
    try:
        counts = write_splits(task, args.out)
    except OSError as e:
        return report_error(f"error: cannot write to {args.out}: {e.strerror or e}", EXIT_RUN_ERROR)
    print(f"wrote {', '.join(f'{split}.jsonl ({n} rows)' for split, n in counts.items())} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
