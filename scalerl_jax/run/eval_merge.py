"""The report of a whole evaluation from the reports of its parts (`evaluate --problems START:END`).

The parts must have evaluated the same checkpoint and step, on the same file and split, with the
same samples per problem, pass@k values, group field and sampling settings, and no problem twice.
The merged report is the one a single run over the union would have written, up to sampling
seeds:

- mean@K, pass@k and the per-group numbers are recomputed from the joined per-sample correctness
  (`benchmark.summarize`), so they weight every problem alike, whatever the parts' sizes;
- a fraction or mean over samples (``*_frac``, ``mean_completion_tokens``) is the parts' values
  weighted by their sample counts: sum_j n_j x_j / sum_j n_j;
- counts (``timeouts``, ``num_samples``) add up, maxima (``max_completion_tokens``) take the max;
- sampling and wall seconds add up, and completion tokens/s is their total tokens over the total
  sampling time.

A metric none of these rules covers is refused by name rather than merged by a guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from scalerl_jax.run.benchmark import summarize, summarize_groups

# Report fields the parts must agree on for their union to be one evaluation.
SHARED_FIELDS = ("checkpoint", "step", "data", "split", "group_field", "samples_per_prompt", "sampling")
SUMMED_METRICS = ("timeouts", "num_samples")
RECOMPUTED_METRICS = ("num_prompts", "pass_rate")


class MergeError(ValueError):
    """Parts that are not one evaluation; the message names the files and the field."""


def _metric_rule(name: str) -> str:
    """How a metric of the parts merges: 'recompute', 'weighted', 'sum' or 'max'."""
    if name.startswith(("mean@", "pass@")) or name in RECOMPUTED_METRICS:
        return "recompute"
    if name.endswith("_frac") or name.startswith("mean_"):
        return "weighted"
    if name in SUMMED_METRICS:
        return "sum"
    if name.startswith("max_"):
        return "max"
    raise MergeError(f"metric {name!r}: no rule merges it (fractions, means, counts and maxima do)")


def _check_parts(parts: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """MergeError unless every part agrees with the first on `SHARED_FIELDS`, on the range total
    and on the pass@k values, and no problem row is in two parts."""
    first_path, first = parts[0]
    pass_keys = sorted(k for k in first["metrics"] if k.startswith("pass@"))
    seen: dict[int, str] = {}
    for path, report in parts:
        for field in SHARED_FIELDS:
            if report.get(field) != first.get(field):
                raise MergeError(
                    f"{path}: {field} {report.get(field)!r} differs from {first_path}'s {first.get(field)!r}"
                )
        if report["problems"]["of"] != first["problems"]["of"]:
            raise MergeError(
                f"{path}: a range of {report['problems']['of']} problems, {first_path}'s of {first['problems']['of']}"
            )
        keys = sorted(k for k in report["metrics"] if k.startswith("pass@"))
        if keys != pass_keys:
            raise MergeError(f"{path}: pass@k values {keys} differ from {first_path}'s {pass_keys}")
        if set(report["metrics"]) != set(first["metrics"]):
            odd = sorted(set(report["metrics"]) ^ set(first["metrics"]))
            raise MergeError(f"{path}: metrics {odd} are in one of it and {first_path}, not both")
        for entry in report["per_prompt"]:
            if entry["row"] in seen:
                raise MergeError(f"{path}: row {entry['row']} was evaluated in {seen[entry['row']]} too")
            seen[entry["row"]] = path


def merge_reports(parts: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The report of the union of `parts` ((path, report) pairs, each `evaluate`'s JSON), by the
    rules of the module docstring, with `merged_from` (each part's path and range) and `problems.covered`
    (the problems the parts' ranges hold) beside their total `problems.of`."""
    if not parts:
        raise MergeError("no reports to merge")
    for path, report in parts:
        missing = [f for f in (*SHARED_FIELDS, "problems", "metrics", "per_prompt") if f not in report]
        if missing:
            raise MergeError(f"{path}: not an evaluate report with --problems (missing {missing})")
    _check_parts(parts)
    reports = [report for _, report in parts]
    first = reports[0]
    per_prompt = sorted((entry for r in reports for entry in r["per_prompt"]), key=lambda entry: entry["row"])
    correct = np.asarray([entry["correct"] for entry in per_prompt], bool)
    ks = [int(k.split("@", 1)[1]) for k in first["metrics"] if k.startswith("pass@")]
    samples = np.asarray([r["metrics"]["num_samples"] for r in reports], np.float64)
    metrics: dict[str, float] = {}
    for name in first["metrics"]:
        rule = _metric_rule(name)
        values = np.asarray([r["metrics"][name] for r in reports], np.float64)
        if rule == "weighted":
            metrics[name] = float(np.sum(values * samples) / np.sum(samples))
        elif rule == "sum":
            metrics[name] = float(values.sum())
        elif rule == "max":
            metrics[name] = float(values.max())
    summary = summarize(correct, ks)
    if "pass_rate" in first["metrics"]:
        metrics["pass_rate"] = summary[f"mean@{correct.shape[1]}"]
    metrics.update(summary)
    sampling_s = sum(r["sampling_seconds"] for r in reports)
    tokens = sum(r["completion_tokens_per_s"] * r["sampling_seconds"] for r in reports)
    merged = {field: first[field] for field in SHARED_FIELDS}
    merged.update(
        {
            "problems": {
                "covered": sum(r["problems"]["end"] - r["problems"]["start"] for r in reports),
                "of": first["problems"]["of"],
            },
            "merged_from": [{"path": path, **report["problems"]} for path, report in parts],
            "wall_seconds": sum(r.get("wall_seconds", 0.0) for r in reports),
            "metrics": metrics,
            "sampling_seconds": sampling_s,
            "completion_tokens_per_s": tokens / sampling_s if sampling_s > 0 else 0.0,
            "skipped_too_long": sorted(row for r in reports for row in r["skipped_too_long"]),
            "per_prompt": per_prompt,
        }
    )
    if first["group_field"]:
        merged["groups"] = summarize_groups(correct, [entry["group"] for entry in per_prompt], ks)
    return merged
