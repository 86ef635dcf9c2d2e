"""`run.eval_merge` and `scalerl merge-evals`: the report of an evaluation run in parts equals a hand
computation (math.comb over the joined correctness, sample-weighted fractions), and parts that are
not one evaluation are refused naming the file and field."""

import copy
import json
import math

import pytest

from scalerl_jax.cli import merge_evals
from scalerl_jax.run.eval_merge import MergeError, merge_reports

SAMPLING = {"temperature": 0.8, "top_p": 1.0, "top_k": 0, "max_new_tokens": 320, "seed": 0}


def _part(start, end, rows, correct, *, truncated, mean_tokens, max_tokens, timeouts, seconds, tokens_per_s):
    """An evaluate report of problems [start, end) as the command writes it (K = 4, pass@1 and pass@2)."""
    samples = 4 * len(rows)
    return {
        "checkpoint": "/ckpt",
        "step": 0,
        "data": "/data/mbpp.jsonl",
        "split": "test",
        "group_field": None,
        "samples_per_prompt": 4,
        "sampling": SAMPLING,
        "problems": {"start": start, "end": end, "of": 5},
        "wall_seconds": seconds + 1.0,
        "sampling_seconds": seconds,
        "completion_tokens_per_s": tokens_per_s,
        "skipped_too_long": [],
        "metrics": {
            "pass_rate": -1.0,  # recomputed from the correctness; a wrong value here must not leak
            "mean@4": -1.0,
            "pass@1": -1.0,
            "pass@2": -1.0,
            "num_prompts": len(rows),
            "num_samples": samples,
            "truncated_frac": truncated,
            "code_timeout_frac": truncated / 2,
            "mean_completion_tokens": mean_tokens,
            "max_completion_tokens": max_tokens,
            "timeouts": timeouts,
        },
        "per_prompt": [{"row": r, "answer": "", "correct": c} for r, c in zip(rows, correct)],
    }


T, F = True, False
PART_A = _part(0, 3, [10, 11], [[T, F, F, F], [T, T, T, T]], truncated=0.25, mean_tokens=10.0,
               max_tokens=20, timeouts=1, seconds=10.0, tokens_per_s=8.0)  # fmt: skip
# The second part covers problems 3:5 but the file's row 13 was too long: one prompt evaluated.
PART_B = _part(3, 5, [12], [[F, F, F, F]], truncated=1.0, mean_tokens=40.0, max_tokens=50, timeouts=0,
               seconds=20.0, tokens_per_s=8.0)  # fmt: skip
PART_B["skipped_too_long"] = [13]


def _hand_pass_at(n, c, k):
    return 1 - math.comb(n - c, k) / math.comb(n, k)


def test_merged_metrics_equal_a_hand_computation():
    merged = merge_reports([("b.json", PART_B), ("a.json", PART_A)])  # any order
    metrics = merged["metrics"]
    assert [p["row"] for p in merged["per_prompt"]] == [10, 11, 12]
    assert metrics["mean@4"] == pytest.approx((1 / 4 + 1 + 0) / 3) == metrics["pass_rate"]
    assert metrics["pass@1"] == pytest.approx((1 / 4 + 1 + 0) / 3)
    assert metrics["pass@2"] == pytest.approx((_hand_pass_at(4, 1, 2) + 1 + 0) / 3)  # (0.5 + 1 + 0) / 3
    assert metrics["num_prompts"] == 3 and metrics["num_samples"] == 12
    assert metrics["truncated_frac"] == pytest.approx((0.25 * 8 + 1.0 * 4) / 12)  # 0.5
    assert metrics["code_timeout_frac"] == pytest.approx((0.125 * 8 + 0.5 * 4) / 12)
    assert metrics["mean_completion_tokens"] == pytest.approx((10 * 8 + 40 * 4) / 12)  # 20
    assert metrics["max_completion_tokens"] == 50 and metrics["timeouts"] == 1
    assert merged["sampling_seconds"] == 30 and merged["wall_seconds"] == 32
    assert merged["completion_tokens_per_s"] == pytest.approx((80 + 160) / 30)
    assert merged["skipped_too_long"] == [13]
    assert merged["problems"] == {"covered": 5, "of": 5}
    assert [(m["path"], m["start"], m["end"]) for m in merged["merged_from"]] == [("b.json", 3, 5), ("a.json", 0, 3)]


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda r: r["sampling"].__setitem__("temperature", 1.0), "b.json: sampling"),
        (lambda r: r.__setitem__("samples_per_prompt", 8), "b.json: samples_per_prompt"),
        (lambda r: r["per_prompt"][0].__setitem__("row", 11), "b.json: row 11 was evaluated in a.json too"),
        (lambda r: r["metrics"].pop("pass@2"), "b.json: pass@k values"),
        (lambda r: r["metrics"].pop("truncated_frac"), "b.json: metrics ['truncated_frac']"),
        (lambda r: r.pop("problems"), "b.json: not an evaluate report with --problems"),
    ],
)
def test_parts_that_are_not_one_evaluation_are_refused_by_name(edit, words):
    odd = copy.deepcopy(PART_B)
    edit(odd)
    with pytest.raises(MergeError, match=words.replace("[", r"\[").replace("]", r"\]")):
        merge_reports([("a.json", PART_A), ("b.json", odd)])


def test_a_metric_without_a_merge_rule_is_refused():
    a, b = copy.deepcopy(PART_A), copy.deepcopy(PART_B)
    a["metrics"]["median_seconds"] = b["metrics"]["median_seconds"] = 1.0
    with pytest.raises(MergeError, match="metric 'median_seconds': no rule merges it"):
        merge_reports([("a.json", a), ("b.json", b)])


def test_command_prints_the_table_writes_the_report_and_exits_2_on_bad_parts(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(PART_A))
    b.write_text(json.dumps(PART_B))
    out = tmp_path / "all.json"
    assert merge_evals.main([str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "problems covered: 5 of 5\n" in printed and "pass@2" in printed
    assert json.loads(out.read_text())["metrics"]["pass@2"] == pytest.approx(0.5)
    assert merge_evals.main([str(a)]) == 0
    assert "problems covered: 3 of 5 (partial)" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{not json")
    assert merge_evals.main([str(a), str(tmp_path / "bad.json")]) == 2
    assert "bad.json: not JSON (line 1" in capsys.readouterr().err
    assert merge_evals.main([str(a), str(tmp_path / "missing.json")]) == 2
    assert "missing.json: cannot read it" in capsys.readouterr().err
