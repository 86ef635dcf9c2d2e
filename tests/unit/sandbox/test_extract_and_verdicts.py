"""The program taken out of a completion, and the kinds read off the harness's lines (hand-written
cases); the `verify-code` command's JSON line and exit statuses."""

from __future__ import annotations

import json

import pytest

from scalerl_jax.cli import verify_code
from scalerl_jax.sandbox.extract import program_from_completion
from scalerl_jax.sandbox.verifier import SandboxLimits, verdict_from_reports


@pytest.mark.parametrize(
    "text, whole_text, expected",
    [
        ("x = 1\n", True, "x = 1\n"),
        ("x = 1\n", False, None),
        ("Here:\n```python\ndef f():\n    return 1\n```\nDone.", False, "def f():\n    return 1\n"),
        ("```\na = 1\n```\n```python\nb = 2\n```\n```\nc = 3\n```\n", False, "b = 2\n"),  # tagged beats untagged
        ("```py\na = 1\n```\ntext\n```python3\nb = 2\n```", False, "b = 2\n"),  # the last tagged block
        ("```\na = 1\n```\n```\nb = 2\n```", False, "b = 2\n"),
        ("```bash\nrm -rf /\n```\n", True, "```bash\nrm -rf /\n```\n"),  # another language is never the program
        ("```python\ndef f():\n    return 1", False, "def f():\n    return 1"),  # cut at the length cap
        ("```Python \nx = 2\n  ```\n", False, "x = 2\n"),
    ],
)
def test_program_from_completion(text, whole_text, expected):
    assert program_from_completion(text, whole_text_when_unfenced=whole_text) == expected


@pytest.mark.parametrize(
    "timed_out, runner, supervisor, returncode, expected",
    [
        (True, "passed ", "exit 0", 0, ("timeout", "wall-clock deadline")),
        (False, "passed ", "exit 0", 0, ("passed", "")),
        (False, "failed AssertionError: ", "exit 0", 0, ("failed", "AssertionError: ")),
        (False, "memory MemoryError: ", "exit 0", 0, ("memory", "MemoryError: ")),
        (False, "unparsable SyntaxError: x", "exit 0", 0, ("unparsable", "SyntaxError: x")),
        (False, None, "signal SIGXCPU", 0, ("timeout", "CPU time limit (SIGXCPU)")),
        (False, None, "signal SIGSEGV", 0, ("crash", "killed by SIGSEGV")),
        (False, None, "exit 0", 0, ("crash", "exited with status 0 before the tests finished")),
        (False, "bogus kind", "exit 3", 0, ("crash", "exited with status 3 before the tests finished")),
        (False, None, None, 1, ("crash", "the sandbox ended with status 1 and no report")),
    ],
)
def test_verdict_from_reports(timed_out, runner, supervisor, returncode, expected):
    assert verdict_from_reports(timed_out, runner, supervisor, returncode) == expected


def test_limits_are_checked():
    with pytest.raises(ValueError, match="wall_s=0"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="processes=1"):
        SandboxLimits(processes=1)


def test_verify_code_prints_one_json_line_and_exits_0_whatever_the_verdict(tmp_path, capsys):
    program, completion, tests = tmp_path / "p.py", tmp_path / "c.txt", tmp_path / "t.py"
    program.write_text("def add(a, b):\n    return a + b\n")
    completion.write_text("Sure:\n```python\ndef add(a, b):\n    return a * b\n```\n")
    tests.write_text("assert add(2, 3) == 5\n")
    assert verify_code.main([str(program), str(tests)]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["passed"] is True and line["kind"] == "passed" and line["seconds"] > 0
    assert verify_code.main(["--completion", str(completion), str(tests)]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "failed"
    completion.write_text("def add(a, b):\n    return a + b\n")
    assert verify_code.main(["--completion", "--fenced_only", str(completion), str(tests)]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "unparsable"


def test_verify_code_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    tests = tmp_path / "t.py"
    tests.write_text("assert (\n")
    program = tmp_path / "p.py"
    program.write_text("x = 1\n")
    assert verify_code.main([str(program), str(tests)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"verify-code: {tests}: the tests do not compile (SyntaxError: '(' was never closed (<tests>, line 1))"
    ]
    assert verify_code.main([str(tmp_path / "missing.py"), str(tests)]) == 2
    assert "missing.py: cannot read the program" in capsys.readouterr().err
