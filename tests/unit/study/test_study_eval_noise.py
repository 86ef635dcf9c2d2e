"""The evaluation-noise analysis: correctness read back from samples, replica pass rates and
binomial noise against hand calculations, point noise against Bernoulli draws of known rates."""

import json
import math

import numpy as np
import pytest

from scalerl_jax.cli import eval_noise as eval_noise_cli
from scalerl_jax.scaling import RunCurve
from scalerl_jax.study import eval_noise


def _write_samples(path, steps, matrix_by_step, extra_rows=()):
    with open(path, "w", encoding="utf-8") as f:
        for step in steps:
            matrix = matrix_by_step[step]
            for p, row in enumerate(matrix):
                for s, ok in enumerate(row):
                    record = {
                        "step": step,
                        "set": "eval",
                        "prompt_index": p,
                        "sample": s,
                        "outcome": "fast_equal" if ok else "not_equal",
                        "reward": 1.0 if ok else 0.0,
                    }
                    f.write(json.dumps(record) + "\n")
        for record in extra_rows:
            f.write(json.dumps(record) + "\n")


def _write_metrics(path, steps, pass_rates):
    with open(path, "w", encoding="utf-8") as f:
        for i, (step, rate) in enumerate(zip(steps, pass_rates)):
            f.write(json.dumps({"step": step, "compute/device_hours": 0.01 * (i + 1), "eval/pass_rate": rate}) + "\n")


HAND = {
    0: [[1, 0, 1, 1], [0, 0, 1, 0]],
    5: [[1, 1, 1, 1], [0, 1, 0, 0]],
}


def test_correctness_read_from_samples_and_round_trips(tmp_path):
    other_set = {"step": 0, "set": "eval_math", "prompt_index": 0, "sample": 0, "outcome": "no_box", "reward": 0}
    _write_samples(tmp_path / "samples.jsonl", [0, 5], HAND, extra_rows=[other_set])
    matrices = eval_noise.correctness_from_samples(tmp_path / "samples.jsonl")
    assert sorted(matrices) == [0, 5]
    np.testing.assert_array_equal(matrices[0], np.array(HAND[0], bool))
    np.testing.assert_array_equal(matrices[5], np.array(HAND[5], bool))
    path = eval_noise.write_correctness(tmp_path, matrices)
    assert path.read_text().splitlines()[0] == json.dumps({"step": 0, "correct": ["1011", "0010"]})
    back = eval_noise.read_correctness(path)
    for step in (0, 5):
        np.testing.assert_array_equal(back[step], matrices[step])


