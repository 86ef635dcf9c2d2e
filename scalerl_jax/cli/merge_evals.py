"""Join the reports of an evaluation run in parts: ``scalerl merge-evals PART.json ... [--out ALL.json]``.

Each PART is the JSON report of ``scalerl evaluate ... --problems START:END --out PART.json`` on the
same checkpoint, file, samples and sampling settings; the merged report (`run.eval_merge`) is
printed as `evaluate` prints its table, with the problems the parts cover out of the file's, and
written to ``--out``. Exit status: 0 on success, 2 when a part cannot be read or the parts are not
one evaluation (one line naming the file and the field), 1 when the output cannot be written.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from scalerl_jax.cli.errors import EXIT_INPUT_ERROR, report_error
from scalerl_jax.cli.evaluate import write_report
from scalerl_jax.run.benchmark import format_table
from scalerl_jax.run.eval_merge import MergeError, merge_reports


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(prog="scalerl merge-evals", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("parts", nargs="+", help="evaluate reports (JSON) of disjoint --problems ranges")
    parser.add_argument("--out", help="write the merged JSON report here")
    return parser


def read_part(path: str) -> dict:
    """One part's report; MergeError naming the file when it is missing or not a JSON object."""
    try:
        with open(path) as f:
            report = json.load(f)
    except OSError as e:
        raise MergeError(f"{path}: cannot read it: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise MergeError(f"{path}: not JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(report, dict):
        raise MergeError(f"{path}: not an evaluate report (a JSON {type(report).__name__})")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        merged = merge_reports([(path, read_part(path)) for path in args.parts])
    except MergeError as e:
        return report_error(f"error: {e}", EXIT_INPUT_ERROR)
    print(format_table(merged, merged["group_field"]))
    covered, total = merged["problems"]["covered"], merged["problems"]["of"]
    print(f"problems covered: {covered} of {total}" + ("" if covered == total else " (partial)"))
    return write_report(merged, args.out)


if __name__ == "__main__":
    sys.exit(main())
