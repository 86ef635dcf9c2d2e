"""Answer extraction and the scoring of one completion, in the standard library only.

The verify workers load this file by its path (``verify_worker.py`` runs as a plain script), so it
imports nothing from scalerl_jax, numpy or jax. Every function here runs inside a worker under the
pool's hard per-item time limit; the main process imports it for the names and for tests.

Scoring one completion (``score_item``):

1. The answer part: for ``answer_format='think'`` the text after the first ``think_end`` tag
   (none: ``NO_THINK_END``); for ``'plain'`` (base models without a think phase) the whole text.
2. The prediction: the first answer style of the configured list (``data.answer_extraction``,
   ``parse_styles``) that finds one in the answer part (``find_answer``):

   - ``boxed``: the content of the last complete ``\\boxed{...}`` (``last_boxed``);
   - ``hashes``: the text after the last ``####``, to the end of that line, stripped (GSM8K);
   - ``answer_is``: the text after the last "the answer is" / "the final answer is" /
     "answer:" (any case, optional colon), to the end of that line or sentence; a
     ``\\boxed{}`` in it is unwrapped (``answer_is``);
   - ``last_number``: the last number (optional sign, thousands commas, decimals, ``a/b``).

   None found: ``NO_BOX`` when the list is ``boxed`` alone, else ``NO_ANSWER``.
3. With a custom reward function, its value decides (outcome ``CUSTOM``; it gets the whole
   completion, the gold and the problem). Otherwise: gold and prediction that both read as
   numbers (``as_number``: ``$``, ``%``, thousands commas, a trailing period ignored; integers,
   decimals, ``a/b``) are compared as exact rationals (``FAST_EQUAL`` / ``FAST_NOT_EQUAL``);
   else kind ``'exact'`` compares the stripped strings and kind ``'math'`` asks math-verify
   (``EQUAL``, ``NOT_EQUAL``, ``UNPARSABLE``, ``TIMEOUT``, ``ERROR``).

The pool adds ``TIMEOUT`` (the hard limit killed the worker) and ``CRASH`` (the worker died).
"""

from __future__ import annotations

import decimal
import fractions
import importlib
import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import cast

THINK = "think"
PLAIN = "plain"
ANSWER_FORMATS = (THINK, PLAIN)
KINDS = ("math", "exact")

# Answer styles (`data.answer_extraction`, `data.gold_extraction`), tried in the configured order.
BOXED = "boxed"
HASHES = "hashes"
ANSWER_IS = "answer_is"
LAST_NUMBER = "last_number"
ANSWER_STYLES = (BOXED, HASHES, ANSWER_IS, LAST_NUMBER)
DEFAULT_STYLES = (BOXED,)

# Outcomes of one scored completion.
NO_THINK_END = "no_think_end"
NO_BOX = "no_box"  # the style list is `boxed` alone and the answer part has no closed box
NO_ANSWER = "no_answer"  # no style of a longer list found an answer
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
    NO_ANSWER,
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
FORMAT_FAILURES = frozenset({NO_THINK_END, NO_BOX, NO_ANSWER})

_BOX_OPEN = "\\boxed{"
# ``\boxed{``, an escaped brace, or a brace; every other character is skipped by the scan.
_BOX_TOKENS = re.compile(r"\\boxed\{|\\[{}]|[{}]")
_HASHES = "####"
# "the answer is", "the final answer is" or "answer:", then an optional colon; any case.
_ANSWER_IS = re.compile(r"(?:\bthe\s+(?:final\s+)?answer\s+is|\banswer[ \t]*:)[ \t]*:?", re.IGNORECASE)
# A number in running text: not glued to a word or a decimal point before it (so `x2` and the
# `5` of `3.5` are not numbers of their own, and the `-` of `5-3` is not a sign), an optional
# minus, digits with or without thousands commas, optional decimals, optional `/denominator`.
_NUMBER_IN_TEXT = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
# A whole answer that is a number: sign, `$`, digits (thousands commas), decimals (a trailing
# period allowed), `/denominator`, `%`, a closing `$` and a sentence's period around it.
_NUMERIC = re.compile(
    r"\s*(?P<sign>[+-]?)\s*\$?\s*(?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)"
    r"(?:\s*/\s*(?P<den>\d+))?\s*%?\s*\$?\s*\.?\s*"
)
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


