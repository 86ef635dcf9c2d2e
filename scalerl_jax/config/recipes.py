"""The ScaleRL recipe and its variants as ml_collections configs.

Every key and its default live in `schema`; a recipe is that baseline with some keys changed, and
`configs/*.py` are thin files that pick one (`--config=configs/loo.py:dapo`). The baseline is Table/Section 4 of "The Art of Scaling
Reinforcement Learning Compute for LLMs" (arXiv 2510.13786):
PipelineRL-8, CISPO, prompt-level aggregation, batch-level advantage normalization,
zero-variance filtering, No-Positive-Resampling, forced interruptions, FP32 LM head,
48 prompts x 16 completions, AdamW lr 5e-7.
"""

from __future__ import annotations

import ml_collections

from scalerl_jax.config import schema

# Sequences per microbatch in the 8B configs: one per trainer GPU of the paper's 16.
ROWS_PER_MICROBATCH = 16
# For data whose gold is a worked solution ending in `#### <number>` (GSM8K): asks for the same
# ending, which `data.answer_extraction` = 'hashes' reads (with `data.gold_extraction` = 'hashes').
WORKED_SOLUTION_TEMPLATE = (
    "{problem}\n\nSolve the problem step by step. Then write the final answer, a number only, on its own "
    "last line in the form:\n#### <number>"
)


def scalerl_8b() -> ml_collections.ConfigDict:
    """The full ScaleRL recipe for an 8B dense policy on Polaris-53K: every key at its schema
    default (`schema.KEYS`, documented in docs/config.md)."""
    return schema.default_config()


# ---------------------------------------------------------------- leave-one-out variants
def _loo_dapo(c):
    c.rl.objective = "dapo"


def _loo_no_fp32_head(c):
    c.model.fp32_head = False


def _loo_sample_avg(c):
    c.rl.aggregation = "sample"


def _loo_token_avg(c):
    c.rl.aggregation = "token"


def _loo_prompt_norm(c):
    c.rl.advantage_normalization = "prompt"


def _loo_no_zero_variance_filter(c):
    c.rl.zero_variance_filter = False


def _loo_no_positive_resampling(c):
    c.rl.no_positive_resampling = False


def _loo_length_penalty(c):
    c.rl.length_control = "length_penalty"
    c.sampler.think_budget_min = c.sampler.max_new_tokens
    c.sampler.think_budget_max = c.sampler.max_new_tokens


def _loo_ppo_off_policy(c):
    c.schedule.kind = "ppo_off_policy"


LEAVE_ONE_OUT = {
    "dapo": _loo_dapo,
    "no_fp32_head": _loo_no_fp32_head,
    "sample_avg": _loo_sample_avg,
    "token_avg": _loo_token_avg,
    "prompt_norm": _loo_prompt_norm,
    "no_zero_variance_filter": _loo_no_zero_variance_filter,
    "no_positive_resampling": _loo_no_positive_resampling,
    "length_penalty": _loo_length_penalty,
    "ppo_off_policy": _loo_ppo_off_policy,
}


def leave_one_out(name: str) -> ml_collections.ConfigDict:
    """ScaleRL with exactly one choice reverted (Section 4.2 of the paper)."""
    if name not in LEAVE_ONE_OUT:
        raise ValueError(f"unknown leave-one-out variant {name!r}; choose one of {sorted(LEAVE_ONE_OUT)}")
    c = scalerl_8b()
    LEAVE_ONE_OUT[name](c)
    return c


# ---------------------------------------------------------------- prevalent recipes (Figure 2)
def _deepseek_grpo(c):
    c.rl.objective = "grpo"
    c.rl.eps_low = c.rl.eps_high = 0.2
    c.rl.aggregation = "sample"
    c.rl.advantage_normalization = "prompt"
    c.model.fp32_head = False
    c.schedule.kind = "ppo_off_policy"
    c.rl.zero_variance_filter = False
    c.rl.no_positive_resampling = False


def _qwen25_dapo(c):
    c.rl.objective = "dapo"
    c.rl.eps_low, c.rl.eps_high = 0.2, 0.26
    c.rl.aggregation = "prompt"
    c.rl.advantage_normalization = "prompt"
    c.model.fp32_head = False
    c.schedule.kind = "ppo_off_policy"
    c.batch.prompts_per_step = 80
    c.batch.microbatches = 80
    c.rl.zero_variance_filter = True
    c.rl.no_positive_resampling = False


def _magistral(c):
    c.rl.objective = "dapo"
    c.rl.eps_low, c.rl.eps_high = 0.2, 0.28
    c.rl.aggregation = "token"
    c.rl.advantage_normalization = "batch"
    c.model.fp32_head = False
    c.schedule.kind = "pipeline"
    c.rl.zero_variance_filter = True
    c.rl.no_positive_resampling = False
    c.rl.length_control = "length_penalty"