def test_incomplete_evaluation_is_refused_with_its_step(tmp_path):
    _write_samples(tmp_path / "samples.jsonl", [0, 5], HAND)
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    (tmp_path / "samples.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # step 5 loses one sample
    with pytest.raises(ValueError, match=r"step 5 logged 7 of 2 x 4 samples"):
        eval_noise.correctness_from_samples(tmp_path / "samples.jsonl")


def test_load_run_checks_the_logged_pass_rate(tmp_path):
    _write_samples(tmp_path / "samples.jsonl", [0, 5], HAND)
    _write_metrics(tmp_path / "metrics.jsonl", [0, 5], [4 / 8, 5 / 8])
    run = eval_noise.load_run(tmp_path)
    assert run.correct.shape == (2, 2, 4)
    (tmp_path / "samples.jsonl").unlink()  # as committed: metrics and eval_correct.jsonl only
    np.testing.assert_array_equal(eval_noise.load_run(tmp_path).correct, run.correct)
    _write_metrics(tmp_path / "metrics.jsonl", [0, 5, 10], [4 / 8, 5 / 8, 0.5])
    with pytest.raises(ValueError, match=r"no samples for the evaluation at step\(s\) \[10\]"):
        eval_noise.load_run(tmp_path)
    (tmp_path / eval_noise.CORRECTNESS_FILE).unlink()
    with pytest.raises(ValueError, match="neither samples.jsonl nor eval_correct.jsonl"):
        eval_noise.load_run(tmp_path)
    _write_samples(tmp_path / "samples.jsonl", [0, 5], HAND)
    _write_metrics(tmp_path / "metrics.jsonl", [0, 5], [4 / 8, 6 / 8])
    with pytest.raises(ValueError, match=r"step 5: the samples give pass rate 0.625000, metrics.jsonl logged 0.750000"):
        eval_noise.load_run(tmp_path)


def test_replica_pass_rates_by_hand():
    correct = np.array([HAND[0], HAND[5]], bool)
    # size 2, step 0: samples {0,1} -> (1+0+0+0)/4, samples {2,3} -> (1+1+1+0)/4; step 5: 3/4 and 2/4
    np.testing.assert_allclose(eval_noise.replica_pass_rates(correct, 2), [[0.25, 0.75], [0.75, 0.5]])
    np.testing.assert_allclose(eval_noise.replica_pass_rates(correct, 4), [[0.5, 0.625]])
    np.testing.assert_allclose(eval_noise.replica_pass_rates(correct, 1)[:, 0], [0.5, 0.0, 1.0, 0.5])
    with pytest.raises(ValueError, match="does not divide 4"):
        eval_noise.replica_pass_rates(correct, 3)


def test_binomial_point_noise_by_hand():
    correct = np.array([HAND[0]], bool)  # p = 0.75 and 0.25
    # sum p (1 - p) = 2 x 0.1875 = 0.375; / (N^2 s) = 0.375 / (4 x 2)
    assert eval_noise.binomial_point_noise(correct, 2) == pytest.approx(math.sqrt(0.375 / 8))


def _simulated_runs(num_runs, *, num_prompts=96, num_samples=8, a=0.8, r0=0.3, c_mid=0.02, b=1.5, jitter=0.0):
    """Runs whose prompt i passes with probability q_i (R(C) + e), R a known sigmoid, q_i fixed
    per prompt, e ~ N(0, jitter^2) drawn per evaluation (the policy scattering about R)."""
    rng = np.random.default_rng(0)
    compute = np.linspace(0.004, 0.2, 50)
    truth = r0 + (a - r0) / (1 + (c_mid / compute) ** b)
    truth = truth + rng.normal(0.0, jitter, truth.shape)
    q = rng.uniform(0.6, 1.0, num_prompts)
    q /= q.mean()
    p = np.clip(truth[:, None] * q[None, :], 0, 1)  # [E, N]
    runs = []
    for r in range(num_runs):
        correct = rng.random((len(compute), num_prompts, num_samples)) < p[:, :, None]
        curve = RunCurve(
            name=f"seed{r}",
            path="",
            unit="device_hours",
            steps=np.arange(len(compute)) * 10,
            compute=compute,
            pass_rate=correct.mean(axis=(1, 2)),
            lines=tuple(range(len(compute))),
            num_train_lines=0,
            num_skipped_lines=0,
        )
        runs.append(eval_noise.EvaluatedRun(curve, correct))
    return runs, p


def test_point_noise_matches_the_bernoulli_rates_it_was_drawn_from():
    runs, p = _simulated_runs(3)
    num_prompts = p.shape[1]
    for size in (1, 2, 4):
        result = eval_noise.analyze_size(runs, size, fit_end=0.5, fit_start_fraction=0.05, a_range=(0.45, 1.0))
        expected = math.sqrt(np.mean(np.sum(p * (1 - p), axis=1)) / (num_prompts**2 * size))
        assert result.point_noise == pytest.approx(expected, rel=0.1)
        assert result.binomial_noise == pytest.approx(expected, rel=0.1)
        assert result.num_replicas == 3 * (8 // size)
    # a fit on 4x noisier points (1 sample per prompt against 4) scatters about 2x more
    one, four, full = (
        eval_noise.analyze_size(runs, size, fit_end=0.75, fit_start_fraction=0.05, a_range=(0.45, 1.0))
        for size in (1, 4, 8)
    )
    assert one.a_eval_std > 2 * four.a_eval_std
    # the simulated runs share one truth: across them A scatters by the evaluation noise alone
    assert one.a_total_std == pytest.approx(one.a_eval_std, rel=0.3)
    assert math.isnan(full.point_noise) and math.isnan(full.a_eval_std)  # one replica per run
    assert full.a_mean == pytest.approx(0.8, abs=0.02)  # the A the rates were drawn with


@pytest.mark.parametrize("jitter", [0.0, 0.04])
def test_policy_scatter_recovers_the_jitter_drawn(jitter):
    # a = 0.6: no prompt's rate q_i (R + e) reaches the clip at 1, which would shrink the jitter
    runs, _ = _simulated_runs(3, num_prompts=256, jitter=jitter, a=0.6, r0=0.2)
    result = eval_noise.analyze_size(runs, 8, fit_end=0.75, fit_start_fraction=0.05, a_range=(0.45, 1.0))
    # the whole-run floor holds the evaluation noise and the jitter; the scatter only the jitter,
    # a little low as the in-sample fit absorbs some of it
    assert result.floor == pytest.approx(math.sqrt(result.binomial_noise**2 + jitter**2), rel=0.25)
    if jitter:
        assert result.policy_scatter == pytest.approx(jitter, rel=0.25)
    else:
        assert result.policy_scatter < 0.5 * result.binomial_noise


def test_cli_refuses_a_directory_without_runs(tmp_path, capsys):
    assert eval_noise_cli.main([str(tmp_path)]) == 2
    assert "no seed<k>/ run directories" in capsys.readouterr().err


def test_cli_writes_one_row_per_fit_end_and_size(tmp_path, capsys):
    for seed in (0, 1):
        run = tmp_path / "variant" / f"seed{seed}"
        run.mkdir(parents=True)
        _write_samples(run / "samples.jsonl", [0, 5], HAND)
        _write_metrics(run / "metrics.jsonl", [0, 5], [4 / 8, 5 / 8])
    out = tmp_path / "eval_noise.md"
    assert eval_noise_cli.main([str(tmp_path / "variant"), "--fit-ends", "0.5,0.75", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 0.")]
    # K = 4: sizes 1, 2, 4; two points per run are too few to fit, so every fit is counted as failed
    assert [row.split(" | ")[:3] for row in rows] == [
        [f"| {end}", f"2 x {size}", str(2 * (4 // size))] for end in ("0.5", "0.75") for size in (1, 2, 4)
    ]
    assert all(row.endswith(f"| {row.split(' | ')[2]} |") for row in rows)  # failed fits = replicas
    assert "2 runs evaluated on 2 prompts x 4 samples" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [(["--sizes", "2,x"], "--sizes must be comma-separated integers"), (["--fit-ends", "0.5,1.5"], "--fit-ends must")],
)
def test_cli_bad_flags_exit_2_with_one_line(tmp_path, capsys, flags, message):
    run = tmp_path / "variant" / "seed0"
    run.mkdir(parents=True)
    _write_samples(run / "samples.jsonl", [0, 5], HAND)
    _write_metrics(run / "metrics.jsonl", [0, 5], [4 / 8, 5 / 8])
    assert eval_noise_cli.main([str(tmp_path / "variant"), *flags]) == 2
    assert message in capsys.readouterr().err
