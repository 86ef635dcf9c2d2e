"""Evaluation noise of a study's fits: the same training runs read at several evaluation sizes.

A run evaluated on N prompts x K samples, with every sample in `samples.jsonl`
(`eval.samples_logged` >= N), holds for each size s dividing K the K / s disjoint evaluations
N x s: replica j reads samples j s .. (j + 1) s - 1 of every prompt. The replicas share the
training run, the prompts and the compute axis, so they differ by sampling noise alone, at equal
training compute. `correctness_file` keeps the correctness matrix of each evaluation
(`eval_correct.jsonl`, one line per evaluation step: one '0'/'1' string of K per prompt), small
enough to commit beside `metrics.jsonl`.

Per size s, over the runs r and their replicas j (`SizeResult`):
  - point noise: sqrt(mean over runs and evaluation steps of the sample variance (ddof 1) of the
    replicas' pass rates), the standard deviation of one evaluation point; beside it the binomial
    value sqrt(mean over steps of sum_i p_i (1 - p_i) / (N^2 s)), p_i the prompt's pass rate over
    all K samples (prompts are fixed, so only the sampling of each prompt adds noise);
  - A of each replica's sigmoid fit (`analysis.fit_early`, window [fit_start, end x C_end]): its
    eval-noise std (sqrt of the mean over runs of the variance across that run's replicas) and the
    std a study at this size sees across seeds (sqrt of the mean over replica indices j of the
    variance across runs of replica j's A: training seed and evaluation noise together); the same
    two for the fit's mean prediction over the held-back computes (what the study's order claims
    compare between variants);
  - late RMSE of each replica's fit against its own held-back points (what a study reports) and
    against the full N x K curve of the same run (the least noisy reading of the same policies),
    both averaged over runs and replicas;
  - the floor: the in-sample RMSE of a sigmoid fitted to the whole run [fit_start, C_end] (no
    extrapolation at all), averaged over runs and replicas. No early fit can predict the late
    points better than this. What of it evaluation noise does not explain is scatter of the
    policies themselves from one evaluation to the next: sqrt(floor^2 - binomial noise^2), a little
    low since the in-sample fit absorbs some of it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from scalerl_jax.data.answers import CORRECT_OUTCOMES
from scalerl_jax.scaling import RunCurve, fit_sigmoid, read_run
from scalerl_jax.study.analysis import Curve, CurveFit, fit_early

SAMPLES_FILE = "samples.jsonl"
CORRECTNESS_FILE = "eval_correct.jsonl"
EVAL_SET = "eval"


@dataclasses.dataclass(frozen=True)
class EvaluatedRun:
    """A run's evaluation points and their correctness: correct[e] is bool[N, K] at steps[e]."""

    curve: RunCurve
    correct: np.ndarray  # bool[E, N, K]


