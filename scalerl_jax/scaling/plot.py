"""Paper-style figure of pass rate against compute with fitted sigmoids (matplotlib, Agg).

Per run, one colour: the measured points (filled: fitted; hollow: before fit_start; squares:
held out after fit_end), the fitted sigmoid solid over the fit window and dashed beyond it
(extrapolation), a dotted horizontal line at its asymptote A (with the bootstrap interval as a
band when given), and the region before fit_start shaded. Compute axis logarithmic, over the
fitted compute range (``compute_limits``): the untrained start (a few milliseconds of compute at
step 0, or C = 0, which a log axis cannot show) and the earlier points before the fit window would
stretch it by decades and squeeze the fitted points into the last one; the points left of the axis
are counted in the key. At most ``MAX_TICKS`` labelled ticks (``log_ticks``), plain numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

from scalerl_jax.scaling.bootstrap import BootstrapIntervals
from scalerl_jax.scaling.fitting import GPU_HOURS, SigmoidFit, normalize_unit

DEFAULT_FIGSIZE = (7.0, 4.5)
DEFAULT_DPI = 150
DEFAULT_EXTEND = 2.0
NUM_CURVE_POINTS = 400
LEGEND_HEADROOM_PER_RUN = 0.07  # fraction of the data's pass-rate span added on top per legend row
FIT_MARGIN = 2.0  # the axis starts this factor below the smallest fitted compute
MAX_TICKS = 6
# Mantissas of the labelled ticks per decade, densest first (`log_ticks`).
TICK_MANTISSAS = ((1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 5), (1, 3), (1,))


@dataclasses.dataclass(frozen=True)
class PlotSeries:
    """One run to draw: its points, its fit (None if it could not be fitted), its A interval."""

    name: str
    compute: np.ndarray
    pass_rate: np.ndarray
    fit: SigmoidFit | None = None
    interval: BootstrapIntervals | None = None


def unit_label(unit: str) -> str:
    """Axis label text for a unit name ('gpu_hours' -> 'GPU-hours')."""
    unit = normalize_unit(unit)
    return "GPU-hours" if unit == GPU_HOURS else unit.replace("_", "-")


def format_compute(c: float) -> str:
    """Compute as people read it: '40,000' from 100 up, else 3 significant digits ('0.25',
    '5e-5')."""
    if 100 <= abs(c) < 1e9:
        return f"{c:,.0f}"
    return f"{c:.3g}".replace("e-0", "e-").replace("e+0", "e+")


def _legend_label(series: PlotSeries) -> str:
    fit = series.fit
    if fit is None:
        return f"{series.name} (no fit)"
    a_text = f"A={fit.a:.3f}"
    if series.interval is not None:
        a_text += f"±{series.interval.a_half_width:.3f}"
    flag = "" if fit.reliable else " [unreliable]"
    return f"{series.name}: {a_text}, B={fit.b:.2f}, C_mid={format_compute(fit.c_mid)}{flag}"


def log_ticks(lo: float, hi: float, max_ticks: int = MAX_TICKS) -> list[float]:
    """The labelled ticks of a log axis over [lo, hi] (0 < lo < hi): m x 10^k for the mantissas m of
    the densest set of ``TICK_MANTISSAS`` that puts at most ``max_ticks`` ticks in [lo, hi]; when
    even whole decades are too many, every s-th decade (10^k with k divisible by s) for the
    smallest such stride s."""
    if not 0 < lo < hi:
        raise ValueError(f"log_ticks: need 0 < lo < hi, got {lo}, {hi}")
    first, last = int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi)))
    within = lo * (1 - 1e-9), hi * (1 + 1e-9)

    def ticks(mantissas: Sequence[int], stride: int) -> list[float]:
        decades = [k for k in range(first, last + 1) if k % stride == 0]
        return [m * 10.0**k for k in decades for m in mantissas if within[0] <= m * 10.0**k <= within[1]]

    for mantissas in TICK_MANTISSAS:
        chosen = ticks(mantissas, 1)
        if len(chosen) <= max_ticks:
            return chosen
    stride = 2
    while len(chosen := ticks((1,), stride)) > max_ticks:
        stride += 1
    return chosen


def _fitted(series: PlotSeries) -> np.ndarray:
    """Mask of the points ``series``'s fit used (all points with compute > 0 when it has none)."""
    c = np.asarray(series.compute, dtype=np.float64)
    fit = series.fit
    if fit is None:
        return c > 0
    return (c >= fit.fit_start) & (c > 0) & (c <= (fit.fit_end if fit.fit_end is not None else np.inf))


def compute_limits(series: Sequence[PlotSeries], extend: float) -> tuple[float, float]:
    """The compute axis: from the smallest fitted compute / ``FIT_MARGIN`` to ``extend`` x the
    largest compute of any point (fitted or held out). ValueError when no point is fitted."""
    fitted = np.concatenate([np.asarray(s.compute, dtype=np.float64)[_fitted(s)] for s in series])
    if fitted.size == 0:
        raise ValueError("plot_scaling: no fitted point has compute > 0; a log axis cannot show them")
    largest = max(float(np.max(s.compute)) for s in series)
    return float(fitted.min()) / FIT_MARGIN, largest * extend