def _minimax(c):
    c.rl.objective = "cispo"
    c.model.fp32_head = True
    c.schedule.kind = "ppo_off_policy"
    c.rl.aggregation = "prompt"
    c.batch.prompts_per_step = 80
    c.batch.microbatches = 80
    c.rl.no_positive_resampling = False


PREVALENT = {
    "deepseek_grpo": _deepseek_grpo,
    "qwen25_dapo": _qwen25_dapo,
    "magistral": _magistral,
    "minimax": _minimax,
}


def prevalent(name: str) -> ml_collections.ConfigDict:
    """One of the prevalent recipes the paper compares against in Figure 2."""
    if name not in PREVALENT:
        raise ValueError(f"unknown prevalent recipe {name!r}; choose one of {sorted(PREVALENT)}")
    c = scalerl_8b()
    PREVALENT[name](c)
    return c


# ---------------------------------------------------------------- scale-up axes
def _budget_32k(c):
    c.sampler.max_new_tokens = 30_720  # total 32,768 with a 2,048-token prompt
    c.sampler.think_budget_min = 26_624
    c.sampler.think_budget_max = 28_672
    c.rl.length_penalty_max = 30_720


def _batch(prompts: int):
    def apply(c):
        c.batch.prompts_per_step = prompts // c.batch.generations_per_prompt
        c.batch.microbatches = prompts // ROWS_PER_MICROBATCH

    return apply


def _generations(n: int):
    def apply(c):
        total = c.batch.prompts_per_step * c.batch.generations_per_prompt
        c.batch.generations_per_prompt = n
        c.batch.prompts_per_step = total // n
        c.batch.microbatches = total // ROWS_PER_MICROBATCH

    return apply


SCALE = {
    "budget_32k": _budget_32k,
    "bs512": _batch(512),
    "bs2048": _batch(2048),
    "gens8": _generations(8),
    "gens24": _generations(24),
    "gens32": _generations(32),
}


def scale(name: str) -> ml_collections.ConfigDict:
    """A scale-up run: longer generation budget, bigger batch, or more generations per prompt.

    Batch variants keep 16 generations per prompt (bs512 = 32x16, bs2048 = 128x16); generation
    variants keep the 768-completion batch (gens8 = 96x8, gens24 = 32x24, gens32 = 24x32).
    """
    if name not in SCALE:
        raise ValueError(f"unknown scale-up variant {name!r}; choose one of {sorted(SCALE)}")
    c = scalerl_8b()
    SCALE[name](c)
    return c


def _scout_on_h100(c):
    """9 nodes of 8 H100s (`h100:9x8`): 64 GPUs train (fsdp 16 x tensor 4: the optimizer state alone
    is 19 GiB per GPU at 64), one node of 8 generates (tensor 8: 27 GB of weights per GPU, a KV pool
    of 65,536 pages of 16 tokens, 1M tokens over 128 slots)."""
    c.mesh.generator_fraction = 0.11  # 8 of 72 GPUs: round(72 x 0.11) = 8
    c.mesh.trainer_shape = (1, -1, 4)
    c.mesh.generator_shape = (1, 1, -1)
    c.sampler.num_slots = 128
    c.sampler.num_pages = 65_536


def _scout_on_v5p(c):
    """A TPU v5p slice of 64 chips (`v5p:4x4x4`, 16 hosts of 4): 32 chips train (fsdp 16 x tensor
    2), 8 hosts generate, each its own 4 chips (tensor 4: 54 GB of weights per chip, a KV pool of
    24,576 pages, 393k tokens over 64 slots)."""
    c.mesh.generator_fraction = 0.5
    c.mesh.trainer_shape = (1, -1, 2)
    c.mesh.generator_shape = (1, 1, -1)
    c.sampler.num_slots = 64
    c.sampler.num_pages = 24_576


SCOUT = {"h100": _scout_on_h100, "v5p": _scout_on_v5p}


def scalerl_scout(target: str = "h100") -> ml_collections.ConfigDict:
    """The paper's mixture-of-experts run: the ScaleRL recipe (batch 48 x 16, prompts up to 2,048
    tokens, 16,384 in all) on Llama 4 Scout's text decoder (`llama4-scout`: 48 layers, 16 experts
    of which each token takes 1 beside a shared expert; 108B parameters, 17B active per token),
    scanned in periods of 4 layers, laid out for the smallest cluster of `target` it fits (`SCOUT`:
    'h100' 9 nodes of 8, 'v5p' a 64-chip slice; `compile_check` holds each). On a larger cluster,
    raise `mesh.generator_fraction` in whole generator hosts."""
    if target not in SCOUT:
        raise ValueError(f"unknown Scout layout {target!r}; choose one of {sorted(SCOUT)}")
    c = scalerl_8b()
    c.model.preset = "llama4-scout"
    SCOUT[target](c)
    return c


