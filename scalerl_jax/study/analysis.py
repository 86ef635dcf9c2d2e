"""A study's fits: early-half sigmoids per run and per variant, scored on the held-back late half.

For a curve whose last evaluation is at compute C_end (device-hours, as `fit` reads runs), the
fit window is [fit_start, cut] with cut = cut_fraction * C_end (default: the first half of the
compute range) and fit_start = the `fit` convention for a run of length C_end
(`scaling.default_fit_start`: the paper's 1,500 of 16,000 GPU-hours, 0.09375 C_end), which
skips the initial rise. R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) is fitted there by the
paper's grid (`scaling.fit_sigmoid`); the points beyond the cut are held back and predicted.

Per variant:
  - every seed's run is fitted on its own window: A, B, C_mid as mean and sample std (ddof 1);
  - the variant curve (at each evaluation step that every seed logged: the mean over seeds of
    compute and of pass rate) is fitted the same way, with the bootstrap interval of that fit
    (`scaling.bootstrap_sigmoid`), and scored on its held-back points:
    RMSE = sqrt(mean_i (R(C_i) - y_i)^2), final error = R(C_last) - y_last (signed).
Ordering: for each pair of variants, the late half's observed order (mean pass rate of the
held-back points) against the early fits' order, read two ways: the predicted mean over the same
held-back computes, and the asymptote A.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from scalerl_jax.scaling import (
    BootstrapIntervals,
    RunCurve,
    SigmoidFit,
    bootstrap_sigmoid,
    default_fit_start,
    fit_sigmoid,
)

DEFAULT_CUT_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class Curve:
    """Evaluation points of a run or of a variant's mean over seeds."""

    name: str
    unit: str
    steps: np.ndarray
    compute: np.ndarray
    pass_rate: np.ndarray


@dataclasses.dataclass(frozen=True)
class CurveFit:
    """An early-half fit of a curve and its score on the held-back points (fit None: `error` says
    why; interval None with a fit: not asked for, or `interval_error` says why)."""

    curve: Curve
    fit_start: float
    cut: float
    fit: SigmoidFit | None = None
    error: str = ""
    interval: BootstrapIntervals | None = None
    interval_error: str = ""

    @property
    def held_out(self) -> np.ndarray:
        """Mask of the points beyond the cut."""
        return self.curve.compute > self.cut

    @property
    def late_observed(self) -> float:
        """Mean measured pass rate of the held-back points (NaN without any)."""
        held = self.held_out
        return float(self.curve.pass_rate[held].mean()) if held.any() else float("nan")

    @property
    def late_predicted(self) -> float:
        """Mean of the fit's predictions at the held-back computes (NaN without fit or points)."""
        held = self.held_out
        if self.fit is None or not held.any():
            return float("nan")
        return float(np.mean(self.fit.predict(self.curve.compute[held])))

    @property
    def late_rmse(self) -> float:
        """sqrt(mean (R(C_i) - y_i)^2) over the held-back points (NaN without fit or points)."""
        held = self.held_out
        if self.fit is None or not held.any():
            return float("nan")
        residual = self.fit.predict(self.curve.compute[held]) - self.curve.pass_rate[held]
        return float(np.sqrt(np.mean(residual**2)))

    @property
    def final_error(self) -> float:
        """R(C_last) - y_last, signed (NaN without fit or when the last point was fitted)."""
        if self.fit is None or not self.held_out[-1]:
            return float("nan")
        return float(self.fit.predict(self.curve.compute[-1]) - self.curve.pass_rate[-1])


@dataclasses.dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation (ddof 1; NaN for one value) over seeds."""

    mean: float
    std: float
    count: int


@dataclasses.dataclass(frozen=True)
class VariantResult:
    """A variant's per-seed fits, its spread over seeds and its mean-curve fit."""

    name: str
    seed_fits: tuple[CurveFit, ...]
    mean_fit: CurveFit

    def spread(self, parameter: str) -> Spread:
        """Spread over the seeds that could be fitted of 'a', 'b' or 'c_mid'."""
        values = np.array([getattr(f.fit, parameter) for f in self.seed_fits if f.fit is not None])
        if values.size == 0:
            return Spread(float("nan"), float("nan"), 0)
        std = float(values.std(ddof=1)) if values.size > 1 else float("nan")
        return Spread(float(values.mean()), std, int(values.size))


