"""Closed-form compute-performance curves, and the computes at which two curves cross.

Sigmoid (ScaleRL, arXiv 2510.13786, Eq. 1), for compute C >= 0:

  R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B)
       = R0 + (A - R0) * expit(B * (log C - log C_mid))

R0 is the pass rate at the start of training (R(0) = R0), A the asymptote, B > 0 the
efficiency exponent and C_mid the compute at which half of the gain A - R0 is reached.

Saturating power law (the comparison curve), for C > 0:

  R(C) = A - D * C ** (-alpha)

with ceiling A, D > 0 and alpha > 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import brentq
from scipy.special import expit

# scipy's brentq has no annotations: pyright infers its types from the source (a float64 rtol, a
# tuple return for full_output=True); called without full_output it returns the root, a float.
_brentq = cast(Callable[..., float], brentq)


def _as_compute(c: ArrayLike, *, allow_zero: bool) -> np.ndarray:
    """Float64 view of ``c``; negative compute (or zero when not allowed) is a ValueError."""
    c = np.asarray(c, dtype=np.float64)
    bad = (c < 0) if allow_zero else (c <= 0)
    if np.any(bad):
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"compute must be {bound}; got compute{list(first)} = {float(c[first])!r}")
    return c


def _scalar_or_array(x: np.ndarray) -> float | np.ndarray:
    return float(x) if x.ndim == 0 else x


def sigmoid(c: ArrayLike, *, r0: float, a: float, b: float, c_mid: float) -> float | np.ndarray:
    """ScaleRL's curve ``R0 + (A - R0) / (1 + (C_mid / C) ** B)`` at compute ``c`` (>= 0).

    Evaluated as ``R0 + (A - R0) * expit(B * (log C - log C_mid))`` so that C = 0 gives R0 and
    large B does not overflow. Scalar in, float out; array in, array out.
    """
    if not b > 0:
        raise ValueError(f"sigmoid: b must be > 0, got {b!r}")
    if not c_mid > 0:
        raise ValueError(f"sigmoid: c_mid must be > 0, got {c_mid!r}")
    c = _as_compute(c, allow_zero=True)
    with np.errstate(divide="ignore"):
        log_c = np.log(c)
    return _scalar_or_array(r0 + (a - r0) * expit(b * (log_c - np.log(c_mid))))


def power_law(c: ArrayLike, *, a: float, d: float, alpha: float) -> float | np.ndarray:
    """Saturating power law ``A - D * C ** (-alpha)`` at compute ``c`` (> 0)."""
    c = _as_compute(c, allow_zero=False)
    return _scalar_or_array(a - d * np.exp(-alpha * np.log(c)))


def crossing_computes(
    first: Callable[[float | np.ndarray], float | np.ndarray],
    second: Callable[[float | np.ndarray], float | np.ndarray],
    *,
    c_lo: float,
    c_hi: float,
    num_scan: int = 4096,
    xtol: float = 1e-9,
) -> tuple[float, ...]:
    """Computes in ``[c_lo, c_hi]`` where ``first(c) == second(c)``, ascending.

    The difference is scanned on ``num_scan`` log-spaced points; every sign change is refined
    with Brent's method to relative tolerance ``xtol``. Crossings closer together than one scan
    step can be missed (two sigmoids cross at most twice, so the default scan is ample).
    Raises ValueError if the curves coincide on the whole scan.
    """
    if not 0 < c_lo < c_hi:
        raise ValueError(f"crossing_computes: need 0 < c_lo < c_hi, got c_lo={c_lo!r}, c_hi={c_hi!r}")
    if num_scan < 2:
        raise ValueError(f"crossing_computes: num_scan must be >= 2, got {num_scan}")

    def gap(c: float | np.ndarray) -> np.ndarray:
        return np.asarray(first(c), dtype=np.float64) - np.asarray(second(c), dtype=np.float64)

    scan = np.geomspace(c_lo, c_hi, num_scan)
    values = gap(scan)
    if np.all(values == 0):
        raise ValueError("crossing_computes: the two curves coincide on the whole range")
    roots = [float(c) for c, v in zip(scan, values, strict=True) if v == 0]
    for i in np.flatnonzero(values[:-1] * values[1:] < 0):
        roots.append(float(_brentq(gap, scan[i], scan[i + 1], xtol=xtol * scan[i], rtol=xtol)))
    return tuple(sorted(roots))
