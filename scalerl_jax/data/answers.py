"""Answer extraction and the scoring of one completion, in the standard library only.

The verify workers load this file by its path (``verify_worker.py`` runs as a plain script), so it
imports nothing from scalerl_jax, numpy or jax. Every function here runs inside a worker under the
pool's hard per-item time limit; the main process imports it for the names and for tests.

Scoring one completion (``score_item``):

1. The answer part: for ``answer_format='think'`` the text after the first ``think_end`` tag
   (none: ``NO_THINK_END``); for ``'plain'`` (base models without a think phase) the whole text.
2. The prediction: the content of the last complete ``\\boxed{...}`` of the answer part (see
   ``last_boxed``); none: ``NO_BOX``.
3. With a custom reward function, its value decides (outcome ``CUSTOM``; it gets the whole
   completion, the gold and the problem). Otherwise: gold and prediction both plain integers are
   compared as integers (``FAST_EQUAL`` / ``FAST_NOT_EQUAL``); else kind ``'exact'`` compares the
   stripped strings and kind ``'math'`` asks math-verify (``EQUAL``, ``NOT_EQUAL``,
   ``UNPARSABLE``, ``TIMEOUT``, ``ERROR``).

The pool adds ``TIMEOUT`` (the hard limit killed the worker) and ``CRASH`` (the worker died).
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable
from typing import cast

THINK = "think"
PLAIN = "plain"
ANSWER_FORMATS = (THINK, PLAIN)
KINDS = ("math", "exact")

# Outcomes of one scored completion.
NO_THINK_END = "no_think_end"
NO_BOX = "no_box"
FAST_EQUAL = "fast_equal"
FAST_NOT_EQUAL = "fast_not_equal"
EQUAL = "equal"
NOT_EQUAL = "not_equal"
UNPARSABLE = "unparsable"
TIMEOUT = "timeout"
ERROR = "error"
CRASH = "crash"
CUSTOM = "custom"
OUTCOMES = (
    NO_THINK_END,
    NO_BOX,
    FAST_EQUAL,
    FAST_NOT_EQUAL,
    EQUAL,
    NOT_EQUAL,
    UNPARSABLE,
    TIMEOUT,
    ERROR,
    CRASH,
    CUSTOM,
)
CORRECT_OUTCOMES = frozenset({FAST_EQUAL, EQUAL})  # CUSTOM is correct when its reward is > 0

_BOX_OPEN = "\\boxed{"
# ``\boxed{``, an escaped brace, or a brace; every other character is skipped by the scan.
_BOX_TOKENS = re.compile(r"\\boxed\{|\\[{}]|[{}]")
_INTEGER = re.compile(r"^[+-]?\d+$")
_REWARD_FN_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")

# A completion the custom reward function is called on once at pool start.
CHECK_ITEM = ("<think>1 + 1 = 2</think>The answer is \\boxed{2}.", "2", "What is 1 + 1?")

VerifyMath = Callable[[str, str], tuple[str, str]]  # (gold, pred) -> (outcome, detail)
RewardFn = Callable[[str, str, str], float]  # (completion, gold, problem) -> reward


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` whose braces close, or None.

    One left-to-right pass with a stack of open braces: ``\\{`` and ``\\}`` are escaped literals
    and do not count, a ``}`` with nothing open is ignored, and a box's content ends at the brace
    that closes the box's own ``{``. Of the boxes that close, the one whose closing brace comes
    last wins: a box left open (a truncated answer) is skipped in favour of the last closed one
    before it, and of nested boxes the outermost (it closes after the ones inside it), so
    ``\\boxed{a \\boxed{b} c}`` gives ``a \\boxed{b} c``. ``\\boxed{\\frac{1}{2}}`` gives
    ``\\frac{1}{2}``. Time and memory are linear in ``len(text)``.
    """
    open_braces: list[int] = []  # per open brace: its box's content start, or -1 for a group
    last = None
    for token in _BOX_TOKENS.finditer(text):
        brace = token.group()
        if brace == "{":
            open_braces.append(-1)
        elif brace == "}":
            if open_braces:
                content_start = open_braces.pop()
                if content_start >= 0:
                    last = text[content_start : token.start()]
        elif brace == _BOX_OPEN:
            open_braces.append(token.end())
        # else an escaped brace: a literal
    return last


