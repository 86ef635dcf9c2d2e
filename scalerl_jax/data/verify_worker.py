"""Worker process for ``verify_pool.VerifyPool``: scores completions on its own main thread.

Run as a script (``python -P verify_worker.py SOFT_TIMEOUT_S [REWARD_FN]``), not as a package
module, so it imports only the standard library, math-verify, ``answers.py`` (loaded by its path:
standard library only) and, when ``REWARD_FN`` (``'package.module:function'``) is given, the
user's module (found through the ``PYTHONPATH`` the pool passes down).

Protocol: JSON lines. The worker first scores one warm-up pair (math-verify's first use loads its grammar and sympy), then
writes ``{"status": "ready"}``, or
``{"status": "startup_error", "detail": str}`` and exits if the reward function cannot be loaded.
Then for each request line ``{"kind", "answer_format", "think_end", "styles": [answer style, ...],
"items": [[completion, gold, problem], ...]}`` it writes one line per item, in order, as each is
scored: ``answers.score_item``'s ``{"status", "reward", "prediction", "style", "detail"}``. math-verify runs with its own signal timeout of
SOFT_TIMEOUT_S seconds per call (status ``timeout``); both sides are parsed from
``\\boxed{...}`` so the box's content is read as LaTeX. The worker exits at end of input. Library
output on stdout is moved to stderr so it cannot corrupt the protocol stream.
"""

import functools
import importlib.util
import json
import os
import sys


def _load_answers():
    """``answers.py`` from this file's directory, without importing the scalerl_jax package."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "answers.py")
    spec = importlib.util.spec_from_file_location("_scalerl_answers", path)
    assert spec is not None and spec.loader is not None, path  # a .py path always gets a source loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    """Serves requests from stdin until end of input."""
    soft_timeout_s = int(sys.argv[1])
    reward_fn_spec = sys.argv[2] if len(sys.argv) > 2 else ""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def respond(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")

    answers = _load_answers()
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    reward_fn = None
    if reward_fn_spec:
        try:
            reward_fn = answers.load_reward_fn(reward_fn_spec)
        except ValueError as e:
            respond({"status": "startup_error", "detail": str(e)})
            return

    @functools.lru_cache(maxsize=4096)
    def parse_boxed(text: str):
        return parse("\\boxed{" + text + "}", parsing_timeout=soft_timeout_s, raise_on_error=True)

    def verify_math(gold_text: str, pred_text: str) -> tuple[str, str]:
        try:
            gold, pred = parse_boxed(gold_text), parse_boxed(pred_text)
            if not gold or not pred:
                return answers.UNPARSABLE, "gold" if not gold else "pred"
            equal = verify(gold, pred, timeout_seconds=soft_timeout_s, raise_on_error=True)
            return (answers.EQUAL if equal else answers.NOT_EQUAL), ""
        except TimeoutException as e:
            return answers.TIMEOUT, str(e)[:200]
        except Exception as e:  # noqa: BLE001 - any failure of the verifier on this item is reported, not fatal
            return answers.ERROR, f"{type(e).__name__}: {str(e)[:200]}"

    # math-verify loads its LaTeX grammar and sympy's simplification on first use: seconds on a busy
    # machine, which the pool's per-item limit would charge to the first fraction or polynomial.
    verify_math("\\frac{1}{2}", "x+1")
    respond({"status": "ready"})
    for line in sys.stdin:
        request = json.loads(line)
        for completion, gold, problem in request["items"]:
            respond(
                answers.score_item(
                    completion,
                    gold,
                    problem,
                    kind=request["kind"],
                    answer_format=request["answer_format"],
                    think_end=request["think_end"],
                    verify_math=verify_math,
                    reward_fn=reward_fn,
                    styles=request["styles"],
                )
            )


if __name__ == "__main__":
    main()
