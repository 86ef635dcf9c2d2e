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

Fit-window ends. The same analysis runs at several cuts (`FitEndResult`); each curve's window also
gets the power law R(C) = A - D C^(-alpha) (`scaling.fit_power_law`, same window), scored the
same way. `fit_start_fraction` replaces the `fit` convention by fit_start = fraction * C_end.

Claims against the seed spread (`Claim`). A claim has a margin m, positive when it holds by the
means over seeds, and the combined standard error of those means, SE = sqrt(sum_v s_v^2 / n_v)
(s_v the sample std over variant v's n_v seeds; one term per variant the claim involves). It
holds beyond the seed spread when m > 2 SE, fails beyond it when m < -2 SE, else the seeds do not
decide it; with fewer than 2 seeds in a variant there is no SE and no verdict.

Crossings. Two variants' fitted sigmoids are compared on [max fit_start, CROSSING_HORIZON x the
last compute] (`sigmoid_crossings`), their measured mean curves from the same max fit_start to the
end of the shorter one (`observed_crossing`): before fit_start both sit near R0, where the
difference is noise.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from scalerl_jax.scaling import (
    BootstrapIntervals,
    PowerLawFit,
    RunCurve,
    SigmoidFit,
    bootstrap_sigmoid,
    crossing_computes,
    default_fit_start,
    fit_power_law,
    fit_sigmoid,
)
from scalerl_jax.scaling.fitting import FittedCurve

DEFAULT_CUT_FRACTION = 0.5
RMSE_CLAIM = 0.02  # "the fit predicts the rest within 0.02 RMSE": the paper's A run-to-run spread
SPREAD_FACTOR = 2.0  # a claim holds beyond the seed spread when its margin exceeds 2 combined SEs
CROSSING_HORIZON = 10.0  # predicted crossings are searched up to this factor x the last compute
Predict = Callable[[float | np.ndarray], float | np.ndarray]  # a fitted curve's R(C)
Verdict = Literal["holds", "fails", "within the seed spread", "no spread (< 2 seeds)", "no data"]


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
    why; interval None with a fit: not asked for, or `interval_error` says why), with the power law
    fitted on the same window (None: `power_law_error` says why)."""

    curve: Curve
    fit_start: float
    cut: float
    fit: SigmoidFit | None = None
    error: str = ""
    interval: BootstrapIntervals | None = None
    interval_error: str = ""
    power_law: PowerLawFit | None = None
    power_law_error: str = ""

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

    def _late_rmse(self, model: FittedCurve | None) -> float:
        """sqrt(mean (R(C_i) - y_i)^2) of `model` over the held-back points (NaN without model or points)."""
        held = self.held_out
        if model is None or not held.any():
            return float("nan")
        residual = np.asarray(model.predict(self.curve.compute[held])) - self.curve.pass_rate[held]
        return float(np.sqrt(np.mean(residual**2)))

    def _final_error(self, model: FittedCurve | None) -> float:
        """R(C_last) - y_last of `model`, signed (NaN without model or when the last point was fitted)."""
        if model is None or not self.held_out[-1]:
            return float("nan")
        return float(np.asarray(model.predict(self.curve.compute[-1])) - self.curve.pass_rate[-1])

    @property
    def late_rmse(self) -> float:
        """The sigmoid's sqrt(mean (R(C_i) - y_i)^2) over the held-back points."""
        return self._late_rmse(self.fit)

    @property
    def final_error(self) -> float:
        """The sigmoid's R(C_last) - y_last, signed."""
        return self._final_error(self.fit)

    @property
    def power_law_late_rmse(self) -> float:
        """The power law's sqrt(mean (R(C_i) - y_i)^2) over the held-back points."""
        return self._late_rmse(self.power_law)

    @property
    def power_law_final_error(self) -> float:
        """The power law's R(C_last) - y_last, signed."""
        return self._final_error(self.power_law)


