"""Custom rewards for tests/faults/test_faults_silent.py (imported by the verify workers): each passes the
pool's start-up check on ``answers.CHECK_ITEM`` and fails on every other item in its own way."""

import os
import time

CHECK_PROBLEM = "What is 1 + 1?"  # answers.CHECK_ITEM's problem


def raises_on_training(completion: str, gold: str, problem: str) -> float:
    if problem == CHECK_PROBLEM:
        return 1.0
    raise RuntimeError(f"cannot score gold {gold!r}")


def hangs_on_training(completion: str, gold: str, problem: str) -> float:
    if problem != CHECK_PROBLEM:
        time.sleep(60)
    return 1.0


def crashes_on_training(completion: str, gold: str, problem: str) -> float:
    if problem != CHECK_PROBLEM:
        os._exit(3)
    return 1.0
