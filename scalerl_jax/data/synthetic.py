"""Synthetic verifiable task: chains of integer additions and subtractions with worked traces.

A problem is ``x_0 op_1 x_1 ... op_n x_n`` with ``op_i`` in ``{+, -}``, evaluated left to right
(the same as ordinary precedence, since only ``+`` and ``-`` occur). Its gold answer is the
integer value; its worked trace writes one running result per step::

    problem   23+45-17
    solution  <think>23+45=68
              68-17=51</think>\\boxed{51}

Difficulty levels set the number of operations and the operand range, so a tiny model that
learns one-step sums quickly still has multi-step chains left to improve on with RL. Generation
is a pure function of a seed: every split draws from its own random stream and excludes problems
already taken by the splits drawn before it, so splits are disjoint and the held-out split does
not change when the training split is resized.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
from collections.abc import Iterable, Sequence

import numpy as np

THINK_START = "<think>"
THINK_END = "</think>"

# A short user-turn template for tiny models (contains the boxed-answer instruction).
SYNTHETIC_TEMPLATE = "{problem}\nAnswer in \\boxed{}."

_OPERATORS = {"+": operator.add, "-": operator.sub}


@dataclasses.dataclass(frozen=True)
class Level:
    """A difficulty level: ``num_ops`` operations, operands uniform in ``[0, max_operand]``."""

    num_ops: int
    max_operand: int

    def __post_init__(self):
        if self.num_ops < 1:
            raise ValueError(f"Level.num_ops must be >= 1, got {self.num_ops}")
        if self.max_operand < 1:
            raise ValueError(f"Level.max_operand must be >= 1, got {self.max_operand}")


# Single-digit operands, 2 to 5 steps: every step has the same difficulty, so the pass rate falls
# with the number of steps (roughly p^n) and RL that sharpens single steps lifts every level.
# Two-digit operands are too hard for a CPU demo (docs/results/tiny_demo.md, the task's levels).
DEFAULT_LEVELS: tuple[Level, ...] = (Level(2, 9), Level(3, 9), Level(4, 9), Level(5, 9))


@dataclasses.dataclass(frozen=True)
class SyntheticTaskConfig:
    """Everything that determines the generated problems.

    Attributes:
      seed: base seed; split ``k`` (in ``split_sizes`` order) draws from ``default_rng([seed, k])``.
      split_sizes: ordered ``(name, count)`` pairs; earlier splits are drawn first and later ones
        exclude their problems, so put the held-out split first to keep it stable.
      levels: difficulty levels; problem ``i`` of a split has level ``i % len(levels)`` (balanced).
      operators: subset of ``('+', '-')``.
      nonnegative: if True, every running result (hence the answer) is ``>= 0``.
    """

    seed: int = 0
    split_sizes: tuple[tuple[str, int], ...] = (("heldout", 256), ("sft", 2048), ("train", 2048))
    levels: tuple[Level, ...] = DEFAULT_LEVELS
    operators: tuple[str, ...] = ("+", "-")
    nonnegative: bool = True

    def __post_init__(self):
        if not self.levels:
            raise ValueError("SyntheticTaskConfig.levels must not be empty")
        if not self.operators or any(op not in _OPERATORS for op in self.operators):
            raise ValueError(
                f"SyntheticTaskConfig.operators must be a non-empty subset of {tuple(_OPERATORS)}, got {self.operators}"
            )
        names = [name for name, _ in self.split_sizes]
        if len(set(names)) != len(names):
            raise ValueError(f"SyntheticTaskConfig.split_sizes has repeated split names: {names}")
        for name, count in self.split_sizes:
            if count < 0:
                raise ValueError(f"SyntheticTaskConfig.split_sizes[{name!r}] is negative: {count}")

    def digest(self) -> str:
        """Short hash of every field; names builds so a changed config never reuses old data."""
        payload = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    """``operands[0] operators[0] operands[1] ...`` at difficulty ``level`` (index into levels)."""

    operands: tuple[int, ...]
    operators: tuple[str, ...]
    level: int

    @property
    def text(self) -> str:
        """The expression, e.g. ``'23+45-17'``."""
        parts = [str(self.operands[0])]
        for op, value in zip(self.operators, self.operands[1:]):
            parts.append(f"{op}{value}")
        return "".join(parts)

    def running_results(self) -> list[int]:
        """``r_k = r_{k-1} op_k x_k`` with ``r_0 = x_0``, for ``k = 1..n``."""
        results = []
        value = self.operands[0]
        for op, operand in zip(self.operators, self.operands[1:]):
            value = _OPERATORS[op](value, operand)
            results.append(value)
        return results

    @property
    def answer(self) -> int:
        """The value of the expression."""
        return self.running_results()[-1]

    @property
    def solution(self) -> str:
        """Worked trace: ``a op b = r`` per step inside ``<think>``, then ``\\boxed{answer}``."""
        lines = []
        left = self.operands[0]
        for op, operand, result in zip(self.operators, self.operands[1:], self.running_results()):
            lines.append(f"{left}{op}{operand}={result}")
            left = result
        return f"{THINK_START}{chr(10).join(lines)}{THINK_END}\\boxed{{{self.answer}}}"


def direct_answer(answer: int | str) -> str:
    """An answer-only demonstration: an empty ``<think></think>`` block, then ``\\boxed{answer}``."""
    return f"{THINK_START}{THINK_END}\\boxed{{{answer}}}"


def _draw_problem(
    rng: np.random.Generator, level: Level, level_index: int, operators: Sequence[str]
) -> ArithmeticProblem:
    """Operands uniform in ``[0, max_operand]``, operators uniform over ``operators``."""
    operands = tuple(int(x) for x in rng.integers(0, level.max_operand + 1, size=level.num_ops + 1))
    ops = tuple(operators[int(i)] for i in rng.integers(0, len(operators), size=level.num_ops))
    return ArithmeticProblem(operands=operands, operators=ops, level=level_index)


def generate_problems(
    rng: np.random.Generator,
    count: int,
    levels: Sequence[Level],
    operators: Sequence[str],
    *,
    nonnegative: bool,
    exclude: set[str],
    max_draws: int = 10_000,
) -> list[ArithmeticProblem]:
    """Draws ``count`` distinct problems, problem ``i`` at level ``i % len(levels)``.

    Problems whose text is in ``exclude`` (or already drawn) are redrawn; ``exclude`` is updated
    with the new texts. With ``nonnegative``, problems with a negative running result are redrawn.

    Raises:
      ValueError: naming the level when ``max_draws`` draws in a row found no new problem (the
        level's space is nearly exhausted by the requested sizes).
    """
    problems = []
    for i in range(count):
        level_index = i % len(levels)
        level = levels[level_index]
        for _ in range(max_draws):
            problem = _draw_problem(rng, level, level_index, operators)
            if problem.text in exclude:
                continue
            if nonnegative and min(problem.running_results()) < 0:
                continue
            break
        else:
            raise ValueError(
                f"level {level_index} ({level}): no new problem in {max_draws} draws at problem "
                f"{i}; the level is nearly exhausted: raise its max_operand/num_ops or request "
                "fewer"
            )
        exclude.add(problem.text)
        problems.append(problem)
    return problems


def generate_splits(config: SyntheticTaskConfig) -> dict[str, list[ArithmeticProblem]]:
    """All splits of ``config``, disjoint by problem text, deterministic in ``config``."""
    taken: set[str] = set()
    splits = {}
    for split_index, (name, count) in enumerate(config.split_sizes):
        rng = np.random.default_rng([config.seed, split_index])
        splits[name] = generate_problems(
            rng, count, config.levels, config.operators, nonnegative=config.nonnegative, exclude=taken
        )
    return splits


def tokenizer_corpus(
    problems: Iterable[ArithmeticProblem], prompt_template: str, extra_texts: Sequence[str] = ()
) -> list[str]:
    """Texts to train the tiny tokenizer on: each formatted prompt and worked solution, plus extras.

    ``prompt_template`` contains ``{problem}`` (see ``prompts.format_problem``); ``extra_texts``
    should hold any text the sampler may force into a completion (e.g. the interruption phrase).
    """
    texts = []
    for problem in problems:
        texts.append(prompt_template.replace("{problem}", problem.text))
        texts.append(problem.solution)
        texts.append(direct_answer(problem.answer))
    texts.extend(extra_texts)
    return texts