def scaling_figure(
    series: Sequence[PlotSeries],
    *,
    unit: str,
    title: str | None = None,
    extend: float = DEFAULT_EXTEND,
    figsize: tuple[float, float] = DEFAULT_FIGSIZE,
    dpi: int = DEFAULT_DPI,
) -> Figure:
    """The figure of ``series`` (module docstring), ``figsize * dpi`` pixels; its compute axis is
    ``compute_limits(series, extend)``."""
    if not series:
        raise ValueError("plot_scaling: nothing to plot")
    if extend < 1.0:
        raise ValueError(f"plot_scaling: extend must be >= 1, got {extend}")
    x_left, x_right = compute_limits(series, extend)
    fig = Figure(figsize=figsize, dpi=dpi)
    ax = fig.add_subplot()
    colours = [f"C{i % 10}" for i in range(len(series))]
    num_left_out = 0
    fit_starts = {s.fit.fit_start for s in series if s.fit is not None}
    shared_start = len(fit_starts) == 1
    if shared_start:
        ax.axvspan(x_left, fit_starts.pop(), color="0.5", alpha=0.12, lw=0)

    for s, colour in zip(series, colours, strict=True):
        c = np.asarray(s.compute, dtype=np.float64)
        y = np.asarray(s.pass_rate, dtype=np.float64)
        fit = s.fit
        num_left_out += int((c < x_left).sum())
        fitted = _fitted(s)
        if fit is None:
            before = held_out = np.zeros(c.shape, dtype=bool)
        else:
            before = (c < fit.fit_start) & (c >= x_left)
            held_out = c > fit.fit_end if fit.fit_end is not None else np.zeros(c.shape, dtype=bool)
        ax.plot(c[fitted], y[fitted], "o", color=colour, ms=4, label=_legend_label(s), clip_on=False)
        ax.plot(c[before], y[before], "o", mfc="none", color=colour, ms=4, alpha=0.7, clip_on=False)
        ax.plot(c[held_out], y[held_out], "s", mfc="none", color=colour, ms=4.5)
        if fit is None:
            continue
        if not shared_start:
            ax.axvspan(x_left, fit.fit_start, color=colour, alpha=0.07, lw=0)
        window_end = fit.fit_end if fit.fit_end is not None else float(c.max())
        inside = np.geomspace(max(fit.fit_start, x_left), window_end, NUM_CURVE_POINTS)
        beyond = np.geomspace(window_end, x_right, NUM_CURVE_POINTS)
        ax.plot(inside, fit.predict(inside), "-", color=colour, lw=1.8)
        ax.plot(beyond, fit.predict(beyond), "--", color=colour, lw=1.5)
        ax.axhline(fit.a, color=colour, ls=":", lw=1.0)
        if s.interval is not None:
            ax.axhspan(*s.interval.a, color=colour, alpha=0.10, lw=0)

    ax.set_xscale("log")
    ax.set_xlim(x_left, x_right)
    ax.xaxis.set_major_locator(FixedLocator(log_ticks(x_left, x_right)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda c, _: format_compute(c)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    shown = [
        y
        for s in series
        for c, y in zip(np.asarray(s.compute), np.asarray(s.pass_rate, dtype=np.float64), strict=True)
        if c >= x_left
    ]
    levels = shown + [s.interval.a[1] if s.interval is not None else s.fit.a for s in series if s.fit is not None]
    y_lo, y_hi = min(levels), max(levels)
    span = max(y_hi - y_lo, 0.05)
    ax.set_ylim(y_lo - 0.05 * span, y_hi + span * LEGEND_HEADROOM_PER_RUN * (len(series) + 1))
    ax.set_xlabel(f"RL training compute ({unit_label(unit)}, log scale)")
    ax.set_ylabel("validation pass rate")
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.1)
    if title:
        ax.set_title(title)
    excluded_note = "excluded from fit" + (f" ({num_left_out} left of the axis)" if num_left_out else "")
    key = [
        Line2D([], [], color="0.3", marker="o", ls="", ms=4, label="fitted points"),
        Line2D([], [], color="0.3", marker="o", mfc="none", ls="", ms=4, label=excluded_note),
        Line2D([], [], color="0.3", marker="s", mfc="none", ls="", ms=4.5, label="held out"),
        Line2D([], [], color="0.3", ls="-", label="sigmoid fit"),
        Line2D([], [], color="0.3", ls="--", label="extrapolation"),
        Line2D([], [], color="0.3", ls=":", label="asymptote A"),
    ]
    run_legend = ax.legend(loc="upper left", fontsize=7, frameon=False)
    ax.add_artist(run_legend)
    ax.legend(handles=key, loc="lower right", fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


def plot_scaling(
    series: Sequence[PlotSeries],
    path: str | Path,
    *,
    unit: str,
    title: str | None = None,
    extend: float = DEFAULT_EXTEND,
    figsize: tuple[float, float] = DEFAULT_FIGSIZE,
    dpi: int = DEFAULT_DPI,
) -> Path:
    """Saves ``scaling_figure(series, ...)`` to ``path`` (format from its suffix); returns the path."""
    figure = scaling_figure(series, unit=unit, title=title, extend=extend, figsize=figsize, dpi=dpi)
    path = Path(path)
    figure.savefig(path)
    return path
