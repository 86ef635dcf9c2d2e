"""The study's fit-window ends: sigmoid against power law per fit end, crossings of fitted and
measured curves, and the claims against the seed spread; every number from a hand calculation or
numpy on curves built here."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from scalerl_jax.cli.study import main as study_main
from scalerl_jax.study import report
from scalerl_jax.study.analysis import (
    Curve,
    CurveFit,
    Spread,
    VariantResult,
    analyze_variant,
    combined_standard_error,
    lead_by_compute,
    observed_crossing,
    pair_crossings,
    seed_verdict,
    sigmoid_crossings,
)

A_RANGE = (0.45, 1.0)
NUM_STEPS = 150
EVAL_EVERY = 5
C_END = 0.6  # device-hours at the last evaluation of a seed with compute scale 1


def sigmoid(c, r0, a, b, c_mid):
    """R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), written out here (R(0) = R0)."""
    c = np.asarray(c, dtype=np.float64)
    positive = np.where(c > 0, c, c_mid)
    return np.where(c > 0, r0 + (a - r0) / (1.0 + (c_mid / positive) ** b), r0)


def collapse(c):
    """A sigmoid up to C_END / 2, then a linear loss of up to 0.5 by C_END (as in test_study)."""
    return sigmoid(c, 0.4, 0.90, 2.0, 0.15 * C_END) - collapse_drop(c)


def collapse_drop(c):
    return 0.5 * np.clip((np.asarray(c) - C_END / 2) / (C_END / 2), 0.0, 1.0)


def power_curve(c):
    """R(C) = 0.8 - 0.095 C^(-1/2) for C > 0 (0.3 at the start, outside every fit window)."""
    c = np.asarray(c, dtype=np.float64)
    return np.where(c > 0, 0.8 - 0.095 / np.sqrt(np.where(c > 0, c, 1.0)), 0.3)


def seed_scale(seed):
    """Compute per step of a seed relative to seed 0: 1.00, 1.02, 1.04."""
    return 1.0 + 0.02 * seed


def seed_compute(seed):
    return np.arange(0, NUM_STEPS + 1, EVAL_EVERY) * (C_END / NUM_STEPS) * seed_scale(seed)


def write_run(run_dir: Path, curve, seed: int):
    """metrics.jsonl of a run whose pass rate is `curve` at each evaluation, no noise."""
    run_dir.mkdir(parents=True)
    steps = np.arange(0, NUM_STEPS + 1, EVAL_EVERY)
    rows = [
        {"step": int(s), "compute/device_hours": float(c), "compute/unit": "device_hours", "eval/pass_rate": float(y)}
        for s, c, y in zip(steps, seed_compute(seed), curve(seed_compute(seed)))
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "config.json").write_text(json.dumps({"num_steps": NUM_STEPS, "eval": {"fit_a_range": list(A_RANGE)}}))


def write_study(study_dir: Path, curves: dict, num_seeds: int) -> Path:
    for name, curve in curves.items():
        for seed in range(num_seeds):
            write_run(study_dir / name / f"seed{seed}", curve, seed)
    (study_dir / "study.json").write_text(json.dumps({"variants": list(curves)}))
    return study_dir


# ------------------------------------------------------------------------------ crossings
# Two sigmoids with the same R0 = 0.1 and B = 2: with x = C^2, R - R0 = (A - R0) x / (C_mid^2 + x),
# so R_1 = R_2  <=>  0.8 (1 + x) = 0.5 (16 + x)  for (A, C_mid) = (0.9, 4) and (0.6, 1)
#   =>  0.3 x = 7.2  =>  x = 24,  C = sqrt(24) = 4.89898, where both are 0.1 + 0.8 * 24 / 40 = 0.58.
# The higher asymptote (the first) leads after it.
def high_late(c):
    return sigmoid(c, 0.1, 0.9, 2.0, 4.0)


def high_early(c):
    return sigmoid(c, 0.1, 0.6, 2.0, 1.0)


def test_sigmoid_crossing_closed_form():
    (crossing,) = sigmoid_crossings(high_late, high_early, c_lo=0.1, c_hi=100.0)
    assert crossing.compute == pytest.approx(math.sqrt(24.0), rel=1e-8)
    assert crossing.first_leads_after
    assert high_late(crossing.compute) == pytest.approx(0.58, abs=1e-9)
    (swapped,) = sigmoid_crossings(high_early, high_late, c_lo=0.1, c_hi=100.0)
    assert swapped.compute == pytest.approx(math.sqrt(24.0), rel=1e-8) and not swapped.first_leads_after
    assert sigmoid_crossings(high_late, high_early, c_lo=5.0, c_hi=100.0) == ()  # past the crossing


def test_sigmoid_crossings_twice_match_numpy_roots():
    # Steep and low against shallow and high (test_study's 'fast' and 'slow_high'): they cross twice.
    def fast(c):
        return sigmoid(c, 0.4, 0.70, 2.5, 0.072)

    def slow_high(c):
        return sigmoid(c, 0.4, 0.85, 1.5, 0.12)

    grid = np.geomspace(1e-3, 10.0, 2_000_001)
    diff = fast(grid) - slow_high(grid)
    i = np.flatnonzero(diff[:-1] * diff[1:] < 0)
    numpy_roots = grid[i] - diff[i] * (grid[i + 1] - grid[i]) / (diff[i + 1] - diff[i])
    assert len(numpy_roots) == 2
    crossings = sigmoid_crossings(fast, slow_high, c_lo=1e-3, c_hi=10.0)
    np.testing.assert_allclose([c.compute for c in crossings], numpy_roots, rtol=1e-6)
    assert [c.first_leads_after for c in crossings] == [True, False]  # fast overtakes, then falls behind
    (later,) = sigmoid_crossings(fast, slow_high, c_lo=float(numpy_roots[0]) * 1.1, c_hi=10.0)
    assert later.compute == pytest.approx(numpy_roots[1], rel=1e-6)


def measured(name, compute, pass_rate):
    c = np.asarray(compute, dtype=np.float64)
    return Curve(name, "device_hours", np.arange(c.size), c, np.asarray(pass_rate, dtype=np.float64))


def test_observed_crossing_of_interpolated_curves_by_hand():
    # rising: 0.2, 0.4, 0.8 at C = 1, 2, 4; flat: 0.5 at C = 1, 3, 4. On [2, 4] rising is
    # 0.4 + 0.2 (C - 2), which reaches 0.5 at C = 2.5; rising leads after.
    rising = measured("rising", [1.0, 2.0, 4.0], [0.2, 0.4, 0.8])
    flat = measured("flat", [1.0, 3.0, 4.0], [0.5, 0.5, 0.5])
    crossing = observed_crossing(rising, flat, c_lo=1.0)
    assert crossing is not None and crossing.compute == pytest.approx(2.5) and crossing.first_leads_after
    swapped = observed_crossing(flat, rising, c_lo=1.0)
    assert swapped is not None and swapped.compute == pytest.approx(2.5) and not swapped.first_leads_after
    assert observed_crossing(rising, flat, c_lo=3.0) is None  # from C = 3 on, rising stays ahead
    # Zero difference at a point: 0.4, 0.5, 0.6 against 0.5 meets it at C = 2 exactly.
    through = measured("through", [1.0, 2.0, 3.0], [0.4, 0.5, 0.6])
    crossing = observed_crossing(through, measured("half", [1.0, 3.0], [0.5, 0.5]), c_lo=1.0)
    assert crossing is not None and crossing.compute == 2.0 and crossing.first_leads_after
    # The first of two sign changes: up through 0.5 at C = 1.5 (0.4 -> 0.6), down through it at C = 2.5.
    bump = measured("bump", [1.0, 2.0, 3.0], [0.4, 0.6, 0.4])
    crossing = observed_crossing(bump, measured("half", [1.0, 3.0], [0.5, 0.5]), c_lo=1.0)
    assert crossing is not None and crossing.compute == pytest.approx(1.5) and crossing.first_leads_after


def test_study_crossing_predicted_and_observed(tmp_path):
    # Same R0 = 0.3 and B = 2: (A, C_mid) = (0.6, 0.06) and (0.8, 0.18) cross where, with x = C^2,
    # 0.3 (0.0324 + x) = 0.5 (0.0036 + x)  =>  0.2 x = 0.00792  =>  C = sqrt(0.0396) = 0.19900,
    # inside the observed range [0.05625, 0.6]; the higher asymptote leads after.
    crossing = math.sqrt(0.0396)
    curves = {"low": lambda c: sigmoid(c, 0.3, 0.6, 2.0, 0.06), "high": lambda c: sigmoid(c, 0.3, 0.8, 2.0, 0.18)}
    runs = report.read_study(write_study(tmp_path, curves, num_seeds=1))
    variants = [analyze_variant(name, r, a_range=A_RANGE, bootstrap=0) for name, r in runs.items()]
    (pair,) = pair_crossings(variants)
    assert (pair.first, pair.second, pair.error) == ("low", "high", "")
    assert pair.c_lo == pytest.approx(0.09375 * C_END) and pair.c_hi == pytest.approx(10 * C_END)
    (predicted,) = pair.predicted
    # The early fits (to 0.5 C_end, noise-free points) recover both sigmoids up to the grid's steps.
    assert predicted.compute == pytest.approx(crossing, rel=0.01) and not predicted.first_leads_after
    assert pair.observed is not None and not pair.observed.first_leads_after
    # The straight lines between evaluations 0.02 apart miss the curved crossing by less than 0.5%.
    assert pair.observed.compute == pytest.approx(crossing, rel=0.005)


# ------------------------------------------------------------------------------ claims
def test_seed_verdict_rule_by_hand():
    # SE = std / sqrt(n): 0.03 / 3 = 0.01 and 0.04 / 2 = 0.02; combined sqrt(0.01^2 + 0.02^2) = 0.022361.
    first, second = Spread(0.5, 0.03, 9), Spread(0.4, 0.04, 4)
    assert first.standard_error == pytest.approx(0.01) and second.standard_error == pytest.approx(0.02)
    se = combined_standard_error(first, second)
    assert se == pytest.approx(math.sqrt(0.0005))
    assert seed_verdict(0.045, se) == "holds"  # 0.045 > 2 x 0.02236 = 0.04472
    assert seed_verdict(0.044, se) == "within the seed spread"
    assert seed_verdict(-0.044, se) == "within the seed spread"
    assert seed_verdict(-0.045, se) == "fails"
    assert seed_verdict(0.1, combined_standard_error(first, Spread(0.4, float("nan"), 1))) == "no spread (< 2 seeds)"
    assert seed_verdict(float("nan"), se) == "no data"


VERDICTS = ("holds", "fails", "within the seed spread", "no spread (< 2 seeds)", "no data")


def all_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row of `text`."""
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    return [row for row in all_rows(text) if row[0] == first_cell]


