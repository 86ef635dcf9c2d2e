"""Saturating power-law fit, the comparison the paper draws against its sigmoid.

Model (see ``curves.power_law``): R(C) = A - D * C ** (-alpha), ceiling A, D >= 0, alpha > 0.
Fitted on the same window as the sigmoid (``fitting.select_window``: same fit_start/fit_end
rules). Over the early, still-accelerating part of an RL run it bends too slowly and its
ceiling A overshoots the true asymptote, which is why the paper prefers the sigmoid.

Algorithm: with x = C / C_ref (C_ref the largest fitted compute, for conditioning), for fixed
alpha the model is linear in (A, D'), D' = D C_ref^(-alpha): every alpha on a log grid gets its
linear least-squares (A, D') (clipped into the bounds); the best alpha starts a bounded
trust-region least-squares polish of all three.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import least_squares

from scalerl_jax.scaling.curves import power_law
from scalerl_jax.scaling.fitting import GPU_HOURS, check_curve, normalize_unit, select_window

DEFAULT_A_BOUNDS = (0.0, 1.0)
DEFAULT_ALPHA_BOUNDS = (1e-3, 5.0)
DEFAULT_NUM_ALPHA = 256


@dataclasses.dataclass(frozen=True)
class PowerLawFit:
    """A fitted saturating power law with its window (same conventions as ``SigmoidFit``)."""

    a: float
    d: float
    alpha: float
    ssr: float
    unit: str
    fit_start: float
    fit_end: float | None
    num_points: int
    warnings: tuple[str, ...] = ()
    name: str = "curve"

    def predict(self, c: ArrayLike) -> float | np.ndarray:
        """R(c) = A - D c^(-alpha) of this fit (c > 0)."""
        return power_law(c, a=self.a, d=self.d, alpha=self.alpha)

    @property
    def reliable(self) -> bool:
        """True when no warning was raised by the fit."""
        return not self.warnings


def _linear_start(x: np.ndarray, y: np.ndarray, alphas: np.ndarray, a_bounds: tuple[float, float]) -> np.ndarray:
    """Best (A, D', alpha) over the alpha grid, (A, D') by linear least squares, clipped."""
    basis = np.exp(-alphas[:, None] * np.log(x)[None, :])  # [K, N]: x^(-alpha)
    basis_mean = basis.mean(axis=1)
    centered = basis - basis_mean[:, None]
    variance = np.maximum((centered**2).sum(axis=1), 1e-300)
    d = np.maximum(-(centered @ (y - y.mean())) / variance, 0.0)
    a = np.clip(y.mean() + d * basis_mean, *a_bounds)
    ssr = ((a[:, None] - d[:, None] * basis - y[None, :]) ** 2).sum(axis=1)
    k = int(np.argmin(ssr))
    return np.array([a[k], d[k], alphas[k]])


def fit_power_law(
    compute: ArrayLike,
    pass_rate: ArrayLike,
    *,
    fit_start: float | None = None,
    fit_end: float | None = None,
    unit: str = GPU_HOURS,
    a_bounds: tuple[float, float] = DEFAULT_A_BOUNDS,
    alpha_bounds: tuple[float, float] = DEFAULT_ALPHA_BOUNDS,
    num_alpha: int = DEFAULT_NUM_ALPHA,
    name: str = "curve",
) -> PowerLawFit:
    """Fit R(C) = A - D C^(-alpha) on the window [fit_start, fit_end] (module docstring)."""
    if not (a_bounds[0] < a_bounds[1]) or not (0 < alpha_bounds[0] < alpha_bounds[1]) or num_alpha < 2:
        raise ValueError(f"{name}: bad power-law bounds a={a_bounds}, alpha={alpha_bounds}, num_alpha={num_alpha}")
    c, y = check_curve(compute, pass_rate, name=name)
    window = select_window(c, y, unit=unit, fit_start=fit_start, fit_end=fit_end, name=name)
    c_ref = float(window.c.max())
    x = window.c / c_ref
    alphas = np.geomspace(alpha_bounds[0], alpha_bounds[1], num_alpha)
    start = _linear_start(x, window.y, alphas, a_bounds)
    lower = np.array([a_bounds[0], 0.0, alpha_bounds[0]])
    upper = np.array([a_bounds[1], np.inf, alpha_bounds[1]])

    def residuals(p: np.ndarray) -> np.ndarray:
        a, d_scaled, alpha = p
        return a - d_scaled * np.exp(-alpha * np.log(x)) - window.y

    result = least_squares(residuals, start, bounds=(lower, upper), method="trf", xtol=1e-12, ftol=1e-12, gtol=1e-12)
    a, d_scaled, alpha = (float(v) for v in result.x)
    warnings = []
    if result.status <= 0:
        warnings.append("least_squares did not converge")
    if np.isclose(a, a_bounds[0], rtol=0, atol=1e-9) or np.isclose(a, a_bounds[1], rtol=0, atol=1e-9):
        warnings.append(f"A={a:.3f} at its bound {a_bounds}")
    if np.isclose(alpha, alpha_bounds[0], rtol=1e-6) or np.isclose(alpha, alpha_bounds[1], rtol=1e-6):
        warnings.append(f"alpha={alpha:.4g} at its bound {alpha_bounds}")
    return PowerLawFit(
        a=a,
        d=d_scaled * c_ref**alpha,
        alpha=alpha,
        ssr=float(2.0 * result.cost),
        unit=normalize_unit(unit),
        fit_start=window.fit_start,
        fit_end=window.fit_end,
        num_points=int(window.c.size),
        warnings=tuple(warnings),
        name=name,
    )
