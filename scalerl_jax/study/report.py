"""A study's results on disk: its runs read back, the tables (stdout and STUDY/study.md) and the
figures (STUDY/curves.png: every variant's points and early-half fit on one log-compute axis with
its cut; STUDY/params.png: A and B per variant with the spread over seeds; STUDY/extrapolation.png:
late RMSE against fit-window end, sigmoid and power law, per variant with the spread over seeds)."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from scalerl_jax.config.variants import BASELINE
from scalerl_jax.scaling import RunCurve, read_run
from scalerl_jax.scaling.fitting import PAPER_A_RANGE, PAPER_FIT_START_GPU_HOURS, PAPER_RUN_GPU_HOURS
from scalerl_jax.scaling.plot import format_compute, unit_label
from scalerl_jax.study import driver
from scalerl_jax.study.analysis import (
    CROSSING_HORIZON,
    RMSE_CLAIM,
    SPREAD_FACTOR,
    Claim,
    Crossing,
    CurveFit,
    FitEndResult,
    PairCrossings,
    PairOrder,
    Spread,
    VariantResult,
    lead_by_compute,
    order_claims,
    pair_crossings,
    rmse_claims,
)

REPORT_FILE = "study.md"
CURVES_FIGURE = "curves.png"
PARAMS_FIGURE = "params.png"
EXTRAPOLATION_FIGURE = "extrapolation.png"
MODELS = (("sigmoid", "late_rmse", "final_error"), ("power law", "power_law_late_rmse", "power_law_final_error"))
CURVE_EXTEND = 1.5  # fitted curves drawn up to this factor x the last compute


def has_evaluation(run_dir: Path, metric: str = driver.PASS_RATE_KEY) -> bool:
    path = run_dir / driver.METRICS_FILE
    return path.is_file() and any(metric in r for r in driver.read_jsonl(path))


def _seed_number(path: Path) -> int | None:
    suffix = path.name[len("seed") :]
    return int(suffix) if path.name.startswith("seed") and suffix.isdigit() else None


def study_variants(study_dir: Path) -> list[str]:
    """The variants of STUDY: study.json's order when it exists, else the directories holding
    seed<k> runs (baseline first, then by name)."""
    found = {
        p.name for p in study_dir.iterdir() if p.is_dir() and any(_seed_number(s) is not None for s in p.iterdir())
    }
    spec = study_dir / driver.STUDY_FILE
    if spec.is_file():
        order = json.loads(spec.read_text(encoding="utf-8"))["variants"]
        return [v for v in order if v in found] + sorted(found - set(order))
    return sorted(found, key=lambda v: (v != BASELINE, v))


def read_study(study_dir: Path, *, metric: str = driver.PASS_RATE_KEY) -> dict[str, list[RunCurve]]:
    """Each variant's runs that have logged an evaluation of `metric` (a domain's:
    `eval/code/pass_rate`), by seed, as curves of it (runs without one are left out)."""
    if not study_dir.is_dir():
        raise ValueError(f"{study_dir}: no such study directory")
    runs = {}
    for variant in study_variants(study_dir):
        numbered = [(n, s) for s in (study_dir / variant).iterdir() if (n := _seed_number(s)) is not None]
        seeds = [s for _, s in sorted(numbered, key=lambda pair: pair[0])]
        curves = [
            read_run(s, name=f"{variant}/{s.name}", allow_partial_last_line=True, pass_rate_key=metric)
            for s in seeds
            if has_evaluation(s, metric)
        ]
        if curves:
            runs[variant] = curves
    if not runs:
        raise ValueError(f"{study_dir}: no run with an evaluation under <variant>/seed<k>/{driver.METRICS_FILE}")
    return runs


def study_a_range(study_dir: Path, runs: dict[str, list[RunCurve]]) -> tuple[float, float]:
    """The runs' `eval.fit_a_range` when their config.json files agree on one, else the paper's."""
    ranges = set()
    for curves in runs.values():
        for run in curves:
            config = Path(run.path).parent / driver.RUN_CONFIG_FILE
            if not config.is_file():
                return PAPER_A_RANGE
            ranges.add(tuple(json.loads(config.read_text(encoding="utf-8"))["eval"]["fit_a_range"]))
    return ranges.pop() if len(ranges) == 1 else PAPER_A_RANGE


def _num(x: float, digits: int = 3) -> str:
    return "-" if not math.isfinite(x) else f"{x:.{digits}f}"


def _spread(result: VariantResult, parameter: str, digits: int) -> str:
    s = result.spread(parameter)
    if s.count == 0:
        return "-"
    value = format_compute(s.mean) if parameter == "c_mid" else f"{s.mean:.{digits}f}"
    if s.count == 1:
        return value
    std = format_compute(s.std) if parameter == "c_mid" else f"{s.std:.{digits}f}"
    return f"{value} ± {std}"


def _interval(low: float, high: float, digits: int, compute: bool = False) -> str:
    text = format_compute if compute else (lambda x: f"{x:.{digits}f}")
    return f"[{text(low)}, {text(high)}]"


def _status(fit: CurveFit) -> str:
    if fit.fit is None:
        return f"NO FIT: {fit.error}"
    notes = list(fit.fit.warnings) + ([f"no bootstrap: {fit.interval_error}"] if fit.interval_error else [])
    return "ok" if not notes else ("unreliable: " if fit.fit.warnings else "") + "; ".join(notes)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def variant_table(results: Sequence[VariantResult]) -> str:
    """One row per variant: the compute of its mean curve's last evaluation (C_end: what the same
    steps cost), spread over seeds, the mean-curve fit with its bootstrap interval, and its
    extrapolation to the held-back half."""
    header = [
        "variant",
        "seeds",
        "C_end",
        "A (seeds)",
        "B (seeds)",
        "C_mid (seeds)",
        "A (mean curve) [boot]",
        "B [boot]",
        "C_mid [boot]",
        "fitted/held",
        "late RMSE",
        "final err",
        "late obs",
        "late pred",
        "status",
    ]
    rows = []
    for r in results:
        m = r.mean_fit
        f, i = m.fit, m.interval
        rows.append(
            [
                r.name,
                str(len(r.seed_fits)),
                format_compute(float(m.curve.compute[-1])),
                _spread(r, "a", 3),
                _spread(r, "b", 2),
                _spread(r, "c_mid", 0),
                "-" if f is None else f"{f.a:.3f} " + (_interval(*i.a, 3) if i else ""),
                "-" if f is None else f"{f.b:.2f} " + (_interval(*i.b, 2) if i else ""),
                "-"
                if f is None
                else f"{format_compute(f.c_mid)} " + (_interval(*i.c_mid, 0, compute=True) if i else ""),
                "-" if f is None else f"{f.num_points}/{int(m.held_out.sum())}",
                _num(m.late_rmse),
                _num(m.final_error),
                _num(m.late_observed),
                _num(m.late_predicted),
                _status(m),
            ]
        )
    return markdown_table(header, rows)


def seed_table(results: Sequence[VariantResult]) -> str:
    """One row per run: its own early-half fit and extrapolation."""
    header = [
        "run",
        "last step",
        "R0",
        "A",
        "B",
        "C_mid",
        "fit window",
        "fitted/held",
        "late RMSE",
        "final err",
        "status",
    ]
    rows = []
    for r in results:
        for s in r.seed_fits:
            f = s.fit
            cells = ["-"] * 4 if f is None else [f"{f.r0:.3f}", f"{f.a:.3f}", f"{f.b:.2f}", format_compute(f.c_mid)]
            rows.append(
                [
                    s.curve.name,
                    str(int(s.curve.steps[-1])),
                    *cells,
                    f"[{format_compute(s.fit_start)}, {format_compute(s.cut)}]",
                    "-" if f is None else f"{f.num_points}/{int(s.held_out.sum())}",
                    _num(s.late_rmse),
                    _num(s.final_error),
                    _status(s),
                ]
            )
    return markdown_table(header, rows)


def _agreement(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def order_table(orders: Sequence[PairOrder]) -> str:
    header = [
        "first vs second",
        "late observed (1st - 2nd)",
        "early fit: predicted late (1st - 2nd)",
        "same order",
        "early fit: A (1st - 2nd)",
        "same order",
    ]
    rows = [
        [
            f"{o.first} vs {o.second}",
            f"{o.late_observed_diff:+.3f}",
            f"{o.late_predicted_diff:+.3f}",
            _agreement(o.predicted_agrees),
            f"{o.a_diff:+.3f}",
            _agreement(o.a_agrees),
        ]
        for o in orders
    ]
    return markdown_table(header, rows)


def order_summary(orders: Sequence[PairOrder]) -> str:
    def count(values):
        known = [v for v in values if v is not None]
        return f"{sum(known)} of {len(known)}"

    return (
        f"Early-half fits ordered {count(o.predicted_agrees for o in orders)} pairs as their late halves did "
        f"by predicted late pass rate, {count(o.a_agrees for o in orders)} by asymptote A."
    )


def _mean_std(s: Spread, signed: bool = False) -> str:
    """A spread over seeds as "mean ± std" (the mean alone for one seed, "-" for none)."""
    if s.count == 0:
        return "-"
    mean = f"{s.mean:+.3f}" if signed else f"{s.mean:.3f}"
    return mean if s.count == 1 else f"{mean} ± {s.std:.3f}"


def extrapolation_table(sweep: Sequence[FitEndResult]) -> str:
    """One row per variant and fit end: late RMSE and final error of the per-seed sigmoid and
    power-law fits, mean ± sample std over the seeds that could be fitted."""
    header = ["variant", "fit end", "seeds fitted (sigmoid/power law)"]
    header += [f"{model} {what}" for model, _, _ in MODELS for what in ("late RMSE", "final err")]
    rows = []
    for index in range(len(sweep[0].variants)):
        for end in sweep:
            v = end.variants[index]
            fitted = sum(f.fit is not None for f in v.seed_fits), sum(f.power_law is not None for f in v.seed_fits)
            row = [v.name, f"{end.fit_end:g}", f"{fitted[0]}/{fitted[1]} of {len(v.seed_fits)}"]
            for _, rmse, final in MODELS:
                row += [_mean_std(v.seed_score(rmse)), _mean_std(v.seed_score(final), signed=True)]
            rows.append(row)
    return markdown_table(header, rows)


def _crossing_text(crossings: Sequence[Crossing], first: str, second: str) -> str:
    return "; ".join(
        f"{format_compute(c.compute)} ({first if c.first_leads_after else second} ahead after)" for c in crossings
    )


def crossing_table(sweep: Sequence[FitEndResult]) -> str:
    """One row per pair of variants: the first crossing of the measured mean curves beside every
    crossing of the mean-curve sigmoid fits, per fit end."""
    by_end: list[list[PairCrossings]] = [pair_crossings(end.variants) for end in sweep]
    header = ["first vs second", "observed"] + [f"predicted, fit to {end.fit_end:g} C_end" for end in sweep]
    rows = []
    for pair_at_ends in zip(*by_end):
        pair = pair_at_ends[0]  # the observed crossing does not depend on the fit end
        observed = "none" if pair.observed is None else _crossing_text([pair.observed], pair.first, pair.second)
        predicted = [p.error or _crossing_text(p.predicted, p.first, p.second) or "none" for p in pair_at_ends]
        rows.append([f"{pair.first} vs {pair.second}", observed, *predicted])
    return markdown_table(header, rows)


def lead_table(results: Sequence[VariantResult]) -> str:
    """Per pair of variants and compute range (`lead_by_compute`): each one's mean measured pass
    rate over seeds, their difference against twice its standard error, and who leads."""
    header = ["first vs second", "compute range", "first (seeds)", "second (seeds)", "first - second"]
    header += [f"{SPREAD_FACTOR:g} SE", "ahead", "verdict"]
    rows = []
    for first, second in itertools.combinations(results, 2):
        for lead in lead_by_compute(first, second):
            rows.append(
                [
                    f"{first.name} vs {second.name}",
                    f"[{format_compute(lead.c_lo)}, {format_compute(lead.c_hi)}]",
                    _mean_std(lead.first_spread),
                    _mean_std(lead.second_spread),
                    f"{lead.difference:+.3f}" if math.isfinite(lead.difference) else "-",
                    _num(SPREAD_FACTOR * lead.standard_error),
                    lead.leader or "-",
                    "beyond the seed spread" if lead.verdict == "holds" else lead.verdict,
                ]
            )
    return markdown_table(header, rows)


def claims_table(claims: Sequence[Claim]) -> str:
    header = ["claim", "margin", f"{SPREAD_FACTOR:g} SE", "verdict"]
    rows = [[c.statement, _num(c.margin), _num(SPREAD_FACTOR * c.standard_error), c.verdict] for c in claims]
    return markdown_table(header, rows)


def timing_line(study_dir: Path) -> str:
    """Wall time of the study's launches from study_log.jsonl: the sum of the ended launches'
    minutes; a launch killed before it ended has no end record, so it is counted, not timed. A run
    not launched because another process held its workdir ("refused") is counted apart."""
    log = driver.read_log(study_dir)
    ends = [r for r in log if r.get("event") == "end"]
    unended = sum(r.get("event") == "start" for r in log) - len(ends)
    refused = sum(r.get("event") == "refused" for r in log)
    refused_text = f"; {refused} launch(es) refused, the workdir in use by another process" if refused else ""
    if not ends and not unended:
        return f"Wall time: no launch recorded in study_log.jsonl{refused_text}."
    total = sum(r["minutes"] for r in ends)
    killed = f"; {unended} launch(es) killed before they ended, not timed" if unended else ""
    return (
        f"Wall time: {total:.1f} min over {len(ends)} ended launches of {len({r['run'] for r in ends})} runs"
        f"{killed}{refused_text} (study_log.jsonl)."
    )


def report_text(
    study_dir: Path,
    results: Sequence[VariantResult],
    orders: Sequence[PairOrder],
    sweep: Sequence[FitEndResult],
    cut_fraction: float,
    fit_start_fraction: float | None,
    a_range: tuple[float, float],
    bootstrap: int,
) -> str:
    """The whole report in markdown (also what stdout shows)."""
    unit = unit_label(results[0].mean_fit.curve.unit)
    start = f"{PAPER_FIT_START_GPU_HOURS / PAPER_RUN_GPU_HOURS if fit_start_fraction is None else fit_start_fraction:g}"
    ends = ", ".join(f"{end.fit_end:g}" for end in sweep)
    return (
        "\n\n".join(
            [
                f"# Study {study_dir}",
                timing_line(study_dir),
                f"Fit window per curve: [{start} C_end, {cut_fraction:g} C_end] in {unit} (C_end: the curve's last "
                f"evaluation); points beyond are held back and predicted. A grid {a_range[0]:g}..{a_range[1]:g}. "
                "(seeds): mean ± sample std of the per-seed fits. Mean curve: the mean over seeds at each evaluation "
                f"step, fitted with a {bootstrap}-resample 95% bootstrap interval [boot]. late obs / late pred: mean "
                "measured / predicted pass rate over the held-back points; final err: predicted - measured at the last.",
                "## Variants",
                variant_table(results),
                "## Ordering: did the early half predict the late half's order?",
                order_table(orders),
                order_summary(orders),
                "## Runs",
                seed_table(results),
                "## Extrapolation by fit-window end",
                f"Each seed's run fitted on [{start} C_end, END C_end] for END in {ends}, by the sigmoid and by the "
                "power law R(C) = A - D C^(-alpha) on the same window, and scored on the rest: late RMSE and final "
                "err (predicted - measured at the last point), mean ± sample std over the seeds that could be fitted.",
                extrapolation_table(sweep),
                "## Crossings",
                "observed: the first crossing of two variants' mean curves (straight lines between points) from the "
                "later fit start on; predicted: every crossing of their mean-curve sigmoid fits from that fit start "
                f"up to {CROSSING_HORIZON:g} x the later C_end. C in {unit}; who leads just after each crossing.",
                crossing_table(sweep),
                "### Who leads, by compute range",
                "The measured curves from the later fit start to the earliest last compute of any seed, split into "
                "4 ranges of equal width in log compute; per range, each seed's mean measured pass rate, then mean ± "
                "std over seeds. A variant leads beyond the seed spread when the difference exceeds "
                f"{SPREAD_FACTOR:g} SE (SE as in the claims below). A crossover is one variant ahead early and the "
                "other late.",
                lead_table(results),
                "## Claims against the seed spread",
                "Each claim's margin is positive when it holds by the means over seeds. SE combines the standard "
                "errors of those means (sample std / sqrt(seeds)) of every variant involved, SE = sqrt(sum SE_v^2). "
                f"A claim holds beyond the seed spread when margin > {SPREAD_FACTOR:g} SE, fails beyond it when "
                f"margin < -{SPREAD_FACTOR:g} SE, else it stays within the seed spread. Extrapolation: margin = "
                f"{RMSE_CLAIM:g} - mean late RMSE. Orders (late part: each curve's points beyond its cut): margin = "
                "the difference of the seed means of the late measured pass rate (observed), or of the fits' late "
                "predictions, taken in the observed order (predicted).",
                f"### Extrapolation within {RMSE_CLAIM:g} RMSE",
                claims_table(rmse_claims(sweep)),
                "### Orders of variants",
                claims_table(order_claims(sweep)),
                f"Figures: {CURVES_FIGURE} (points and early-half fits, cut dotted), {PARAMS_FIGURE} (A and B, seed "
                f"std), {EXTRAPOLATION_FIGURE} (late RMSE against fit-window end, seed std).",
            ]
        )
        + "\n"
    )


def curves_figure(results: Sequence[VariantResult]) -> Figure:
    """Every variant on one log-compute axis: seed points faint, mean-curve points (filled: fitted,
    hollow circles: before the fit window, hollow squares: held back), the fit solid over its window and dashed beyond, the cut dotted.
    The step-0 evaluation (the untrained start) is left out: its compute is zero or the few
    milliseconds logged before training, which would stretch the log axis by decades."""
    fig = Figure(figsize=(8.0, 5.0), dpi=150)
    ax = fig.add_subplot()
    for index, r in enumerate(results):
        colour = f"C{index % 10}"
        m = r.mean_fit
        for s in r.seed_fits:
            trained = s.curve.steps > 0
            ax.plot(s.curve.compute[trained], s.curve.pass_rate[trained], ".", color=colour, alpha=0.25, ms=3)
        c, y, held = m.curve.compute, m.curve.pass_rate, m.held_out
        label = r.name if m.fit is None else f"{r.name}: A={m.fit.a:.3f}, B={m.fit.b:.2f}"
        fitted = (c >= m.fit_start) & ~held
        ax.plot(c[fitted], y[fitted], "o", color=colour, ms=4, label=label)
        before = (m.curve.steps > 0) & (c < m.fit_start)
        ax.plot(c[before], y[before], "o", mfc="none", color=colour, ms=4)
        ax.plot(c[held], y[held], "s", mfc="none", color=colour, ms=5)
        if m.fit is not None:
            inside = np.geomspace(m.fit_start, m.cut, 200)
            beyond = np.geomspace(m.cut, float(c[-1]) * CURVE_EXTEND, 200)
            ax.plot(inside, m.fit.predict(inside), "-", color=colour, lw=1.6)
            ax.plot(beyond, m.fit.predict(beyond), "--", color=colour, lw=1.3)
        ax.axvline(m.cut, color=colour, ls=":", lw=1.0)
    ax.set_xscale("log")
    ax.set_xlabel(f"RL training compute ({unit_label(results[0].mean_fit.curve.unit)}, log scale)")
    ax.set_ylabel("held-out pass rate")
    ax.set_title(
        "early-half fits (solid), extrapolation (dashed), cut (dotted), held back (squares), not fitted (hollow)",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=7, frameon=False, loc="best")
    fig.tight_layout()
    return fig


def plot_curves(results: Sequence[VariantResult], path: Path) -> None:
    """Saves `curves_figure(results)` to `path`."""
    curves_figure(results).savefig(path)


def plot_params(results: Sequence[VariantResult], path: Path) -> None:
    """A and B per variant: bars at the mean over seeds, error bars one sample std; diamonds: the
    mean-curve fit."""
    fig = Figure(figsize=(max(5.0, 1.2 * len(results) + 2.0), 4.0), dpi=150)
    names = [r.name for r in results]
    x = np.arange(len(results))
    for column, (parameter, label) in enumerate((("a", "asymptote A"), ("b", "efficiency B"))):
        ax = fig.add_subplot(1, 2, column + 1)
        spreads = [r.spread(parameter) for r in results]
        means = [s.mean for s in spreads]
        stds = [0.0 if not math.isfinite(s.std) else s.std for s in spreads]
        ax.bar(x, means, yerr=stds, capsize=4, color=[f"C{i % 10}" for i in range(len(results))], alpha=0.7)
        fitted = [(i, getattr(r.mean_fit.fit, parameter)) for i, r in enumerate(results) if r.mean_fit.fit is not None]
        if fitted:
            ax.plot(*zip(*fitted), "kD", ms=4, label="mean-curve fit")
            ax.legend(fontsize=7, frameon=False)
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{label} (seed mean ± std)", fontsize=9)
        if parameter == "a":
            finite = [m - s for m, s in zip(means, stds) if math.isfinite(m)]
            if finite:
                ax.set_ylim(max(0.0, min(finite) - 0.05), None)
    fig.tight_layout()
    fig.savefig(path)


def plot_extrapolation(sweep: Sequence[FitEndResult], path: Path) -> None:
    """Late RMSE against fit-window end: sigmoid (left) and power law (right), one line per variant
    at the mean over seeds, error bars one sample std, the RMSE_CLAIM level dotted."""
    fig = Figure(figsize=(9.0, 4.0), dpi=150)
    axes = fig.subplots(1, len(MODELS), sharey=True, squeeze=False)[0]
    ends = [end.fit_end for end in sweep]
    for ax, (model, score, _) in zip(axes, MODELS):
        for index, variant in enumerate(sweep[0].variants):
            spreads = [end.variants[index].seed_score(score) for end in sweep]
            stds = [s.std if math.isfinite(s.std) else 0.0 for s in spreads]
            ax.errorbar(
                ends,
                [s.mean for s in spreads],
                yerr=stds,
                marker="o",
                ms=4,
                capsize=3,
                color=f"C{index % 10}",
                label=variant.name,
            )
        ax.axhline(RMSE_CLAIM, color="0.5", ls=":", lw=1.0, label=f"RMSE {RMSE_CLAIM:g}")
        ax.set_xticks(ends, [f"{e:g}" for e in ends])
        ax.set_xlabel("fit window end (fraction of C_end)")
        ax.set_title(f"{model}: late RMSE (seed mean ± std)", fontsize=9)
        ax.grid(True, alpha=0.2)
    axes[0].set_ylabel("RMSE on the held-back points")
    axes[0].legend(fontsize=7, frameon=False, loc="best")
    fig.tight_layout()
    fig.savefig(path)


def write_report(
    study_dir: Path,
    results: Sequence[VariantResult],
    orders: Sequence[PairOrder],
    sweep: Sequence[FitEndResult],
    *,
    cut_fraction: float,
    fit_start_fraction: float | None,
    a_range: tuple[float, float],
    bootstrap: int,
    out_dir: Path | None = None,
) -> str:
    """Writes study.md, curves.png, params.png and extrapolation.png into `out_dir` (default
    `study_dir`); returns the report text."""
    text = report_text(study_dir, results, orders, sweep, cut_fraction, fit_start_fraction, a_range, bootstrap)
    out_dir = out_dir or study_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / REPORT_FILE).write_text(text, encoding="utf-8")
    plot_curves(results, out_dir / CURVES_FIGURE)
    plot_params(results, out_dir / PARAMS_FIGURE)
    plot_extrapolation(sweep, out_dir / EXTRAPOLATION_FIGURE)
    return text
