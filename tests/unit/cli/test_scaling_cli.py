"""`python -m scalerl_jax.cli.fit` on synthetic runs: the table, the crossing, the PNG, bad input."""

import json
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

from scalerl_jax.cli import fit as fit_cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(directory, *, a, c_mid, seed, r0=0.30, b=2.0, hours_per_step=10.0, num_steps=4_000, eval_every=100):
    """A metrics.jsonl whose eval pass rates follow the explainer's sigmoid plus 0.002 noise."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    with open(directory / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step in range(0, num_steps + 1, 10):
            hours = step * hours_per_step
            line = {
                "step": step,
                "compute/device_hours": hours,
                "compute/unit": "gpu_hours",
                "train/loss": 0.1,
            }
            if step % eval_every == 0:
                truth = r0 + (a - r0) / (1.0 + (c_mid / hours) ** b) if hours > 0 else r0
                line["eval/pass_rate"] = float(np.clip(truth + rng.normal(0.0, 0.002), 0.0, 1.0))
            f.write(json.dumps(line) + "\n")
    return directory


def table_row(stdout, name):
    for line in stdout.splitlines():
        if line.startswith(name + " "):
            return re.split(r"\s{2,}", line.strip())
    raise AssertionError(f"no row for {name!r} in:\n{stdout}")


def test_two_runs_table_crossing_and_png(tmp_path, capsys):
    # Recipes X (A 0.6, C_mid 5,000) and Y (A 0.7, C_mid 10,000) of the explainer, 40,000 GPU-hours each,
    # fitted on [1,500, 20,000]. By hand (test_scaling_curves): Y overtakes X at 10,000 sqrt(2) = 14,142.
    x = write_run(tmp_path / "x", a=0.60, c_mid=5_000.0, seed=0)
    y = write_run(tmp_path / "y", a=0.70, c_mid=10_000.0, seed=1)
    png = tmp_path / "scaling.png"
    status = fit_cli.main([str(x), str(y), "--fit-end", "20000", "--bootstrap", "30", "--plot", str(png)])
    out = capsys.readouterr().out
    assert status == 0, out
    header = re.split(r"\s{2,}", out.splitlines()[0].strip())
    for name, true_a in (("x", 0.60), ("y", 0.70)):
        row = dict(zip(header, table_row(out, name), strict=True))
        assert abs(float(row["A"]) - true_a) < 0.02
        assert row["R0"] == f"{float(row['R0']):.3f}" and abs(float(row["R0"]) - 0.30) < 0.01
        assert row["fit window"] == "[1,500, 20,000]"
        assert row["points"].startswith("19 ")  # evals at 2,000 ... 20,000 GPU-hours
        assert float(row["extrap MAE"].split()[0]) < 0.01
        assert row["status"] == "ok"
    crossing = re.search(r"y overtakes x at C = ([\d,]+) GPU-hours", out)
    assert crossing, out
    assert float(crossing.group(1).replace(",", "")) == pytest.approx(10_000.0 * np.sqrt(2.0), rel=0.03)

    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])  # IHDR: 7 x 4.5 inches at 150 dpi
    assert (width, height) == (1050, 675)
    assert len(data) > 20_000


def test_unfittable_run_gets_a_row_and_exit_status_1(tmp_path, capsys):
    good = write_run(tmp_path / "good", a=0.60, c_mid=5_000.0, seed=0)
    short = write_run(tmp_path / "short", a=0.60, c_mid=5_000.0, seed=0, num_steps=200)  # evals at 0, 1,000, 2,000
    png = tmp_path / "p.png"
    status = fit_cli.main([str(good), str(short), "--bootstrap", "0", "--plot", str(png)])
    out = capsys.readouterr().out
    assert status == 1
    assert "NO FIT: run 'short': 1 point(s) in the fit window" in table_row(out, "short")[-1]
    assert table_row(out, "good")[-1] == "ok"
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_malformed_line_exits_2_naming_file_and_line(tmp_path):
    run = write_run(tmp_path / "broken", a=0.60, c_mid=5_000.0, seed=0)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[41] = lines[41][:-5]  # line 42 cut short
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "scalerl_jax.cli.fit", str(run)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert re.search(r"broken/metrics.jsonl line 42: malformed JSON", result.stderr), result.stderr


def test_fit_of_a_run_dir_uses_its_config_fit_a_range(tmp_path, capsys):
    # A sigmoid whose asymptote is A = 0.9 (points up to 40,000 GPU-hours, C_mid 5,000: the curve
    # is within 0.01 of 0.9 at the end). The paper's grid stops at 0.8, so a fit on it ends at its
    # edge, 0.8; the run's own config.json widens the grid to [0.45, 1.0], where the fit finds ~0.9.
    run = write_run(tmp_path / "wide", a=0.9, c_mid=5_000.0, seed=0)
    (run / "config.json").write_text(json.dumps({"eval": {"fit_a_range": [0.45, 1.0]}}))
    assert fit_cli.main([str(run), "--bootstrap", "0"]) == 0
    out = capsys.readouterr().out
    assert "A grid [0.45, 1] from the run's config.json" in out
    assert float(table_row(out, "wide")[3]) == pytest.approx(0.9, abs=0.01)
    # A flag overrides the run's range: the paper's grid puts A on its upper edge.
    assert fit_cli.main([str(run), "--bootstrap", "0", "--a-range", "0.45,0.8"]) in (0, 1)
    out = capsys.readouterr().out
    assert "from the run's config.json" not in out and float(table_row(out, "wide")[3]) == pytest.approx(0.8)
    # A metrics file with no config.json beside it keeps the paper's grid.
    bare = write_run(tmp_path / "bare", a=0.9, c_mid=5_000.0, seed=0)
    fit_cli.main([str(bare / "metrics.jsonl"), "--bootstrap", "0", "--names", "bare"])
    assert float(table_row(capsys.readouterr().out, "bare")[3]) == pytest.approx(0.8)


def test_fit_names_a_bad_range_in_the_run_config(tmp_path, capsys):
    run = write_run(tmp_path / "bad", a=0.6, c_mid=5_000.0, seed=0)
    (run / "config.json").write_text(json.dumps({"eval": {"fit_a_range": [0.9, 0.5]}}))
    assert fit_cli.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert str(run / "config.json") in err and "eval.fit_a_range" in err


def test_fit_reads_one_domain_of_a_math_code_run(tmp_path, capsys):
    # A math+code run's rows carry eval/<domain>/pass_rate: --metric fits the code curve
    # (A 0.5, C_mid 5,000), which differs from the math curve (A 0.7) in the same rows.
    code = write_run(tmp_path / "code", a=0.50, c_mid=5_000.0, seed=2)
    math_run = write_run(tmp_path / "math", a=0.70, c_mid=5_000.0, seed=3)
    rows = [json.loads(line) for line in (code / "metrics.jsonl").read_text().splitlines()]
    math_rows = [json.loads(line) for line in (math_run / "metrics.jsonl").read_text().splitlines()]
    run = tmp_path / "mixed"
    run.mkdir()
    with open(run / "metrics.jsonl", "w", encoding="utf-8") as f:
        for row, math_row in zip(rows, math_rows):
            if "eval/pass_rate" in row:
                row["eval/code/pass_rate"] = row.pop("eval/pass_rate")
                row["eval/math/pass_rate"] = math_row["eval/pass_rate"]
            f.write(json.dumps(row) + "\n")
    fitted = {}
    for metric in ("eval/code/pass_rate", "eval/math/pass_rate"):
        status = fit_cli.main([str(run), "--metric", metric, "--fit-end", "20000", "--bootstrap", "0"])
        out = capsys.readouterr().out
        assert status == 0, out
        header = re.split(r"\s{2,}", out.splitlines()[0].strip())
        fitted[metric] = float(dict(zip(header, table_row(out, "mixed"), strict=True))["A"])
    assert abs(fitted["eval/code/pass_rate"] - 0.50) < 0.02 and abs(fitted["eval/math/pass_rate"] - 0.70) < 0.02
    status = fit_cli.main([str(run), "--metric", "eval/pass_rate"])
    assert status == 2
    assert "no line has 'eval/pass_rate'" in capsys.readouterr().err
