"""The GSM8K reward both sides of `bench_vs_trl.py` score with (standard library only).

`reward(completion, gold, problem)` is +1.0 when the last number written in the completion
equals GSM8K's answer, the number after the last `####` of the gold solution, and -1.0 otherwise
(no number in the completion, or a gold without `####`). Numbers are compared as exact decimals
after dropping thousands separators, so `1,000`, `1000` and `1000.00` are equal and `0.5` equals
`.5`. It is this project's custom reward interface (`data.reward_fn=benchmarks.gsm8k_reward:reward`)
and, through `trl_reward`, TRL's `reward_funcs` signature.
"""

from __future__ import annotations

import re
from decimal import Decimal

CORRECT = 1.0
INCORRECT = -1.0
GOLD_MARK = "####"
# A signed decimal with optional thousands separators: 1,000 | -3.5 | .5 | 42
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?")


def numbers(text: str) -> list[Decimal]:
    """Every number of `text` in order, as exact decimals (thousands separators dropped)."""
    found = []
    for match in _NUMBER.finditer(text):
        token = match.group(0).replace(",", "")
        if not any(ch.isdigit() for ch in token):
            continue
        found.append(Decimal(token))  # the pattern matches only decimal literals
    return found


def last_number(text: str) -> Decimal | None:
    """The last number of `text`, or None when it has none."""
    found = numbers(text)
    return found[-1] if found else None


def gold_answer(gold: str) -> Decimal | None:
    """The number after the last `####` of a GSM8K solution (`... #### 1,000` -> 1000), or None."""
    cut = gold.rfind(GOLD_MARK)
    if cut == -1:
        return None
    found = numbers(gold[cut + len(GOLD_MARK) :])
    return found[0] if found else None


def reward(completion: str, gold: str, problem: str) -> float:
    """+1.0 if the completion's last number equals the gold's answer, else -1.0 (`problem` unused)."""
    del problem
    expected, predicted = gold_answer(gold), last_number(completion)
    if expected is None or predicted is None:
        return INCORRECT
    return CORRECT if predicted == expected else INCORRECT


def trl_reward(completions: list, answer: list[str], question: list[str], **_: object) -> list[float | None]:
    """`reward` in TRL's `reward_funcs` signature: one float per completion. A conversational
    completion is a list of messages; its text is the content of the last one."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [reward(t, g, q) for t, g, q in zip(texts, answer, question, strict=True)]
