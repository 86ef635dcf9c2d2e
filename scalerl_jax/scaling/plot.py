"""Paper-style figure of pass rate against compute with fitted sigmoids (matplotlib, Agg).

Per run, one colour: the measured points (filled: fitted; hollow: before fit_start; squares:
held out after fit_end), the fitted sigmoid solid over the fit window and dashed beyond it
(extrapolation), a dotted horizontal line at its asymptote A (with the bootstrap interval as a
band when given), and the region before fit_start shaded. Compute axis logarithmic. Points
at C = 0 cannot sit on a log axis: they are drawn at the left edge and the legend says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from scalerl_jax.scaling.bootstrap import BootstrapIntervals
from scalerl_jax.scaling.fitting import GPU_HOURS, SigmoidFit, normalize_unit

DEFAULT_FIGSIZE = (7.0, 4.5)
DEFAULT_DPI = 150
DEFAULT_EXTEND = 2.0
NUM_CURVE_POINTS = 400
LEGEND_HEADROOM_PER_RUN = 0.07  # fraction of the data's pass-rate span added on top per legend row


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
    """Compute as people read it: '40,000' from 100 up, else 3 significant digits ('0.25')."""
    if 100 <= abs(c) < 1e9:
        return f"{c:,.0f}"
    return f"{c:.3g}"


def _legend_label(series: PlotSeries) -> str:
    fit = series.fit
    if fit is None:
        return f"{series.name} (no fit)"
    a_text = f"A={fit.a:.3f}"
    if series.interval is not None:
        a_text += f"±{series.interval.a_half_width:.3f}"
    flag = "" if fit.reliable else " [unreliable]"
    return f"{series.name}: {a_text}, B={fit.b:.2f}, C_mid={format_compute(fit.c_mid)}{flag}"


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
    """Draw ``series`` (module docstring) to ``path`` (format from its suffix); returns the path.

    The compute axis runs from below the smallest positive compute to ``extend`` times the
    largest; the image is ``figsize * dpi`` pixels.
    """
    if not series:
        raise ValueError("plot_scaling: nothing to plot")
    if extend < 1.0:
        raise ValueError(f"plot_scaling: extend must be >= 1, got {extend}")
    positive = np.concatenate([np.asarray(s.compute)[np.asarray(s.compute) > 0] for s in series])
    if positive.size == 0:
        raise ValueError("plot_scaling: no point has compute > 0; a log axis cannot show them")
    x_left = float(positive.min()) / 1.5
    x_right = float(positive.max()) * extend
    fig = Figure(figsize=figsize, dpi=dpi)
    ax = fig.add_subplot()
    colours = [f"C{i % 10}" for i in range(len(series))]
    num_at_edge = 0
    fit_starts = {s.fit.fit_start for s in series if s.fit is not None}
    shared_start = len(fit_starts) == 1
    if shared_start:
        ax.axvspan(x_left, fit_starts.pop(), color="0.5", alpha=0.12, lw=0)

    for s, colour in zip(series, colours, strict=True):
        c = np.asarray(s.compute, dtype=np.float64)
        y = np.asarray(s.pass_rate, dtype=np.float64)
        fit = s.fit
        drawn_c = np.where(c > 0, c, x_left)
        num_at_edge += int((c <= 0).sum())
        if fit is None:
            fitted = np.ones(c.shape, dtype=bool)
            before = held_out = np.zeros(c.shape, dtype=bool)
        else:
            before = c < fit.fit_start
            held_out = c > fit.fit_end if fit.fit_end is not None else np.zeros(c.shape, dtype=bool)
            fitted = ~before & ~held_out
        ax.plot(drawn_c[fitted], y[fitted], "o", color=colour, ms=4, label=_legend_label(s), clip_on=False)
        ax.plot(drawn_c[before], y[before], "o", mfc="none", color=colour, ms=4, alpha=0.7, clip_on=False)
        ax.plot(drawn_c[held_out], y[held_out], "s", mfc="none", color=colour, ms=4.5)
        if fit is None:
            continue
        if not shared_start:
            ax.axvspan(x_left, fit.fit_start, color=colour, alpha=0.07, lw=0)
        window_end = fit.fit_end if fit.fit_end is not None else float(c.max())
        inside = np.geomspace(fit.fit_start, window_end, NUM_CURVE_POINTS)
        beyond = np.geomspace(window_end, x_right, NUM_CURVE_POINTS)
        ax.plot(inside, fit.predict(inside), "-", color=colour, lw=1.8)
        ax.plot(beyond, fit.predict(beyond), "--", color=colour, lw=1.5)
        ax.axhline(fit.a, color=colour, ls=":", lw=1.0)
        if s.interval is not None:
            ax.axhspan(*s.interval.a, color=colour, alpha=0.10, lw=0)

    ax.set_xscale("log")
    ax.set_xlim(x_left, x_right)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda c, _: format_compute(c)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    levels = [y for s in series for y in np.asarray(s.pass_rate, dtype=np.float64)]
    levels += [s.interval.a[1] if s.interval is not None else s.fit.a for s in series if s.fit is not None]
    y_lo, y_hi = min(levels), max(levels)
    span = max(y_hi - y_lo, 0.05)
    ax.set_ylim(y_lo - 0.05 * span, y_hi + span * LEGEND_HEADROOM_PER_RUN * (len(series) + 1))
    ax.set_xlabel(f"RL training compute ({unit_label(unit)}, log scale)")
    ax.set_ylabel("validation pass rate")
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.1)
    if title:
        ax.set_title(title)
    excluded_note = "excluded from fit" + (" (C=0 drawn at left edge)" if num_at_edge else "")
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
    path = Path(path)
    fig.savefig(path)
    return path
