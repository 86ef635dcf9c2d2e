"""`scalerl verify-code PROGRAM_FILE TESTS_FILE`: one program against one test file in the code
sandbox, the verdict as one JSON line (`passed`, `kind`, `seconds`, `detail`).

The verdict is what the RL run's code reward sees for the same text (`scalerl_jax.sandbox`), so a
dataset row or a completion can be checked by hand:
  scalerl verify-code PROGRAM_FILE TESTS_FILE
  scalerl verify-code PROGRAM_FILE --row DATA_FILE:TASK_ID   the tests of an MBPP or HumanEval row
  scalerl verify-code --reference --row DATA_FILE:TASK_ID    that row's own reference solution
With `--row`, the program gets the row's prefix (HumanEval: its prompt) as a run would give it.
`--completion` reads PROGRAM_FILE as a policy's completion and takes its program out of it (the
last fenced python block; `--fenced_only` scores a completion without one `unparsable`). The exit
status is 0 whatever the verdict; 2 when a file or row cannot be read, the tests do not compile,
the arguments do not fit together, or the sandbox cannot start here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from scalerl_jax.cli.errors import EXIT_INPUT_ERROR, report_error
from scalerl_jax.data.code_rows import CodeProblem, read_code_problems
from scalerl_jax.sandbox.bubblewrap import SandboxUnavailable
from scalerl_jax.sandbox.extract import program_from_completion
from scalerl_jax.sandbox.verifier import UNPARSABLE, CodeVerifier, SandboxLimits, Verdict, tests_compile_error


def build_parser() -> argparse.ArgumentParser:
    """The command's flags; the limits default to SandboxLimits'."""
    defaults = SandboxLimits()
    parser = argparse.ArgumentParser(prog="scalerl verify-code", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="PROGRAM_FILE TESTS_FILE; PROGRAM_FILE with --row; none with --reference --row",
    )
    parser.add_argument("--row", default="", help="DATA_FILE:TASK_ID, an MBPP or HumanEval row whose tests to run")
    parser.add_argument("--reference", action="store_true", help="with --row: run the row's reference solution")
    parser.add_argument("--completion", action="store_true", help="take the program out of a completion's text")
    parser.add_argument("--fenced_only", action="store_true", help="with --completion: no fenced block is unparsable")
    parser.add_argument("--wall_s", type=float, default=defaults.wall_s, help="wall-clock deadline (s)")
    parser.add_argument("--cpu_s", type=int, default=defaults.cpu_s, help="CPU time limit (s)")
    parser.add_argument("--memory_mb", type=int, default=defaults.memory_bytes >> 20, help="address space (MiB)")
    parser.add_argument("--python", default="", help="the interpreter run inside (default: found at start-up)")
    parser.add_argument(
        "--allow_shared_network",
        action="store_true",
        help="run with this machine's network where the kernel refuses the sandbox a network namespace",
    )
    return parser


def read_text(path: str, what: str) -> str:
    """The UTF-8 text of `path`; ValueError naming the file when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot read the {what} ({error})") from error


def row_of(spec: str) -> CodeProblem:
    """The CodeProblem `DATA_FILE:TASK_ID` names; ValueError naming the file or the id."""
    path, _, task_id = spec.rpartition(":")
    if not path or not task_id:
        raise ValueError(f"--row {spec!r}: expected DATA_FILE:TASK_ID")
    for problem in read_code_problems(path):
        if problem.task_id == task_id:
            return problem
    raise ValueError(f"{path}: no row with task_id {task_id!r}")


def program_and_tests(args: argparse.Namespace) -> tuple[str | None, str]:
    """The program (None: a completion without the fenced block required) and the tests the
    arguments name; ValueError for a file or row that cannot be read, or arguments that do not fit."""
    expected = 0 if args.reference else 1 if args.row else 2
    if len(args.files) != expected or (args.reference and not args.row):
        raise ValueError(
            "expected PROGRAM_FILE TESTS_FILE, PROGRAM_FILE --row DATA_FILE:TASK_ID, or --reference --row DATA_FILE:TASK_ID"
        )
    row = row_of(args.row) if args.row else None
    if row is not None and args.reference:
        return row.program(row.reference), row.tests
    text = read_text(args.files[0], "completion" if args.completion else "program")
    if row is not None:
        tests = row.tests
    else:
        tests = read_text(args.files[1], "tests")
        error = tests_compile_error(tests)
        if error is not None:
            raise ValueError(f"{args.files[1]}: the tests do not compile ({error})")
    program = program_from_completion(text, whole_text_when_unfenced=not args.fenced_only) if args.completion else text
    if program is not None and row is not None:
        program = row.program(program)
    return program, tests


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the verdict line; the module docstring says the exit statuses."""
    args = build_parser().parse_args(argv)
    try:
        program, tests = program_and_tests(args)
        limits = SandboxLimits(wall_s=args.wall_s, cpu_s=args.cpu_s, memory_bytes=args.memory_mb << 20, workers=1)
        verifier = CodeVerifier(limits, python=args.python, require_network_isolation=not args.allow_shared_network)
    except (ValueError, SandboxUnavailable) as error:
        return report_error(f"verify-code: {error}", EXIT_INPUT_ERROR)
    if program is None:
        verdict = Verdict(kind=UNPARSABLE, seconds=0.0, detail="no fenced code block in the completion")
    else:
        verdict = verifier.check(program, tests)
    print(json.dumps(verdict.as_json()), flush=True)
    return 0
