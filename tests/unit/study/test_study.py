"""The study: analysis of synthetic runs with known sigmoids, the driver's plan/skip/resume logic
on a stand-in main, and (slow) a real 2-variant x 2-seed micro study killed and resumed."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import repo_paths
from absl import flags
from ml_collections import config_flags

from scalerl_jax.cli.study import main as study_main
from scalerl_jax.config import recipes
from scalerl_jax.config.variants import expand_variants, study_config
from scalerl_jax.study import driver, report
from scalerl_jax.study.analysis import analyze_variant, pair_orders

REPO = Path(repo_paths.REPO)
C_END = 0.6  # device-hours at the last evaluation
EVAL_STEPS = np.arange(0, 151, 5)
A_RANGE = (0.45, 1.0)


def true_curve(c, r0, a, b, c_mid):
    """R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), written out here (R(0) = R0)."""
    c = np.asarray(c, dtype=np.float64)
    positive = np.where(c > 0, c, c_mid)
    return np.where(c > 0, r0 + (a - r0) / (1.0 + (c_mid / positive) ** b), r0)


# Three variants. 'collapse' follows its sigmoid up to the cut (C_END / 2), then loses up to 0.5 of
# pass rate linearly by C_END: its early half promises the highest curve, its late half is the lowest.
VARIANTS = {
    "fast": dict(r0=0.4, a=0.70, b=2.5, c_mid=0.12 * C_END),
    "slow_high": dict(r0=0.4, a=0.85, b=1.5, c_mid=0.20 * C_END),
    "collapse": dict(r0=0.4, a=0.90, b=2.0, c_mid=0.15 * C_END),
}
COLLAPSE_DROP = 0.5


def observed(name, c):
    y = true_curve(c, **VARIANTS[name])
    if name == "collapse":
        y = y - COLLAPSE_DROP * np.clip((c - C_END / 2) / (C_END / 2), 0.0, 1.0)
    return y


def write_synthetic_run(run_dir: Path, name: str, seed: int, noise: float = 0.004):
    """metrics.jsonl with an evaluation every 5 steps (compute jittered per seed, pass rate from the
    true curve plus Gaussian noise) and training lines between, and a config.json as main writes."""
    rng = np.random.default_rng([seed, len(name)])
    run_dir.mkdir(parents=True)
    scale = C_END / EVAL_STEPS[-1] * (1.0 + 0.02 * (seed - 1))
    lines = []
    for step in range(0, 151):
        c = step * scale
        record = {"step": step, "compute/device_hours": c, "train/loss": 0.1}
        if step in EVAL_STEPS:
            record["eval/pass_rate"] = float(np.clip(observed(name, c) + rng.normal(0, noise), 0, 1))
            record["compute/unit"] = "device_hours"
        lines.append(json.dumps(record))
    (run_dir / driver.METRICS_FILE).write_text("\n".join(lines) + "\n")
    (run_dir / driver.RUN_CONFIG_FILE).write_text(
        json.dumps({"num_steps": 150, "eval": {"fit_a_range": list(A_RANGE)}})
    )


@pytest.fixture
def synthetic_study(tmp_path):
    for name in VARIANTS:
        for seed in range(3):
            write_synthetic_run(tmp_path / name / f"seed{seed}", name, seed)
    (tmp_path / driver.STUDY_FILE).write_text(json.dumps({"variants": list(VARIANTS)}))  # the report's order
    return tmp_path


def analyzed(study_dir):
    runs = report.read_study(study_dir)
    return [
        analyze_variant(name, curves, a_range=report.study_a_range(study_dir, runs), bootstrap=100)
        for name, curves in runs.items()
    ]


def test_early_half_fits_recover_the_true_sigmoids(synthetic_study):
    results = {r.name: r for r in analyzed(synthetic_study)}
    assert sorted(results) == sorted(VARIANTS)
    for name, truth in VARIANTS.items():
        r = results[name]
        assert len(r.seed_fits) == 3 and all(s.fit is not None for s in r.seed_fits)
        fit = r.mean_fit.fit
        assert fit is not None
        assert fit.fit_end == pytest.approx(0.5 * r.mean_fit.curve.compute[-1])
        assert fit.a == pytest.approx(truth["a"], abs=0.02), name
        assert fit.b == pytest.approx(truth["b"], rel=0.25), name
        assert fit.c_mid == pytest.approx(truth["c_mid"], rel=0.15), name
        assert r.spread("a").mean == pytest.approx(truth["a"], abs=0.02), name
        assert r.spread("a").count == 3 and 0 < r.spread("a").std < 0.03, name
        assert r.mean_fit.interval is not None
        lo, hi = r.mean_fit.interval.a
        assert lo - 0.01 <= truth["a"] <= hi + 0.01, (name, lo, hi)


def test_extrapolation_error_by_hand(synthetic_study):
    results = {r.name: r for r in analyzed(synthetic_study)}
    for name in ("fast", "slow_high"):  # the late half continues the sigmoid: predicted to within noise
        assert results[name].mean_fit.late_rmse < 0.02, name
        assert abs(results[name].mean_fit.final_error) < 0.03, name
    collapse = results["collapse"].mean_fit
    # predicted - measured at the last point: the whole drop; RMSE of a linear drop 0..0.5 over the
    # held-back computes (c - C/2) / (C/2) at the late evaluation steps.
    assert collapse.final_error == pytest.approx(COLLAPSE_DROP, abs=0.04)
    late_steps = EVAL_STEPS[EVAL_STEPS > 75]
    drops = COLLAPSE_DROP * (late_steps - 75) / 75
    assert collapse.late_rmse == pytest.approx(np.sqrt(np.mean(drops**2)), abs=0.03)


def test_ordering_check_finds_the_pair_the_early_half_gets_wrong(synthetic_study):
    orders = {(o.first, o.second): o for o in pair_orders(analyzed(synthetic_study))}
    assert set(orders) == {("fast", "slow_high"), ("fast", "collapse"), ("slow_high", "collapse")}
    right = orders[("fast", "slow_high")]
    assert right.late_observed_diff < 0 and right.predicted_agrees and right.a_agrees
    for pair in (("fast", "collapse"), ("slow_high", "collapse")):
        o = orders[pair]
        assert o.late_observed_diff > 0 and o.late_predicted_diff < 0 and o.a_diff < 0, pair
        assert o.predicted_agrees is False and o.a_agrees is False, pair


def test_analyze_cli_writes_table_and_figures(synthetic_study, capsys):
    assert study_main(["--analyze", str(synthetic_study), "--bootstrap", "20"]) == 0
    out = capsys.readouterr().out
    text = (synthetic_study / report.REPORT_FILE).read_text()
    assert text in out
    assert "fast vs collapse" in text and "| NO |" in text
    assert "| fast | 3 | 0.6 |" in text  # C_end: seeds end at 0.98, 1.00, 1.02 x 0.6 device-hours
    assert "ordered 1 of 3 pairs" in text
    for figure in (report.CURVES_FIGURE, report.PARAMS_FIGURE):
        assert (synthetic_study / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_curves_figure_leaves_out_the_untrained_start(synthetic_study):
    """main logs the step-0 evaluation at the few milliseconds before training (1.7e-6 device-hours
    in docs/results/study_long_extended); drawn, it would stretch the log axis by five decades."""
    for metrics in synthetic_study.glob(f"*/seed*/{driver.METRICS_FILE}"):
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        records[0]["compute/device_hours"] = 1.7e-6
        metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    figure = report.curves_figure(analyzed(synthetic_study))
    drawn = np.concatenate([np.asarray(line.get_xdata(), dtype=np.float64) for line in figure.axes[0].lines])
    first_trained = C_END / EVAL_STEPS[-1] * EVAL_STEPS[1] * 0.98  # seed 0's compute scale is 0.98x
    assert drawn.min() >= first_trained * (1 - 1e-9)


def test_analyze_reports_a_curve_it_cannot_fit(tmp_path, capsys):
    run = tmp_path / "baseline" / "seed0"
    run.mkdir(parents=True)
    rows = [{"step": s, "compute/device_hours": 0.01 * s, "eval/pass_rate": 0.5} for s in range(5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert study_main(["--analyze", str(tmp_path), "--bootstrap", "0"]) == 1
    assert "NO FIT" in capsys.readouterr().out


def test_timing_line_sums_ended_launches_and_counts_killed_ones(tmp_path):
    records = [
        {"event": "start", "run": "baseline/seed0"},
        {"event": "end", "run": "baseline/seed0", "minutes": 1.5},
        {"event": "start", "run": "dapo/seed0"},  # killed: no end
        {"event": "start", "run": "dapo/seed0"},
        {"event": "end", "run": "dapo/seed0", "minutes": 2.25},
    ]
    (tmp_path / driver.STUDY_LOG).write_text("".join(json.dumps(r) + "\n" for r in records))
    line = report.timing_line(tmp_path)
    assert "3.8 min over 2 ended launches of 2 runs" in line  # 1.5 + 2.25 = 3.75
    assert "1 launch(es) killed before they ended" in line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config=configs/tiny.py", "--workdir=W", "--variants=dpo"], "unknown study variant 'dpo'"),
        (["--config=configs/tiny.py", "--workdir=W", "--config.num_steps", "3"], "--config.key=value"),
        (["--config=configs/tiny.py"], "needs --config and --workdir"),
        (["--analyze=/nowhere/study"], "no such study directory"),
        (["--analyze=/nowhere/study", "--cut=1.5"], "--cut must be in (0, 1)"),
    ],
)
def test_cli_bad_input_exits_2_naming_it(argv, message, capsys):
    assert study_main(argv) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------ variants and driver
def test_variants_and_study_config():
    assert expand_variants("baseline,dapo,dapo") == ["baseline", "dapo"]
    assert expand_variants("loo") == ["baseline", *recipes.LEAVE_ONE_OUT]
    with pytest.raises(ValueError, match="'dpo'"):
        expand_variants("dpo")
    expected = recipes.tiny()
    expected.rl.objective = "dapo"  # by hand: the 'dapo' leave-one-out change
    assert study_config("configs/tiny.py,dapo").to_dict() == expected.to_dict()
    assert study_config("configs/tiny.py,baseline").to_dict() == recipes.tiny().to_dict()
    on_loo = study_config("configs/loo.py:sample_avg,ppo_off_policy")  # a base with its own argument
    assert (on_loo.rl.aggregation, on_loo.schedule.kind) == ("sample", "ppo_off_policy")


FAKE_MAIN = """#!{python}
# Stands in for `python -m scalerl_jax.main`: counts its launches, writes a run's files.
import json, os, sys
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
workdir = args["--workdir"]
with open(os.path.join(os.path.dirname(os.path.dirname(workdir)), "launches.txt"), "a") as f:
    f.write(workdir + "\\n")
