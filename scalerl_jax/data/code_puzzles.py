"""A code domain a tiny policy can learn: write a Python expression over given numbers that hits a
target, checked by running it in the code sandbox.

A problem gives values for the names a, b (and c) and a target, e.g. `a=3 b=5 c=7 make 22`. The
completion is one Python expression over those names. The program that runs is
`def f(a, b, c):\\n    return <expression>`, and the problem's tests, run after it, pass when
  - every operator is +, - or * (`BINARY_OP` with one of those; unary minus is allowed),
  - no name is loaded twice (each number is used at most once),
  - the function holds no constant but None (no number literal: the value comes from the given
    numbers) and reads no global or attribute name (no builtins),
  - f(3, 5, 7) == 22.
The rules are checked on the compiled function's bytecode (`dis`) inside the sandbox, so the
policy's text never runs outside it.

A level is `(num_names, max_value)`: values uniform in [1, max_value], the target the value of a
random expression using every name once (`reference`, the warm start's demonstration), with a
random operator of the config's `operators` (default + and -) between neighbours and, for three
names, a random grouping. Generation is a pure function of the seed: split k draws from
`default_rng([seed, k])` and skips the (values, target) pairs of the splits drawn before it, so
splits are disjoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from scalerl_jax.data.code_rows import CodeProblem

PUZZLES = "puzzles"
NAMES = ("a", "b", "c")
OPERATORS = ("+", "-", "*")  # what an answer may use
DEFAULT_OPERATORS = ("+", "-")  # what the targets are made with: the sums the tiny policy's math task teaches
DEFAULT_LEVELS = ((2, 19), (3, 9))
# The user turn of the puzzle domain (a short one: the tiny policy's prompts are at most 32 tokens).
TEMPLATE = "{problem}\nPython expression:"

_RULES = """import dis as _dis
_ins = list(_dis.get_instructions(f))
_loads = [n for i in _ins if i.opname.startswith("LOAD_FAST")
          for n in (i.argval if isinstance(i.argval, tuple) else (i.argval,))]
assert len(_loads) == len(set(_loads)), "a number is used twice"
assert all(c is None for c in f.__code__.co_consts), "a constant"
assert not f.__code__.co_names, "a name other than the numbers"
assert all(i.argrepr in ("+", "-", "*") for i in _ins if i.opname == "BINARY_OP"), "an operator but + - *"
assert not [i for i in _ins if i.opname.startswith("BINARY_") and i.opname != "BINARY_OP"], "an operator but + - *"
"""


@dataclasses.dataclass(frozen=True)
class PuzzleConfig:
    """Everything that determines the puzzles: `seed`, ordered `(split, count)` pairs (earlier
    splits are drawn first), `levels` `(num_names, max_value)` (problem i of a split is at level
    i % len(levels)) and the `operators` the targets are made with."""

    seed: int = 0
    split_sizes: tuple[tuple[str, int], ...] = (("heldout", 128), ("sft", 256), ("train", 512))
    levels: tuple[tuple[int, int], ...] = DEFAULT_LEVELS
    operators: tuple[str, ...] = DEFAULT_OPERATORS

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("code puzzles: levels must not be empty")
        for num_names, max_value in self.levels:
            if not 2 <= num_names <= len(NAMES) or max_value < 1:
                raise ValueError(
                    f"code puzzles: level ({num_names}, {max_value}) needs 2 <= names <= {len(NAMES)} and max value >= 1"
                )
        if not self.operators or not set(self.operators) <= set(OPERATORS):
            raise ValueError(f"code puzzles: operators {self.operators!r} must be a non-empty subset of {OPERATORS}")


@dataclasses.dataclass(frozen=True)
class Puzzle:
    """Values of the first `len(values)` names, the `target`, a `reference` expression reaching
    it, and the `level` (index into the config's levels)."""

    values: tuple[int, ...]
    target: int
    reference: str
    level: int

    @property
    def names(self) -> tuple[str, ...]:
        return NAMES[: len(self.values)]

    @property
    def text(self) -> str:
        """The problem as the prompt shows it: `a=3 b=5 c=7 make 22`."""
        return " ".join(f"{n}={v}" for n, v in zip(self.names, self.values)) + f" make {self.target}"

    def code_problem(self, index: int) -> CodeProblem:
        """The puzzle as the code verifier runs it (the module docstring)."""
        call = f"f({', '.join(str(v) for v in self.values)})"
        return CodeProblem(
            code_format=PUZZLES,
            task_id=f"puzzle/{index}",
            problem=self.text,
            tests=_RULES + f"assert {call} == {self.target}, 'the value is ' + repr({call})\n",
            program_prefix=f"def f({', '.join(self.names)}):\n    return ",
            reference=self.reference,
            source_index=index,
        )


def _expression(names: Sequence[str], operators: Sequence[str], group_right: bool) -> str:
    """`x op y` for two names; `x op y op z` for three, with `x op (y op z)` when `group_right`."""
    if len(names) == 2:
        return f"{names[0]}{operators[0]}{names[1]}"
    if group_right:
        return f"{names[0]}{operators[0]}({names[1]}{operators[1]}{names[2]})"
    return f"({names[0]}{operators[0]}{names[1]}){operators[1]}{names[2]}"


def _value(expression: str, names: Sequence[str], values: Sequence[int]) -> int:
    """The value of one of our own generated expressions (names, + - *, parentheses only)."""
    return int(eval(expression, {"__builtins__": {}}, dict(zip(names, values))))  # noqa: S307 - generated here


def draw_puzzle(
    rng: np.random.Generator, level: tuple[int, int], level_index: int, operators: Sequence[str] = DEFAULT_OPERATORS
) -> Puzzle:
    """One puzzle at `level`, its target made with `operators` (the module docstring)."""
    num_names, max_value = level
    names = NAMES[:num_names]
    values = tuple(int(v) for v in rng.integers(1, max_value + 1, size=num_names))
    order = [names[int(i)] for i in rng.permutation(num_names)]
    chosen = [operators[int(i)] for i in rng.integers(0, len(operators), size=num_names - 1)]
    reference = _expression(order, chosen, bool(rng.integers(0, 2)))
    return Puzzle(values, _value(reference, names, values), reference, level_index)


def generate_splits(config: PuzzleConfig, *, max_draws: int = 10_000) -> dict[str, list[Puzzle]]:
    """Every split of `config`, disjoint by (values, target), deterministic in `config`.
    ValueError naming the level when `max_draws` draws in a row find no new puzzle."""
    taken: set[tuple[tuple[int, ...], int]] = set()
    splits: dict[str, list[Puzzle]] = {}
    for split_index, (name, count) in enumerate(config.split_sizes):
        rng = np.random.default_rng([config.seed, split_index])
        puzzles = []
        for i in range(count):
            level_index = i % len(config.levels)
            for _ in range(max_draws):
                puzzle = draw_puzzle(rng, config.levels[level_index], level_index, config.operators)
                if (puzzle.values, puzzle.target) not in taken:
                    break
            else:
                raise ValueError(
                    f"code puzzles: level {config.levels[level_index]} has no new puzzle after {max_draws} draws "
                    f"(split {name!r}, puzzle {i}); request fewer or raise its max value"
                )
            taken.add((puzzle.values, puzzle.target))
            puzzles.append(puzzle)
        splits[name] = puzzles
    return splits