def extrapolation_rows(text: str, variant: str) -> list[list[str]]:
    """The variant's rows of the extrapolation table (variant, fit end, seeds, 2 x 2 scores)."""
    return [row for row in table_rows(text, variant) if len(row) == 7]


def verdicts(text: str) -> dict[str, str]:
    """Claim -> verdict from the claims tables (claim, margin, 2 SE, verdict)."""
    return {row[0]: row[3] for row in all_rows(text) if len(row) == 4 and row[3] in VERDICTS}


def mean_std(cell: str) -> tuple[float, float]:
    mean, std = cell.split(" ± ")
    return float(mean), float(std)


@pytest.fixture
def three_seed_study(tmp_path):
    return write_study(tmp_path, {"power": power_curve, "collapse": collapse}, num_seeds=3)


def test_fit_ends_report_against_hand_values(three_seed_study, capsys):
    argv = ["--analyze", str(three_seed_study), "--bootstrap", "0", "--fit-ends", "0.75,0.25,0.5"]
    assert study_main(argv) == 0
    text = (three_seed_study / report.REPORT_FILE).read_text()
    assert text in capsys.readouterr().out
    assert (three_seed_study / report.EXTRAPOLATION_FIGURE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The power law fits its own curve exactly on every window: no late error for any seed.
    power_rows = extrapolation_rows(text, "power")
    assert [row[1] for row in power_rows] == ["0.25", "0.5", "0.75"]
    for row in power_rows:
        assert row[2] == "3/3 of 3"
        for cell in row[5:7]:  # power-law late RMSE and final err
            mean, std = mean_std(cell)
            assert abs(mean) <= 0.001 and std <= 0.001, row

    # collapse fitted to 0.5 C_end: the window is all sigmoid, so the fit predicts the sigmoid and
    # misses by the drop. Per seed, over its points beyond half its own last compute:
    # RMSE = sqrt(mean drop^2), final err = drop at the last point (0.5 for every seed: the drop is capped).
    rmse, final = [], []
    for seed in range(3):
        c = seed_compute(seed)
        drop = collapse_drop(c[c > 0.5 * c[-1]])
        rmse.append(np.sqrt(np.mean(drop**2)))
        final.append(drop[-1])
    (row,) = [r for r in extrapolation_rows(text, "collapse") if r[1] == "0.5"]
    rmse_mean, rmse_std = mean_std(row[3])
    final_mean, final_std = mean_std(row[4])
    # Tolerance 0.01: the grid (A step 0.005, 100 C_mid values) leaves each seed's fitted late
    # level up to about 0.01 off the true sigmoid.
    assert rmse_mean == pytest.approx(np.mean(rmse), abs=0.01)
    assert rmse_std == pytest.approx(np.std(rmse, ddof=1), abs=0.01)
    assert final_mean == pytest.approx(np.mean(final), abs=0.01)
    assert final_std == pytest.approx(np.std(final, ddof=1), abs=0.01)

    claims = verdicts(text)
    for end in ("0.25", "0.5", "0.75"):
        assert claims[f"power law fit to {end} C_end predicts power's rest within 0.02 RMSE"] == "holds"
        assert claims[f"sigmoid fit to {end} C_end predicts collapse's rest within 0.02 RMSE"] == "fails"
    # Late part beyond 0.5 C_end: power ends near 0.8 - 0.095 / sqrt(0.6) = 0.677, collapse falls below 0.4.
    assert claims["late part (beyond 0.5 C_end): power above collapse"] == "holds"
    assert "## Crossings" in text and "| power vs collapse |" in text


def test_fit_start_fraction_moves_both_models_windows(three_seed_study):
    runs = report.read_study(three_seed_study)
    variant = analyze_variant("power", runs["power"], fit_start_fraction=0.21, a_range=A_RANGE, bootstrap=0)
    for seed, fitted in enumerate(variant.seed_fits):
        c_end = 0.6 * seed_scale(seed)  # 150 steps x 0.004 device-hours x the seed's scale
        for model in (fitted.fit, fitted.power_law):
            assert model is not None
            assert (model.fit_start, model.fit_end) == pytest.approx((0.21 * c_end, 0.5 * c_end))
            # evaluations every 0.02 x scale: those in [0.126, 0.3] x scale are steps 35, 40, ..., 75.
            assert model.num_points == 9


def test_fit_start_fraction_in_the_report(three_seed_study):
    assert study_main(["--analyze", str(three_seed_study), "--bootstrap", "0", "--fit-start-fraction", "0.21"]) == 0
    text = (three_seed_study / report.REPORT_FILE).read_text()
    assert "Fit window per curve: [0.21 C_end, 0.5 C_end]" in text
    assert "fitted on [0.21 C_end, END C_end] for END in 0.5," in text
    # seed 1's run ends at 150 steps x 0.004 x 1.02 = 0.612 device-hours: its window [0.12852, 0.306].
    (row,) = table_rows(text, "power/seed1")
    assert row[6] == "[0.129, 0.306]"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fit-ends=0.25,1.2"], "--fit-ends must be comma-separated fractions in (0, 1)"),
        (["--fit-ends=0.25,x"], "--fit-ends must be comma-separated fractions in (0, 1)"),
        (["--fit-ends=0.25,0.5", "--fit-start-fraction=0.3"], "--fit-start-fraction must be in (0, 0.25)"),
        (["--fit-start-fraction=0.6"], "--fit-start-fraction must be in (0, 0.5)"),
    ],
)
def test_fit_end_flags_bad_input_exits_2(argv, message, capsys, tmp_path):
    assert study_main(["--analyze", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def _variant(name, pass_rates, fit_start=0.1):
    compute = np.array([0.1, 0.2, 0.4, 0.8, 1.6])
    fits = tuple(
        CurveFit(Curve(f"{name}/seed{k}", "device_hours", np.arange(5), compute, np.array(p)), fit_start, 0.8)
        for k, p in enumerate(pass_rates)
    )
    return VariantResult(name, fits, fits[0])


def test_lead_by_compute_finds_a_crossover_by_hand():
    early = _variant("early", [[0.5, 0.6, 0.6, 0.7, 0.8], [0.5, 0.7, 0.6, 0.6, 0.6]])
    late = _variant("late", [[0.3, 0.3, 0.9, 0.9, 0.9], [0.3, 0.5, 0.9, 0.9, 0.9]])
    first_range, second_range = lead_by_compute(early, late, num_ranges=2)
    # ranges [0.1, 0.4) and [0.4, 1.6]: points {0.1, 0.2} and {0.4, 0.8, 1.6}
    assert (first_range.c_lo, first_range.c_hi) == pytest.approx((0.1, 0.4))
    # early: seed means 0.55, 0.60 -> 0.575, std 0.05 / sqrt(2); late: 0.30, 0.40 -> 0.35, std 0.1 / sqrt(2)
    assert first_range.first_spread.mean == pytest.approx(0.575)
    assert first_range.second_spread.mean == pytest.approx(0.35)
    assert first_range.difference == pytest.approx(0.225)
    assert first_range.standard_error == pytest.approx(math.sqrt(0.05**2 / 4 + 0.1**2 / 4))
    assert (first_range.leader, first_range.verdict) == ("early", "holds")
    # early: 0.7, 0.6 -> 0.65; late: 0.9, 0.9 -> 0.9, std 0; SE = (0.1 / sqrt(2)) / sqrt(2) = 0.05
    assert second_range.difference == pytest.approx(-0.25)
    assert second_range.standard_error == pytest.approx(0.05)
    assert (second_range.leader, second_range.verdict) == ("late", "holds")
    # level: 0.55, 0.65 -> 0.60 early; a gap of 0.025 is within the seed spread
    level = _variant("level", [[0.55, 0.55, 0.6, 0.75, 0.8], [0.55, 0.75, 0.6, 0.65, 0.6]])
    assert lead_by_compute(early, level, num_ranges=2)[0].verdict == "within the seed spread"
