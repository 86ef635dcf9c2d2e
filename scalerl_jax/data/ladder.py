"""A verifiable arithmetic ladder for real instruct models: named rungs of growing difficulty.

A rung is one kind of question over a finite operand space, e.g. ``add_1d``: ``a + b`` with
``a, b`` in 1..9. A problem is a rung and an operand tuple; its text is one of the rung's
phrasings (a bare expression such as ``What is 6 + 3?``, or a short word problem), drawn with the
problem. Gold answers are integers computed here with Python arithmetic.

Two rules keep the grading honest for a model that restates the question (small instruct models
do, in about half of their completions):

- every answer is a positive integer different from each operand, so a completion that echoes
  the question and stops (``6 - 3 = ...``: last number 3) cannot pass; operands 0 (``x + 0``) and
  1 (``x * 1``) never occur;
- the held-out split is drawn first, per rung, as whole operand tuples, and training takes only
  the rest: a held-out problem never reaches training under any phrasing.

Generation is a pure function of ``(seed, rung)``: each rung's space is enumerated, permuted with
``numpy.random.default_rng([seed, rung_index])``, the first ``heldout_per_level`` tuples are
held out and the others train, in that permuted order, each with a phrasing drawn from the same
stream. Rungs only evaluated (``transfer_levels``) are drawn the same way and never trained.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Callable, Sequence

import numpy as np

# Word-problem fillers: a name and a countable noun per problem, drawn with the problem.
_NAMES = ("Mia", "Sam", "Lena", "Omar", "Ava", "Ben", "Zoe", "Ravi")
_THINGS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "coins")


@dataclasses.dataclass(frozen=True)
class Rung:
    """One question kind: ``answer(operands)`` over the operand ranges (inclusive), written with
    one of ``bare`` (placeholders ``{a} {b} {c}``) or ``word`` (also ``{name} {things}``)."""

    ranges: tuple[tuple[int, int], ...]
    answer: Callable[[Sequence[int]], int]
    bare: tuple[str, ...]
    word: tuple[str, ...]

    def space(self) -> list[tuple[int, ...]]:
        """Every operand tuple whose answer is a positive integer different from each operand."""
        axes = [range(low, high + 1) for low, high in self.ranges]
        return [t for t in itertools.product(*axes) if _is_gradable(t, self.answer(t))]


def _is_gradable(operands: Sequence[int], answer: int) -> bool:
    return answer > 0 and answer not in operands


def _one_digit(value: int) -> int:
    """``value`` when it has one digit, else 0 (not gradable: the rung leaves it out)."""
    return value if 1 <= value <= 9 else 0


_ADD_BARE = ("What is {a} + {b}?", "Calculate {a} + {b}.", "Add {a} and {b}.")
_SUB_BARE = ("What is {a} - {b}?", "Calculate {a} - {b}.", "Subtract {b} from {a}.")
_MUL_BARE = ("What is {a} * {b}?", "Calculate {a} times {b}.", "Multiply {a} by {b}.")
_ADD_WORD = ("{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?",)
_SUB_WORD = ("{name} has {a} {things} and gives {b} away. How many {things} does {name} have left?",)
_MUL_WORD = ("There are {a} bags with {b} {things} in each bag. How many {things} are there in all?",)

RUNGS: dict[str, Rung] = {
    # In order of difficulty for SmolLM2-135M-Instruct (docs/results/smollm2_arith/README.md).
    "add_1d": Rung(((1, 9), (1, 9)), lambda t: t[0] + t[1], _ADD_BARE, _ADD_WORD),
    "sub_1d": Rung(((2, 18), (1, 9)), lambda t: _one_digit(t[0] - t[1]), _SUB_BARE, _SUB_WORD),
    "mul_1d": Rung(((2, 9), (2, 9)), lambda t: t[0] * t[1], _MUL_BARE, _MUL_WORD),
    "add_teen": Rung(((10, 19), (1, 9)), lambda t: t[0] + t[1], _ADD_BARE, _ADD_WORD),
    "add_3": Rung(
        ((1, 9), (1, 9), (1, 9)),
        lambda t: t[0] + t[1] + t[2],
        ("What is {a} + {b} + {c}?", "Calculate {a} + {b} + {c}."),
        ("{name} has {a} {things}, gets {b} more and then {c} more. How many {things} does {name} have now?",),
    ),
    "add_2d": Rung(((10, 99), (1, 99)), lambda t: t[0] + t[1], _ADD_BARE, _ADD_WORD),
    "sub_2d": Rung(((10, 99), (1, 99)), lambda t: t[0] - t[1], _SUB_BARE, _SUB_WORD),
    "mul_add": Rung(
        ((2, 9), (2, 9), (1, 9)),
        lambda t: t[0] * t[1] + t[2],
        ("What is {a} * {b} + {c}?", "Calculate {a} times {b}, plus {c}."),
        (
            "There are {a} bags with {b} {things} in each bag and {c} more {things} on the table. "
            "How many {things} are there in all?",
        ),
    ),
}
LEVELS = tuple(RUNGS)


@dataclasses.dataclass(frozen=True)
class LadderProblem:
    """A rung's question for one operand tuple, as phrased, with its integer answer."""

    level: str
    operands: tuple[int, ...]
    text: str
    answer: int

    def row(self) -> dict[str, str]:
        """The problem as a data row: ``problem`` (the text), ``answer`` (a string), ``level``."""
        return {"problem": self.text, "answer": str(self.answer), "level": self.level}


