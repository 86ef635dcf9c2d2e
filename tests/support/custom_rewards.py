"""Custom reward functions for the ``RewardConfig.reward_fn`` tests (imported by the workers)."""

import os
import time


def contains_gold(completion: str, gold: str, problem: str) -> float:
    """1 if the gold appears in the text after ``</think>``, minus 0.001 per character of that
    text (shorter answers score higher); -1 if it does not appear."""
    answer = completion.partition("</think>")[2]
    return 1.0 - 0.001 * len(answer) if gold in answer else -1.0


def mentions_problem(completion: str, gold: str, problem: str) -> float:
    """0.5 if the completion repeats the problem text, else 0 (checks that problems arrive)."""
    return 0.5 if problem and problem in completion else 0.0


def raises(completion: str, gold: str, problem: str) -> float:
    raise RuntimeError(f"cannot score {gold!r}")


def raises_on_long(completion: str, gold: str, problem: str) -> float:
    """1 normally; raises on completions of over 100 characters."""
    if len(completion) > 100:
        raise RuntimeError("too long")
    return 1.0


def returns_string(completion: str, gold: str, problem: str):
    return "1.0"


def returns_nan(completion: str, gold: str, problem: str) -> float:
    return float("nan")


def sleeps_on_hang(completion: str, gold: str, problem: str) -> float:
    """Sleeps 60 s on completions containing ``HANG``, else returns 1."""
    if "HANG" in completion:
        time.sleep(60)
    return 1.0


def sleeps_briefly(completion: str, gold: str, problem: str) -> float:
    """Takes 0.4 s per item, then returns 1."""
    time.sleep(0.4)
    return 1.0


def exits_on_crash(completion: str, gold: str, problem: str) -> float:
    """Ends the worker process on completions containing ``CRASH``, else returns 1."""
    if "CRASH" in completion:
        os._exit(3)
    return 1.0


def sleeps(completion: str, gold: str, problem: str) -> float:
    time.sleep(60)
    return 1.0


NOT_CALLABLE = 3