num_steps = int(args.get("--config.num_steps", 3))
json.dump({{"num_steps": num_steps, "seed": int(args["--config.seed"])}}, open(os.path.join(workdir, "config.json"), "w"))
last = num_steps - (1 if os.environ.get("FAKE_STOP_EARLY") else 0)
with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for step in range(last + 1):
        f.write(json.dumps({{"step": step, "compute/device_hours": 0.1 * step, "eval/pass_rate": 0.5}}) + "\\n")
sys.exit(int(os.environ.get("FAKE_STATUS", 0)))
"""


@pytest.fixture
def fake_python(tmp_path):
    path = tmp_path / "fake_main"
    path.write_text(FAKE_MAIN.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def make_study(tmp_path, overrides=("--config.num_steps=3",)):
    return driver.StudySpec(
        study_dir=tmp_path / "study",
        base=driver.absolute_base("configs/tiny.py"),
        variants=("baseline", "dapo"),
        num_seeds=2,
        overrides=tuple(overrides),
    )


def test_plan_and_command(tmp_path, monkeypatch):
    study = make_study(tmp_path)
    runs = driver.plan_runs(study)
    assert [r.name for r in runs] == ["baseline/seed0", "dapo/seed0", "baseline/seed1", "dapo/seed1"]
    assert runs[3].workdir == tmp_path / "study" / "dapo" / "seed1"
    command = driver.main_command(study, runs[3], python="py")
    assert command == [
        "py",
        "-m",
        "scalerl_jax.main",
        f"--config={REPO / 'configs' / 'study.py'}:{REPO / 'configs/tiny.py'},dapo",
        "--config.seed=1",
        "--config.num_steps=3",
        f"--workdir={runs[3].workdir}",
    ]
    # main's own flag parser (ml_collections, which reads overrides from sys.argv) resolves that
    # command line to tiny + dapo, seed 1, 3 steps.
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values, lock_config=True)
    monkeypatch.setattr(sys, "argv", ["main", *command[3:-1]])
    flag_values(sys.argv)
    expected = recipes.tiny()
    expected.rl.objective, expected.seed, expected.num_steps = "dapo", 1, 3
    assert flag_values.config.to_dict() == expected.to_dict()
    with pytest.raises(ValueError, match="seed"):
        driver.check_overrides(["--config.seed=3"], base="configs/tiny.py")
    with pytest.raises(ValueError, match="--config.key=value"):
        driver.check_overrides(["--config.num_steps", "3"], base="configs/tiny.py")


def test_overrides_main_would_refuse_are_refused_before_the_study_starts(tmp_path):
    """An unknown key or a value of the wrong type fails in main's parser; the study refuses it
    up front, naming the flag, and writes no study.json (which would then pin the bad override)."""
    base = str(REPO / "configs" / "tiny.py")
    assert driver.check_overrides(["--config.num_steps=3"], base=base) == ("--config.num_steps=3",)
    with pytest.raises(ValueError, match="--config.nonexistent=3.*no key .nonexistent."):
        driver.check_overrides(["--config.nonexistent=3"], base=base)
    with pytest.raises(ValueError, match="--config.num_steps=many"):
        driver.check_overrides(["--config.num_steps=many"], base=base)
    assert (
        study_main(
            [
                f"--config={base}",
                "--variants=baseline",
                "--seeds=1",
                f"--workdir={tmp_path / 'study'}",
                "--config.nonexistent=3",
            ]
        )
        == 2
    )
    assert not (tmp_path / "study").exists()


def test_run_state(tmp_path):
    run = tmp_path / "run"
    assert driver.run_state(run) == "new"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"num_steps": 4}))
    assert driver.run_state(run) == "started"
    rows = [{"step": s, "eval/pass_rate": 0.5} if s % 2 == 0 else {"step": s} for s in range(4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert driver.run_state(run) == "started"  # step 4 not reached
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4}) + "\n" + '{"step": 4, "eval/pa')  # no evaluation yet, a torn line
    assert driver.run_state(run) == "started"
    with open(run / "metrics.jsonl", "a") as f:
        f.write('ss_rate": 0.6}\n')
    assert driver.run_state(run) == "finished"


def launches(study):
    path = study.study_dir / "launches.txt"
    return path.read_text().split() if path.exists() else []


def test_driver_skips_finished_resumes_started_and_links_the_warm_start(tmp_path, fake_python, capsys):
    study = make_study(tmp_path)
    runs = driver.plan_runs(study)
    # A finished run and a started one, as a killed study leaves them.
    write_synthetic_run(runs[0].workdir, "fast", 0)
    (runs[0].workdir / "config.json").write_text(json.dumps({"num_steps": 150}))
    runs[1].workdir.mkdir(parents=True)
    (runs[1].workdir / "config.json").write_text(json.dumps({"num_steps": 3}))
    finished_mtime = (runs[0].workdir / "metrics.jsonl").stat().st_mtime_ns

    assert driver.run_study(study, python=fake_python) == 0
    assert launches(study) == [str(r.workdir) for r in runs[1:]]
    assert (runs[0].workdir / "metrics.jsonl").stat().st_mtime_ns == finished_mtime
    log = driver.read_log(study.study_dir)
    assert [(r["run"], r["action"]) for r in log if r["event"] == "start"] == [
        ("dapo/seed0", "resume"),
        ("baseline/seed1", "run"),
        ("dapo/seed1", "run"),
    ]
    for run in runs[1:]:
        link = run.workdir / "warm_start"
        assert link.is_symlink() and link.resolve() == (study.study_dir / "warm_start").resolve()
        assert json.loads((run.workdir / "config.json").read_text())["seed"] == run.seed
    out = capsys.readouterr().out
    assert "study: 1/4 runs finished, ETA unknown until a run finishes; next: dapo/seed0 (resume)" in out
    assert "study: 2/4 runs finished" in out and "min/run, ETA" in out and "study: 4/4 runs finished" in out

    assert driver.run_study(study, python=fake_python) == 0  # all finished: nothing launched
    assert len(launches(study)) == 3
    other = dataclasses.replace(study, overrides=("--config.num_steps=5",))
    with pytest.raises(ValueError, match="started with overrides"):
        driver.run_study(other, python=fake_python)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"FAKE_STATUS": "1"}, "failed with exit status 1"),
        ({"FAKE_STOP_EARLY": "1"}, "ended without an evaluation at its num_steps"),
    ],
)
def test_driver_stops_at_a_failed_run(tmp_path, fake_python, monkeypatch, capsys, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    study = make_study(tmp_path)
    assert driver.run_study(study, python=fake_python) == 1
    assert len(launches(study)) == 1
    assert message in capsys.readouterr().out


def test_driver_refuses_a_bad_variant_or_base_before_any_run(tmp_path, fake_python):
    with pytest.raises(ValueError, match="not a file"):
        driver.run_study(dataclasses.replace(make_study(tmp_path), base="/nowhere/tiny.py"), python=fake_python)
    with pytest.raises(ValueError, match="unknown study variant"):
        driver.run_study(dataclasses.replace(make_study(tmp_path), variants=("dpo",)), python=fake_python)
    assert launches(make_study(tmp_path)) == []


# ------------------------------------------------------------------------------ the real micro study
MICRO = [
    "--config.warm_start.steps=8",
    "--config.warm_start.batch_size=16",
    "--config.synthetic.sft_size=64",
    "--config.synthetic.train_size=64",
    "--config.synthetic.heldout_size=8",
    "--config.num_steps=3",
    "--config.batch.prompts_per_step=4",
    "--config.batch.generations_per_prompt=2",
    "--config.sampler.num_slots=8",
    "--config.eval.every=1",
    "--config.eval.num_prompts=4",
    "--config.eval.samples_per_prompt=2",
    "--config.checkpoint.every=2",
]


def study_command(workdir):
    return [
        sys.executable,
        "-m",
        "scalerl_jax.cli.study",
        "--config=configs/tiny.py",
        "--variants=baseline,dapo",
        "--seeds=2",
        f"--workdir={workdir}",
        "--bootstrap=10",
        *MICRO,
    ]


def study_env():
    return dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO)
    )


def has_eval_line(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.is_file() and '"eval/pass_rate"' in path.read_text()


@pytest.mark.slow
def test_micro_study_killed_and_resumed(tmp_path):
    workdir = tmp_path / "study"
    first, second = workdir / "baseline" / "seed0", workdir / "dapo" / "seed0"
    process = subprocess.Popen(
        study_command(workdir),
        cwd=REPO,
        env=study_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    try:
        while not has_eval_line(second):  # the second run is under way (its step-0 evaluation is written)
            assert process.poll() is None, "the study ended before its second run got going"
            assert time.monotonic() < deadline, "the second run did not start within 600 s"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the driver and its main
        process.wait()
    assert driver.run_state(first) == "finished" and driver.run_state(second) == "started"
    first_mtime = (first / "metrics.jsonl").stat().st_mtime_ns
    digests = os.listdir(workdir / "warm_start")
    assert len(digests) == 1
    marker = workdir / "warm_start" / digests[0] / "warm_start_complete.json"
    marker_mtime = marker.stat().st_mtime_ns

    result = subprocess.run(
        study_command(workdir), cwd=REPO, env=study_env(), capture_output=True, text=True, timeout=900
    )
    assert result.returncode in (0, 1), result.stderr[-3000:]  # 1: a 3-step curve may not be fittable
    assert "study: 4/4 runs finished" in result.stdout, result.stdout[-3000:]
    starts = [(r["run"], r["action"]) for r in driver.read_log(workdir) if r["event"] == "start"]
    assert starts == [
        ("baseline/seed0", "run"),
        ("dapo/seed0", "run"),
        ("dapo/seed0", "resume"),
        ("baseline/seed1", "run"),
        ("dapo/seed1", "run"),
    ]
    assert (first / "metrics.jsonl").stat().st_mtime_ns == first_mtime  # not rerun
    for variant in ("baseline", "dapo"):
        for seed in (0, 1):
            run = workdir / variant / f"seed{seed}"
            assert driver.run_state(run) == "finished"
            config = json.loads((run / "config.json").read_text())
            assert config["seed"] == seed and config["rl"]["objective"] == ("dapo" if variant == "dapo" else "cispo")
            assert (run / "warm_start").is_symlink()
            if (variant, seed) != ("baseline", 0):
                assert "warm start: reusing" in (run / "main.log").read_text()
    assert os.listdir(workdir / "warm_start") == digests and marker.stat().st_mtime_ns == marker_mtime  # built once
    assert (
        (workdir / "study.md").is_file() and (workdir / "curves.png").is_file() and (workdir / "params.png").is_file()
    )


def test_analyze_one_domain_of_a_math_code_study(synthetic_study, capsys):
    # Each run also logs a code curve: the fast variant's true sigmoid lowered by 0.1 (A 0.60).
    for seed in range(3):
        path = synthetic_study / "fast" / f"seed{seed}" / driver.METRICS_FILE
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            if "eval/pass_rate" in row:
                row["eval/code/pass_rate"] = row["eval/pass_rate"] - 0.1
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    runs = report.read_study(synthetic_study, metric="eval/code/pass_rate")
    assert sorted(runs) == ["fast"]  # the other variants log no code curve
    code = analyze_variant("fast", runs["fast"], a_range=(0.3, 1.0), bootstrap=0)
    assert code.mean_fit.fit is not None and code.mean_fit.fit.a == pytest.approx(0.60, abs=0.02)
    assert study_main(["--analyze", str(synthetic_study), "--bootstrap", "0", "--metric", "eval/code/pass_rate"]) == 0
    capsys.readouterr()
    assert (synthetic_study / "eval_code_pass_rate" / report.REPORT_FILE).is_file()
    assert not (synthetic_study / report.REPORT_FILE).exists()  # the default curve's report is not touched