@dataclasses.dataclass(frozen=True)
class PairOrder:
    """Whether the early-half fits order two variants as their late halves did.

    Differences are first minus second; agreement means equal signs (None when a value is missing).
    """

    first: str
    second: str
    late_observed_diff: float
    late_predicted_diff: float
    a_diff: float

    @staticmethod
    def _agree(diff: float, observed: float) -> bool | None:
        if not (np.isfinite(diff) and np.isfinite(observed)):
            return None
        return bool(np.sign(diff) == np.sign(observed))

    @property
    def predicted_agrees(self) -> bool | None:
        return self._agree(self.late_predicted_diff, self.late_observed_diff)

    @property
    def a_agrees(self) -> bool | None:
        return self._agree(self.a_diff, self.late_observed_diff)


def run_curve(run: RunCurve) -> Curve:
    return Curve(run.name, run.unit, run.steps, run.compute, run.pass_rate)


def mean_curve(name: str, runs: Sequence[RunCurve]) -> Curve:
    """At each evaluation step that every run logged: mean compute and mean pass rate over runs."""
    if not runs:
        raise ValueError(f"variant {name!r}: no runs")
    units = {run.unit for run in runs}
    if len(units) != 1:
        raise ValueError(f"variant {name!r}: runs logged different compute units {sorted(units)}")
    steps = sorted(set.intersection(*(set(run.steps.tolist()) for run in runs)))
    if not steps:
        raise ValueError(f"variant {name!r}: its runs share no evaluation step")
    picks = [np.searchsorted(run.steps, steps) for run in runs]
    compute = np.mean([run.compute[p] for run, p in zip(runs, picks)], axis=0)
    pass_rate = np.mean([run.pass_rate[p] for run, p in zip(runs, picks)], axis=0)
    return Curve(name, units.pop(), np.asarray(steps), compute, pass_rate)


def fit_early(
    curve: Curve,
    *,
    cut_fraction: float = DEFAULT_CUT_FRACTION,
    a_range: tuple[float, float],
    bootstrap: int = 0,
    seed: int = 0,
) -> CurveFit:
    """The early-half fit of `curve` (module docstring), with a bootstrap interval when `bootstrap` > 0."""
    if not 0.0 < cut_fraction < 1.0:
        raise ValueError(f"cut_fraction must be in (0, 1), got {cut_fraction}")
    c_end = float(curve.compute[-1])
    fit_start, cut = default_fit_start(curve.unit, c_end), cut_fraction * c_end
    if cut <= fit_start:
        return CurveFit(curve, fit_start, cut, error=f"the cut {cut:.4g} is not past fit_start {fit_start:.4g}")
    try:
        fit = fit_sigmoid(
            curve.compute,
            curve.pass_rate,
            fit_start=fit_start,
            fit_end=cut,
            unit=curve.unit,
            a_range=a_range,
            name=curve.name,
        )
    except ValueError as error:
        return CurveFit(curve, fit_start, cut, error=str(error))
    if bootstrap == 0:
        return CurveFit(curve, fit_start, cut, fit=fit)
    try:
        interval = bootstrap_sigmoid(curve.compute, curve.pass_rate, fit, num_samples=bootstrap, seed=seed)
    except ValueError as error:
        return CurveFit(curve, fit_start, cut, fit=fit, interval_error=str(error))
    return CurveFit(curve, fit_start, cut, fit=fit, interval=interval)


def analyze_variant(
    name: str,
    runs: Sequence[RunCurve],
    *,
    cut_fraction: float = DEFAULT_CUT_FRACTION,
    a_range: tuple[float, float],
    bootstrap: int = 200,
) -> VariantResult:
    """Per-seed fits and the mean-curve fit (with its bootstrap interval) of one variant."""
    seed_fits = tuple(fit_early(run_curve(run), cut_fraction=cut_fraction, a_range=a_range) for run in runs)
    mean_fit = fit_early(mean_curve(name, runs), cut_fraction=cut_fraction, a_range=a_range, bootstrap=bootstrap)
    return VariantResult(name, seed_fits, mean_fit)


def pair_orders(results: Sequence[VariantResult]) -> list[PairOrder]:
    """Every pair of variants (in the given order): late observed vs early-predicted differences."""
    orders = []
    for first, second in itertools.combinations(results, 2):
        f, s = first.mean_fit, second.mean_fit
        a_diff = f.fit.a - s.fit.a if f.fit is not None and s.fit is not None else float("nan")
        orders.append(
            PairOrder(
                first.name, second.name, f.late_observed - s.late_observed, f.late_predicted - s.late_predicted, a_diff
            )
        )
    return orders
