"""Verifiable rewards: every completion is scored in a ``VerifyPool`` worker under a time limit.

Scoring one completion against a gold answer (``answers.score_item``, run in the worker):

1. The answer part: ``answer_format='think'``: the text after the first ``think_end`` (default
   ``</think>``; none is a format failure); ``'plain'`` (base models without a think phase): the
   whole completion.
2. The prediction is what the first of the configured answer styles (``answer_styles``, from
   ``data.answer_extraction``; default ``boxed``: the content of the last complete, brace-matched
   ``\\boxed{...}``) finds in the answer part (``answers.find_answer``); none found is a format
   failure.
3. If gold and prediction both read as numbers (``answers.as_number``: thousands commas, ``$``,
   ``%``, a trailing period ignored; integers, decimals, ``a/b``), they are compared as exact
   rationals: no math-verify call.
4. Otherwise kind ``'math'`` asks math-verify; kind ``'exact'`` (the synthetic task) compares the
   stripped strings.

Correct gets ``correct_reward`` (+1), everything else (wrong, format failure, unparsable, verifier
error, timeout, crash) ``incorrect_reward`` (-1). With a custom ``reward_fn`` its value is the
reward instead (timeouts, errors and crashes still get ``incorrect_reward``), and an item counts
as correct when its reward is > 0. Every outcome is counted by category, so format failures and
timeouts show up in the metrics, and so is every completion whose answer a style found
(``ScoredBatch.answer_found``): a prompt that asks for one answer style while the reward reads
another shows as a low found fraction, not as a low pass rate.

Items the reward itself failed on (``FAILURE_METRICS``: an error, a timeout, a crash of the
worker, an answer math-verify cannot parse) are counted for the whole run by ``RewardTallies``
(checkpointed with the run state), one ``RewardTally`` per scope: training under ``data/``, each
evaluation set under its own prefix; the first item of each kind in a scope is logged once. The
tally also counts the items whose answer was found (``<prefix>/answers_found``; training also
reports their fraction of all its items so far, ``data/answer_found_frac``, and of the items scored
since the previous training step's row, ``data/step_answer_found_frac``: a late format collapse
moves the second at once, the first only by the share of the run it lasts).
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
from collections.abc import Mapping, Sequence

import numpy as np
from absl import logging

from scalerl_jax.data import answers, verify_pool
from scalerl_jax.data.answers import (
    CORRECT_OUTCOMES,
    CUSTOM,
    FAST_EQUAL,
    FAST_NOT_EQUAL,
    FORMAT_FAILURES,
    NO_ANSWER,
    NO_BOX,
    NO_THINK_END,
    OUTCOMES,
    as_number,
    last_boxed,
)
from scalerl_jax.data.synthetic import THINK_END
from scalerl_jax.sandbox import verifier as verdicts

__all__ = [
    "CODE_FAILURE_KINDS",
    "CORRECT_OUTCOMES",
    "CUSTOM",
    "FAST_EQUAL",
    "FAST_NOT_EQUAL",
    "FORMAT_FAILURES",
    "NO_ANSWER",
    "NO_BOX",
    "NO_THINK_END",
    "FAILURE_METRICS",
    "OUTCOMES",
    "RewardConfig",
    "RewardTallies",
    "RewardTally",
    "ScoredBatch",
    "as_number",
    "check_reward_fn",
    "default_pool",
    "extract_answer",
    "last_boxed",
    "math_reward",
    "score_completions",
]


def extract_answer(
    completion: str,
    *,
    answer_format: str = answers.THINK,
    think_end: str = THINK_END,
    styles: Sequence[str] = answers.DEFAULT_STYLES,
) -> tuple[str | None, str | None]:
    """``(prediction, failure)``: see ``answers.extract_answer`` (here ``think_end`` defaults to
    the tokenizer's ``THINK_END``)."""
    return answers.extract_answer(completion, answer_format=answer_format, think_end=think_end, styles=styles)


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """How completions are scored.

    Attributes:
      kind: ``'math'`` (math-verify after the integer fast path) or ``'exact'`` (integer or
        stripped-string equality only: the synthetic task).
      correct_reward, incorrect_reward: reward values (paper: +1 / -1).
      think_end: the tag that ends the thinking part (the sampler's interruption uses the same).
      answer_format: ``'think'`` (the answer follows ``think_end``) or ``'plain'`` (the answer
        anywhere; base models without a think phase).
      answer_styles: the answer styles tried in order on the answer part (``answers.ANSWER_STYLES``;
        default ``('boxed',)``: the last closed ``\\boxed{}``).
      reward_fn: ``'package.module:function'``, a custom reward ``(completion, gold, problem) ->
        float`` that replaces ``kind``'s rule; correct means reward > 0. The ``VerifyPool`` must
        be started with the same ``reward_fn``.
    """

    kind: str = "math"
    correct_reward: float = 1.0
    incorrect_reward: float = -1.0
    think_end: str = THINK_END
    answer_format: str = answers.THINK
    reward_fn: str | None = None
    answer_styles: tuple[str, ...] = answers.DEFAULT_STYLES

    def __post_init__(self):
        if self.kind not in answers.KINDS:
            raise ValueError(f"RewardConfig.kind must be one of {answers.KINDS}, got {self.kind!r}")
        if self.answer_format not in answers.ANSWER_FORMATS:
            raise ValueError(
                f"RewardConfig.answer_format must be one of {answers.ANSWER_FORMATS}, got {self.answer_format!r}"
            )
        if not isinstance(self.think_end, str) or not self.think_end:
            raise ValueError(f"RewardConfig.think_end must be a non-empty string, got {self.think_end!r}")
        try:
            answers.parse_styles(",".join(self.answer_styles))
        except (ValueError, TypeError) as e:
            raise ValueError(f"RewardConfig.answer_styles = {self.answer_styles!r}: {e}") from None
        if self.reward_fn is not None:
            try:
                answers.check_reward_fn_spec(self.reward_fn)
            except ValueError as e:
                raise ValueError(f"RewardConfig.{e}") from None


@dataclasses.dataclass(frozen=True)
class ScoredBatch:
    """Rewards and outcomes of a batch; ``counts`` has every category of ``OUTCOMES``.

    ``predictions[i]`` is the extracted answer or None where there is none (format failure) or
    the worker did not answer (timeout, crash); ``styles[i]`` the answer style that found it (None
    with it); ``details[i]`` says why an item is an error, a timeout, a crash or unparsable (''
    otherwise; empty when not known).
    """

    rewards: np.ndarray  # float32[N]
    correct: np.ndarray  # bool[N]
    outcomes: list[str]
    counts: dict[str, int]
    predictions: list[str | None]
    details: list[str] = dataclasses.field(default_factory=list)
    styles: list[str | None] = dataclasses.field(default_factory=list)

    @property
    def answer_found(self) -> np.ndarray:
        """bool[N]: whether an answer style found item i's answer (its prediction is not None)."""
        return np.array([prediction is not None for prediction in self.predictions], dtype=bool)


def score_completions(
    completions: Sequence[str],
    golds: Sequence[str],
    config: RewardConfig,
    *,
    pool: verify_pool.VerifyPool | None = None,
    problems: Sequence[str] | None = None,
) -> ScoredBatch:
    """Scores ``completions[i]`` against ``golds[i]`` (see the module docstring) in ``pool``.

    ``pool`` defaults to the shared ``default_pool()`` (no custom reward function). ``problems``
    (the problem text of each item) is passed to a custom reward function and required with one.
    """
    if len(completions) != len(golds):
        raise ValueError(f"score_completions: {len(completions)} completions but {len(golds)} golds")
    if config.reward_fn is not None and problems is None:
        raise ValueError(f"score_completions: RewardConfig.reward_fn={config.reward_fn!r} needs the problems")
    if problems is not None and len(problems) != len(completions):
        raise ValueError(f"score_completions: {len(problems)} problems for {len(completions)} completions")
    problems = problems if problems is not None else [""] * len(completions)
    for index, item in enumerate(zip(completions, golds, problems)):
        if not all(isinstance(field, str) for field in item):
            raise ValueError(
                f"score_completions: item {index} is not a (completion, gold, "
                f"problem) of strings ({', '.join(type(f).__name__ for f in item)})"
            )
    if pool is None and config.reward_fn is None:
        pool = default_pool()
    if pool is None or pool.reward_fn != config.reward_fn:
        raise ValueError(
            f"score_completions: RewardConfig.reward_fn={config.reward_fn!r} but the "
            f"VerifyPool has reward_fn={getattr(pool, 'reward_fn', None)!r}"
        )
    results = pool.score(
        list(zip(completions, golds, problems)),
        kind=config.kind,
        answer_format=config.answer_format,
        think_end=config.think_end,
        styles=config.answer_styles,
    )
    outcomes = [r.status for r in results]
    correct = np.array(
        [
            r.status in CORRECT_OUTCOMES or (r.status == CUSTOM and r.reward is not None and r.reward > 0)
            for r in results
        ],
        dtype=bool,
    )
    rewards = np.array(
        [
            r.reward if r.status == CUSTOM else config.correct_reward if ok else config.incorrect_reward
            for r, ok in zip(results, correct)
        ],
        dtype=np.float32,
    )
    counts = {name: outcomes.count(name) for name in OUTCOMES}
    return ScoredBatch(
        rewards=rewards,
        correct=correct,
        outcomes=outcomes,
        counts=counts,
        predictions=[r.prediction for r in results],
        details=[r.detail for r in results],
        styles=[r.style for r in results],
    )


# Outcomes where the reward failed rather than judged (the item gets `incorrect_reward`), and the
# name of each one's cumulative count (`<prefix>/<name>`).
FAILURE_METRICS = {
    answers.ERROR: "reward_errors",
    answers.TIMEOUT: "reward_timeouts",
    answers.CRASH: "reward_crashes",
    answers.UNPARSABLE: "reward_unparsable",
}
# The code verifier's verdicts other than a pass, counted as `<prefix>/code_<kind>` in a run with a
# code domain (a program that fails its tests, runs out of time or memory, crashes, or is no program).
CODE_FAILURE_KINDS = (verdicts.FAILED, verdicts.TIMEOUT, verdicts.MEMORY, verdicts.CRASH, verdicts.UNPARSABLE)
ITEMS_METRIC = "reward_items"
FOUND_METRIC = "answers_found"
FOUND_FRAC_METRIC = "answer_found_frac"
STEP_FOUND_FRAC_METRIC = "step_answer_found_frac"
STEPS_WITHOUT_ANSWERS_METRIC = "steps_without_answers"


def _failure_reason(outcome: str, detail: str, prediction: str | None, gold: str) -> str:
    if outcome == answers.UNPARSABLE:
        side = f"the gold answer {gold!r}" if detail == "gold" else f"the prediction {prediction!r}"
        return f"math-verify could not parse {side}"
    return detail or "no detail"


class RewardTally:
    """Cumulative counts of one scope's scored items, of those whose answer a style found, and of
    those the reward failed on (``FAILURE_METRICS``); the first item of each failure kind is
    logged once (a warning naming the item's problem prefix, its gold and the reason). It also
    counts the items read by answer styles (not by a custom reward) and the answers found since
    ``take_step`` was last called (not saved with the
    run state: a resumed run's first window starts at its start), and the windows with items in
    which no answer was found at all (saved). Thread safe."""

    def __init__(self, prefix: str, what: str, *, report_code: bool = False):
        self.prefix, self._what = prefix, what
        self._report_code = report_code
        self._code_items = 0
        self._code = dict.fromkeys(CODE_FAILURE_KINDS, 0)
        self._lock = threading.Lock()
        self._items = 0
        self._found = 0
        self._step_items = 0
        self._step_found = 0
        self._steps_without_answers = 0
        self._failures = dict.fromkeys(FAILURE_METRICS, 0)
        self._logged: set[str] = set()

    def add(self, scored: ScoredBatch, problems: Sequence[str], golds: Sequence[str], *, code: bool = False) -> None:
        """Counts the items of ``scored`` (``problems[i]``, ``golds[i]`` are item i's); ``code``:
        they are the code verifier's verdicts (``CODE_FAILURE_KINDS`` counted, answers found are
        programs found), else the math reward's outcomes."""
        first: list[int] = []
        with self._lock:
            self._items += len(scored.outcomes)
            self._found += int(scored.answer_found.sum())
            # A custom reward reads the whole completion, not an answer the styles found.
            self._step_items += sum(outcome != CUSTOM for outcome in scored.outcomes)
            self._step_found += int(scored.answer_found.sum())
            if code:
                self._code_items += len(scored.outcomes)
                for outcome in scored.outcomes:
                    if outcome in self._code:
                        self._code[outcome] += 1
                return
            for index, outcome in enumerate(scored.outcomes):
                if outcome in self._failures:
                    self._failures[outcome] += 1
                    if outcome not in self._logged:
                        self._logged.add(outcome)
                        first.append(index)
        for index in first:
            outcome, problem, gold = scored.outcomes[index], problems[index], golds[index]
            detail = scored.details[index] if index < len(scored.details) else ""
            reason = _failure_reason(outcome, detail, scored.predictions[index], gold)
            logging.warning(
                "reward %s on %s (counted in %s/%s; only the first is logged): problem %s, gold %r: %s",
                outcome,
                self._what,
                self.prefix,
                FAILURE_METRICS[outcome],
                repr(problem[:60]) + ("..." if len(problem) > 60 else ""),
                gold,
                reason,
            )

    def metrics(self) -> dict[str, float]:
        """``{prefix}/reward_items``, ``{prefix}/answers_found``, one ``{prefix}/<FAILURE_METRICS
        name>`` per failure kind, ``{prefix}/code_<kind>`` per code failure kind (see
        ``RewardTallies``), and for the training scope (prefix ``data``) ``data/
        answer_found_frac`` = answers found / items (once there are items) and ``data/
        steps_without_answers`` (``take_step``). An evaluation set's fraction is its evaluation's
        own (``evaluation.evaluate``), not this running one."""
        with self._lock:
            counts: dict[str, float] = {
                f"{self.prefix}/{ITEMS_METRIC}": self._items,
                f"{self.prefix}/{FOUND_METRIC}": self._found,
            }
            counts.update({f"{self.prefix}/{name}": self._failures[o] for o, name in FAILURE_METRICS.items()})
            if self._report_code or self._code_items:
                counts.update({f"{self.prefix}/code_{kind}": n for kind, n in self._code.items()})
            if self.prefix == RewardTallies.TRAINING:
                counts[f"{self.prefix}/{STEPS_WITHOUT_ANSWERS_METRIC}"] = self._steps_without_answers
                if self._items:
                    counts[f"{self.prefix}/{FOUND_FRAC_METRIC}"] = self._found / self._items
            return counts

    def take_step(self) -> dict[str, float]:
        """``{prefix}/step_answer_found_frac`` = answers found / items scored since the previous
        call (or since this tally was made), empty when no item was scored meanwhile; starts the
        next window, and counts the window in ``{prefix}/steps_without_answers`` when it had items
        and no answer. Called once per training step's row, so each item counts in one step."""
        with self._lock:
            items, found = self._step_items, self._step_found
            self._step_items = self._step_found = 0
            if items and not found:
                self._steps_without_answers += 1
        return {f"{self.prefix}/{STEP_FOUND_FRAC_METRIC}": found / items} if items else {}

    def state_dict(self) -> dict[str, int]:
        with self._lock:
            return {
                "items": self._items,
                "found": self._found,
                "steps_without_answers": self._steps_without_answers,
                **self._failures,
                "code_items": self._code_items,
                **{f"code_{kind}": n for kind, n in self._code.items()},
            }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        with self._lock:
            self._items = int(state.get("items", 0))
            self._found = int(state.get("found", 0))
            self._steps_without_answers = int(state.get("steps_without_answers", 0))
            for outcome in self._failures:
                self._failures[outcome] = int(state.get(outcome, 0))
            self._code_items = int(state.get("code_items", 0))
            for kind in self._code:
                self._code[kind] = int(state.get(f"code_{kind}", 0))


class RewardTallies:
    """The run's ``RewardTally`` per scope: ``training`` (prefix ``data``) and one per evaluation
    set (``evaluation(name)``, prefix ``name``), created on first use. Saved with the run state.
    ``report_code``: the training tally reports the code verifier's failure kinds in every row
    (zero until one); an evaluation set's reports them once it has scored code."""

    TRAINING = "data"

    def __init__(self, *, report_code: bool = False):
        self._lock = threading.Lock()
        self._tallies: dict[str, RewardTally] = {}
        self._report_code = report_code  # a run with a code domain: every row has data/code_*

    def _get(self, prefix: str, what: str) -> RewardTally:
        with self._lock:
            if prefix not in self._tallies:
                # The training scope of a run with code reports the code kinds from its first row;
                # an evaluation set's tally once it has scored code.
                report_code = self._report_code and prefix == self.TRAINING
                self._tallies[prefix] = RewardTally(prefix, what, report_code=report_code)
            return self._tallies[prefix]

    @property
    def training(self) -> RewardTally:
        return self._get(self.TRAINING, "a training item")

    def evaluation(self, name: str) -> RewardTally:
        return self._get(name, f"an item of evaluation set {name!r}")

    def metrics(self) -> dict[str, float]:
        """Every scope's counts (the training scope always, so that every row carries them)."""
        self.training  # noqa: B018 - created if no item was scored yet
        with self._lock:
            tallies = list(self._tallies.values())
        return {key: value for tally in tallies for key, value in tally.metrics().items()}

    def state_dict(self) -> dict[str, dict[str, int]]:
        with self._lock:
            tallies = dict(self._tallies)
        return {prefix: tally.state_dict() for prefix, tally in tallies.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, int]]) -> None:
        for prefix, counts in state.items():
            if prefix == self.TRAINING:
                self.training.load_state_dict(counts)
            else:
                self.evaluation(prefix).load_state_dict(counts)