def extract_answer(completion: str, *, answer_format: str, think_end: str) -> tuple[str | None, str | None]:
    """``(prediction, failure)``: the boxed answer of the answer part, or why there is none.

    The answer part is the text after the first ``think_end`` for ``answer_format='think'`` and
    the whole completion for ``'plain'``. ``failure`` is ``NO_THINK_END`` or ``NO_BOX`` when
    ``prediction`` is None, else None.
    """
    if answer_format == THINK:
        cut = completion.find(think_end)
        if cut == -1:
            return None, NO_THINK_END
        completion = completion[cut + len(think_end) :]
    elif answer_format != PLAIN:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    prediction = last_boxed(completion)
    return (None, NO_BOX) if prediction is None else (prediction, None)


def as_integer(text: str) -> int | None:
    """``int(text)`` for a plain integer (whitespace and ``$`` around it ignored), else None."""
    stripped = text.strip().strip("$").strip()
    return int(stripped) if _INTEGER.match(stripped) else None


def check_reward_fn_spec(spec: str) -> tuple[str, str]:
    """``(module, function)`` of a ``'package.module:function'`` spec; ValueError if malformed."""
    if not isinstance(spec, str) or not _REWARD_FN_SPEC.match(spec):
        raise ValueError(f"reward_fn must look like 'package.module:function', got {spec!r}")
    module, function = spec.split(":")
    return module, function


def load_reward_fn(spec: str) -> RewardFn:
    """Imports the function named by ``spec``; ValueError naming the spec and what went wrong."""
    module_name, function_name = check_reward_fn_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"reward_fn {spec!r}: module not found ({e})") from e
    except Exception as e:  # noqa: BLE001 - the user's module failed while being imported
        raise ValueError(f"reward_fn {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from e
    function = getattr(module, function_name, None)
    if function is None:
        raise ValueError(
            f"reward_fn {spec!r}: module {module_name!r} ({module.__file__}) has no attribute {function_name!r}"
        )
    if not callable(function):
        raise ValueError(f"reward_fn {spec!r}: {function_name!r} is a {type(function).__name__}, not callable")
    return cast(RewardFn, function)  # its signature is the user's contract; results are checked per call


def _custom_reward(reward_fn: RewardFn, completion: str, gold: str, problem: str) -> tuple[str, float | None, str]:
    """``(outcome, reward, detail)`` of calling ``reward_fn``; a number that is not a finite real
    (a string, None, a bool, NaN, inf) or an exception is an ``ERROR``."""
    try:
        value = reward_fn(completion, gold, problem)
    except Exception as e:  # noqa: BLE001 - the user's function failed on this item: reported, not fatal
        return ERROR, None, f"raised {type(e).__name__}: {str(e)[:200]}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return ERROR, None, f"returned {value!r:.100} ({type(value).__name__}), not a finite number"
    return CUSTOM, float(value), ""


def score_item(
    completion: str,
    gold: str,
    problem: str,
    *,
    kind: str,
    answer_format: str,
    think_end: str,
    verify_math: VerifyMath,
    reward_fn: RewardFn | None = None,
) -> dict:
    """Scores one completion (see the module docstring).

    Returns ``{"status": outcome, "reward": float or None, "prediction": str or None,
    "detail": str}``; ``reward`` is set only for ``CUSTOM`` (the caller maps the other outcomes
    to its correct / incorrect rewards). ``verify_math(gold, pred)`` is math-verify's verdict.
    """
    prediction, failure = extract_answer(completion, answer_format=answer_format, think_end=think_end)
    reward, detail = None, ""
    if reward_fn is not None:
        status, reward, detail = _custom_reward(reward_fn, completion, gold, problem)
    elif failure is not None:
        status = failure
    else:
        assert prediction is not None  # extract_answer returns either a prediction or a failure
        pred_int, gold_int = as_integer(prediction), as_integer(gold)
        if pred_int is not None and gold_int is not None:
            status = FAST_EQUAL if pred_int == gold_int else FAST_NOT_EQUAL
        elif kind == "exact":
            status = FAST_EQUAL if prediction.strip() == gold.strip() else FAST_NOT_EQUAL
        else:
            status, detail = verify_math(gold, prediction)
    return {"status": status, "reward": reward, "prediction": prediction, "detail": detail}
