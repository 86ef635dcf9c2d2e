"""Reading metrics.jsonl runs: the points it keeps, and an error naming file and line for bad input."""

import json

import numpy as np
import pytest

from scalerl_jax.scaling import read_run, read_runs


def write_lines(path, lines, *, trailing_newline=True):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + ("\n" if trailing_newline else ""), encoding="utf-8")
    return path


def record(step, hours, pass_rate=None, **extra):
    out = {"step": step, "compute/device_hours": hours, "train/loss": 0.5, **extra}
    if pass_rate is not None:
        out["eval/pass_rate"] = pass_rate
    return json.dumps(out)


GOOD = [
    record(0, 0.0, 0.25),
    record(1, 0.5),
    record(2, 1.0),
    record(3, 1.5, 0.35),
    record(4, 2.0),
    record(5, 2.5, 0.5),
]


def test_reads_eval_points_of_a_run_dir(tmp_path):
    write_lines(tmp_path / "bs512" / "metrics.jsonl", GOOD)
    run = read_run(tmp_path / "bs512")
    assert run.name == "bs512"
    assert run.unit == "device_hours"  # nothing logged, no override
    np.testing.assert_array_equal(run.steps, [0, 3, 5])
    np.testing.assert_array_equal(run.compute, [0.0, 1.5, 2.5])
    np.testing.assert_array_equal(run.pass_rate, [0.25, 0.35, 0.5])
    assert run.lines == (1, 4, 6)
    assert run.num_train_lines == 3 and run.num_skipped_lines == 0


def test_unit_logged_or_overridden(tmp_path):
    path = write_lines(
        tmp_path / "curve.jsonl", [record(0, 0.0, 0.2, **{"compute/unit": "GPU-hours"}), record(1, 10.0, 0.3)]
    )
    assert read_run(path).name == "curve"
    assert read_run(path).unit == "gpu_hours"
    assert read_run(path, unit="cpu_hours").unit == "cpu_hours"


def test_partial_last_line_only_when_allowed(tmp_path):
    path = write_lines(tmp_path / "live" / "metrics.jsonl", GOOD + ['{"step": 6, "compute/dev'], trailing_newline=False)
    with pytest.raises(ValueError, match=r"metrics.jsonl line 7: malformed JSON"):
        read_run(path)
    run = read_run(path, allow_partial_last_line=True)
    assert run.num_skipped_lines == 1 and len(run.compute) == 3


@pytest.mark.parametrize(
    "lines, message",
    [
        ([GOOD[0], "", GOOD[3]], r"line 2: empty line"),
        ([GOOD[0], "{not json", GOOD[3]], r"line 2: malformed JSON"),
        ([GOOD[0], "[1, 2]", GOOD[3]], r"line 2: expected a JSON object, got list"),
        (
            [GOOD[0], json.dumps({"step": 3, "eval/pass_rate": 0.4})],
            r"line 2: missing 'compute/device_hours'",
        ),
        (
            [GOOD[0], json.dumps({"compute/device_hours": 1.0, "eval/pass_rate": 0.4})],
            r"line 2: missing 'step'",
        ),
        ([GOOD[0], record(3, 1.5, "0.4")], r"line 2: 'eval/pass_rate' must be a number, got '0.4'"),
        ([GOOD[0], record(3, True, 0.4)], r"line 2: 'compute/device_hours' must be a number, got True"),
        ([GOOD[0], record(3.5, 1.5, 0.4)], r"line 2: 'step' must be an integer"),
        (
            [GOOD[0], '{"step": 3, "compute/device_hours": NaN, "eval/pass_rate": 0.4}'],
            r"line 2: compute nan is not a finite number",
        ),
        ([GOOD[0], record(3, -1.5, 0.4)], r"line 2: compute -1.5 is not a finite number >= 0"),
        (
            [GOOD[0], record(3, 1.5, 0.4), record(4, 1.5, 0.45)],
            r"line 3: compute 1.5 does not increase \(previous point, .*line 2",
        ),
        ([GOOD[0], record(3, 1.5, 1.4)], r"line 2: pass rate 1.4 is not in \[0, 1\]"),
        ([record(0, 0.0), record(1, 1.0)], r"no line has 'eval/pass_rate' \(2 training lines\)"),
        (
            [
                record(0, 0.0, 0.2, **{"compute/unit": "gpu_hours"}),
                record(1, 1.0, 0.3, **{"compute/unit": "cpu_hours"}),
            ],
            r"line 2: 'compute/unit' is 'cpu_hours' but line 1 has 'gpu_hours'",
        ),
    ],
)
def test_bad_lines_are_named(tmp_path, lines, message):
    path = write_lines(tmp_path / "runA" / "metrics.jsonl", lines)
    with pytest.raises(ValueError, match=message) as error:
        read_run(path)
    assert "metrics.jsonl" in str(error.value)


def test_missing_file_and_duplicate_names(tmp_path):
    with pytest.raises(ValueError, match="no such metrics file"):
        read_run(tmp_path / "nowhere")
    write_lines(tmp_path / "a" / "run" / "metrics.jsonl", GOOD)
    write_lines(tmp_path / "b" / "run" / "metrics.jsonl", GOOD)
    with pytest.raises(ValueError, match="both named 'run'"):
        read_runs([tmp_path / "a" / "run", tmp_path / "b" / "run"])
    runs = read_runs([tmp_path / "a" / "run", tmp_path / "b" / "run"], names=["first", "second"])
    assert [r.name for r in runs] == ["first", "second"]
