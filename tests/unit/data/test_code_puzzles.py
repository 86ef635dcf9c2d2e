"""The code puzzles: their rules enforced in the sandbox on hand-written expressions (verdicts
known by hand), every reference expression of a held-out split passing, disjoint deterministic splits."""

from __future__ import annotations

import pytest

from scalerl_jax.data.code_puzzles import Puzzle, PuzzleConfig, generate_splits
from scalerl_jax.sandbox import CodeVerifier, SandboxLimits

# a=3 b=5 c=7 make 22: 3*5+7 = 22 (by hand).
THREE = Puzzle(values=(3, 5, 7), target=22, reference="a*b+c", level=1).code_problem(0)
# a=9 b=4 make 5: 9-4 = 5.
TWO = Puzzle(values=(9, 4), target=5, reference="a-b", level=0).code_problem(1)

CASES = [
    (THREE, "a*b+c", "passed", ""),
    (THREE, "c+b*a", "passed", ""),  # any order and grouping
    (THREE, "(c+b)*a-b", "failed", "a number is used twice"),  # 3*12-5 = 31 anyway
    (THREE, "22", "failed", "a constant"),
    (THREE, "a*b+c+0", "failed", "a constant"),
    (THREE, "int(a*b+c)", "failed", "a name other than the numbers"),
    (THREE, "(a*b+c)//1", "failed", "a constant"),
    (THREE, "b**2+a+c", "failed", "a constant"),
    (THREE, "a*b", "failed", "the value is 15"),
    (THREE, "a*(b+c)", "failed", "the value is 36"),
    (TWO, "a-b", "passed", ""),
    (TWO, "-b+a", "passed", ""),  # unary minus is allowed
    (TWO, "a/b", "failed", "an operator but + - *"),
    (TWO, "b-a", "failed", "the value is -5"),
    (TWO, "a b", "unparsable", ""),
]


@pytest.fixture(scope="module")
def verifier():
    return CodeVerifier(SandboxLimits(wall_s=5.0, cpu_s=2, workers=2))


def test_the_rules_hold_in_the_sandbox(verifier):
    verdicts = verifier.check_many([(problem.program(code), problem.tests) for problem, code, _, _ in CASES])
    for (_, code, kind, detail), verdict in zip(CASES, verdicts):
        assert verdict.kind == kind, (code, verdict)
        assert detail in verdict.detail, (code, verdict)


def test_the_prompt_and_program_read_as_documented():
    assert THREE.problem == "a=3 b=5 c=7 make 22"
    assert THREE.program("a*b+c") == "def f(a, b, c):\n    return a*b+c"
    assert TWO.program_prefix == "def f(a, b):\n    return "


def test_every_held_out_reference_passes(verifier):
    heldout = generate_splits(PuzzleConfig(split_sizes=(("heldout", 48),)))["heldout"]
    problems = [p.code_problem(i) for i, p in enumerate(heldout)]
    verdicts = verifier.check_many([(q.program(q.reference), q.tests) for q in problems])
    assert [v.kind for v in verdicts] == ["passed"] * len(problems)


def test_splits_are_disjoint_deterministic_and_levelled():
    config = PuzzleConfig(seed=3, split_sizes=(("heldout", 40), ("sft", 60), ("train", 100)), levels=((2, 19), (3, 9)))
    splits = generate_splits(config)
    assert splits == generate_splits(config)
    keys = {name: {(p.values, p.target) for p in puzzles} for name, puzzles in splits.items()}
    assert [len(k) for k in keys.values()] == [40, 60, 100]
    assert not (keys["heldout"] & keys["sft"]) and not (keys["heldout"] | keys["sft"]) & keys["train"]
    for puzzle in splits["train"]:
        assert len(puzzle.values) == (2, 3)[puzzle.level]
        assert all(1 <= v <= (19, 9)[puzzle.level] for v in puzzle.values)
    # the held-out split does not move when a later split grows
    bigger = PuzzleConfig(seed=3, split_sizes=(("heldout", 40), ("sft", 60), ("train", 300)), levels=config.levels)
    assert generate_splits(bigger)["heldout"] == splits["heldout"]


def test_a_level_too_small_for_the_request_names_itself():
    with pytest.raises(ValueError, match=r"level \(2, 2\) has no new puzzle"):
        generate_splits(PuzzleConfig(split_sizes=(("train", 50),), levels=((2, 2),)), max_draws=50)
