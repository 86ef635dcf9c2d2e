"""Speed of the paper's sigmoid grid fit: vectorized B solve vs a per-pair scipy loop.

The paper's grid: 71 A values x 100 C_mid values, B least squares per pair, on 50 points
(a ScaleRL-8B-like curve, Table 1: A 0.610, B 1.92, C_mid 2,542, with 0.003 noise). Baseline:
the naive procedure, one bounded ``scipy.optimize.curve_fit`` of B per (A, C_mid) pair (7,100
calls), run in the same process. Prints median wall times, the ratio, and how far the two
solutions are apart. BLAS is pinned to one thread (target: under 2 s on one core).

  .venv/bin/python benchmarks/bench_sigmoid_grid.py [--repeats 5] [--baseline-repeats 1]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import TypeVar  # noqa: E402

import numpy as np  # noqa: E402
from scipy.optimize import OptimizeWarning, curve_fit  # noqa: E402
from scipy.special import expit  # noqa: E402

from scalerl_jax.scaling import fit_sigmoid, make_grid, sigmoid  # noqa: E402


def naive_grid_fit(c: np.ndarray, y: np.ndarray, r0: float, a_values, c_mid_values, b_bounds) -> tuple:
    """One bounded curve_fit of B per (A, C_mid) pair; the lowest SSR wins: (A, B, C_mid, SSR)."""
    best = (np.inf, None)
    log_c = np.log(c)
    for a in a_values:
        for c_mid in c_mid_values:
            log_c_mid = np.log(c_mid)

            def model(_, b, a=a, log_c_mid=log_c_mid):
                return r0 + (a - r0) * expit(b * (log_c - log_c_mid))

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", OptimizeWarning)
                (b,), _ = curve_fit(model, c, y, p0=[1.0], bounds=b_bounds)
            ssr = float(((model(c, b) - y) ** 2).sum())
            if ssr < best[0]:
                best = (ssr, (a, b, c_mid, ssr))
    _, params = best
    assert params is not None, "no (A, C_mid) pair to fit"
    return params


T = TypeVar("T")


def timed(fn: Callable[[], T], repeats: int) -> tuple[float, T]:
    """Median wall time of ``repeats`` calls of ``fn`` and the last call's result."""
    times, results = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        results.append(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), results[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline-repeats", type=int, default=1)
    parser.add_argument("--num-points", type=int, default=50)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    c = np.linspace(1_500.0, 16_000.0, args.num_points)
    y = np.asarray(sigmoid(c, r0=0.3, a=0.610, b=1.92, c_mid=2_542.0)) + rng.normal(0.0, 0.003, c.size)
    r0 = 0.3
    grid = make_grid("gpu_hours", float(c.max()))
    print(f"points={c.size}  grid: {len(grid.a_values)} A x {len(grid.c_mid_values)} C_mid, B grid {grid.num_b}")

    fast_time, fast = timed(lambda: fit_sigmoid(c, y, r0=r0, fit_start=c[0]), args.repeats)
    slow_time, slow = timed(
        lambda: naive_grid_fit(c, y, r0, grid.a_values, grid.c_mid_values, grid.b_bounds),
        args.baseline_repeats,
    )
    for label, repeats, seconds, (a, b, c_mid, ssr) in (
        ("vectorized grid", args.repeats, fast_time, (fast.a, fast.b, fast.c_mid, fast.ssr)),
        ("naive curve_fit loop", args.baseline_repeats, slow_time, slow),
    ):
        print(
            f"{label:21s} (median of {repeats}): {seconds:8.3f} s  A={a:.3f} B={b:.4f} C_mid={c_mid:,.1f} SSR={ssr:.6e}"
        )
    print(f"speed-up (naive / vectorized): {slow_time / fast_time:.1f}x")
    print(f"SSR vectorized - naive: {fast.ssr - slow[3]:+.3e} (negative: the vectorized fit found a lower SSR)")


if __name__ == "__main__":
    main()
