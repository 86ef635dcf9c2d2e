"""Scoring throughput (items/s) of ``score_completions`` and verify-worker start-up time.

Workloads, each scored through one ``VerifyPool`` of --workers processes (median of --repeats):

- ``integer``: 768 completions (the 8B run's per-step batch) with integer answers (the fast
  path; no math-verify call), thinking text of 2k-20k characters;
- ``latex``: 256 completions whose answers need math-verify (fractions vs decimals, sets);
- ``exact``: 512 completions of the synthetic task (kind ``'exact'``).

``last_boxed`` scaling: median seconds on adversarial text (one closed box, then thousands of
boxes that never close) of 10k and 100k characters, and their ratio (linear: ~10x).

Start-up: seconds from creating a 1-worker pool to the answer of its first item (Python start,
imports, first item), median of --repeats fresh pools. Each repeat scores fresh answers, so
the workers' parse caches do not help.

  .venv/bin/python benchmarks/bench_rewards.py [--workers 2] [--repeats 3] [--chunk_items 16]

It imports scalerl_jax from the checkout it lives in (not an installed copy).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scalerl_jax.data.rewards import RewardConfig, last_boxed, score_completions  # noqa: E402
from scalerl_jax.data.verify_pool import VerifyPool  # noqa: E402


def latex_pair(i: int) -> tuple[str, str]:
    """A distinct (gold, prediction) pair per ``i`` (the worker caches parses of repeats)."""
    a, b = i + 2, i + 3
    return [
        (f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{2 * a}}}{{{2 * b}}}"),
        (f"\\{{{a},{b}\\}}", f"\\{{{b},{a}\\}}"),
        (f"x^{{{a}}}+{b}", f"{b}+x^{{{a}}}"),
        (f"({a},{b}]", f"[{a},{b}]"),
    ][i % 4]


def _thinking(rng: random.Random) -> str:
    words = ["so", "x", "=", "3", "\\frac{1}{2}", "then", "{", "}", "\\boxed{2}", "check"]
    length = rng.randint(2_000, 20_000)
    text, size = [], 0
    while size < length:
        text.append(rng.choice(words))
        size += len(text[-1]) + 1
    return " ".join(text)


def workloads(seed: int = 0) -> dict[str, tuple[list[str], list[str], RewardConfig]]:
    rng = random.Random(seed)
    integer_golds = [str(rng.randint(0, 999)) for _ in range(768)]
    integer = [f"<think>{_thinking(rng)}</think>So \\boxed{{{g if rng.random() < 0.5 else 7}}}." for g in integer_golds]
    latex_pairs = [latex_pair(i + 1000 * seed) for i in range(256)]
    latex = [f"<think>{_thinking(rng)}</think>\\boxed{{{pred}}}" for _, pred in latex_pairs]
    exact_golds = [str(rng.randint(0, 99)) for _ in range(512)]
    exact = [f"<think>{_thinking(rng)[:500]}</think>\\boxed{{{g}}}" for g in exact_golds]
    return {
        "integer": (integer, integer_golds, RewardConfig(kind="math")),
        "latex": (latex, [g for g, _ in latex_pairs], RewardConfig(kind="math")),
        "exact": (exact, exact_golds, RewardConfig(kind="exact")),
    }


def unclosed_boxes(num_chars: int) -> str:
    """One closed box, then boxes nested in boxes that never close: a truncated, looping answer."""
    unit = "\\boxed{x^{2} \\{ {a} \\boxed{"
    return ("\\boxed{1} " + unit * (num_chars // len(unit) + 1))[:num_chars]


def last_boxed_seconds(text: str, repeats: int, calls: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            last_boxed(text)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def startup_seconds(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with VerifyPool(1, time_limit_s=30.0) as pool:
            score_completions(["<think></think>\\boxed{\\frac{1}{2}}"], ["0.5"], RewardConfig(kind="math"), pool=pool)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk_items", type=int, default=16)
    args = parser.parse_args()
    small, large = (last_boxed_seconds(unclosed_boxes(n), 2 * args.repeats + 1) for n in (10_000, 100_000))
    print(
        f"last_boxed on unclosed boxes: 10k chars {small * 1e3:.2f} ms, 100k chars "
        f"{large * 1e3:.2f} ms, ratio {large / small:.1f}x (linear: ~10x)"
    )
    print(f"worker start-up to first answer: {startup_seconds(args.repeats):.3f} s")
    with VerifyPool(args.workers, time_limit_s=30.0, chunk_items=args.chunk_items) as pool:
        score_completions(["<think></think>\\boxed{x}"], ["x"], RewardConfig(), pool=pool)  # warm
        runs = [workloads(seed) for seed in range(args.repeats)]  # fresh answers per repeat
        for name in runs[0]:
            times = []
            for run in runs:
                completions, golds, config = run[name]
                start = time.perf_counter()
                score_completions(completions, golds, config, pool=pool)
                times.append(time.perf_counter() - start)
            chars = sum(map(len, completions))
            print(
                f"{name:8s} {len(completions):4d} items ({chars / len(completions):7.0f} chars "
                f"avg): {len(completions) / statistics.median(times):8.1f} items/s"
            )


if __name__ == "__main__":
    main()