@dataclasses.dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation (ddof 1; NaN for one value) over seeds."""

    mean: float
    std: float
    count: int

    @property
    def standard_error(self) -> float:
        """Standard error of the mean, std / sqrt(count) (NaN for fewer than 2 values)."""
        return self.std / math.sqrt(self.count) if self.count > 1 else float("nan")


def spread_of(values: Sequence[float]) -> Spread:
    """Spread of the finite `values` (a seed without a fit gives NaN and is left out)."""
    finite = np.array([v for v in values if math.isfinite(v)], dtype=np.float64)
    if finite.size == 0:
        return Spread(float("nan"), float("nan"), 0)
    std = float(finite.std(ddof=1)) if finite.size > 1 else float("nan")
    return Spread(float(finite.mean()), std, int(finite.size))


@dataclasses.dataclass(frozen=True)
class VariantResult:
    """A variant's per-seed fits, its spread over seeds and its mean-curve fit."""

    name: str
    seed_fits: tuple[CurveFit, ...]
    mean_fit: CurveFit

    def spread(self, parameter: str) -> Spread:
        """Spread over the seeds that could be fitted of 'a', 'b' or 'c_mid'."""
        return spread_of([getattr(f.fit, parameter) for f in self.seed_fits if f.fit is not None])

    def seed_score(self, score: str) -> Spread:
        """Spread over the seeds of a `CurveFit` score ('late_rmse', 'power_law_final_error', ...)."""
        return spread_of([getattr(f, score) for f in self.seed_fits])


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


def parse_fractions(text: str, flag: str) -> list[float]:
    """The comma-separated fractions in (0, 1) of a command-line flag, ascending and distinct;
    ValueError naming `flag` otherwise."""
    message = f"{flag} must be comma-separated fractions in (0, 1), got {text!r}"
    try:
        values = sorted({float(x) for x in text.split(",")})
    except ValueError:  # not numbers
        raise ValueError(message) from None
    if not all(0.0 < v < 1.0 for v in values):
        raise ValueError(message)
    return values


def fit_window(curve: Curve, cut_fraction: float, fit_start_fraction: float | None) -> tuple[float, float]:
    """(fit_start, cut) of `curve`: cut = cut_fraction C_end; fit_start = fit_start_fraction C_end,
    or the `fit` convention (`scaling.default_fit_start`) when None."""
    c_end = float(curve.compute[-1])
    if fit_start_fraction is None:
        return default_fit_start(curve.unit, c_end), cut_fraction * c_end
    return fit_start_fraction * c_end, cut_fraction * c_end


def fit_early(
    curve: Curve,
    *,
    cut_fraction: float = DEFAULT_CUT_FRACTION,
    fit_start_fraction: float | None = None,
    a_range: tuple[float, float],
    bootstrap: int = 0,
    seed: int = 0,
) -> CurveFit:
    """The early fits of `curve` (module docstring): the sigmoid, with a bootstrap interval when
    `bootstrap` > 0, and the power law on the same window."""
    if not 0.0 < cut_fraction < 1.0:
        raise ValueError(f"cut_fraction must be in (0, 1), got {cut_fraction}")
    fit_start, cut = fit_window(curve, cut_fraction, fit_start_fraction)
    if cut <= fit_start:
        return CurveFit(curve, fit_start, cut, error=f"the cut {cut:.4g} is not past fit_start {fit_start:.4g}")
    try:
        power_law = fit_power_law(
            curve.compute, curve.pass_rate, fit_start=fit_start, fit_end=cut, unit=curve.unit, name=curve.name
        )
        power_only = CurveFit(curve, fit_start, cut, power_law=power_law)
    except ValueError as error:
        power_only = CurveFit(curve, fit_start, cut, power_law_error=str(error))
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
        return dataclasses.replace(power_only, error=str(error))
    if bootstrap == 0:
        return dataclasses.replace(power_only, fit=fit)
    try:
        interval = bootstrap_sigmoid(curve.compute, curve.pass_rate, fit, num_samples=bootstrap, seed=seed)
    except ValueError as error:
        return dataclasses.replace(power_only, fit=fit, interval_error=str(error))
    return dataclasses.replace(power_only, fit=fit, interval=interval)


