"""Datasets (TFDS, array_record), prompts, verifiable rewards, prompt pool and evaluation.

Works on strings and token ids only; imports nothing from models, sampler or pipeline.
"""

from scalerl_jax.data.builders import (
    POLARIS_FILENAME,
    build_ladder,
    build_local_file,
    build_polaris,
    build_synthetic,
    read_split,
)
from scalerl_jax.data.evaluation import EvalResult, evaluate, pass_at_k
from scalerl_jax.data.ladder import LadderConfig
from scalerl_jax.data.pool import PoolExhaustedError, PromptPool
from scalerl_jax.data.prompts import (
    DEFAULT_TEMPLATE,
    EncodedPrompts,
    PromptEncoder,
    PromptFormat,
    PromptSet,
    build_prompt_set,
    format_problem,
    sft_arrays,
    sft_example,
)
from scalerl_jax.data.rewards import (
    RewardConfig,
    ScoredBatch,
    check_reward_fn,
    default_pool,
    extract_answer,
    last_boxed,
    math_reward,
    score_completions,
)
from scalerl_jax.data.synthetic import (
    SYNTHETIC_TEMPLATE,
    THINK_END,
    THINK_START,
    ArithmeticProblem,
    Level,
    SyntheticTaskConfig,
    direct_answer,
    generate_splits,
    tokenizer_corpus,
)
from scalerl_jax.data.tokenizer import TOKENIZER_LAYOUT, train_tokenizer
from scalerl_jax.data.verify_pool import ItemResult, VerifyPool
from scalerl_jax.data.zero_variance import zero_variance_filter

__all__ = [
    "POLARIS_FILENAME",
    "DEFAULT_TEMPLATE",
    "SYNTHETIC_TEMPLATE",
    "THINK_END",
    "THINK_START",
    "TOKENIZER_LAYOUT",
    "ArithmeticProblem",
    "EncodedPrompts",
    "EvalResult",
    "Level",
    "PoolExhaustedError",
    "PromptEncoder",
    "PromptFormat",
    "PromptPool",
    "PromptSet",
    "RewardConfig",
    "ScoredBatch",
    "SyntheticTaskConfig",
    "ItemResult",
    "LadderConfig",
    "VerifyPool",
    "build_ladder",
    "build_local_file",
    "build_polaris",
    "build_prompt_set",
    "build_synthetic",
    "check_reward_fn",
    "default_pool",
    "direct_answer",
    "evaluate",
    "extract_answer",
    "format_problem",
    "generate_splits",
    "last_boxed",
    "math_reward",
    "pass_at_k",
    "read_split",
    "score_completions",
    "sft_arrays",
    "sft_example",
    "tokenizer_corpus",
    "train_tokenizer",
    "zero_variance_filter",
]
