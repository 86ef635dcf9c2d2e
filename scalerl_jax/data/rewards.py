"""Verifiable rewards: answer extraction, integer fast path, math-verify in a process pool.

Scoring one completion against a gold answer:

1. The answer part is the text after the first ``</think>``; no ``</think>`` is a format failure.
2. The prediction is the content of the last complete (brace-matched) ``\\boxed{...}`` of the
   answer part; no complete box is a format failure.
3. If gold and prediction are both plain integers (``[+-]?digits``, surrounding whitespace and
   ``$`` ignored), they are compared as integers: no math-verify call.
4. Otherwise (kind ``'math'``) math-verify decides in a ``VerifyPool`` worker with a time limit;
   kind ``'exact'`` (the synthetic task) compares the stripped strings instead.

Correct gets ``correct_reward`` (+1), everything else ``incorrect_reward`` (-1); every outcome is
counted by category, so format failures and timeouts show up in the metrics.
"""

from __future__ import annotations

import atexit
import dataclasses
import re
import threading
from collections.abc import Sequence

import numpy as np

from scalerl_jax.data import verify_pool
from scalerl_jax.data.synthetic import THINK_END

BOX_COMMAND = "\\boxed"

# Outcome categories of one scored completion.
NO_THINK_END = "no_think_end"
NO_BOX = "no_box"
FAST_EQUAL = "fast_equal"
FAST_NOT_EQUAL = "fast_not_equal"
OUTCOMES = (NO_THINK_END, NO_BOX, FAST_EQUAL, FAST_NOT_EQUAL) + verify_pool.STATUSES
CORRECT_OUTCOMES = frozenset({FAST_EQUAL, verify_pool.EQUAL})

_INTEGER = re.compile(r"^[+-]?\d+$")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` whose braces close, or None.

    Braces are matched by depth counting (``\\{`` and ``\\}`` are escaped literals and do not
    count), so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. A box left open (a truncated
    answer) is skipped in favour of the last closed one before it.
    """
    start = text.rfind(BOX_COMMAND + "{")
    while start != -1:
        content_start = start + len(BOX_COMMAND) + 1
        depth, i = 1, content_start
        while i < len(text):
            char = text[i]
            if char == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
                i += 2
                continue
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    return text[content_start:i]
            i += 1
        start = text.rfind(BOX_COMMAND + "{", 0, start)
    return None


def extract_answer(completion: str, *, think_end: str = THINK_END) -> tuple[str | None, str | None]:
    """``(prediction, failure)``: the boxed answer after the first ``think_end``, or a failure.

    ``failure`` is ``NO_THINK_END`` or ``NO_BOX`` when ``prediction`` is None.
    """
    cut = completion.find(think_end)
    if cut == -1:
        return None, NO_THINK_END
    prediction = last_boxed(completion[cut + len(think_end):])
    if prediction is None:
        return None, NO_BOX
    return prediction, None


def as_integer(text: str) -> int | None:
    """``int(text)`` for a plain integer (whitespace and ``$`` around it ignored), else None."""
    stripped = text.strip().strip("$").strip()
    return int(stripped) if _INTEGER.match(stripped) else None


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """How completions are scored.

    Attributes:
      kind: ``'math'`` (math-verify after the integer fast path) or ``'exact'`` (integer or
        stripped-string equality only: the synthetic task).
      correct_reward, incorrect_reward: reward values (paper: +1 / -1).
      think_end: the tag that ends the thinking part.
    """

    kind: str = "math"
    correct_reward: float = 1.0
    incorrect_reward: float = -1.0
    think_end: str = THINK_END

    def __post_init__(self):
        if self.kind not in ("math", "exact"):
            raise ValueError(f"RewardConfig.kind must be 'math' or 'exact', got {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class ScoredBatch:
    """Rewards and outcomes of a batch; ``counts`` has every category of ``OUTCOMES``."""

    rewards: np.ndarray  # float32[N]
    correct: np.ndarray  # bool[N]
    outcomes: list[str]
    counts: dict[str, int]


def _fast_outcome(prediction: str, gold: str, kind: str) -> str | None:
    """Outcome decided without math-verify, or None when math-verify must decide."""
    pred_int, gold_int = as_integer(prediction), as_integer(gold)
    if pred_int is not None and gold_int is not None:
        return FAST_EQUAL if pred_int == gold_int else FAST_NOT_EQUAL
    if kind == "exact":
        return FAST_EQUAL if prediction.strip() == gold.strip() else FAST_NOT_EQUAL
    return None


def score_completions(completions: Sequence[str], golds: Sequence[str], config: RewardConfig, *,
                      pool: verify_pool.VerifyPool | None = None) -> ScoredBatch:
    """Scores ``completions[i]`` against ``golds[i]`` (see the module docstring).

    ``pool`` is needed only for kind ``'math'`` items the fast path cannot decide; when None,
    the shared ``default_pool()`` is used.
    """
    if len(completions) != len(golds):
        raise ValueError(f"score_completions: {len(completions)} completions but "
                         f"{len(golds)} golds")
    outcomes: list[str | None] = []
    to_verify: list[tuple[int, tuple[str, str]]] = []
    for index, (completion, gold) in enumerate(zip(completions, golds)):
        if not isinstance(completion, str) or not isinstance(gold, str):
            raise ValueError(f"score_completions: item {index} is not a pair of strings "
                             f"({type(completion).__name__}, {type(gold).__name__})")
        prediction, failure = extract_answer(completion, think_end=config.think_end)
        if failure is not None:
            outcomes.append(failure)
            continue
        fast = _fast_outcome(prediction, gold, config.kind)
        outcomes.append(fast)
        if fast is None:
            to_verify.append((index, (gold, prediction)))
    if to_verify:
        statuses = (pool or default_pool()).verify([pair for _, pair in to_verify])
        for (index, _), status in zip(to_verify, statuses):
            outcomes[index] = status
    correct = np.array([o in CORRECT_OUTCOMES for o in outcomes], dtype=bool)
    rewards = np.where(correct, config.correct_reward, config.incorrect_reward).astype(np.float32)
    counts = {name: outcomes.count(name) for name in OUTCOMES}
    return ScoredBatch(rewards=rewards, correct=correct, outcomes=list(outcomes), counts=counts)


_default_pool: verify_pool.VerifyPool | None = None
_default_pool_lock = threading.Lock()
DEFAULT_POOL_WORKERS = 1
DEFAULT_TIME_LIMIT_S = 5.0


def default_pool() -> verify_pool.VerifyPool:
    """The process-wide pool behind ``math_reward`` (created on first use, closed at exit).

    It has ``DEFAULT_POOL_WORKERS`` workers and ``DEFAULT_TIME_LIMIT_S`` per item; runs that
    score many items should create their own ``VerifyPool`` from the config and pass it.
    """
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = verify_pool.VerifyPool(DEFAULT_POOL_WORKERS,
                                                   time_limit_s=DEFAULT_TIME_LIMIT_S)
            atexit.register(_default_pool.close)
        return _default_pool


def math_reward(completion: str, gold: str, *, pool: verify_pool.VerifyPool | None = None,
                correct_reward: float = 1.0, incorrect_reward: float = -1.0) -> float:
    """+1 if the last ``\\boxed{}`` after ``</think>`` is equivalent to ``gold``, else -1.

    No ``</think>``, no box, unparsable, verifier error or timeout all give ``incorrect_reward``.
    """
    config = RewardConfig(kind="math", correct_reward=correct_reward,
                          incorrect_reward=incorrect_reward)
    return float(score_completions([completion], [gold], config, pool=pool).rewards[0])