# ---------------------------------------------------------------- a real pretrained model on CPU
def smollm2_gsm8k() -> ml_collections.ConfigDict:
    """The ScaleRL recipe's choices (CISPO, PipelineRL-k, prompt aggregation, batch-normalized
    advantages, zero-variance filtering, No-Positive-Resampling, FP32 head) at CPU size for a small
    real instruct model on GSM8K as published: set `model.checkpoint` (a Hugging Face directory,
    e.g. SmolLM2-135M-Instruct) and `data.path` (GSM8K's train.jsonl) on the command line.

    Answers are read as such a model writes them (`#### 3`, "The answer is: 3", else the last
    number), golds after the last `####`, with no think phase and no forced interruption; the task
    is narrowed to GSM8K's two-step problems (`data.max_solution_steps`), sampled at temperature
    0.4 (the measurements behind these choices: docs/results/gsm8k_smollm2/README.md).
    """
    c = scalerl_8b()
    c.num_steps = 200
    c.model.dtype = "float32"
    c.model.logprob_chunk = 256

    c.data.problem_field = "question"
    c.data.answer_field = "answer"
    c.data.gold_extraction = "hashes"
    c.data.answer_extraction = "hashes,answer_is,last_number"
    c.data.answer_format = "plain"
    c.data.prompt_template = WORKED_SOLUTION_TEMPLATE
    c.data.max_solution_steps = 2
    c.data.max_prompt_tokens = 256
    c.data.heldout_size = 200
    c.data.verify_workers = 1

    c.batch.prompts_per_step = 8
    c.batch.generations_per_prompt = 8
    c.batch.microbatches = 8
    c.batch.length_buckets_per_octave = 2

    c.rl.length_control = "none"

    c.sampler.num_slots = 64
    c.sampler.chunk_steps = 16
    c.sampler.max_new_tokens = 256
    c.sampler.temperature = 0.4

    c.schedule.k = 2

    c.optimizer.lr = 1e-5
    c.optimizer.warmup_steps = 5
    c.optimizer.eps = 1e-8
    c.optimizer.max_grad_norm = 1.0

    c.mesh.generator_fraction = 0.5
    c.mesh.require_accelerator = False
    c.mesh.cpu_devices = 2  # one generator device, one trainer device

    c.eval.every = 10
    c.eval.num_prompts = 200
    c.eval.samples_per_prompt = 2
    c.eval.fit_a_range = (0.05, 1.0)
    # The trainer waits for each evaluation: on 2 cores a concurrent one shares the decode with the
    # training batches and the train step, and step 0's 400 samples took over 28 minutes.
    c.eval.concurrent = False
    c.checkpoint.every = 10
    return c


# The arithmetic ladder's instruction. SmolLM2-135M-Instruct writes '####' in few of its answers
# (12% at temperature 0.6), so the reward also reads "the answer is" and the last number: a correct
# answer followed by more numbers fails, and stopping after the answer is part of what RL teaches.
LADDER_TEMPLATE = "{problem} Put the final answer after '####'."


def smollm2_arith() -> ml_collections.ConfigDict:
    """The ScaleRL recipe's choices (CISPO, PipelineRL-k, prompt aggregation, batch-normalized
    advantages, zero-variance filtering, No-Positive-Resampling, FP32 head) at CPU size for a small
    real instruct model on the arithmetic ladder (`scalerl_jax/data/ladder.py`): set
    `model.checkpoint` (a Hugging Face directory, e.g. SmolLM2-135M-Instruct) on the command line.

    Trained and held out: one-digit addition, subtraction and multiplication and a teen plus a
    digit; evaluated and never trained (`eval_transfer/...`): two-digit addition and a product
    plus a digit. Answers read as such a model writes them (`#### 3`, "The answer is: 3", else the
    last number), no think phase; the sampling temperature and sizes were chosen by the
    measurements of docs/results/smollm2_arith/README.md.
    """
    c = smollm2_gsm8k()
    c.num_steps = 40
    c.data.dataset = "ladder"
    c.data.path = ""
    c.data.problem_field = "problem"
    c.data.answer_field = "answer"
    c.data.gold_extraction = ""
    c.data.max_solution_steps = 0
    c.data.prompt_template = LADDER_TEMPLATE
    c.data.max_prompt_tokens = 96

    c.batch.microbatches = 4

    c.sampler.max_new_tokens = 64
    c.sampler.temperature = 0.6

    c.optimizer.lr = 2e-5

    c.eval.every = 4
    c.eval.num_prompts = 128  # the whole held-out split: 4 levels x 32
    c.eval.samples_per_prompt = 1
    c.eval.samples_logged = 128
    c.eval.fit_a_range = (0.3, 1.0)
    c.checkpoint.every = 4

    c.ladder = schema.section_config("ladder")
    c.ladder.transfer_levels = ("add_2d", "mul_add")
    return c


