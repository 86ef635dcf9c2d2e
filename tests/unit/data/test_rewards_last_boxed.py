"""``last_boxed``: hand-written cases, a brute-force reference on random brace strings, and its
cost growing linearly with the text (adversarial text of many unclosed boxes), counted in
interpreter steps; its wall time is measured in ``benchmarks/bench_rewards.py``."""

import random
import sys

import pytest

from scalerl_jax.data.rewards import last_boxed

BOX = "\\boxed{"


def reference_last_boxed(text: str) -> str | None:
    """Brute force from the definition: for every ``\\boxed{`` find its closing brace by depth
    counting from the box (``\\{``, ``\\}`` skipped as escaped literals); of the boxes that close,
    the content of the one whose closing brace comes last."""
    best_end, best = -1, None
    start = text.find(BOX)
    while start != -1:
        i, depth = start + len(BOX), 1
        while i < len(text):
            if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
                i += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                if i > best_end:
                    best_end, best = i, text[start + len(BOX) : i]
                break
            i += 1
        start = text.find(BOX, start + 1)
    return best


HAND_CASES = [
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{a} \\boxed{b}", "b"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed{\\}}", "\\}"),
    ("\\boxed{\\{}", "\\{"),
    ("\\boxed{1} \\boxed{2", "1"),  # the open box is skipped
    ("\\boxed{{x}", None),
    ("no box", None),
    ("\\boxed{}", ""),
    ("\\boxed {1}", None),  # not the box command
    ("}}}\\boxed{1}}}", "1"),  # stray closing braces around it
    ("\\\\boxed{7}", "7"),  # a LaTeX line break before the command
    ("\\boxed{a \\boxed{b} c}", "a \\boxed{b} c"),  # nested: the outer box ends last
    ("\\boxed{\\boxed{b}}", "\\boxed{b}"),
    ("\\boxed{x \\boxed{y}", "y"),  # outer never closes: the inner one is the last closed
    ("\\boxed{a} \\boxed{b {c}", "a"),
    ("\\boxed{a} \\boxed{b \\}", "a"),  # the escaped brace does not close the second box
]


@pytest.mark.parametrize("text,expected", HAND_CASES)
def test_hand_cases(text, expected):
    assert last_boxed(text) == expected
    assert reference_last_boxed(text) == expected  # the reference agrees with the hand answers


def test_matches_brute_force_on_random_brace_strings():
    rng = random.Random(0)
    pieces = [BOX, BOX, "{", "}", "}", "\\{", "\\}", "\\", "a", " ", "\\frac{1}{2}"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert last_boxed(text) == reference_last_boxed(text), text


def _adversarial(num_chars: int) -> str:
    """One closed box, then many that never close (each unit opens two boxes, one inside the
    other, with closed groups and an escaped brace inside): a truncated, looping answer."""
    unit = "\\boxed{x^{2} \\{ {a} \\boxed{"
    return ("\\boxed{1} " + unit * (num_chars // len(unit) + 1))[:num_chars]


def _interpreter_steps(function, text: str) -> int:
    """Python lines executed inside ``function(text)`` (``sys.settrace`` line events): a
    deterministic measure of its work, unlike wall time on a shared machine."""
    steps = 0

    def trace(frame, event, arg):
        nonlocal steps
        if event == "line":
            steps += 1
        return trace

    sys.settrace(trace)
    try:
        function(text)
    finally:
        sys.settrace(None)
    return steps


def test_cost_is_linear_in_the_text():
    small, large = _adversarial(10_000), _adversarial(100_000)
    assert last_boxed(large) == "1"
    ratio = _interpreter_steps(last_boxed, large) / _interpreter_steps(last_boxed, small)
    assert 9 <= ratio <= 11, f"100k characters took {ratio:.1f}x the steps of 10k (linear: 10x)"


def test_step_count_catches_a_quadratic_scan():
    """The measure above tells quadratic from linear: the brute-force reference rescans the
    rest of the text from every open box, ~100x the steps for 10x the text."""
    small, large = _adversarial(500), _adversarial(5_000)
    ratio = _interpreter_steps(reference_last_boxed, large) / _interpreter_steps(reference_last_boxed, small)
    assert ratio > 50, ratio