def check_reward_fn(spec: str, *, time_limit_s: float = 5.0) -> None:
    """Imports the custom reward function ``spec`` in a worker and calls it once on a test item;
    ValueError naming the spec and what went wrong (module not found, no such attribute, not
    callable, raised, hung past ``time_limit_s``, returned a non-number or a non-finite one)."""
    verify_pool.VerifyPool(1, time_limit_s=time_limit_s, reward_fn=spec).close()


_default_pool: verify_pool.VerifyPool | None = None
_default_pool_lock = threading.Lock()
DEFAULT_POOL_WORKERS = 1
DEFAULT_TIME_LIMIT_S = 5.0


def default_pool() -> verify_pool.VerifyPool:
    """The process-wide pool behind ``math_reward`` (created on first use, closed at exit).

    It has ``DEFAULT_POOL_WORKERS`` workers and ``DEFAULT_TIME_LIMIT_S`` per item; runs that
    score many items should create their own ``VerifyPool`` from the config and pass it.
    """
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = verify_pool.VerifyPool(DEFAULT_POOL_WORKERS, time_limit_s=DEFAULT_TIME_LIMIT_S)
            atexit.register(_default_pool.close)
        return _default_pool


def math_reward(
    completion: str,
    gold: str,
    *,
    pool: verify_pool.VerifyPool | None = None,
    correct_reward: float = 1.0,
    incorrect_reward: float = -1.0,
    answer_format: str = answers.THINK,
    think_end: str = THINK_END,
) -> float:
    """+1 if the last ``\\boxed{}`` after ``</think>`` is equivalent to ``gold``, else -1.

    ``answer_format='plain'`` takes the last ``\\boxed{}`` anywhere instead. No ``</think>``,
    no box, unparsable, verifier error or timeout all give ``incorrect_reward``.
    """
    config = RewardConfig(
        kind="math",
        correct_reward=correct_reward,
        incorrect_reward=incorrect_reward,
        answer_format=answer_format,
        think_end=think_end,
    )
    return float(score_completions([completion], [gold], config, pool=pool).rewards[0])