@dataclasses.dataclass(frozen=True)
class LadderConfig:
    """Everything that determines the generated problems.

    Attributes:
      seed: base seed of every rung's permutation and phrasings.
      levels: rungs trained on and held out (names from ``LEVELS``).
      heldout_per_level: held-out problems per rung of ``levels`` and of ``transfer_levels``.
      transfer_levels: rungs only evaluated (their own split), never trained.
      word_problem_fraction: probability that a problem is phrased as a word problem.
    """

    seed: int = 0
    levels: tuple[str, ...] = ("add_1d", "sub_1d", "mul_1d", "add_teen")
    heldout_per_level: int = 32
    transfer_levels: tuple[str, ...] = ()
    word_problem_fraction: float = 0.25

    def __post_init__(self):
        for field, names in (("levels", self.levels), ("transfer_levels", self.transfer_levels)):
            unknown = [name for name in names if name not in RUNGS]
            if unknown:
                raise ValueError(
                    f"`ladder.{field}` = {names}: unknown level(s) {unknown}; the ladder's levels are {LEVELS}"
                )
        if not self.levels:
            raise ValueError(f"`ladder.levels` is empty; choose from {LEVELS}")
        both = sorted(set(self.levels) & set(self.transfer_levels))
        if both:
            raise ValueError(
                f"`ladder.transfer_levels` = {self.transfer_levels}: {both} also in `ladder.levels` (trained); list each once"
            )
        if not 0.0 <= self.word_problem_fraction <= 1.0:
            raise ValueError(
                f"`ladder.word_problem_fraction` = {self.word_problem_fraction}: expected a number in [0, 1]"
            )
        for name in (*self.levels, *self.transfer_levels):
            size = len(RUNGS[name].space())
            if self.heldout_per_level >= size:
                raise ValueError(
                    f"`ladder.heldout_per_level` = {self.heldout_per_level} leaves level {name!r} ({size} problems) "
                    f"nothing to train on; expected fewer than {size}"
                )

    def digest(self) -> str:
        """Short hash of every field; names builds so a changed config never reuses old data."""
        payload = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:12]


def phrase(rung: Rung, operands: Sequence[int], rng: np.random.Generator, word_problem_fraction: float) -> str:
    """One phrasing of ``operands``: a word problem with probability ``word_problem_fraction``,
    else a bare question; template, name and noun drawn from ``rng``."""
    use_word = bool(rng.random() < word_problem_fraction)
    templates = rung.word if use_word else rung.bare
    template = templates[int(rng.integers(len(templates)))]
    name, things = _NAMES[int(rng.integers(len(_NAMES)))], _THINGS[int(rng.integers(len(_THINGS)))]
    values = dict(zip("abc", operands))
    return template.format(name=name, things=things, **values)


def rung_split(config: LadderConfig, level: str) -> tuple[list[LadderProblem], list[LadderProblem]]:
    """(held-out, train) problems of ``level``: its space permuted with ``default_rng([seed,
    index of level in LEVELS])``, the first ``heldout_per_level`` held out, the rest to train."""
    rung = RUNGS[level]
    rng = np.random.default_rng([config.seed, LEVELS.index(level)])
    space = rung.space()
    order = rng.permutation(len(space))
    problems = []
    for index in order:
        operands = space[int(index)]
        text = phrase(rung, operands, rng, config.word_problem_fraction)
        problems.append(LadderProblem(level, operands, text, rung.answer(operands)))
    return problems[: config.heldout_per_level], problems[config.heldout_per_level :]


def _interleave(per_level: list[list[LadderProblem]]) -> list[LadderProblem]:
    """Round robin over the levels (a prefix of the result is balanced), longer lists last."""
    out = []
    for row in itertools.zip_longest(*per_level):
        out.extend(problem for problem in row if problem is not None)
    return out


def generate_splits(config: LadderConfig) -> dict[str, list[LadderProblem]]:
    """``heldout`` and ``train`` over ``config.levels`` and ``transfer`` over
    ``config.transfer_levels`` (held-out draws of those rungs), each interleaved across its levels."""
    heldout, train = zip(*(rung_split(config, level) for level in config.levels))
    transfer = [rung_split(config, level)[0] for level in config.transfer_levels]
    return {"heldout": _interleave(list(heldout)), "train": _interleave(list(train)), "transfer": _interleave(transfer)}