def after_hashes(text: str) -> str | None:
    """The text after the last ``####`` of ``text``, to the end of that line, stripped; None if
    there is no ``####`` or nothing follows it on its line."""
    cut = text.rfind(_HASHES)
    if cut == -1:
        return None
    return text[cut + len(_HASHES) :].split("\n", 1)[0].strip() or None


def _first_sentence(text: str) -> str:
    """``text`` up to its first newline, or its first ``.``, ``!`` or ``?`` that is followed by
    whitespace or the end and lies outside braces (so ``3.5`` and ``\\boxed{x.}`` stay whole)."""
    depth = 0
    for index, char in enumerate(text):
        if char == "\n":
            return text[:index]
        if char == "{":
            depth += 1
        elif char == "}":
            depth = max(0, depth - 1)
        elif char in ".!?" and depth == 0 and (index + 1 == len(text) or text[index + 1].isspace()):
            return text[:index]
    return text


def after_answer_is(text: str) -> str | None:
    """What follows the last "the answer is" / "the final answer is" / "answer:" of ``text`` (any
    case, an optional colon after it), to the end of that line or sentence (``_first_sentence``,
    the sentence's period dropped), stripped; the content of a ``\\boxed{}`` in it when it has
    one. None if there is no such phrase or nothing follows it."""
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    sentence = _first_sentence(text[matches[-1].end() :])
    boxed = last_boxed(sentence)
    return (sentence if boxed is None else boxed).strip() or None


def last_number(text: str) -> str | None:
    """The last number of ``text`` as written (``_NUMBER_IN_TEXT``: ``-3``, ``1,000``, ``18.50``,
    ``3/4``), or None."""
    numbers_found = _NUMBER_IN_TEXT.findall(text)
    return numbers_found[-1] if numbers_found else None


_STYLE_FUNCTIONS: dict[str, Callable[[str], str | None]] = {
    BOXED: last_boxed,
    HASHES: after_hashes,
    ANSWER_IS: after_answer_is,
    LAST_NUMBER: last_number,
}


def parse_styles(spec: str) -> tuple[str, ...]:
    """The styles of a comma-separated list such as ``'hashes,answer_is,last_number'``, in order;
    ValueError for an empty list or entry, an unknown style or one named twice."""
    if not isinstance(spec, str):
        raise ValueError(f"expected a comma-separated string of answer styles, got {spec!r}")
    styles = tuple(part.strip() for part in spec.split(","))
    unknown = [style for style in styles if style not in ANSWER_STYLES]
    repeated = sorted({style for style in styles if styles.count(style) > 1})
    if unknown or repeated:
        if "" in styles:
            what = "an empty entry"
        else:
            what = f"unknown {', '.join(unknown)}" if unknown else f"named twice: {', '.join(repeated)}"
        raise ValueError(
            f"{spec!r} ({what}); expected a comma-separated list of distinct styles from {', '.join(ANSWER_STYLES)}"
        )
    return styles


def find_answer(text: str, styles: Sequence[str] = DEFAULT_STYLES) -> tuple[str | None, str | None]:
    """``(answer, style)``: the answer the first of ``styles`` that finds one gives, and that
    style; ``(None, None)`` if none does."""
    for style in styles:
        answer = _STYLE_FUNCTIONS[style](text)
        if answer is not None:
            return answer, style
    return None, None


def gold_of(answer_text: str, gold_extraction: str) -> str | None:
    """The gold answer of a dataset row's answer field: the field as is for ``gold_extraction=''``,
    else what the styles of ``gold_extraction`` (``parse_styles``) find in it (GSM8K's worked
    solutions: ``'hashes'``), None when they find nothing."""
    if not gold_extraction:
        return answer_text
    return find_answer(answer_text, parse_styles(gold_extraction))[0]