def correctness_from_samples(samples_path: Path) -> dict[int, np.ndarray]:
    """{step: bool[N, K]} from the held-out rows of a run's samples file; ValueError (naming the
    file and step) when an evaluation did not log every sample of every prompt."""
    cells: dict[int, dict[tuple[int, int], bool]] = {}
    with open(samples_path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{samples_path} line {number}: malformed JSON ({error.msg})") from None
            if row.get("set") != EVAL_SET:
                continue
            outcome = row["outcome"]
            correct = outcome in CORRECT_OUTCOMES or (outcome == "custom" and float(row["reward"]) > 0)
            cells.setdefault(int(row["step"]), {})[(int(row["prompt_index"]), int(row["sample"]))] = correct
    matrices = {}
    for step, cell in sorted(cells.items()):
        prompts = 1 + max(p for p, _ in cell)
        samples = 1 + max(s for _, s in cell)
        if len(cell) != prompts * samples:
            raise ValueError(
                f"{samples_path}: step {step} logged {len(cell)} of {prompts} x {samples} samples "
                "(run with eval.samples_logged >= eval.num_prompts)"
            )
        matrix = np.zeros((prompts, samples), bool)
        for (p, s), value in cell.items():
            matrix[p, s] = value
        matrices[step] = matrix
    if not matrices:
        raise ValueError(f"{samples_path}: no held-out ({EVAL_SET!r}) samples")
    return matrices


def write_correctness(run_dir: Path, matrices: dict[int, np.ndarray]) -> Path:
    """Writes `run_dir/eval_correct.jsonl`: per step, one '0'/'1' string of K per prompt."""
    path = run_dir / CORRECTNESS_FILE
    with open(path, "w", encoding="utf-8") as f:
        for step, matrix in sorted(matrices.items()):
            rows = ["".join("1" if x else "0" for x in row) for row in matrix]
            f.write(json.dumps({"step": step, "correct": rows}) + "\n")
    return path


def read_correctness(path: Path) -> dict[int, np.ndarray]:
    """{step: bool[N, K]} from an `eval_correct.jsonl` file."""
    matrices = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            record = json.loads(line)
            rows = record["correct"]
            if len({len(r) for r in rows}) != 1 or any(set(r) - {"0", "1"} for r in rows):
                raise ValueError(f"{path} line {number}: 'correct' must be equal-length strings of 0 and 1")
            matrices[int(record["step"])] = np.array([[c == "1" for c in r] for r in rows], bool)
    return matrices


def load_run(run_dir: Path) -> EvaluatedRun:
    """The run's curve (`metrics.jsonl`) and correctness: read from `samples.jsonl` when the run
    has it (and written to `eval_correct.jsonl`, so a run extended since is read afresh), else from
    `eval_correct.jsonl` (a run copied without its samples). ValueError when an evaluation step
    lacks its samples or a pass rate read from the samples differs from the logged one."""
    curve = read_run(run_dir, name=run_dir.name)
    if (run_dir / SAMPLES_FILE).is_file():
        matrices = correctness_from_samples(run_dir / SAMPLES_FILE)
        write_correctness(run_dir, matrices)
    elif (run_dir / CORRECTNESS_FILE).is_file():
        matrices = read_correctness(run_dir / CORRECTNESS_FILE)
    else:
        raise ValueError(f"{run_dir}: neither {SAMPLES_FILE} nor {CORRECTNESS_FILE} to read the samples from")
    missing = [int(s) for s in curve.steps if int(s) not in matrices]
    if missing:
        raise ValueError(f"{run_dir}: no samples for the evaluation at step(s) {missing}")
    correct = np.stack([matrices[int(s)] for s in curve.steps])
    logged = correct.mean(axis=(1, 2))
    mismatch = np.flatnonzero(np.abs(logged - curve.pass_rate) > 1e-9)
    if mismatch.size:
        e = int(mismatch[0])
        raise ValueError(
            f"{run_dir}: step {int(curve.steps[e])}: the samples give pass rate {logged[e]:.6f}, "
            f"metrics.jsonl logged {curve.pass_rate[e]:.6f}"
        )
    return EvaluatedRun(curve, correct)


def replica_pass_rates(correct: np.ndarray, size: int) -> np.ndarray:
    """float[K / size, E]: replica j's pass rate at each evaluation, the mean of samples
    j size .. (j + 1) size - 1 over all prompts (`correct` is bool[E, N, K], size divides K)."""
    num_samples = correct.shape[2]
    if size < 1 or num_samples % size:
        raise ValueError(f"an evaluation size of {size} samples per prompt does not divide {num_samples}")
    groups = correct.reshape(correct.shape[0], correct.shape[1], num_samples // size, size)
    return groups.mean(axis=(1, 3)).T


def binomial_point_noise(correct: np.ndarray, size: int) -> float:
    """sqrt(mean_e sum_i p_ei (1 - p_ei) / (N^2 size)): the standard deviation of a pass rate over
    N fixed prompts x `size` samples when prompt i passes with probability p_ei (its rate over all
    K samples at evaluation e)."""
    p = correct.mean(axis=2)
    num_prompts = correct.shape[1]
    return float(math.sqrt(np.mean(np.sum(p * (1 - p), axis=1) / (num_prompts**2 * size))))


@dataclasses.dataclass(frozen=True)
class SizeResult:
    """One evaluation size N x s at one fit-window end (module docstring for each value)."""

    size: int
    fit_end: float
    num_replicas: int
    point_noise: float
    binomial_noise: float
    a_eval_std: float
    a_total_std: float
    late_predicted_eval_std: float
    late_predicted_total_std: float
    a_mean: float
    late_rmse_own: float
    late_rmse_full: float
    floor: float
    num_failed_fits: int

    @property
    def policy_scatter(self) -> float:
        """sqrt(floor^2 - binomial noise^2): the scatter about a sigmoid not due to evaluation."""
        return math.sqrt(max(self.floor**2 - self.binomial_noise**2, 0.0))


def _late_rmse_against(fit: CurveFit, pass_rate: np.ndarray) -> float:
    """The sigmoid's RMSE over the held-back computes against `pass_rate` (same points)."""
    held = fit.held_out
    if fit.fit is None or not held.any():
        return float("nan")
    residual = np.asarray(fit.fit.predict(fit.curve.compute[held])) - pass_rate[held]
    return float(np.sqrt(np.mean(residual**2)))


def whole_run_rmse(curve: Curve, fit_start: float, a_range: tuple[float, float]) -> float:
    """In-sample RMSE of the sigmoid fitted to every point of `curve` from `fit_start` on (NaN
    when it cannot be fitted)."""
    try:
        fit = fit_sigmoid(
            curve.compute, curve.pass_rate, fit_start=fit_start, unit=curve.unit, a_range=a_range, name=curve.name
        )
    except ValueError:
        return float("nan")
    window = curve.compute >= fit_start
    residual = np.asarray(fit.predict(curve.compute[window])) - curve.pass_rate[window]
    return float(np.sqrt(np.mean(residual**2)))


def _within_and_across_std(values: np.ndarray) -> tuple[float, float]:
    """(sqrt(mean over runs of the variance across its replicas), sqrt(mean over replica indices
    of the variance across runs)) of values[run, replica], NaN entries left out (ddof 1)."""

    def pooled(rows: np.ndarray) -> float:
        variances = [float(np.nanvar(row, ddof=1)) for row in rows if np.isfinite(row).sum() > 1]
        return math.sqrt(np.mean(variances)) if variances else float("nan")

    return pooled(values), pooled(values.T)


def _nanmean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def analyze_size(
    runs: Sequence[EvaluatedRun],
    size: int,
    *,
    fit_end: float,
    fit_start_fraction: float | None,
    a_range: tuple[float, float],
) -> SizeResult:
    """Every run's N x `size` replicas fitted to `fit_end` C_end and scored (module docstring)."""
    point_variances, binomial, a_by_run, late_by_run, own, full, floors, failed = [], [], [], [], [], [], [], 0
    for run in runs:
        replicas = replica_pass_rates(run.correct, size)
        if len(replicas) > 1:
            point_variances.append(float(np.mean(replicas.var(axis=0, ddof=1))))
        binomial.append(binomial_point_noise(run.correct, size))
        run_a, run_late = np.full(len(replicas), np.nan), np.full(len(replicas), np.nan)
        for j, pass_rate in enumerate(replicas):
            c = run.curve
            curve = Curve(f"{c.name}/{size}x{j}", c.unit, c.steps, c.compute, pass_rate)
            fit = fit_early(curve, cut_fraction=fit_end, fit_start_fraction=fit_start_fraction, a_range=a_range)
            floors.append(whole_run_rmse(curve, fit.fit_start, a_range))
            if fit.fit is None:
                failed += 1
                continue
            run_a[j], run_late[j] = fit.fit.a, fit.late_predicted
            own.append(fit.late_rmse)
            full.append(_late_rmse_against(fit, c.pass_rate))
        a_by_run.append(run_a)
        late_by_run.append(run_late)
    a = np.array(a_by_run)  # [runs, replicas], NaN where a fit failed
    a_eval_std, a_total_std = _within_and_across_std(a)
    late_eval_std, late_total_std = _within_and_across_std(np.array(late_by_run))
    return SizeResult(
        size=size,
        fit_end=fit_end,
        num_replicas=a.size,
        point_noise=math.sqrt(np.mean(point_variances)) if point_variances else float("nan"),
        binomial_noise=float(math.sqrt(np.mean(np.square(binomial)))),
        a_eval_std=a_eval_std,
        a_total_std=a_total_std,
        late_predicted_eval_std=late_eval_std,
        late_predicted_total_std=late_total_std,
        a_mean=float(np.nanmean(a)) if np.isfinite(a).any() else float("nan"),
        late_rmse_own=_nanmean(own),
        late_rmse_full=_nanmean(full),
        floor=_nanmean(floors),
        num_failed_fits=failed,
    )


def _fmt(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.4f}"


def report_table(results: Sequence[SizeResult], num_prompts: int) -> str:
    """One markdown row per (fit end, size)."""
    header = (
        "| fit end | evaluation | replicas | point noise (replicas) | point noise (binomial) | mean A | "
        "A std: eval noise | A std: seeds and eval | late pred std: eval noise | late pred std: seeds and eval | "
        "late RMSE vs own points | late RMSE vs N x K curve | floor | policy scatter | failed fits |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        lines.append(
            f"| {r.fit_end:g} | {num_prompts} x {r.size} | {r.num_replicas} | {_fmt(r.point_noise)} | "
            f"{_fmt(r.binomial_noise)} | {_fmt(r.a_mean)} | {_fmt(r.a_eval_std)} | {_fmt(r.a_total_std)} | "
            f"{_fmt(r.late_predicted_eval_std)} | {_fmt(r.late_predicted_total_std)} | "
            f"{_fmt(r.late_rmse_own)} | {_fmt(r.late_rmse_full)} | {_fmt(r.floor)} | {_fmt(r.policy_scatter)} | "
            f"{r.num_failed_fits} |"
        )
    return "\n".join(lines)
