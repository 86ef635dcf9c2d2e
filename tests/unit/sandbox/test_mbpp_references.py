"""Every MBPP reference solution (`../shared/data/mbpp`, 974 rows) in the sandbox, against the count
its data card gives: run as the setup code, the solution, then the tests, 972 pass and tasks 367
and 927 do not (their setup code builds trees of the solution's own `Node` class before it exists).
Run as `code_rows` lays a row out (the solution, then the setup code and the tests), all 974 pass."""

from __future__ import annotations

from repo_paths import MBPP_PATH

from scalerl_jax.data.code_rows import read_code_problems
from scalerl_jax.sandbox.verifier import CodeVerifier, SandboxLimits


def test_every_reference_solution_passes_and_the_card_order_fails_exactly_two():
    problems = read_code_problems(MBPP_PATH)
    verifier = CodeVerifier(SandboxLimits(wall_s=10.0, workers=2))
    verdicts = verifier.check_many([(p.program(p.reference), p.tests) for p in problems])
    assert len(verdicts) == 974
    assert {p.task_id: v.kind for p, v in zip(problems, verdicts) if not v.passed} == {}
    # The card's order for the two rows with setup code: setup first, then the solution, then the tests.
    setup_rows = [p for p in problems if not p.tests.startswith("assert")]
    split = [p.tests.split("\nassert", 1) for p in setup_rows]
    card_order = verifier.check_many(
        [(setup + "\n" + p.reference, "assert" + asserts) for p, (setup, asserts) in zip(setup_rows, split)]
    )
    assert {p.task_id: v.kind for p, v in zip(setup_rows, card_order)} == {"367": "failed", "927": "failed"}
    assert all("NameError: name 'Node' is not defined" in v.detail for v in card_order)
