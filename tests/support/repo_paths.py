"""Paths the tests share, wherever a test file sits under tests/: the repository root (subprocess
runs start there: `configs/tiny.py`, `launch/`), this folder (helpers and subprocess peers, put on
PYTHONPATH for the processes that import them), and GSM8K and MBPP as published beside the
project's root (../shared/data/gsm8k, ../shared/data/mbpp)."""

import os

SUPPORT = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(SUPPORT))
GSM8K_DIR = os.path.join(REPO, "..", "shared", "data", "gsm8k")
MBPP_PATH = os.path.join(REPO, "..", "shared", "data", "mbpp", "mbpp.jsonl")