def analyze_variant(
    name: str,
    runs: Sequence[RunCurve],
    *,
    cut_fraction: float = DEFAULT_CUT_FRACTION,
    fit_start_fraction: float | None = None,
    a_range: tuple[float, float],
    bootstrap: int = 200,
) -> VariantResult:
    """Per-seed fits and the mean-curve fit (with its bootstrap interval) of one variant."""
    window = functools.partial(
        fit_early, cut_fraction=cut_fraction, fit_start_fraction=fit_start_fraction, a_range=a_range
    )
    seed_fits = tuple(window(run_curve(run)) for run in runs)
    mean_fit = window(mean_curve(name, runs), bootstrap=bootstrap)
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


@dataclasses.dataclass(frozen=True)
class FitEndResult:
    """Every variant analyzed with its fit window ending at `fit_end` C_end."""

    fit_end: float
    variants: tuple[VariantResult, ...]


def combined_standard_error(*spreads: Spread) -> float:
    """sqrt(sum_v SE_v^2): the standard error of a sum or difference of independent seed means."""
    return math.sqrt(sum(s.standard_error**2 for s in spreads))


def seed_verdict(margin: float, standard_error: float) -> Verdict:
    """'holds' when margin > 2 SE, 'fails' when margin < -2 SE, else 'within the seed spread';
    no verdict without a margin (no fit or no held-back point) or an SE (fewer than 2 seeds)."""
    if not math.isfinite(margin):
        return "no data"
    if not math.isfinite(standard_error):
        return "no spread (< 2 seeds)"
    if margin > SPREAD_FACTOR * standard_error:
        return "holds"
    if margin < -SPREAD_FACTOR * standard_error:
        return "fails"
    return "within the seed spread"


@dataclasses.dataclass(frozen=True)
class Claim:
    """A statement about the study, its margin (> 0 when it holds by the seed means) and the
    combined standard error of that margin (module docstring)."""

    statement: str
    fit_end: float
    margin: float
    standard_error: float

    @property
    def verdict(self) -> Verdict:
        return seed_verdict(self.margin, self.standard_error)


def rmse_claims(sweep: Sequence[FitEndResult]) -> list[Claim]:
    """Per fit end, variant and model: 'predicts the rest within RMSE_CLAIM', margin
    RMSE_CLAIM - mean late RMSE over seeds, SE that mean's standard error."""
    claims = []
    for end in sweep:
        for variant in end.variants:
            for model, score in (("sigmoid", "late_rmse"), ("power law", "power_law_late_rmse")):
                rmse = variant.seed_score(score)
                claims.append(
                    Claim(
                        f"{model} fit to {end.fit_end:g} C_end predicts {variant.name}'s rest within "
                        f"{RMSE_CLAIM:g} RMSE",
                        end.fit_end,
                        RMSE_CLAIM - rmse.mean,
                        rmse.standard_error,
                    )
                )
    return claims


def order_claims(sweep: Sequence[FitEndResult]) -> list[Claim]:
    """Per fit end and pair of variants, two claims on the late part (beyond the cut), from the
    per-seed values: the observed order (margin |d_obs|, d_obs the difference of the seed means of
    the late measured pass rate) and the early fits' prediction of that order (margin
    sign(d_obs) d_pred, d_pred the same difference of the fits' late predictions). SE combines
    both variants' standard errors."""
    claims = []
    for end in sweep:
        for first, second in itertools.combinations(end.variants, 2):
            observed = first.seed_score("late_observed"), second.seed_score("late_observed")
            predicted = first.seed_score("late_predicted"), second.seed_score("late_predicted")
            observed_diff = observed[0].mean - observed[1].mean
            leader, other = (first, second) if observed_diff >= 0 else (second, first)
            claims.append(
                Claim(
                    f"late part (beyond {end.fit_end:g} C_end): {leader.name} above {other.name}",
                    end.fit_end,
                    abs(observed_diff),
                    combined_standard_error(*observed),
                )
            )
            claims.append(
                Claim(
                    f"fit to {end.fit_end:g} C_end predicts {leader.name} above {other.name} in the late part",
                    end.fit_end,
                    float(np.sign(observed_diff)) * (predicted[0].mean - predicted[1].mean),
                    combined_standard_error(*predicted),
                )
            )
    return claims


