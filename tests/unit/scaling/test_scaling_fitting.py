"""Sigmoid / power-law fits: recovery of the paper's Table 1 curves, a brute-force reference for
the grid search, the unit rules, bootstrap against Monte Carlo, extrapolation error, bad input."""

import numpy as np
import pytest

from scalerl_jax.scaling import (
    SigmoidFit,
    bootstrap_sigmoid,
    extrapolation_error,
    fit_power_law,
    fit_sigmoid,
    make_grid,
)
from scalerl_jax.scaling.fitting import grid_fit_rows

R0 = 0.30  # assumed start pass rate (Table 1 gives no R0)
NOISE = 0.003  # eval noise: ~ binomial std of 1,000 prompts x 16 samples near p = 0.5 is 0.004
# Table 1 of arXiv 2510.13786: (A, B, C_mid) and how far each curve is sampled (GPU-hours).
# The batch-2048 curve (C_mid 10,909) is sampled to 64,000 so that the first half passes its midpoint.
SCALERL_8B = dict(a=0.610, b=1.92, c_mid=2_542.0, total=16_000.0)
BATCH_2048 = dict(a=0.645, b=1.70, c_mid=10_909.0, total=64_000.0)


def true_curve(c, a, b, c_mid, total=None):
    """Direct formula, independent of the package: R0 + (A - R0) / (1 + (C_mid / C)^B)."""
    c = np.asarray(c, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return R0 + (a - R0) / (1.0 + (c_mid / c) ** b)


def sampled(params, seed, num_points=121):
    c = np.linspace(0.0, params["total"], num_points)
    rng = np.random.default_rng(seed)
    return c, true_curve(c, **params) + rng.normal(0.0, NOISE, c.size)


@pytest.mark.parametrize("params", [SCALERL_8B, BATCH_2048], ids=["scalerl_8b", "batch_2048"])
@pytest.mark.parametrize("method", ["grid", "least_squares"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovers_table1_curve_from_first_half(params, method, seed):
    c, y = sampled(params, seed)
    total = params["total"]
    fit = fit_sigmoid(c, y, fit_end=total / 2, method=method)
    assert fit.reliable, fit.warnings
    assert fit.fit_start == 1_500.0  # the paper's cut in GPU-hours
    assert abs(fit.a - params["a"]) < 0.02
    assert abs(fit.predict(total) - true_curve(total, **params)) < 0.01
    held_out = extrapolation_error(fit, c, y)
    assert held_out.num_points == int((c > total / 2).sum())
    assert held_out.mae < 0.01


def test_power_law_overpredicts_the_ceiling():
    c, y = sampled(SCALERL_8B, seed=0)
    sig = fit_sigmoid(c, y, fit_end=8_000.0)
    power = fit_power_law(c, y, fit_end=8_000.0)
    assert power.fit_start == sig.fit_start and power.num_points == sig.num_points
    assert power.a > SCALERL_8B["a"] + 0.05  # ceiling well above the true asymptote 0.610
    assert power.predict(16_000.0) > true_curve(16_000.0, **SCALERL_8B) + 0.01
    assert extrapolation_error(power, c, y).mae > 2 * extrapolation_error(sig, c, y).mae


def test_grid_search_matches_brute_force_reference():
    # Small grid so that an exhaustive reference is cheap: for every (A, C_mid) pair, B over
    # 20,001 log-spaced values in [0.05, 20] with the direct formula; lowest SSR over all.
    rng = np.random.default_rng(7)
    c = np.linspace(600.0, 6_000.0, 20)
    y = true_curve(c, a=0.62, b=1.5, c_mid=2_000.0) + rng.normal(0.0, 0.01, c.size)
    a_values = np.linspace(0.5, 0.7, 5)
    c_mid_values = np.linspace(500.0, 5_000.0, 10)
    b_values = np.geomspace(0.05, 20.0, 20_001)
    best = (np.inf, None)
    for a in a_values:
        for c_mid in c_mid_values:
            pred = R0 + (a - R0) / (1.0 + (c_mid / c[None, :]) ** b_values[:, None])
            ssr = ((pred - y[None, :]) ** 2).sum(axis=1)
            k = int(np.argmin(ssr))
            if ssr[k] < best[0]:
                best = (ssr[k], (a, b_values[k], c_mid))
    ref_ssr, ref_params = best
    assert ref_params is not None
    ref_a, ref_b, ref_c_mid = ref_params

    fit = fit_sigmoid(
        c,
        y,
        r0=R0,
        fit_start=500.0,
        a_range=(0.5, 0.7),
        a_step=0.05,
        c_mid_range=(500.0, 5_000.0),
        num_c_mid=10,
    )
    assert fit.a == pytest.approx(ref_a)
    assert fit.c_mid == pytest.approx(ref_c_mid)
    assert fit.b == pytest.approx(ref_b, rel=1e-3)
    assert fit.ssr <= ref_ssr * (1 + 1e-9)
    assert fit.ssr == pytest.approx(ref_ssr, rel=1e-6)
    np.testing.assert_allclose(fit.ssr, ((fit.predict(c) - y) ** 2).sum(), rtol=1e-12)


def test_weights_act_as_repeated_points():
    rng = np.random.default_rng(3)
    c = np.linspace(1_500.0, 8_000.0, 12)
    y = true_curve(c, **SCALERL_8B) + rng.normal(0.0, 0.01, c.size)
    counts = rng.integers(0, 4, c.size).astype(np.float64)
    grid = make_grid("gpu_hours", 8_000.0)
    weighted = grid_fit_rows(c, y, counts[None], R0, grid)[0]
    repeated = grid_fit_rows(
        np.repeat(c, counts.astype(int)),
        np.repeat(y, counts.astype(int)),
        np.ones((1, int(counts.sum()))),
        R0,
        grid,
    )[0]
    np.testing.assert_allclose(weighted, repeated, rtol=1e-7)


def test_paper_grid_and_defaults_in_gpu_hours():
    grid = make_grid("GPU-hours", 8_000.0)
    assert len(grid.a_values) == 71  # 0.450, 0.455, ..., 0.800
    assert grid.a_values[0] == pytest.approx(0.45) and grid.a_values[-1] == pytest.approx(0.80)
    np.testing.assert_allclose(np.diff(grid.a_values), 0.005)
    assert len(grid.c_mid_values) == 100
    assert grid.c_mid_values[0] == 100.0 and grid.c_mid_values[-1] == 40_000.0
    np.testing.assert_allclose(np.diff(grid.c_mid_values), (40_000.0 - 100.0) / 99)


def test_other_units_scale_the_paper_rules():
    # A 16,000 GPU-hour run written in another unit (1 unit = 8,000 GPU-hours, so it ends at 2.0):
    # c_max = 2.0 -> C_mid grid [2/160, 2.5 * 2] = [100, 40,000] / 8,000 and
    # fit_start = 1,500/16,000 * 2 = 0.1875 = 1,500 / 8,000: the very same fit, C_mid rescaled.
    c, y = sampled(SCALERL_8B, seed=4)
    in_gpu_hours = fit_sigmoid(c, y)
    in_other_unit = fit_sigmoid(c / 8_000.0, y, unit="device_hours")
    assert in_other_unit.fit_start == pytest.approx(0.1875)
    assert in_other_unit.grid.c_mid_values[0] == pytest.approx(0.0125)
    assert in_other_unit.grid.c_mid_values[-1] == pytest.approx(5.0)
    assert in_other_unit.a == pytest.approx(in_gpu_hours.a)
    assert in_other_unit.b == pytest.approx(in_gpu_hours.b, rel=1e-6)
    assert in_other_unit.c_mid * 8_000.0 == pytest.approx(in_gpu_hours.c_mid)
    assert in_other_unit.num_points == in_gpu_hours.num_points


def test_bootstrap_interval_matches_monte_carlo_spread():
    # Independent reference: the spread of A over 30 fresh noise draws of the same curve.
    c = np.linspace(0.0, 16_000.0, 121)
    truth = true_curve(c, **SCALERL_8B)
    rng = np.random.default_rng(123)
    fits = [
        fit_sigmoid(c, truth + rng.normal(0.0, NOISE, c.size), r0=R0, fit_end=8_000.0, method="least_squares")
        for _ in range(30)
    ]
    monte_carlo_half_width = 1.96 * np.std([f.a for f in fits])
    y = truth + rng.normal(0.0, NOISE, c.size)
    fit = fit_sigmoid(c, y, r0=R0, fit_end=8_000.0, method="least_squares")
    intervals = bootstrap_sigmoid(c, y, fit, num_samples=100, seed=0)
    assert intervals.a[0] <= SCALERL_8B["a"] <= intervals.a[1]
    assert 0.5 * monte_carlo_half_width < intervals.a_half_width < 2.0 * monte_carlo_half_width
    assert intervals.b[0] < intervals.b[1] and intervals.c_mid[0] < intervals.c_mid[1]
    assert intervals.num_skipped == 0
    assert bootstrap_sigmoid(c, y, fit, num_samples=100, seed=0) == intervals  # seeded


def test_extrapolation_error_hand_values():
    # Recipe X of the explainer (R0 0.3, A 0.6, B 2, C_mid 5,000), fitted up to 10,000:
    #   R(20,000) = 0.3 + 0.3 / 1.0625 = 0.582353, measured 0.600 -> |err| = 0.017647
    #   R(40,000) = 0.3 + 0.3 / (1 + 1/64) = 0.595385, measured 0.590 -> |err| = 0.005385
    #   MAE = (0.017647 + 0.005385) / 2 = 0.011516; the points at 5,000 and 10,000 are in the window.
    fit = SigmoidFit(
        r0=0.3,
        a=0.6,
        b=2.0,
        c_mid=5_000.0,
        ssr=0.0,
        method="grid",
        unit="gpu_hours",
        fit_start=1_000.0,
        fit_end=10_000.0,
        num_points=2,
        num_before_start=0,
        num_after_end=2,
        grid=make_grid("gpu_hours", 1e4),
    )
    error = extrapolation_error(fit, [5_000.0, 10_000.0, 20_000.0, 40_000.0], [0.45, 0.54, 0.60, 0.59])
    assert error.num_points == 2
    assert error.mae == pytest.approx((0.6 - (0.3 + 0.3 / 1.0625) + (0.3 + 0.3 / (1 + 1 / 64)) - 0.59) / 2, abs=1e-12)
    assert error.max_abs == pytest.approx(0.6 - (0.3 + 0.3 / 1.0625), abs=1e-12)


def test_window_before_the_midpoint_is_flagged_not_trusted():
    # Batch 2048 (C_mid 10,909) fitted only up to 8,000: A is not identifiable, the fit says so.
    c, y = sampled(dict(BATCH_2048, total=16_000.0), seed=0)
    fit = fit_sigmoid(c, y, fit_end=8_000.0)
    assert not fit.reliable
    assert any("edge" in w or "beyond the last fitted point" in w for w in fit.warnings)


def test_falling_curve_is_flagged():
    c = np.linspace(0.0, 16_000.0, 40)
    y = 0.6 - 0.1 * c / c.max()
    fit = fit_sigmoid(c, y)
    assert any("does not rise" in w for w in fit.warnings)


@pytest.mark.parametrize(
    "compute, pass_rate, kwargs, message",
    [
        ([0, 1e3, np.nan, 3e3, 4e3], [0.3, 0.4, 0.5, 0.55, 0.6], {}, r"point 2: compute nan"),
        ([0, 1e3, -2e3, 3e3, 4e3], [0.3, 0.4, 0.5, 0.55, 0.6], {}, r"point 2: compute -2000.0"),
        (
            [0, 2e3, 2e3, 3e3, 4e3],
            [0.3, 0.4, 0.5, 0.55, 0.6],
            {},
            r"point 2: compute 2000.0 does not increase",
        ),
        (
            [0, 2e3, 3e3, 4e3, 5e3],
            [0.3, 0.4, 1.2, 0.55, 0.6],
            {},
            r"point 2: pass rate 1.2 is not in \[0, 1\]",
        ),
        ([0, 2e3, 3e3, 4e3, 5e3], [0.3, 0.4, np.nan, 0.55, 0.6], {}, r"point 2: pass rate nan"),
        (
            [0, 1e3, 2e3, 3e3],
            [0.3, 0.4, 0.5, 0.55],
            {},
            r"2 point\(s\) in the fit window .* 3 fitted parameters",
        ),
        ([0, 2e3, 3e3, 4e3], [0.3, 0.5, 0.5, 0.5], {}, r"all 3 pass rates in the fit window equal 0.5"),
        ([0, 2e3, 3e3, 4e3], [0.3, 0.4, 0.5, 0.6], {"method": "adam"}, r"method must be one of"),
        ([0, 2e3, 3e3, 4e3], [0.3, 0.4, 0.5, 0.6], {"fit_start": 0.0}, r"fit_start must be > 0"),
        ([0, 2e3, 3e3, 4e3], [0.3, 0.4, 0.5, 0.6], {"fit_end": 1_000.0}, r"fit_end=1000.0 must exceed"),
        ([], [], {}, r"no points"),
        ([0, 2e3], [0.3], {}, r"equal length"),
    ],
)
def test_bad_input_names_the_point(compute, pass_rate, kwargs, message):
    with pytest.raises(ValueError, match=rf"run7.*{message}"):
        fit_sigmoid(compute, pass_rate, name="run7", **kwargs)
    if "method" not in kwargs:
        with pytest.raises(ValueError, match=message):
            fit_power_law(compute, pass_rate, name="run7", **{k: v for k, v in kwargs.items() if k != "method"})
