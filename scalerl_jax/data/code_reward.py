"""The code reward: each completion's program run against its problem's tests in the sandbox.

For completion i of problem p_i: the program is the completion's last fenced python block
(`sandbox.extract`; the whole text when it has none and `whole_text_when_unfenced`), preceded by
p_i's program prefix (HumanEval: its prompt). It scores `correct_reward` when the verifier says
`passed`, else `incorrect_reward`; a completion without a program is `unparsable` and never runs.
The result is a `ScoredBatch` whose outcomes are the verifier's kinds (`CODE_KINDS`) and whose
counts hold every math outcome (zero) and every code kind, so the math evaluation's metrics
(timeouts, answer-found, format failures) read it unchanged; `predictions[i]` is the program
(None without one), `details[i]` the verdict's detail.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scalerl_jax.data.answers import OUTCOMES
from scalerl_jax.data.code_rows import CodeProblem
from scalerl_jax.data.rewards import ScoredBatch
from scalerl_jax.sandbox.extract import program_from_completion
from scalerl_jax.sandbox.verifier import CRASH, FAILED, MEMORY, PASSED, TIMEOUT, UNPARSABLE, CodeVerifier, Verdict

CODE_KINDS = (PASSED, FAILED, TIMEOUT, MEMORY, CRASH, UNPARSABLE)


def score_code_completions(
    completions: Sequence[str],
    problems: Sequence[CodeProblem],
    verifier: CodeVerifier,
    *,
    whole_text_when_unfenced: bool = True,
    correct_reward: float = 1.0,
    incorrect_reward: float = -1.0,
) -> ScoredBatch:
    """Scores `completions[i]` against `problems[i]` (the module docstring), the programs run
    `verifier.limits.workers` at once."""
    if len(completions) != len(problems):
        raise ValueError(f"score_code_completions: {len(completions)} completions but {len(problems)} problems")
    programs = [
        program_from_completion(text, whole_text_when_unfenced=whole_text_when_unfenced) for text in completions
    ]
    runnable = [i for i, program in enumerate(programs) if program is not None]
    ran = verifier.check_many([(problems[i].program(programs[i] or ""), problems[i].tests) for i in runnable])
    verdicts: list[Verdict] = [Verdict(kind=UNPARSABLE, seconds=0.0, detail="no program in the completion")] * len(
        completions
    )
    for i, verdict in zip(runnable, ran):
        verdicts[i] = verdict
    outcomes = [v.kind for v in verdicts]
    correct = np.array([v.passed for v in verdicts], dtype=bool)
    return ScoredBatch(
        rewards=np.where(correct, correct_reward, incorrect_reward).astype(np.float32),
        correct=correct,
        outcomes=outcomes,
        counts={name: outcomes.count(name) for name in (*OUTCOMES, *CODE_KINDS)},
        predictions=list(programs),
        details=[v.detail for v in verdicts],
        styles=[None] * len(completions),
    )
