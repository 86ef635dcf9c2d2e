"""What changed in the completions: format against arithmetic, from `evaluate --completions` reports.

  PYTHONPATH=. .venv/bin/python benchmarks/ladder_completions.py --data HELDOUT.jsonl BEFORE.json AFTER.json [...]

Each report is `python -m scalerl_jax.cli.evaluate ... --data HELDOUT.jsonl --group-field level
--completions --out REPORT.json` of one policy on the ladder's held-out file (`scalerl ladder`).
Per report, over all samples:

  pass              graded correct (the run's answer styles: `####`, "the answer is", else the last number)
  hashes            completions that write `####`
  gold_somewhere    the gold number appears somewhere in the completion
  not_last          gold somewhere but graded wrong: the model said it and went on (a format error)
  wrong_everywhere  the gold appears nowhere: an arithmetic (or reading) error
  chars             mean completion length in characters
  carry / no_carry  pass rate of one-digit additions whose sum is >= 10 / < 10, and of
                    one-digit subtractions that borrow (minuend >= 10) / do not

A gain in `pass` that `not_last` gives back is format; one that `wrong_everywhere` gives back is
arithmetic. `--examples N` prints N completions of the same prompts from the first and the last
report.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence

NUMBER = re.compile(r"-?\d+")


def carries(level: str, problem: str) -> bool | None:
    """Whether a one-digit addition carries (sum >= 10) or a one-digit subtraction borrows
    (minuend >= 10); None for other levels."""
    numbers = [int(x) for x in NUMBER.findall(problem)]
    if level == "add_1d":
        return sum(numbers) >= 10
    if level == "sub_1d":
        return max(numbers) >= 10
    return None


def analyze(report: dict, rows: list[dict]) -> dict[str, float]:
    """The fractions of the module docstring over every sample of `report`."""
    counts = dict.fromkeys(("n", "pass", "hashes", "gold_somewhere", "not_last", "wrong_everywhere", "chars"), 0.0)
    by_carry: dict[bool, list[int]] = {True: [0, 0], False: [0, 0]}
    for prompt in report["per_prompt"]:
        row = rows[prompt["row"]]
        carry = carries(row["level"], row["problem"])
        for text, correct in zip(prompt["completions"], prompt["correct"]):
            somewhere = row["answer"] in NUMBER.findall(text)
            counts["n"] += 1
            counts["pass"] += correct
            counts["hashes"] += "####" in text
            counts["gold_somewhere"] += somewhere
            counts["not_last"] += somewhere and not correct
            counts["wrong_everywhere"] += not somewhere
            counts["chars"] += len(text)
            if carry is not None:
                by_carry[carry][0] += correct
                by_carry[carry][1] += 1
    n = counts.pop("n")
    out = {key: value / n for key, value in counts.items()}
    out["carry"] = by_carry[True][0] / max(1, by_carry[True][1])
    out["no_carry"] = by_carry[False][0] / max(1, by_carry[False][1])
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="evaluate --completions reports (json)")
    parser.add_argument("--data", required=True, help="the held-out jsonl the reports evaluated")
    parser.add_argument("--examples", type=int, default=0, help="completions to show from the first and last report")
    args = parser.parse_args(argv)
    with open(args.data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    reports = []
    for path in args.reports:
        with open(path, encoding="utf-8") as f:
            reports.append(json.load(f))
    keys = ("pass", "hashes", "gold_somewhere", "not_last", "wrong_everywhere", "carry", "no_carry", "chars")
    print("| report | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for path, report in zip(args.reports, reports):
        stats = analyze(report, rows)
        print(
            f"| {path} | " + " | ".join(f"{stats[k]:.1f}" if k == "chars" else f"{stats[k]:.3f}" for k in keys) + " |"
        )
    for index in range(min(args.examples, len(reports[0]["per_prompt"]))):
        first, last = reports[0]["per_prompt"][index], reports[-1]["per_prompt"][index]
        row = rows[first["row"]]
        print(f"\n### {row['problem']} (gold {row['answer']}, {row['level']})")
        print(f"before ({'correct' if first['correct'][0] else 'wrong'}): {first['completions'][0]!r}")
        print(f"after  ({'correct' if last['correct'][0] else 'wrong'}): {last['completions'][0]!r}")


if __name__ == "__main__":
    main()
