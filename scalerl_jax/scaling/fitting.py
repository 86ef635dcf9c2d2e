"""Fit ScaleRL's sigmoid to (compute, pass rate) points, and score its extrapolation.

Model (see ``curves.sigmoid``): R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B).

Fit window. Points with ``fit_start <= C <= fit_end`` are fitted (``fit_end=None``: no upper
limit). Earlier points (the noisy start of training) and later ones (held out to check the
extrapolation) only serve plots and ``extrapolation_error``; the fit counts both.

R0 is not fitted: it is the pass rate at the smallest compute (the start of training) unless
given.

``method='grid'`` (the paper's procedure): A runs over a grid (0.450..0.800 step 0.005, 71
values), C_mid over 100 linearly spaced values, and for every (A, C_mid) pair B minimizes
SSR = sum_i w_i (y_i - R(C_i)) ** 2 over ``b_bounds``; the triple with the lowest SSR wins.
The B solve is vectorized over all pairs. With t_i = y_i - R0, d = A - R0 and the table
E[j, k, i] = expit(B_k (log C_i - log C_mid_j)) on a log-spaced grid of ``num_b`` B values,

  SSR(A, C_mid_j, B_k) = sum_i w_i t_i^2 - 2 d sum_i w_i t_i E[j,k,i] + d^2 sum_i w_i E[j,k,i]^2,

so every (A, C_mid, B_k) costs two contractions of one [J, K, N] table. Each pair's best B_k is
refined by the vertex of the parabola (in log B) through its neighbours; the few pairs with the
lowest refined SSR get B polished by Brent's method inside that bracket, and the lowest wins.

``method='least_squares'``: A, B and C_mid all free, bounded (A in [0, 1], B in ``b_bounds``,
C_mid in the C_mid grid's range), by scipy's trust-region reflective solver started from the
grid solution.

Units and defaults. With ``unit='gpu_hours'`` the paper's constants hold: C_mid grid
100..40,000 GPU-hours and ``fit_start`` 1,500 GPU-hours. Any other unit (device-hours of a
small run, CPU-hours, ...) scales them to the data: with c_max the largest compute inside the
fit window's upper limit, and the paper's 16,000 GPU-hour ablation runs as the reference,
the C_mid grid spans [c_max / 160, 2.5 c_max] and ``fit_start`` defaults to
(1,500 / 16,000) c_max = 0.09375 c_max, i.e. the same fractions of the run the paper used.
The A grid is unit-free and stays the paper's unless ``a_range`` is given.

Reliability. Structural problems raise ValueError naming the curve and the point: non-finite
or negative compute, compute not strictly increasing, pass rate outside [0, 1], fewer fitted
points than the 3 fitted parameters, all fitted pass rates equal. Soft problems (a parameter
at the edge of its grid or bound, A <= R0, no residual degree of freedom, solver not
converged, C_mid beyond the last fitted point so that A is not yet constrained) are listed in
``SigmoidFit.warnings``; such a fit has ``reliable == False``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import least_squares, minimize_scalar
from scipy.special import expit

from scalerl_jax.scaling.curves import sigmoid

GPU_HOURS = "gpu_hours"
PAPER_A_RANGE = (0.450, 0.800)
PAPER_A_STEP = 0.005
PAPER_C_MID_RANGE_GPU_HOURS = (100.0, 40_000.0)
PAPER_NUM_C_MID = 100
PAPER_FIT_START_GPU_HOURS = 1_500.0
PAPER_RUN_GPU_HOURS = 16_000.0  # length of the paper's ablation runs: reference for other units
DEFAULT_B_BOUNDS = (0.05, 20.0)
DEFAULT_NUM_B = 64
DEFAULT_NUM_POLISHED = 4  # pairs whose B is polished exactly before the winner is picked
NUM_SIGMOID_PARAMS = 3  # A, B, C_mid (R0 is measured, not fitted)
METHODS = ("grid", "least_squares")


def normalize_unit(unit: str) -> str:
    """Canonical unit name: lower case, '-' and ' ' as '_' ('GPU-hours' -> 'gpu_hours')."""
    return unit.strip().lower().replace("-", "_").replace(" ", "_")


@dataclasses.dataclass(frozen=True)
class SigmoidGrid:
    """The search space of a sigmoid fit: A values, C_mid values, B bounds and B grid size."""

    a_values: tuple[float, ...]
    c_mid_values: tuple[float, ...]
    b_bounds: tuple[float, float]
    num_b: int


def make_grid(
    unit: str,
    c_max: float,
    *,
    a_range: tuple[float, float] = PAPER_A_RANGE,
    a_step: float = PAPER_A_STEP,
    c_mid_range: tuple[float, float] | None = None,
    num_c_mid: int = PAPER_NUM_C_MID,
    b_bounds: tuple[float, float] = DEFAULT_B_BOUNDS,
    num_b: int = DEFAULT_NUM_B,
) -> SigmoidGrid:
    """The paper's grid for ``unit='gpu_hours'``, else scaled to ``c_max`` (module docstring)."""
    a_lo, a_hi = a_range
    if not (0.0 <= a_lo <= a_hi <= 1.0) or not a_step > 0:
        raise ValueError(f"a_range must satisfy 0 <= lo <= hi <= 1 and a_step > 0; got {a_range}, {a_step}")
    num_a = int(np.floor((a_hi - a_lo) / a_step + 1e-9)) + 1  # lo, lo + step, ... up to hi
    a_values = np.linspace(a_lo, a_lo + (num_a - 1) * a_step, num_a)
    if c_mid_range is None:
        c_mid_range = default_c_mid_range(unit, c_max)
    c_lo, c_hi = c_mid_range
    if not (0 < c_lo < c_hi) or num_c_mid < 2:
        raise ValueError(f"c_mid_range must satisfy 0 < lo < hi with num_c_mid >= 2; got {c_mid_range}, {num_c_mid}")
    b_lo, b_hi = b_bounds
    if not (0 < b_lo < b_hi) or num_b < 3:
        raise ValueError(f"b_bounds must satisfy 0 < lo < hi with num_b >= 3; got {b_bounds}, {num_b}")
    return SigmoidGrid(
        a_values=tuple(float(a) for a in a_values),
        c_mid_values=tuple(float(c) for c in np.linspace(c_lo, c_hi, num_c_mid)),
        b_bounds=(float(b_lo), float(b_hi)),
        num_b=int(num_b),
    )


