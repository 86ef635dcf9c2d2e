"""Bootstrap intervals for a sigmoid fit's A, B and C_mid.

Case resampling over the fitted points: replicate r draws the N points of the fit window N
times with replacement, i.e. multinomial counts n_r[i] with sum_i n_r[i] = N, and refits with
the same R0, window, grid and method, each point's squared residual weighted by n_r[i]. The
interval at ``level`` is the percentile interval [q((1 - level) / 2), q((1 + level) / 2)] of the
replicates. Replicates with fewer distinct points than fitted parameters, or whose drawn pass
rates are all equal, cannot be fitted: they are skipped and counted.

The yardstick: the paper reports A varying by about +-0.02 between repeated runs of one
recipe, which also covers run-to-run noise that a bootstrap of one run cannot see.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import ArrayLike

from scalerl_jax.scaling.fitting import (
    NUM_SIGMOID_PARAMS,
    SigmoidFit,
    check_curve,
    grid_fit_rows,
    least_squares_refine,
)

PAPER_A_RUN_TO_RUN = 0.02


@dataclasses.dataclass(frozen=True)
class BootstrapIntervals:
    """Percentile intervals (lo, hi) of A, B and C_mid over the bootstrap replicates."""

    a: tuple[float, float]
    b: tuple[float, float]
    c_mid: tuple[float, float]
    level: float
    num_samples: int
    num_skipped: int

    @property
    def a_half_width(self) -> float:
        """Half the width of the A interval (the '+-' next to A)."""
        return 0.5 * (self.a[1] - self.a[0])


def bootstrap_sigmoid(
    compute: ArrayLike,
    pass_rate: ArrayLike,
    fit: SigmoidFit,
    *,
    num_samples: int = 200,
    level: float = 0.95,
    seed: int = 0,
) -> BootstrapIntervals:
    """Percentile bootstrap intervals of ``fit``'s parameters over its fitted points."""
    if num_samples < 1:
        raise ValueError(f"{fit.name}: num_samples must be >= 1, got {num_samples}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"{fit.name}: level must be in (0, 1), got {level}")
    c, y = check_curve(compute, pass_rate, name=fit.name)
    in_window = c >= fit.fit_start
    if fit.fit_end is not None:
        in_window &= c <= fit.fit_end
    c, y = c[in_window], y[in_window]
    if c.size != fit.num_points:
        raise ValueError(f"{fit.name}: {c.size} points in the fit window but the fit used {fit.num_points}")
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(c.size, np.full(c.size, 1.0 / c.size), size=num_samples).astype(np.float64)
    drawn = counts > 0
    distinct_points = drawn.sum(axis=1)
    y_drawn_max = np.where(drawn, y[None, :], -np.inf).max(axis=1)
    y_drawn_min = np.where(drawn, y[None, :], np.inf).min(axis=1)
    usable = (distinct_points >= NUM_SIGMOID_PARAMS) & (y_drawn_max > y_drawn_min)
    if not np.any(usable):
        raise ValueError(f"{fit.name}: none of the {num_samples} bootstrap replicates can be fitted")
    rows = grid_fit_rows(c, y, counts[usable], fit.r0, fit.grid)
    if fit.method == "least_squares":
        rows = [
            least_squares_refine(c, y, w, fit.r0, fit.grid, row[:3])[:4]
            for w, row in zip(counts[usable], rows, strict=True)
        ]
    params = np.array([row[:3] for row in rows])
    tails = [(1.0 - level) / 2.0, (1.0 + level) / 2.0]
    lo, hi = np.quantile(params, tails, axis=0)
    return BootstrapIntervals(
        a=(float(lo[0]), float(hi[0])),
        b=(float(lo[1]), float(hi[1])),
        c_mid=(float(lo[2]), float(hi[2])),
        level=level,
        num_samples=num_samples,
        num_skipped=int((~usable).sum()),
    )