@dataclasses.dataclass(frozen=True)
class Crossing:
    """Where two curves cross, and which leads just after: the first (True) or the second."""

    compute: float
    first_leads_after: bool


def sigmoid_crossings(first: Predict, second: Predict, *, c_lo: float, c_hi: float) -> tuple[Crossing, ...]:
    """Every C in [c_lo, c_hi] with R_1(C) = R_2(C), ascending, for two fitted curves' predictions
    R_1 = `first`, R_2 = `second` (ValueError if they coincide on the whole range).

    The difference R_1 - R_2 is scanned on a log-compute grid and each sign change refined by
    Brent's method (`scaling.crossing_computes`). Between consecutive roots the difference keeps
    its sign, so the leader after a root is the sign at the log-midpoint to the next root (or c_hi).
    """
    roots = crossing_computes(first, second, c_lo=c_lo, c_hi=c_hi)
    probes = [math.sqrt(root * end) for root, end in zip(roots, [*roots[1:], c_hi])]
    return tuple(
        Crossing(root, bool(np.asarray(first(probe)) > np.asarray(second(probe)))) for root, probe in zip(roots, probes)
    )


def observed_crossing(first: Curve, second: Curve, *, c_lo: float) -> Crossing | None:
    """The first crossing at compute >= c_lo of two measured curves, each read as straight lines
    between its points (None when they do not cross).

    On P = {c_lo, c_hi} and every point of either curve in between (c_hi the shorter curve's last
    compute), d = y_1(P) - y_2(P) by linear interpolation. Both interpolants are linear between
    consecutive points of P, so d is too: the first sign change of d between nonzero values at
    P_j and P_k crosses at P_j + d_j (P_k - P_j) / (d_j - d_k) when k = j + 1, at P_(j+1) (where
    d = 0) otherwise; the first curve leads after it when d_k > 0.
    """
    c_hi = min(float(first.compute[-1]), float(second.compute[-1]))
    if not c_lo < c_hi:
        return None
    both = np.concatenate([first.compute, second.compute])
    points = np.unique(np.concatenate([[c_lo, c_hi], both[(both > c_lo) & (both < c_hi)]]))
    diff = np.interp(points, first.compute, first.pass_rate) - np.interp(points, second.compute, second.pass_rate)
    nonzero = np.flatnonzero(diff != 0)
    for j, k in zip(nonzero[:-1], nonzero[1:]):
        if np.sign(diff[j]) == np.sign(diff[k]):
            continue
        if k == j + 1:
            compute = points[j] + diff[j] * (points[k] - points[j]) / (diff[j] - diff[k])
        else:
            compute = points[j + 1]
        return Crossing(float(compute), bool(diff[k] > 0))
    return None


@dataclasses.dataclass(frozen=True)
class PairCrossings:
    """Where two variants' mean-curve fits cross on [c_lo, c_hi] (`error`: why none was sought)
    and where their measured mean curves first cross from c_lo on."""

    first: str
    second: str
    c_lo: float
    c_hi: float
    predicted: tuple[Crossing, ...]
    observed: Crossing | None
    error: str = ""