def answer_part(completion: str, *, answer_format: str, think_end: str) -> str | None:
    """The text after the first ``think_end`` for ``answer_format='think'`` (None without one),
    the whole completion for ``'plain'``."""
    if answer_format == PLAIN:
        return completion
    if answer_format != THINK:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    cut = completion.find(think_end)
    return None if cut == -1 else completion[cut + len(think_end) :]


def no_answer_outcome(styles: Sequence[str]) -> str:
    """The format failure of an answer part where no style finds an answer: ``NO_BOX`` when the
    list is ``boxed`` alone, else ``NO_ANSWER``."""
    return NO_BOX if tuple(styles) == (BOXED,) else NO_ANSWER


def extract_answer(
    completion: str, *, answer_format: str, think_end: str, styles: Sequence[str] = DEFAULT_STYLES
) -> tuple[str | None, str | None]:
    """``(prediction, failure)``: the answer ``styles`` find in the answer part (``answer_part``,
    ``find_answer``), or why there is none: ``NO_THINK_END``, or ``no_answer_outcome(styles)``."""
    part = answer_part(completion, answer_format=answer_format, think_end=think_end)
    if part is None:
        return None, NO_THINK_END
    prediction, _ = find_answer(part, styles)
    return (None, no_answer_outcome(styles)) if prediction is None else (prediction, None)


def as_number(text: str) -> fractions.Fraction | None:
    """The exact value of an answer that is one number, else None.

    Read: an optional sign, ``$`` (or LaTeX ``\\$``), digits with or without thousands commas
    (``1,000``; LaTeX ``1{,}000``), optional decimals, an optional ``/denominator`` (nonzero), an
    optional ``%`` (``\\%``) and closing ``$``, a trailing period, spaces around any of them. So
    ``'$1,000.00'``, ``'1000'`` and ``'1000.'`` are all 1000, ``'50%'`` is 50, ``'3/4'`` is 0.75;
    ``'3,4'``, ``'x'`` and ``'1/0'`` are None.
    """
    normalized = text.replace("\\$", "$").replace("\\%", "%").replace("{,}", ",")
    match = _NUMERIC.fullmatch(normalized)
    if match is None:
        return None
    value = fractions.Fraction(decimal.Decimal(match["num"].replace(",", "")))
    if match["den"] is not None:
        if int(match["den"]) == 0:
            return None
        value /= int(match["den"])
    return -value if match["sign"] == "-" else value


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
    styles: Sequence[str] = DEFAULT_STYLES,
) -> dict:
    """Scores one completion (see the module docstring), its answer found by ``styles``.

    Returns ``{"status": outcome, "reward": float or None, "prediction": str or None, "style":
    the style that found the prediction or None, "detail": str}``; ``reward`` is set only for
    ``CUSTOM`` (the caller maps the other outcomes to its correct / incorrect rewards).
    ``verify_math(gold, pred)`` is math-verify's verdict.
    """
    part = answer_part(completion, answer_format=answer_format, think_end=think_end)
    prediction, style = (None, None) if part is None else find_answer(part, styles)
    reward, detail = None, ""
    if reward_fn is not None:
        status, reward, detail = _custom_reward(reward_fn, completion, gold, problem)
    elif part is None:
        status = NO_THINK_END
    elif prediction is None:
        status = no_answer_outcome(styles)
    else:
        pred_number, gold_number = as_number(prediction), as_number(gold)
        if pred_number is not None and gold_number is not None:
            status = FAST_EQUAL if pred_number == gold_number else FAST_NOT_EQUAL
        elif kind == "exact":
            status = FAST_EQUAL if prediction.strip() == gold.strip() else FAST_NOT_EQUAL
        else:
            status, detail = verify_math(gold, prediction)
    return {"status": status, "reward": reward, "prediction": prediction, "style": style, "detail": detail}