# ---------------------------------------------------------------- the embedded default (CPU)
def tiny() -> ml_collections.ConfigDict:
    """The full ScaleRL recipe scaled down to one CPU: a 0.86M-parameter Llama-style policy warm
    started on the synthetic arithmetic task, then PipelineRL-2 with CISPO, prompt aggregation,
    batch normalization, zero-variance filtering, No-Positive-Resampling and interruptions."""
    c = scalerl_8b()
    c.num_steps = 120
    c.model.preset = "tiny-llama"
    c.model.dtype = "float32"
    c.model.scan_layers = False
    c.model.remat_policy = "none"
    c.model.logprob_chunk = 64

    c.data.dataset = "synthetic"
    c.data.use_chat_template = False
    c.data.prompt_template = "{problem}\nAnswer in \\boxed{}."
    c.data.max_prompt_tokens = 32
    c.data.heldout_size = 128

    c.batch.prompts_per_step = 16
    c.batch.generations_per_prompt = 8
    c.batch.microbatches = 1

    c.rl.length_penalty_max = 64
    c.rl.length_penalty_cache = 16

    c.sampler.num_slots = 64
    c.sampler.chunk_steps = 8
    c.sampler.max_new_tokens = 80
    c.sampler.think_budget_min = 60
    c.sampler.think_budget_max = 68
    c.sampler.answer_budget = 12
    c.sampler.interruption_phrase = "Time is up. </think>"

    c.schedule.k = 2

    c.optimizer.lr = 5e-5
    c.optimizer.warmup_steps = 5
    c.optimizer.eps = 1e-8
    c.optimizer.max_grad_norm = 1.0

    c.mesh.generator_fraction = 0.5  # 2 devices: 'auto' could pick only this split (1 / 1)
    c.mesh.trainer_shape = (1, -1, 1)
    c.mesh.generator_shape = (-1, 1, 1)
    c.mesh.require_accelerator = False
    c.mesh.cpu_devices = 2  # one generator device, one trainer device, as on a cluster

    # Every 5 steps on all 128 held-out prompts, 4 samples each (why 4: docs/results/tiny_demo.md).
    c.eval.every = 5
    c.eval.num_prompts = 128
    c.eval.samples_per_prompt = 4
    c.eval.fit_a_range = (0.45, 1.0)
    c.eval.concurrent = True  # the trainer keeps stepping while the generator evaluates
    c.checkpoint.every = 20

    c.synthetic = schema.section_config("synthetic")
    c.warm_start = schema.section_config("warm_start")
    return c


def tiny_moe() -> ml_collections.ConfigDict:
    """The tiny run on a mixture-of-experts policy: a 2-layer Qwen3-MoE decoder with 8 SwiGLU
    experts per layer, 2 per token (`tiny-qwen3-moe`), warm started and trained as the dense one;
    the routing metrics (moe/*) are in every train row."""
    c = tiny()
    c.model.preset = "tiny-qwen3-moe"
    return c


def tiny_math_code() -> ml_collections.ConfigDict:
    """The tiny run with a second, code-executing domain: half of each step's prompts are code
    puzzles (write a Python expression over given numbers that equals a target), whose programs
    run in the code sandbox; both domains are warm started and evaluated (eval/math, eval/code)."""
    c = tiny()
    c.data.mixture = ml_collections.ConfigDict({"math": 1.0, "code": 1.0})
    c.code = schema.section_config("code")
    c.code.task = "puzzles"
    c.code.sft_size = 1024  # fewer demonstrations leave the tiny policy unsure of the form (names once each)
    c.code.workers = 2
    c.code.wall_s = 5.0
    c.code.cpu_s = 2
    c.code.memory_mb = 512
    return c


def scalerl_8b_math_code() -> ml_collections.ConfigDict:
    """The paper's multi-task run: the 8B recipe on math (Polaris-53K, `data.path`) and code
    (`code.path`: a local MBPP file here, whose train split trains and test split is held out)
    in equal shares, each scored by its own verifier and evaluated and fitted per domain."""
    c = scalerl_8b()
    c.data.mixture = ml_collections.ConfigDict({"math": 1.0, "code": 1.0})
    c.code = schema.section_config("code")
    c.code.task = "file"
    c.code.workers = 32
    return c
