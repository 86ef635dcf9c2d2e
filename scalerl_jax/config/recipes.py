"""The ScaleRL recipe and its variants as ml_collections configs.

Every knob of a run lives here; `configs/*.py` are thin files that pick a variant
(`--config=configs/loo.py:dapo`). The baseline is Table/Section 4 of "The Art of Scaling
Reinforcement Learning Compute for LLMs" (arXiv 2510.13786):
PipelineRL-8, CISPO, prompt-level aggregation, batch-level advantage normalization,
zero-variance filtering, No-Positive-Resampling, forced interruptions, FP32 LM head,
48 prompts x 16 completions, AdamW lr 5e-7.
"""

from __future__ import annotations

import ml_collections

INTERRUPTION_PHRASE = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
# Sequences per microbatch in the 8B configs: one per trainer GPU of the paper's 16.
ROWS_PER_MICROBATCH = 16
# `{problem}` is replaced literally (data.prompts.format_problem), so LaTeX braces stay as written.
DEFAULT_PROMPT_TEMPLATE = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{}."
# For data whose gold is a worked solution ending in `#### <number>` (GSM8K): asks for the same
# ending, which `data.answer_extraction` = 'hashes' reads (with `data.gold_extraction` = 'hashes').
WORKED_SOLUTION_TEMPLATE = (
    "{problem}\n\nSolve the problem step by step. Then write the final answer, a number only, on its own "
    "last line in the form:\n#### <number>"
)