def _predicted_crossings(
    first: CurveFit, second: CurveFit, c_lo: float, c_hi: float
) -> tuple[tuple[Crossing, ...], str]:
    """(the crossings of the two sigmoid fits on [c_lo, c_hi], '') or ((), why none were sought)."""
    if first.fit is None or second.fit is None:
        return (), "no fit"
    if not 0 < c_lo < c_hi:
        return (), f"no compute range [{c_lo:.4g}, {c_hi:.4g}]"
    try:
        return sigmoid_crossings(first.fit.predict, second.fit.predict, c_lo=c_lo, c_hi=c_hi), ""
    except ValueError:  # crossing_computes: the two fits coincide on the whole range
        return (), "the fits coincide"


def pair_crossings(variants: Sequence[VariantResult]) -> list[PairCrossings]:
    """Every pair of variants (given order): predicted crossings of their mean-curve fits on
    [max fit_start, CROSSING_HORIZON x the later last compute], observed from that fit_start."""
    pairs = []
    for first, second in itertools.combinations(variants, 2):
        f, s = first.mean_fit, second.mean_fit
        c_lo = max(f.fit_start, s.fit_start)
        c_hi = CROSSING_HORIZON * max(float(f.curve.compute[-1]), float(s.curve.compute[-1]))
        predicted, error = _predicted_crossings(f, s, c_lo, c_hi)
        observed = observed_crossing(f.curve, s.curve, c_lo=c_lo)
        pairs.append(PairCrossings(first.name, second.name, c_lo, c_hi, predicted, observed, error))
    return pairs


@dataclasses.dataclass(frozen=True)
class RangeLead:
    """Two variants over one compute range [c_lo, c_hi): the spread over seeds of each seed's mean
    measured pass rate in the range, and the verdict on who leads there."""

    first: str
    second: str
    c_lo: float
    c_hi: float
    first_spread: Spread
    second_spread: Spread

    @property
    def difference(self) -> float:
        """First minus second, of the seed means."""
        return self.first_spread.mean - self.second_spread.mean

    @property
    def standard_error(self) -> float:
        return combined_standard_error(self.first_spread, self.second_spread)

    @property
    def leader(self) -> str:
        """The variant ahead by the seed means ('' when level or without data)."""
        if not math.isfinite(self.difference) or self.difference == 0:
            return ""
        return self.first if self.difference > 0 else self.second

    @property
    def verdict(self) -> Verdict:
        """Whether the leader leads beyond the seed spread (`seed_verdict` of |difference|)."""
        return seed_verdict(abs(self.difference), self.standard_error)


def range_mean(curve: Curve, c_lo: float, c_hi: float) -> float:
    """Mean measured pass rate of the curve's points with c_lo <= C < c_hi (NaN without any)."""
    inside = (curve.compute >= c_lo) & (curve.compute < c_hi)
    return float(curve.pass_rate[inside].mean()) if inside.any() else float("nan")


def lead_by_compute(first: VariantResult, second: VariantResult, num_ranges: int = 4) -> list[RangeLead]:
    """Who leads where: [max fit_start, the earliest last compute of any seed of either] split into
    `num_ranges` ranges of equal width in log compute; in each, every seed's mean measured pass
    rate (`range_mean`), spread over seeds per variant. A crossover shows as one variant ahead
    beyond the seed spread in an early range and the other in a late one. (The last range is closed
    at its top so that the earliest-ending seed's last point counts.)"""
    c_lo = max(first.mean_fit.fit_start, second.mean_fit.fit_start)
    c_hi = min(float(f.curve.compute[-1]) for f in (*first.seed_fits, *second.seed_fits))
    if not 0 < c_lo < c_hi:
        return []
    edges = np.geomspace(c_lo, c_hi, num_ranges + 1)
    edges[-1] = np.nextafter(c_hi, np.inf)
    leads = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        spreads = [spread_of([range_mean(f.curve, lo, hi) for f in v.seed_fits]) for v in (first, second)]
        leads.append(RangeLead(first.name, second.name, float(lo), float(hi), *spreads))
    return leads
