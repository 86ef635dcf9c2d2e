"""The main job on configs/tiny_math_code.py (a handful of steps): math and code prompts in one
run, the code scored in the sandbox, every metric per domain, the fits per domain, a resume, and
the bad inputs of a mixture."""

import json
import os
import subprocess
import sys

import pytest
from main_runs import SMALL, flags, main_env, read_metrics
from repo_paths import REPO

CODE_SMALL = {
    **SMALL,
    "code.sft_size": 32,
    "code.train_size": 32,
    "code.heldout_size": 4,
    "code.workers": 2,
}
CODE_KINDS = ("failed", "timeout", "memory", "crash", "unparsable")


def run_math_code(workdir, *overrides, env=None, timeout=600):
    command = [
        sys.executable,
        "-m",
        "scalerl_jax.main",
        "--config=configs/tiny_math_code.py",
        f"--workdir={workdir}",
        *overrides,
    ]
    return subprocess.run(command, cwd=REPO, env=env or main_env(), capture_output=True, text=True, timeout=timeout)


def test_math_and_code_in_one_run_per_domain_and_resumed(tmp_path):
    result = run_math_code(tmp_path, *flags(CODE_SMALL))
    assert result.returncode == 0, result.stderr[-4000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows:  # the code verdict counts in every row, never lost
        assert all(f"data/code_{kind}" in row for kind in CODE_KINDS), sorted(row)
    for row in (rows[0], rows[2], rows[3]):  # the evaluations: each domain's, and their mean (equal weights)
        math_rate, code_rate = row["eval/math/pass_rate"], row["eval/code/pass_rate"]
        assert row["eval/pass_rate"] == pytest.approx((math_rate + code_rate) / 2)
        assert row["eval/code/num_samples"] == 4 * 2 and row["eval/math/num_samples"] == 4 * 2
        code_verdicts = sum(row[f"eval/code/code_{kind}"] for kind in CODE_KINDS)
        assert code_verdicts <= row["eval/code/reward_items"]
    for row in rows[1:]:
        groups = row.get("train/math/groups", 0) + row.get("train/code/groups", 0)
        assert groups == CODE_SMALL["batch.prompts_per_step"]
        assert row["data/math/pool_remaining"] + row["data/math/pool_retired"] == 64  # synthetic.train_size
        assert row["data/code/pool_remaining"] + row["data/code/pool_retired"] == 32  # code.train_size
    assert sum(r.get("train/code/groups", 0) for r in rows) >= 4  # the round robin draws code too
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    code_samples = [s for s in samples if s["set"] == "eval/code"]
    assert code_samples and all(s["outcome"] in ("passed", *CODE_KINDS) for s in code_samples)
    assert all(s["prompt"].endswith("\nPython expression:") for s in code_samples)
    for name in ("scaling.png", "scaling_math.png", "scaling_code.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    resumed = run_math_code(tmp_path, *flags({**CODE_SMALL, "num_steps": 5}))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from checkpoint step 3" in resumed.stderr
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    # the counts go on from the checkpoint's: never fewer than before the resume
    for kind in CODE_KINDS:
        assert rows[5][f"data/code_{kind}"] >= rows[3][f"data/code_{kind}"]


def test_a_mixture_naming_a_missing_domain_exits_2_naming_it(tmp_path):
    config = tmp_path / "prose.py"
    config.write_text(
        "from scalerl_jax.config import recipes\n\n\ndef get_config():\n"
        "    c = recipes.tiny_math_code()\n    c.data.mixture.prose = 1.0\n    return c\n"
    )
    result = run_math_code(tmp_path / "run", f"--config={config}", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "config key `data.mixture.prose`: no such domain; the domains are math, code" in result.stderr


def test_no_sandbox_stops_the_run_before_any_compile(tmp_path):
    env = dict(main_env(), PATH=str(tmp_path / "empty"))  # no bwrap on PATH
    result = run_math_code(tmp_path / "run", *flags(CODE_SMALL), env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: code sandbox: bubblewrap (`bwrap`) is not on PATH" in result.stderr
    assert "compiling" not in result.stderr and "warm start: step" not in result.stderr
    assert not os.path.exists(tmp_path / "run" / "warm_start")