def default_c_mid_range(unit: str, c_max: float) -> tuple[float, float]:
    """Paper: (100, 40,000) GPU-hours; other units: (c_max / 160, 2.5 c_max)."""
    if normalize_unit(unit) == GPU_HOURS:
        return PAPER_C_MID_RANGE_GPU_HOURS
    scale = c_max / PAPER_RUN_GPU_HOURS
    return (PAPER_C_MID_RANGE_GPU_HOURS[0] * scale, PAPER_C_MID_RANGE_GPU_HOURS[1] * scale)


def default_fit_start(unit: str, c_max: float) -> float:
    """Paper: 1,500 GPU-hours; other units: (1,500 / 16,000) c_max."""
    if normalize_unit(unit) == GPU_HOURS:
        return PAPER_FIT_START_GPU_HOURS
    return PAPER_FIT_START_GPU_HOURS / PAPER_RUN_GPU_HOURS * c_max


def check_curve(
    compute: ArrayLike,
    pass_rate: ArrayLike,
    *,
    name: str = "curve",
    labels: Sequence[str] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Validated float64 copies of a curve's points, or a ValueError naming the bad point.

    Requires 1-D arrays of equal non-zero length, finite compute >= 0 and strictly increasing,
    finite pass rates in [0, 1]. ``labels[i]`` names point i in messages (e.g. 'run.jsonl line
    12'); default 'point i'.
    """
    c = np.asarray(compute, dtype=np.float64)
    y = np.asarray(pass_rate, dtype=np.float64)
    if c.ndim != 1 or y.ndim != 1 or c.shape != y.shape:
        raise ValueError(f"{name}: compute and pass_rate must be 1-D of equal length; got shapes {c.shape}, {y.shape}")
    if c.size == 0:
        raise ValueError(f"{name}: no points")
    if labels is not None and len(labels) != c.size:
        raise ValueError(f"{name}: {len(labels)} labels for {c.size} points")

    def where(i: int) -> str:
        return labels[i] if labels is not None else f"point {i}"

    for i in range(c.size):
        compute_i, rate_i = float(c[i]), float(y[i])
        if not np.isfinite(compute_i) or compute_i < 0:
            raise ValueError(f"{name}, {where(i)}: compute {compute_i!r} is not a finite number >= 0")
        if not np.isfinite(rate_i) or not 0.0 <= rate_i <= 1.0:
            raise ValueError(f"{name}, {where(i)}: pass rate {rate_i!r} is not in [0, 1]")
        if i > 0 and compute_i <= c[i - 1]:
            raise ValueError(
                f"{name}, {where(i)}: compute {compute_i!r} does not increase (previous point, "
                f"{where(i - 1)}, has {float(c[i - 1])!r})"
            )
    return c, y


@dataclasses.dataclass(frozen=True)
class SigmoidFit:
    """A fitted sigmoid with the window and settings it came from.

    ``fit_start``/``fit_end`` bound the fitted compute (``fit_end`` None: unbounded);
    ``num_before_start``/``num_after_end`` count the points outside that window.
    """

    r0: float
    a: float
    b: float
    c_mid: float
    ssr: float
    method: str
    unit: str
    fit_start: float
    fit_end: float | None
    num_points: int
    num_before_start: int
    num_after_end: int
    grid: SigmoidGrid = dataclasses.field(repr=False)
    warnings: tuple[str, ...] = ()
    name: str = "curve"

    def predict(self, c: ArrayLike) -> float | np.ndarray:
        """R(c) of this fit."""
        return sigmoid(c, r0=self.r0, a=self.a, b=self.b, c_mid=self.c_mid)

    @property
    def reliable(self) -> bool:
        """True when no warning was raised by the fit."""
        return not self.warnings

    @property
    def rmse(self) -> float:
        """Root mean squared residual over the fitted points."""
        return float(np.sqrt(self.ssr / self.num_points))


def _weighted_ssr(log_c: np.ndarray, target: np.ndarray, w: np.ndarray, d: float, b: float, log_c_mid: float) -> float:
    """sum_i w_i (t_i - d expit(b (log C_i - log C_mid)))^2."""
    residual = target - d * expit(b * (log_c - log_c_mid))
    return float(w @ residual**2)


def grid_fit_rows(
    c: np.ndarray,
    y: np.ndarray,
    weights: np.ndarray,
    r0: float,
    grid: SigmoidGrid,
    *,
    num_polished: int = DEFAULT_NUM_POLISHED,
) -> list[tuple[float, float, float, float]]:
    """The paper's grid fit, once per row of ``weights`` [R, N]: list of (A, B, C_mid, SSR).

    ``c`` > 0 and ``y`` are the fitted points; row r of ``weights`` weights the squared
    residuals (1 for a plain fit, resampling counts for a bootstrap replicate). The [J, K, N]
    table E is built once and shared by all rows (algorithm in the module docstring). The
    ``num_polished`` pairs with the lowest parabola-refined SSR get their B polished by Brent's
    method and the lowest polished SSR wins, so near-ties between pairs are settled exactly.
    """
    log_c = np.log(c)
    target = y - r0
    d = np.asarray(grid.a_values) - r0
    log_c_mid = np.log(np.asarray(grid.c_mid_values))
    log_b = np.linspace(np.log(grid.b_bounds[0]), np.log(grid.b_bounds[1]), grid.num_b)
    step = log_b[1] - log_b[0]
    basis = expit(np.exp(log_b)[None, :, None] * (log_c[None, None, :] - log_c_mid[:, None, None]))
    basis_sq = basis * basis
    last = grid.num_b - 1
    results = []
    for w in np.atleast_2d(weights):
        # SSR minus the constant sum_i w_i t_i^2, for every (A, C_mid, B_k): [A, J, K].
        ssr = np.multiply.outer(d * d, basis_sq @ w)
        ssr -= np.multiply.outer(2.0 * d, basis @ (w * target))
        k = np.argmin(ssr, axis=-1)
        s0 = np.take_along_axis(ssr, k[..., None], axis=-1)[..., 0]
        s_minus = np.take_along_axis(ssr, np.maximum(k - 1, 0)[..., None], axis=-1)[..., 0]
        s_plus = np.take_along_axis(ssr, np.minimum(k + 1, last)[..., None], axis=-1)[..., 0]
        curvature = s_minus - 2.0 * s0 + s_plus
        interior = (k > 0) & (k < last) & (curvature > 0)
        vertex = np.where(interior, s0 - (s_minus - s_plus) ** 2 / (8.0 * np.where(interior, curvature, 1.0)), s0)
        candidates = np.argpartition(vertex, min(num_polished, vertex.size) - 1, axis=None)[:num_polished]
        best = None
        for ia, ij in zip(*np.unravel_index(candidates, vertex.shape), strict=True):
            kb = int(k[ia, ij])

            def pair_ssr(lb: float, ia=ia, ij=ij, w=w) -> float:
                return _weighted_ssr(log_c, target, w, float(d[ia]), float(np.exp(lb)), float(log_c_mid[ij]))

            lo, hi = log_b[max(kb - 1, 0)], log_b[min(kb + 1, last)]
            polished = minimize_scalar(pair_ssr, bounds=(lo, hi), method="bounded", options={"xatol": 1e-10 * step})
            pair_best = (pair_ssr(log_b[kb]), log_b[kb])
            if polished.fun < pair_best[0]:
                pair_best = (float(polished.fun), float(polished.x))
            if best is None or pair_best[0] < best[0]:
                best = (pair_best[0], grid.a_values[ia], float(np.exp(pair_best[1])), grid.c_mid_values[ij])
        assert best is not None, "at least one (A, C_mid) pair is polished"
        results.append((best[1], best[2], best[3], best[0]))
    return results


def least_squares_refine(
    c: np.ndarray,
    y: np.ndarray,
    w: np.ndarray,
    r0: float,
    grid: SigmoidGrid,
    start: tuple[float, float, float],
) -> tuple[float, float, float, float, bool]:
    """Bounded least squares over (A, log B, log C_mid) from ``start`` = (A, B, C_mid).

    Returns (A, B, C_mid, SSR, converged).
    """
    log_c = np.log(c)
    sqrt_w = np.sqrt(w)
    lower = np.array([0.0, np.log(grid.b_bounds[0]), np.log(min(grid.c_mid_values))])
    upper = np.array([1.0, np.log(grid.b_bounds[1]), np.log(max(grid.c_mid_values))])
    x0 = np.clip(np.array([start[0], np.log(start[1]), np.log(start[2])]), lower, upper)

    def residuals(p: np.ndarray) -> np.ndarray:
        a, log_b, log_c_mid = p
        return sqrt_w * (r0 + (a - r0) * expit(np.exp(log_b) * (log_c - log_c_mid)) - y)

    result = least_squares(residuals, x0, bounds=(lower, upper), method="trf", xtol=1e-12, ftol=1e-12, gtol=1e-12)
    a, log_b, log_c_mid = result.x
    return (
        float(a),
        float(np.exp(log_b)),
        float(np.exp(log_c_mid)),
        float(2.0 * result.cost),
        result.status > 0,
    )


def _edge_warnings(
    a: float, b: float, c_mid: float, r0: float, c_last: float, method: str, grid: SigmoidGrid
) -> list[str]:
    """Warnings: a parameter on the edge of its search space, a curve that does not rise, or a
    midpoint beyond the last fitted compute ``c_last`` (the asymptote is then a guess)."""
    warnings = []
    a_lo, a_hi = (0.0, 1.0) if method == "least_squares" else (grid.a_values[0], grid.a_values[-1])
    if a_hi > a_lo and (np.isclose(a, a_lo, rtol=0, atol=1e-9) or np.isclose(a, a_hi, rtol=0, atol=1e-9)):
        warnings.append(f"A={a:.3f} at the edge of its range [{a_lo:.3f}, {a_hi:.3f}]; widen a_range")
    c_lo, c_hi = min(grid.c_mid_values), max(grid.c_mid_values)
    if np.isclose(c_mid, c_lo, rtol=1e-9) or np.isclose(c_mid, c_hi, rtol=1e-9):
        warnings.append(f"C_mid={c_mid:.4g} at the edge of its range [{c_lo:.4g}, {c_hi:.4g}]")
    b_lo, b_hi = grid.b_bounds
    if np.isclose(b, b_lo, rtol=1e-6) or np.isclose(b, b_hi, rtol=1e-6):
        warnings.append(f"B={b:.4g} at its bound [{b_lo:.4g}, {b_hi:.4g}]")
    if a <= r0:
        warnings.append(f"A={a:.3f} <= R0={r0:.3f}: the fitted curve does not rise")
    if c_mid > c_last:
        warnings.append(f"C_mid={c_mid:.4g} lies beyond the last fitted point ({c_last:.4g}): A is not yet constrained")
    return warnings


@dataclasses.dataclass(frozen=True)
class FitWindow:
    """The points of a curve that a fit uses, and how many it leaves out on each side."""

    c: np.ndarray
    y: np.ndarray
    fit_start: float
    fit_end: float | None
    num_before_start: int
    num_after_end: int


def select_window(
    c: np.ndarray, y: np.ndarray, *, unit: str, fit_start: float | None, fit_end: float | None, name: str
) -> FitWindow:
    """Points with fit_start <= C <= fit_end; defaults per the unit rule; ValueError if too few."""
    before_end = c <= fit_end if fit_end is not None else np.ones(c.shape, dtype=bool)
    if not np.any(before_end):
        raise ValueError(f"{name}: no point has compute <= fit_end={fit_end!r}")
    c_max = float(c[before_end].max())
    if fit_start is None:
        fit_start = default_fit_start(unit, c_max)
    if not fit_start > 0:
        raise ValueError(f"{name}: fit_start must be > 0 (C = 0 anchors R0 and is never fitted); got {fit_start!r}")
    if fit_end is not None and fit_end <= fit_start:
        raise ValueError(f"{name}: fit_end={fit_end!r} must exceed fit_start={fit_start!r}")
    in_window = before_end & (c >= fit_start)
    count = int(in_window.sum())
    if count < NUM_SIGMOID_PARAMS:
        span = f"[{fit_start:g}, {'end' if fit_end is None else format(fit_end, 'g')}] ({unit})"
        advice = "log more eval points or move fit_start/fit_end"
        raise ValueError(
            f"{name}: {count} point(s) in the fit window {span} but the sigmoid has "
            f"{NUM_SIGMOID_PARAMS} fitted parameters (A, B, C_mid); {advice}"
        )
    y_in = y[in_window]
    if np.all(y_in == y_in[0]):
        raise ValueError(
            f"{name}: all {count} pass rates in the fit window equal {float(y_in[0])!r}; "
            "the curve's shape cannot be fitted"
        )
    return FitWindow(
        c=c[in_window],
        y=y_in,
        fit_start=float(fit_start),
        fit_end=None if fit_end is None else float(fit_end),
        num_before_start=int((c < fit_start).sum()),
        num_after_end=int((~before_end).sum()),
    )


def fit_sigmoid(
    compute: ArrayLike,
    pass_rate: ArrayLike,
    *,
    r0: float | None = None,
    fit_start: float | None = None,
    fit_end: float | None = None,
    method: str = "grid",
    unit: str = GPU_HOURS,
    a_range: tuple[float, float] = PAPER_A_RANGE,
    a_step: float = PAPER_A_STEP,
    c_mid_range: tuple[float, float] | None = None,
    num_c_mid: int = PAPER_NUM_C_MID,
    b_bounds: tuple[float, float] = DEFAULT_B_BOUNDS,
    num_b: int = DEFAULT_NUM_B,
    name: str = "curve",
) -> SigmoidFit:
    """Fit R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B) to a curve (module docstring).

    Args:
      compute, pass_rate: 1-D, compute >= 0 strictly increasing, pass rates in [0, 1].
      r0: start pass rate; default the pass rate at the smallest compute.
      fit_start, fit_end: fitted window [fit_start, fit_end]; fit_start default per ``unit``.
      method: 'grid' (paper) or 'least_squares'.
      unit: compute unit; 'gpu_hours' selects the paper's constants, others scale to the data.
      a_range, a_step, c_mid_range, num_c_mid, b_bounds, num_b: the search space (defaults:
        the paper's, C_mid range per ``unit``).
      name: names the curve in errors.
    """
    if method not in METHODS:
        raise ValueError(f"{name}: method must be one of {METHODS}, got {method!r}")
    c, y = check_curve(compute, pass_rate, name=name)
    if r0 is None:
        r0 = float(y[0])
    if not 0.0 <= r0 <= 1.0:
        raise ValueError(f"{name}: r0={r0!r} is not in [0, 1]")
    window = select_window(c, y, unit=unit, fit_start=fit_start, fit_end=fit_end, name=name)
    grid = make_grid(
        unit,
        float(window.c.max()),
        a_range=a_range,
        a_step=a_step,
        c_mid_range=c_mid_range,
        num_c_mid=num_c_mid,
        b_bounds=b_bounds,
        num_b=num_b,
    )
    weights = np.ones_like(window.c)
    a, b, c_mid, ssr = grid_fit_rows(window.c, window.y, weights, r0, grid)[0]
    warnings = []
    if method == "least_squares":
        a, b, c_mid, ssr, converged = least_squares_refine(window.c, window.y, weights, r0, grid, (a, b, c_mid))
        if not converged:
            warnings.append("least_squares did not converge")
    warnings += _edge_warnings(a, b, c_mid, r0, float(window.c.max()), method, grid)
    if window.c.size <= NUM_SIGMOID_PARAMS:
        warnings.append(f"{window.c.size} points for {NUM_SIGMOID_PARAMS} parameters: no residual degree of freedom")
    return SigmoidFit(
        r0=float(r0),
        a=float(a),
        b=float(b),
        c_mid=float(c_mid),
        ssr=float(ssr),
        method=method,
        unit=normalize_unit(unit),
        fit_start=window.fit_start,
        fit_end=window.fit_end,
        num_points=int(window.c.size),
        num_before_start=window.num_before_start,
        num_after_end=window.num_after_end,
        grid=grid,
        warnings=tuple(warnings),
        name=name,
    )


@dataclasses.dataclass(frozen=True)
class ExtrapolationError:
    """|prediction - measurement| over the points beyond a fit's window (none: NaNs)."""

    mae: float
    max_abs: float
    num_points: int


class FittedCurve(Protocol):
    """What ``extrapolation_error`` needs of a fit (``SigmoidFit``, ``PowerLawFit``)."""

    @property
    def name(self) -> str: ...

    @property
    def fit_end(self) -> float | None: ...

    def predict(self, c: ArrayLike) -> float | np.ndarray: ...


def extrapolation_error(fit: FittedCurve, compute: ArrayLike, pass_rate: ArrayLike) -> ExtrapolationError:
    """Mean and max absolute error of ``fit.predict`` on the points with compute > fit.fit_end."""
    c, y = check_curve(compute, pass_rate, name=fit.name)
    if fit.fit_end is None:
        return ExtrapolationError(mae=float("nan"), max_abs=float("nan"), num_points=0)
    held_out = c > fit.fit_end
    if not np.any(held_out):
        return ExtrapolationError(mae=float("nan"), max_abs=float("nan"), num_points=0)
    errors = np.abs(np.asarray(fit.predict(c[held_out])) - y[held_out])
    return ExtrapolationError(mae=float(errors.mean()), max_abs=float(errors.max()), num_points=int(held_out.sum()))