def scalerl_8b() -> ml_collections.ConfigDict:
    """The full ScaleRL recipe for an 8B dense policy on Polaris-53K."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.num_steps = 10_000

    c.model = ml_collections.ConfigDict()
    c.model.preset = "llama3.1-8b"
    c.model.checkpoint = ""  # local Hugging Face directory (config.json + safetensors + tokenizer.json)
    c.model.dtype = "bfloat16"
    c.model.fp32_head = True
    # The FP32 head's matmul: 'bf16x3' is a near-fp32 tensor-core algorithm on GPU (exact fp32 on
    # CPU); 'highest' is exact fp32 everywhere (non-tensor-core on GPU). See models.ModelConfig.
    c.model.head_precision = "bf16x3"
    # Training / prefill attention: 'auto' is cuDNN flash attention on GPU (no T x T scores), 'xla' on CPU.
    c.model.attention_impl = "auto"
    c.model.scan_layers = True
    c.model.remat_policy = "full"
    c.model.logprob_chunk = 1024

    c.data = ml_collections.ConfigDict()
    # '' (default): the reader follows `data.path` (Polaris-53K for polaris-data-53K.jsonl, else any
    # .jsonl / .parquet with `data.problem_field` / `data.answer_field`); or 'polaris_53k' | 'jsonl' | 'synthetic'.
    c.data.dataset = ""
    c.data.path = ""  # local polaris-data-53K.jsonl, or any .jsonl / .parquet file
    c.data.data_dir = ""  # TFDS data_dir; empty means WORKDIR/tfds
    c.data.problem_field = "problem"
    c.data.answer_field = "answer"
    c.data.heldout_size = 1_000
    c.data.heldout_seed = 0
    c.data.prompt_template = DEFAULT_PROMPT_TEMPLATE
    c.data.use_chat_template = True
    # 'think': the answer part is the text after sampler.think_end, and forced interruption
    # applies; 'plain' (base models without a think phase): the whole completion, no
    # interruption. One key for the sampler's length control and the reward's extraction.
    c.data.answer_format = "think"
    # How the prediction is read from the answer part: a comma-separated list of styles, tried in
    # order, the first that finds an answer gives it: 'boxed' (the last closed \boxed{}), 'hashes'
    # (the text after the last '####' to the end of its line: GSM8K's style), 'answer_is' (after
    # the last "the answer is" / "the final answer is" / "answer:", to the end of that line or
    # sentence; a \boxed{} in it unwrapped), 'last_number' (the last number). An instruct model
    # on GSM8K-style data: 'hashes,answer_is,last_number' with WORKED_SOLUTION_TEMPLATE. The prompt
    # template should ask for what this reads (config_validation warns when it asks for \boxed{}
    # or '####' that no style reads); the interruption phrase names no format. The fraction of
    # completions where an answer is found is logged (eval/answer_found_frac, data/answer_found_frac).
    c.data.answer_extraction = "boxed"
    # The gold answer of each row read from data.path (and eval.extra files): '' = the answer field
    # as is; else a style list as above applied to the answer field (GSM8K's worked solutions:
    # 'hashes'). Rows where no style finds a gold are counted, skipped and named in one warning.
    c.data.gold_extraction = ""
    # Narrows a worked-solution task (GSM8K) to its easier problems: only rows whose answer field
    # has at most this many steps (lines before its last ####; GSM8K: 2 to 8) are read (0: every row).
    c.data.max_solution_steps = 0
    c.data.reward_fn = ""  # 'package.module:function' (completion, gold, problem) -> float; '' = math-verify
    c.data.max_prompt_tokens = 2_048
    c.data.reward_correct = 1.0
    c.data.reward_incorrect = -1.0
    c.data.verify_timeout_s = 5.0
    c.data.verify_workers = 4

    c.batch = ml_collections.ConfigDict()
    c.batch.prompts_per_step = 48
    c.batch.generations_per_prompt = 16
    c.batch.microbatches = 48  # 768 sequences / 48 = 16 per microbatch, one per trainer GPU
    # Rows sorted by length into the microbatches, each padded only to its own length bucket
    # (False: every row padded to the bucket of the batch's longest). Loss and gradient unchanged.
    c.batch.sort_by_length = True
    # Train length buckets per octave of sequence length (1: powers of two). 8: a row pads by
    # < 1/8 of its bucket; at most 8 x log2(max / 32) + 1 compiled microbatch shapes (73 at 16k).
    c.batch.length_buckets_per_octave = 8

    c.rl = ml_collections.ConfigDict()
    c.rl.objective = "cispo"  # 'cispo' | 'dapo' | 'grpo' | 'gspo'
    c.rl.eps_max = 4.0
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.28
    c.rl.aggregation = "prompt"  # 'prompt' | 'sample' | 'token'
    c.rl.advantage_normalization = "batch"  # 'batch' | 'prompt' | 'none'
    c.rl.zero_variance_filter = True
    c.rl.refill_zero_variance = False  # DAPO's dynamic sampling: keep sampling until the batch is full
    c.rl.no_positive_resampling = True
    c.rl.positive_pass_rate = 0.9
    c.rl.length_control = "interruption"  # 'interruption' | 'length_penalty' | 'none'
    c.rl.length_penalty_max = 14_336
    c.rl.length_penalty_cache = 2_048
    c.rl.mask_truncated_completions = False  # completions cut by the token limit leave the loss

    c.sampler = ml_collections.ConfigDict()
    c.sampler.temperature = 1.0
    c.sampler.top_p = 1.0
    c.sampler.top_k = 0
    c.sampler.num_slots = 256
    c.sampler.chunk_steps = 64
    c.sampler.max_new_tokens = 14_336  # think + answer = total 16,384 - prompt 2,048
    c.sampler.think_budget_min = 10_240
    c.sampler.think_budget_max = 12_288
    c.sampler.answer_budget = 2_048
    c.sampler.interruption_phrase = INTERRUPTION_PHRASE
    c.sampler.think_end = "</think>"
    c.sampler.page_size = 16  # tokens per KV page
    c.sampler.num_pages = 0  # KV pages per generator (0: every slot can reach max_len at once)
    c.sampler.decode_kernel = "auto"  # 'xla' | 'pallas' (GPU) | 'auto' (= 'xla' until measured)
    c.sampler.compile_ahead = True  # compile every decode-path shape before the first request

    c.train = ml_collections.ConfigDict()
    # Compile the train step for every length bucket of the batches (batch.length_buckets_per_octave)
    # before the first step, in a background thread beside the sampler's warm-up and first
    # generations (False: each bucket compiles when a batch first needs it).
    c.train.compile_ahead = True
    c.train.compile_threads = 0  # programs compiled at once ahead of time; 0: half the host's CPU cores

    c.schedule = ml_collections.ConfigDict()
    c.schedule.kind = "pipeline"  # 'pipeline' (PipelineRL-k) | 'ppo_off_policy'
    c.schedule.k = 8
    c.schedule.queue_groups = 0  # groups admitted and not yet trained; 0: the schedule's bound ((k+1)G, or kG for PPO)

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.lr = 5e-7
    c.optimizer.warmup_steps = 100
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.999
    c.optimizer.eps = 1e-15
    c.optimizer.weight_decay = 0.01
    c.optimizer.max_grad_norm = 0.0  # 0 disables global-norm clipping

    c.mesh = ml_collections.ConfigDict()
    # Paper: 64 generator GPUs, 16 trainer GPUs. Or 'auto': picked at start-up from the measured
    # generation and training rates (run/device_split.py); a FieldReference of type object so that
    # --config.mesh.generator_fraction takes a number or the string.
    c.mesh.generator_fraction = ml_collections.FieldReference(0.8, field_type=object)
    c.mesh.trainer_shape = (1, -1, 1)  # (data, fsdp, tensor); -1 means the rest
    c.mesh.generator_shape = (-1, 1, 1)
    c.mesh.require_accelerator = True  # refuse to start on the CPU backend (set False to allow it)
    c.mesh.cpu_devices = 0  # on the CPU backend: split the host into this many devices (0: leave as is)

    # Runs over several processes (launch/local.sh N, launch/slurm.sbatch; see distributed/roles.py).
    c.distributed = ml_collections.ConfigDict()
    c.distributed.connect_timeout_s = 300.0  # start-up: connections, barriers, the shared files of process 0
    c.distributed.heartbeat_s = 2.0  # beat interval between every process and the leader
    c.distributed.heartbeat_timeout_s = 30.0  # silence after which a process counts as lost (run stops)
    c.distributed.reply_timeout_s = 86400.0  # longest wait for an answer to work (an evaluation, a pull)
    c.eval = ml_collections.ConfigDict()
    c.eval.every = 100
    c.eval.num_prompts = 1_000
    c.eval.samples_per_prompt = 16
    c.eval.fit_a_range = (0.45, 0.8)  # the sigmoid fit's grid over the asymptote A (the paper's)
    c.eval.samples_logged = 4  # prompts per evaluation written with their completions to samples.jsonl
    # True: evaluate while training goes on; each generator gets a second batcher (its own KV pool, as
    # large as the sampler's) that decodes the evaluated version's retained params (2 extra copies of
    # the params on the generator devices at most), and an evaluation's row is written when it is done.
    # False: the trainer waits for each evaluation.
    c.eval.concurrent = False
    # Extra evaluation sets, logged as eval_<name>/...: {'aime24': '/data/aime24.jsonl', ...}
    # (jsonl or parquet with data.problem_field / data.answer_field).
    c.eval.extra = ml_collections.ConfigDict()

    c.logging = ml_collections.ConfigDict()
    c.logging.wandb_project = ""  # '' = off; else Weights & Biases (offline unless wandb_mode='online')
    c.logging.wandb_mode = "offline"

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 100
    c.checkpoint.keep = 3

    c.nan_policy = "skip"  # 'skip' (count the step and go on) | 'stop' (raise with the step number)
    return c


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

    c.synthetic = ml_collections.ConfigDict()
    c.synthetic.seed = 0
    c.synthetic.heldout_size = 128
    c.synthetic.sft_size = 4096
    c.synthetic.train_size = 4096
    c.synthetic.levels = ((2, 9), (3, 9), (4, 9), (5, 9))

    c.warm_start = ml_collections.ConfigDict()
    c.warm_start.seed = 0
    c.warm_start.steps = 400
    # 30% of the demonstrations answer without a trace, so RL has reasoning to find
    # (`run.warm_start.with_direct_answers`; the measurement: docs/results/tiny_demo.md).
    c.warm_start.direct_answer_fraction = 0.3
    c.warm_start.batch_size = 64
    c.warm_start.lr = 2e-3
    c.warm_start.warmup_steps = 30
    c.warm_start.weight_decay = 0.0
    c.warm_start.max_len = 72  # the longest prompt + trace is 65 tokens
    c.warm_start.tokenizer_vocab_size = 300
    c.warm_start.log_every = 25
    c.warm_start.model_overrides = ml_collections.ConfigDict(
        dict(
            hidden_size=128,
            intermediate_size=384,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            rope_scaling=None,
            max_position_embeddings=128,
        )
    )
    return c
