"""The scaling figure (a run's scaling.png, `fit --plot`): its compute axis spans the fitted points,
not the untrained start, and its tick labels are few and do not overlap."""

import json

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from scalerl_jax.scaling import read_run
from scalerl_jax.scaling.plot import PlotSeries, log_ticks, scaling_figure
from scalerl_jax.scaling.report import FitOptions, fit_run


def write_metrics(path):
    """What main logs: the step-0 evaluation at the 1.7e-6 device-hours spent before training
    (docs/results/study_long_extended), then an evaluation every 5 steps at 0.01 device-hours per
    step (0.05, 0.10, ..., 1.00), pass rates on a sigmoid (A 0.8, C_mid 0.3, B 1.5) from 0.3."""
    rows = [{"step": 0, "compute/device_hours": 1.7e-6, "compute/unit": "device_hours", "eval/pass_rate": 0.3}]
    for step in range(5, 101, 5):
        hours = 0.01 * step
        rate = 0.3 + 0.5 / (1.0 + (0.3 / hours) ** 1.5)
        rows.append(
            {"step": step, "compute/device_hours": hours, "compute/unit": "device_hours", "eval/pass_rate": rate}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def figure_of(tmp_path, **options):
    run = read_run(write_metrics(tmp_path / "metrics.jsonl"))
    report = fit_run(run, FitOptions(bootstrap=0, **options))
    assert report.fit is not None, report.error
    series = [PlotSeries("run", run.compute, run.pass_rate, fit=report.fit)]
    return scaling_figure(series, unit=run.unit)


def tick_labels(figure):
    """The x tick labels drawn inside the axis, as (text, pixel box)."""
    FigureCanvasAgg(figure).draw()
    ax = figure.axes[0]
    lo, hi = ax.get_xlim()
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    return [
        (label.get_text(), label.get_window_extent(renderer))
        for tick, label in zip(ax.xaxis.get_majorticklocs(), ax.get_xticklabels(), strict=True)
        if lo <= tick <= hi and label.get_text()
    ]


def test_the_run_figure_spans_the_fitted_points_not_the_untrained_start(tmp_path):
    # Default fit window for device-hours: from 0.09375 x the largest compute (1.00), so the fitted
    # points are 0.10 ... 1.00; the axis runs from 0.10 / 2 to 2 x 1.00 (the default extension).
    figure = figure_of(tmp_path)
    assert figure.axes[0].get_xlim() == pytest.approx((0.05, 2.0))
    drawn = np.concatenate([np.asarray(line.get_xdata(), dtype=np.float64) for line in figure.axes[0].lines])
    assert drawn[drawn > 0].min() >= 0.05  # the step-0 point (1.7e-6) is not drawn


def test_a_later_fit_start_moves_the_axis_and_the_labels_are_plain_and_apart(tmp_path):
    figure = figure_of(tmp_path, fit_start=0.2)  # fitted: 0.20 ... 1.00
    assert figure.axes[0].get_xlim() == pytest.approx((0.1, 2.0))
    labels = tick_labels(figure)
    assert [text for text, _ in labels] == ["0.1", "0.2", "0.5", "1", "2"]
    boxes = [box for _, box in labels]
    assert all(left.x1 < right.x0 for left, right in zip(boxes, boxes[1:]))  # no label runs into the next


@pytest.mark.parametrize(
    ("lo", "hi", "expected"),
    [
        (0.1, 2.0, [0.1, 0.2, 0.5, 1.0, 2.0]),
        (0.45, 0.95, [0.5, 0.6, 0.7, 0.8, 0.9]),  # within one decade: every mantissa
        (0.05, 3.0, [0.05, 0.1, 0.2, 0.5, 1.0, 2.0]),
        (0.02, 6.0, [0.03, 0.1, 0.3, 1.0, 3.0]),  # 1, 2, 5 would be 8 labels
        (1.3e-6, 3.0, [1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]),  # six decades: one label each
        (1e-9, 1.0, [1e-8, 1e-6, 1e-4, 1e-2, 1.0]),  # nine: every other decade
    ],
)
def test_log_ticks(lo, hi, expected):
    assert log_ticks(lo, hi) == pytest.approx(expected)
