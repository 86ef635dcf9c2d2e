"""The run config's schema: every key, with its type, its default (the 8B recipe's), its allowed
values or bounds, one line of documentation, whether a resumed run may change it, and which
compiled programs it sizes.

Everything else about keys derives from `KEYS`: the baseline recipe (`default_config`), the checks
of types, choices and bounds (`validation`), the keys a resume may change (`RESUMABLE`), the keys
`compile_check` names for a program that does not fit (`sized_by`), and `docs/config.md`
(`markdown`). Choice lists are the constants of the modules that interpret the key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import ml_collections

from scalerl_jax.config.errors import ConfigError
from scalerl_jax.data.answers import ANSWER_FORMATS
from scalerl_jax.data.builders import DATASET_CHOICES
from scalerl_jax.data.code_puzzles import DEFAULT_LEVELS as DEFAULT_PUZZLE_LEVELS
from scalerl_jax.data.code_puzzles import DEFAULT_OPERATORS as DEFAULT_PUZZLE_OPERATORS
from scalerl_jax.data.code_puzzles import PUZZLES
from scalerl_jax.models.config import ATTENTION_IMPLS, HEAD_PRECISIONS, MOE_IMPLS, REMAT_POLICIES, RUN_DTYPES
from scalerl_jax.models.layers import DECODE_KERNELS
from scalerl_jax.pipeline.lag import SCHEDULES
from scalerl_jax.rl import AGGREGATIONS, NORMALIZATIONS, OBJECTIVES
from scalerl_jax.rl.length_penalty import LENGTH_CONTROLS
from scalerl_jax.telemetry.wandb_sink import WANDB_MODES
from scalerl_jax.train.step_config import NAN_POLICIES


@dataclasses.dataclass(frozen=True)
class Bound:
    """A numeric range: `low` <(=) x <(=) `high` (None: unbounded), optionally integers only."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def admits(self, value: Any) -> bool:
        """True when `value` is a finite number (an int if `integer`) inside the range."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return kind + (" " + " and ".join(parts) if parts else "")


COUNT = Bound(1, integer=True)
NON_NEGATIVE_INT = Bound(0, integer=True)
POSITIVE = Bound(0, low_open=True)
NON_NEGATIVE = Bound(0)
PROBABILITY = Bound(0, 1)
BETA = Bound(0, 1, high_open=True)
FINITE = Bound()
OPEN_UNIT = Bound(0, 1, low_open=True, high_open=True)
HALF_OPEN_UNIT = Bound(0, 1, low_open=True)

# Key types.
BOOL, STR, CHOICE, NUMBER, SEQUENCE, MAPPING = "bool", "str", "choice", "number", "sequence", "mapping"
# `mesh.generator_fraction`: a number in (0, 1), or AUTO_SPLIT: the split is picked at start-up
# from measured generation and training rates (`run.device_split`).
FRACTION_OR_AUTO = "fraction or 'auto'"
AUTO_SPLIT = "auto"

# Compiled programs (`run.programs`), by name or by role prefix: what a key sizes.
TRAIN_STEP = ("train/accumulate", "train/step")
TRAIN_ANY = "train/"
PREFILL = "generator/prefill"
GENERATOR_ANY = "generator/"
PUSH_ANY = "push/"

CODE_TASKS = ("file", PUZZLES)
# Sections only some configs carry (the tiny run's synthetic task and warm start, the arithmetic
# ladder of real instruct models); `default_config` leaves them out and `section_config` builds one.
OPTIONAL_SECTIONS = ("synthetic", "warm_start", "ladder", "code")


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key. `name` is dotted (`sampler.num_pages`); `default` is the 8B recipe's value
    (an optional section's: the tiny run's); `type` one of BOOL, STR, CHOICE (one of `choices`),
    NUMBER (inside `bound`), SEQUENCE (a tuple), MAPPING (a section whose keys the user names),
    FRACTION_OR_AUTO; `resumable`: a run resumed from its checkpoints may change it; `sizes`: the
    compiled programs (names, or role prefixes ending in '/') whose shapes it sets."""

    name: str
    default: Any
    type: str
    doc: str
    choices: tuple = ()
    bound: Bound | None = None
    resumable: bool = False
    sizes: tuple[str, ...] = ()

    @property
    def section(self) -> str:
        """The key's section ('' for a top-level key)."""
        return self.name.rpartition(".")[0]

    def describe(self) -> str:
        """What values the key takes, in words."""
        if self.type == CHOICE:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.type == NUMBER:
            assert self.bound is not None
            return self.bound.describe()
        if self.type == BOOL:
            return "True or False"
        if self.type == STR:
            return "a string"
        if self.type == SEQUENCE:
            return "a tuple"
        if self.type == MAPPING:
            return "a mapping of names the user chooses"
        return f"a number in (0, 1), or {AUTO_SPLIT!r}"


# One constructor per type, so that the table below reads `type(name, default, [choices | bound,] doc)`.
def flag(name: str, default: bool, doc: str, **kw: Any) -> Key:
    return Key(name, default, BOOL, doc, **kw)


def text(name: str, default: str, doc: str, **kw: Any) -> Key:
    return Key(name, default, STR, doc, **kw)


def choice(name: str, default: str, choices: tuple[str, ...], doc: str, **kw: Any) -> Key:
    return Key(name, default, CHOICE, doc, choices=tuple(choices), **kw)


def number(name: str, default: float, bound: Bound, doc: str, **kw: Any) -> Key:
    return Key(name, default, NUMBER, doc, bound=bound, **kw)


def sequence(name: str, default: tuple, doc: str, **kw: Any) -> Key:
    return Key(name, default, SEQUENCE, doc, **kw)


def mapping(name: str, default: dict, doc: str, **kw: Any) -> Key:
    return Key(name, default, MAPPING, doc, **kw)


INTERRUPTION_PHRASE = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
# `{problem}` is replaced literally (data.prompts.format_problem), so LaTeX braces stay as written.
DEFAULT_PROMPT_TEMPLATE = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{}."

KEYS: tuple[Key, ...] = (
    number("seed", 0, NON_NEGATIVE_INT, "Seed of the run: prompt draws, sampling, think budgets, params init."),
    number("num_steps", 10_000, COUNT, "Train steps of the run.", resumable=True),
    # ------------------------------------------------------------------ model
    text("model.preset", "llama3.1-8b", "Architecture preset (models.get_preset) when no checkpoint gives one."),
    text("model.checkpoint", "", "Local Hugging Face directory (config.json + safetensors + tokenizer.json)."),
    choice("model.dtype", "bfloat16", RUN_DTYPES, "Params and activations dtype.", sizes=(TRAIN_ANY,)),
    flag("model.fp32_head", True, "LM head (unembedding) matmul and logits in float32, generator and trainer."),
    choice(
        "model.head_precision",
        "bf16x3",
        HEAD_PRECISIONS,
        "The FP32 head's matmul: 'bf16x3' near-fp32 on GPU tensor cores (exact on CPU); 'highest' exact fp32.",
    ),
    choice(
        "model.attention_impl",
        "auto",
        ATTENTION_IMPLS,
        "Training attention: 'auto' is cuDNN flash attention on GPU (no T x T scores), 'xla' on CPU.",
        sizes=TRAIN_STEP,
    ),
    flag(
        "model.scan_layers",
        True,
        "Scan over the layers (one compiled period of layer kinds, ModelConfig.layer_period) instead of unrolling them.",
    ),
    choice("model.remat_policy", "full", REMAT_POLICIES, "What the train step keeps per layer.", sizes=TRAIN_STEP),
    number("model.logprob_chunk", 1024, COUNT, "Tokens per chunk of the log-prob head.", sizes=TRAIN_STEP),
    choice(
        "model.moe_impl",
        "auto",
        MOE_IMPLS,
        "Mixture-of-experts layers: 'dense' runs every expert on every token (CPU), 'ragged' one grouped "
        "matmul per projection over the tokens sorted by expert (GPU/TPU); 'auto' picks by platform.",
    ),
    number(
        "model.router_aux_loss_coef",
        0.0,
        NON_NEGATIVE,
        "Weight of the MoE load-balancing loss in the train loss (0, as Qwen3-MoE ships: output_router_logits off).",
    ),
    # ------------------------------------------------------------------ data
    choice(
        "data.dataset",
        "",
        DATASET_CHOICES,
        "'': the reader follows data.path (Polaris-53K for polaris-data-53K.jsonl, else .jsonl/.parquet); "
        "'synthetic', 'ladder': generated arithmetic (sections synthetic, ladder).",
    ),
    text("data.path", "", "Local polaris-data-53K.jsonl, or any .jsonl / .parquet file."),
    text("data.data_dir", "", "TFDS data_dir; empty means WORKDIR/tfds."),
    text("data.problem_field", "problem", "Field of a row holding the problem."),
    text("data.answer_field", "answer", "Field of a row holding the gold answer."),
    number("data.heldout_size", 1_000, COUNT, "Prompts held out of training for evaluation."),
    number("data.heldout_seed", 0, NON_NEGATIVE_INT, "Seed of the held-out split."),
    text("data.prompt_template", DEFAULT_PROMPT_TEMPLATE, "Prompt text; {problem} is replaced by the problem."),
    flag("data.use_chat_template", True, "Wrap the prompt in the checkpoint's chat template."),
    choice(
        "data.answer_format",
        "think",
        ANSWER_FORMATS,
        "'think': the answer is after sampler.think_end, interruption applies; 'plain': the whole completion.",
    ),
    text(
        "data.answer_extraction",
        "boxed",
        "Styles that read the prediction, tried in order: boxed, hashes, answer_is, last_number.",
    ),
    text("data.gold_extraction", "", "'': the answer field as is; else styles as above that read the gold."),
    number(
        "data.max_solution_steps",
        0,
        NON_NEGATIVE_INT,
        "Only rows whose worked solution has at most this many steps (GSM8K); 0: every row.",
    ),
    text("data.reward_fn", "", "'package.module:function' (completion, gold, problem) -> float; '': math-verify."),
    number("data.max_prompt_tokens", 2_048, COUNT, "Longest prompt, in tokens.", sizes=(PREFILL, *TRAIN_STEP)),
    number("data.reward_correct", 1.0, FINITE, "Reward of a correct answer."),
    number("data.reward_incorrect", -1.0, FINITE, "Reward of a wrong or missing answer."),
    number("data.verify_timeout_s", 5.0, POSITIVE, "Time limit of one answer's verification."),
    number("data.verify_workers", 4, COUNT, "Verifier worker processes."),
    mapping(
        "data.mixture",
        {},
        "Domains and weights of the training prompts, e.g. {'math': 1, 'code': 1} (code: section code); "
        "{}: data.* alone.",
    ),
    # ------------------------------------------------------------------ batch
    number("batch.prompts_per_step", 48, COUNT, "Prompts per train step.", sizes=TRAIN_STEP),
    number("batch.generations_per_prompt", 16, Bound(2, integer=True), "Completions per prompt.", sizes=TRAIN_STEP),
    number("batch.microbatches", 48, COUNT, "Microbatches per step (gradient accumulation).", sizes=TRAIN_STEP),
    flag(
        "batch.sort_by_length",
        True,
        "Rows sorted by length into microbatches, each padded to its own bucket (loss unchanged).",
        resumable=True,
    ),
    number(
        "batch.length_buckets_per_octave",
        8,
        COUNT,
        "Train length buckets per octave of sequence length (1: powers of two).",
        resumable=True,
    ),
    # ------------------------------------------------------------------ rl
    choice("rl.objective", "cispo", OBJECTIVES, "Policy loss."),
    number("rl.eps_max", 4.0, POSITIVE, "CISPO's truncation of the importance weight."),
    number("rl.eps_low", 0.2, BETA, "Lower clip of the ratio (dapo, grpo, gspo)."),
    number("rl.eps_high", 0.28, NON_NEGATIVE, "Upper clip of the ratio (dapo, grpo, gspo)."),
    choice("rl.aggregation", "prompt", AGGREGATIONS, "How token losses are averaged."),
    choice("rl.advantage_normalization", "batch", NORMALIZATIONS, "What the centered reward is divided by."),
    flag("rl.zero_variance_filter", True, "Prompts whose completions all got one reward leave the loss."),
    flag("rl.refill_zero_variance", False, "DAPO's dynamic sampling: keep sampling until the batch is full."),
    flag("rl.no_positive_resampling", True, "Prompts with a historical pass rate >= rl.positive_pass_rate retire."),
    number("rl.positive_pass_rate", 0.9, HALF_OPEN_UNIT, "Pass rate at which No-Positive-Resampling retires a prompt."),
    choice("rl.length_control", "interruption", LENGTH_CONTROLS, "How completion length is bounded."),
    number("rl.length_penalty_max", 14_336, COUNT, "Length penalty's L_max (Eq. 9)."),
    number("rl.length_penalty_cache", 2_048, COUNT, "Length penalty's L_cache (Eq. 9)."),
    flag("rl.mask_truncated_completions", False, "Completions cut by the token limit leave the loss."),
    flag(
        "rl.router_replay",
        False,
        "Mixture-of-experts policies: the trainer computes each generated token with the experts the sampler "
        "routed it to (router replay); train/routing_mismatch_frac is logged either way.",
    ),
    # ------------------------------------------------------------------ sampler
    number("sampler.temperature", 1.0, POSITIVE, "Sampling temperature (the train step's log-probs use it too)."),
    number("sampler.top_p", 1.0, HALF_OPEN_UNIT, "Nucleus sampling mass."),
    number("sampler.top_k", 0, NON_NEGATIVE_INT, "Top-k sampling; 0: off."),
    number("sampler.num_slots", 256, COUNT, "Decode slots per generator.", sizes=(PREFILL, GENERATOR_ANY)),
    number("sampler.chunk_steps", 64, COUNT, "Decode steps per compiled chunk.", sizes=(GENERATOR_ANY,)),
    number(
        "sampler.max_new_tokens",
        14_336,
        COUNT,
        "Longest completion: think + answer (16,384 total - 2,048 prompt).",
        sizes=(*TRAIN_STEP, GENERATOR_ANY),
    ),
    number("sampler.think_budget_min", 10_240, COUNT, "Shortest think budget drawn for interruption."),
    number("sampler.think_budget_max", 12_288, COUNT, "Longest think budget drawn for interruption."),
    number("sampler.answer_budget", 2_048, COUNT, "Tokens after the interruption phrase."),
    text("sampler.interruption_phrase", INTERRUPTION_PHRASE, "Text forced in at the think budget."),
    text("sampler.think_end", "</think>", "The tag that ends the think phase."),
    number("sampler.page_size", 16, COUNT, "Tokens per KV page.", resumable=True),
    number(
        "sampler.num_pages",
        0,
        NON_NEGATIVE_INT,
        "KV pages per generator (0: every slot can reach max_len at once).",
        resumable=True,
        sizes=(PREFILL, GENERATOR_ANY),
    ),
    choice(
        "sampler.decode_kernel",
        "auto",
        DECODE_KERNELS,
        "Paged attention: 'xla', 'pallas' (GPU), 'auto' (= 'xla' until measured).",
        resumable=True,
    ),
    number(
        "sampler.prefill_chunk",
        32,
        COUNT,
        "Tokens per prompt piece: prompts are prefilled in pieces of this many tokens into the KV pages.",
        resumable=True,
        sizes=(PREFILL,),
    ),
    number(
        "sampler.max_prefill_rows",
        16,
        COUNT,
        "Prompt pieces per prefill call (one call per decode chunk while sequences decode).",
        resumable=True,
        sizes=(PREFILL,),
    ),
    flag(
        "sampler.share_prompts",
        True,
        "Samples of one prompt share its KV pages: the prompt is prefilled once per group.",
        resumable=True,
    ),
    flag("sampler.compile_ahead", True, "Compile every decode-path shape before the first request.", resumable=True),
    # ------------------------------------------------------------------ train
    flag(
        "train.compile_ahead",
        True,
        "Compile the train step for every length bucket before the first step, in the background.",
        resumable=True,
    ),
    number(
        "train.compile_threads",
        0,
        NON_NEGATIVE_INT,
        "Programs compiled at once ahead of time; 0: half the host's CPU cores.",
        resumable=True,
    ),
    # ------------------------------------------------------------------ schedule
    choice("schedule.kind", "pipeline", SCHEDULES, "PipelineRL-k ('pipeline') or PPO-off-policy-k."),
    number("schedule.k", 8, COUNT, "Largest version lag (pipeline) or updates per generation round (PPO)."),
    number(
        "schedule.queue_groups",
        0,
        NON_NEGATIVE_INT,
        "Groups admitted and not yet trained; 0: the schedule's bound ((k+1)G, or kG for PPO).",
    ),
    # ------------------------------------------------------------------ optimizer
    number("optimizer.lr", 5e-7, POSITIVE, "AdamW learning rate, constant after the warmup."),
    number("optimizer.warmup_steps", 100, NON_NEGATIVE_INT, "Linear warmup steps."),
    number("optimizer.b1", 0.9, BETA, "AdamW beta1."),
    number("optimizer.b2", 0.999, BETA, "AdamW beta2."),
    number("optimizer.eps", 1e-15, POSITIVE, "AdamW epsilon."),
    number("optimizer.weight_decay", 0.01, NON_NEGATIVE, "AdamW decoupled weight decay."),
    number("optimizer.max_grad_norm", 0.0, NON_NEGATIVE, "Global-norm gradient clipping; 0: off."),
    # ------------------------------------------------------------------ mesh
    Key(
        "mesh.generator_fraction",
        0.8,
        FRACTION_OR_AUTO,
        "Share of devices that generate (paper: 64 of 80 GPUs); 'auto': picked from measured rates.",
        sizes=(*TRAIN_STEP, TRAIN_ANY, PREFILL, GENERATOR_ANY, PUSH_ANY),
    ),
    sequence(
        "mesh.trainer_shape",
        (1, -1, 1),
        "Trainer mesh (data, fsdp, tensor); -1 means the rest.",
        sizes=(*TRAIN_STEP, TRAIN_ANY, PUSH_ANY),
    ),
    sequence(
        "mesh.generator_shape",
        (-1, 1, 1),
        "Generator mesh (data, fsdp, tensor); -1 means the rest.",
        sizes=(PREFILL, GENERATOR_ANY, PUSH_ANY),
    ),
    flag("mesh.require_accelerator", True, "Refuse to start on the CPU backend."),
    number("mesh.cpu_devices", 0, NON_NEGATIVE_INT, "On the CPU backend: split the host into this many devices."),
    # ------------------------------------------------------------------ distributed
    number(
        "distributed.connect_timeout_s",
        300.0,
        POSITIVE,
        "Start-up: connections, barriers, the shared files of process 0.",
        resumable=True,
    ),
    number(
        "distributed.heartbeat_s", 2.0, POSITIVE, "Beat interval between every process and the leader.", resumable=True
    ),
    number(
        "distributed.heartbeat_timeout_s",
        30.0,
        POSITIVE,
        "Silence after which a process counts as lost (the run stops).",
        resumable=True,
    ),
    number(
        "distributed.reply_timeout_s",
        86400.0,
        POSITIVE,
        "Longest wait for an answer to work (an evaluation, a pull).",
        resumable=True,
    ),
    # ------------------------------------------------------------------ eval
    number("eval.every", 100, COUNT, "Steps between evaluations.", resumable=True),
    number("eval.num_prompts", 1_000, COUNT, "Held-out prompts per evaluation."),
    number("eval.samples_per_prompt", 16, COUNT, "Samples per held-out prompt."),
    sequence("eval.fit_a_range", (0.45, 0.8), "The sigmoid fit's grid over the asymptote A (low, high)."),
    number(
        "eval.samples_logged",
        4,
        NON_NEGATIVE_INT,
        "Prompts per evaluation written with their completions to samples.jsonl.",
        resumable=True,
    ),
    flag(
        "eval.concurrent",
        False,
        "Evaluate beside training on a second batcher of the generator (else the trainer waits).",
        resumable=True,
        sizes=(PREFILL, GENERATOR_ANY),
    ),
    mapping("eval.extra", {}, "Extra evaluation sets, logged as eval_<name>/...: {name: path to .jsonl/.parquet}."),
    # ------------------------------------------------------------------ logging, checkpoint
    text(
        "logging.wandb_project",
        "",
        "'': off; else Weights & Biases (offline unless logging.wandb_mode='online').",
        resumable=True,
    ),
    choice("logging.wandb_mode", "offline", WANDB_MODES, "Weights & Biases mode.", resumable=True),
    number("checkpoint.every", 100, COUNT, "Steps between checkpoints.", resumable=True),
    number("checkpoint.keep", 3, COUNT, "Checkpoints kept.", resumable=True),
    choice("nan_policy", "skip", NAN_POLICIES, "A NaN loss: 'skip' counts the step and goes on, 'stop' raises."),
    # ------------------------------------------------------------------ synthetic (optional)
    number("synthetic.seed", 0, NON_NEGATIVE_INT, "Seed of the synthetic arithmetic task."),
    number("synthetic.heldout_size", 128, COUNT, "Held-out problems of the synthetic task."),
    number("synthetic.sft_size", 4096, COUNT, "Warm-start demonstrations."),
    number("synthetic.train_size", 4096, COUNT, "RL training problems."),
    sequence("synthetic.levels", ((2, 9), (3, 9), (4, 9), (5, 9)), "(terms, largest digit) of each difficulty level."),
    # ------------------------------------------------------------------ ladder (optional)
    number("ladder.seed", 0, NON_NEGATIVE_INT, "Seed of the arithmetic ladder's problems and phrasings."),
    sequence(
        "ladder.levels",
        ("add_1d", "sub_1d", "mul_1d", "add_teen"),
        "Rungs trained on and held out (scalerl_jax/data/ladder.py LEVELS).",
    ),
    number("ladder.heldout_per_level", 32, COUNT, "Held-out problems per rung (never trained, any phrasing)."),
    sequence("ladder.transfer_levels", (), "Rungs only evaluated (eval_transfer/...), never trained."),
    number("ladder.word_problem_fraction", 0.25, PROBABILITY, "Problems phrased as short word problems."),
    # ------------------------------------------------------------------ code (optional)
    choice(
        "code.task",
        "file",
        CODE_TASKS,
        "'file': code.path (MBPP: train on its train split, evaluate on test); 'puzzles': generated expressions.",
    ),
    text("code.path", "", "A local MBPP .jsonl (or HumanEval .jsonl.gz, evaluation only) for code.task='file'."),
    text("code.prompt_template", "", "'': the layout's own user turn (code_rows.TEMPLATES, code_puzzles.TEMPLATE)."),
    flag("code.fenced_only", False, "Only a fenced code block is a program; else the whole text when it has none."),
    number("code.workers", 4, Bound(1, 100, integer=True), "Code sandboxes run at once (the verifier's pool)."),
    number("code.wall_s", 10.0, POSITIVE, "Wall-clock deadline of one program, sandbox start-up included."),
    number("code.cpu_s", 10, COUNT, "CPU seconds of one program."),
    number("code.memory_mb", 1024, COUNT, "Address space of one program, in MiB."),
    flag(
        "code.require_network_isolation",
        True,
        "Refuse to start when the kernel gives the sandbox no network namespace of its own.",
    ),
    number("code.seed", 0, NON_NEGATIVE_INT, "Seed of the generated puzzles."),
    number("code.heldout_size", 128, COUNT, "Held-out puzzles."),
    number("code.sft_size", 256, NON_NEGATIVE_INT, "Puzzles among the warm start's demonstrations."),
    number("code.train_size", 512, COUNT, "RL training puzzles."),
    sequence("code.levels", DEFAULT_PUZZLE_LEVELS, "(names, largest value) of each puzzle level."),
    sequence("code.operators", DEFAULT_PUZZLE_OPERATORS, "Operators the puzzles' targets are made with (of + - *)."),
    # ------------------------------------------------------------------ warm_start (optional)
    number("warm_start.seed", 0, NON_NEGATIVE_INT, "Seed of the warm start's init and batches."),
    number("warm_start.steps", 400, COUNT, "Supervised steps of the warm start."),
    number(
        "warm_start.direct_answer_fraction",
        0.3,
        PROBABILITY,
        "Demonstrations that answer without a trace, so RL has reasoning to find.",
    ),
    number("warm_start.batch_size", 64, COUNT, "Warm-start batch size."),
    number("warm_start.lr", 2e-3, POSITIVE, "Warm-start learning rate."),
    number("warm_start.warmup_steps", 30, NON_NEGATIVE_INT, "Warm-start warmup steps."),
    number("warm_start.weight_decay", 0.0, NON_NEGATIVE, "Warm-start weight decay."),
    number("warm_start.max_len", 72, Bound(2, integer=True), "Longest warm-start row (prompt + trace: 65 tokens)."),
    number("warm_start.tokenizer_vocab_size", 300, Bound(259, integer=True), "Vocabulary of the trained tokenizer."),
    number("warm_start.log_every", 25, COUNT, "Warm-start steps between log lines."),
    mapping(
        "warm_start.model_overrides",
        dict(
            hidden_size=128,
            intermediate_size=384,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            rope_scaling=None,
            max_position_embeddings=128,
        ),
        "ModelConfig fields of the warm-started policy, over model.preset's.",
    ),
)
BY_NAME: dict[str, Key] = {key.name: key for key in KEYS}
# Keys a resumed run may change: how long it runs, how often it evaluates, saves and logs, how the
# sampler holds and reads its KV cache (not what it samples) and how the trainer lays out a batch
# into microbatches (not what it computes). `log_every` was a key no code read: a workdir whose
# saved config still has it resumes.
RESUMABLE = tuple(key.name for key in KEYS if key.resumable) + ("log_every",)
# MAPPING keys: sections whose own keys the user names (extra evaluation sets, model overrides).
OPEN_KEYS = frozenset(key.name for key in KEYS if key.type == MAPPING)


def sections() -> list[str]:
    """The sections, in schema order ('' for the top level)."""
    return list(dict.fromkeys(key.section for key in KEYS))


def _value(key: Key) -> Any:
    if key.type == MAPPING:
        return ml_collections.ConfigDict(dict(key.default))
    if key.type == FRACTION_OR_AUTO:  # takes a number or the string on the command line
        return ml_collections.FieldReference(key.default, field_type=object)
    return key.default


def _assign(config: ml_collections.ConfigDict, key: Key) -> None:
    node = config
    for part in key.section.split(".") if key.section else ():
        if part not in node:
            node[part] = ml_collections.ConfigDict()
        node = node[part]
    node[key.name.rpartition(".")[2]] = _value(key)


def default_config() -> ml_collections.ConfigDict:
    """The baseline recipe: every key of a non-optional section at its default."""
    config = ml_collections.ConfigDict()
    for key in KEYS:
        if key.name.split(".")[0] not in OPTIONAL_SECTIONS:
            _assign(config, key)
    return config


def section_config(section: str) -> ml_collections.ConfigDict:
    """An optional section at its defaults (`config.warm_start = section_config('warm_start')`)."""
    if section not in OPTIONAL_SECTIONS:
        raise ValueError(f"{section!r} is not an optional section; choose one of {OPTIONAL_SECTIONS}")
    config = ml_collections.ConfigDict()
    for key in KEYS:
        if key.section == section:
            config[key.name.rpartition(".")[2]] = _value(key)
    return config


def get_key(config: Any, dotted: str) -> Any:
    """The value of the dotted key `dotted` in a ConfigDict or its JSON form; ConfigError naming it
    when missing."""
    node: Any = config
    for part in dotted.split("."):
        if part not in node:
            raise ConfigError(f"config key `{dotted}` is missing")
        node = node[part]
    return node


def flat_keys(config: Any, prefix: str = "") -> Iterator[str]:
    """The dotted keys of a ConfigDict or its JSON form; a MAPPING key counts as one key."""
    for name, value in config.items():
        path = f"{prefix}{name}"
        if isinstance(value, (ml_collections.ConfigDict, dict)) and path not in OPEN_KEYS:
            yield from flat_keys(value, path + ".")
        else:
            yield path


def sized_by(program_name: str) -> tuple[str, ...]:
    """The keys that size the program `program_name`: those naming it, else those naming its role
    ('train/', 'generator/', 'push/'), in schema order."""
    named = tuple(key.name for key in KEYS if program_name in key.sizes)
    if named:
        return named
    role = program_name.split("/")[0] + "/"
    return tuple(key.name for key in KEYS if role in key.sizes)


def _cell(value: Any) -> str:
    """A default as a markdown table cell: its repr in backquotes, cut at 40 characters."""
    text_value = repr(value)
    if len(text_value) > 40:
        text_value = text_value[:37] + "..."
    return "`" + text_value.replace("|", "\\|").replace("\n", "\\n") + "`"


def markdown() -> str:
    """docs/config.md: a table per section of every key, its default, allowed values, resume rule,
    programs it sizes and documentation."""
    lines = [
        "# Config keys",
        "",
        "Generated from `scalerl_jax/config/schema.py` by `scalerl config-docs --out docs/config.md`; a test",
        "fails when this file is stale. Defaults are the 8B recipe's (`configs/scalerl_8b.py`); the optional",
        f"sections ({', '.join(OPTIONAL_SECTIONS)}) only some recipes carry (synthetic and warm_start the tiny",
        "one, ladder configs/smollm2_arith.py), with the defaults shown.",
        "*resume*: a run resumed from its checkpoints may change the key. *sizes*: the compiled programs",
        "whose shapes it sets (`scalerl compile-check` names these keys when a program does not fit).",
    ]
    for section in sections():
        lines += ["", f"## {section or 'top level'}", "", "| key | default | values | resume | sizes | what |"]
        lines.append("|---|---|---|---|---|---|")
        for key in KEYS:
            if key.section != section:
                continue
            values = key.describe().replace("|", "\\|")
            lines.append(
                f"| `{key.name}` | {_cell(key.default)} | {values} | {'yes' if key.resumable else ''} | "
                f"{' '.join(key.sizes)} | {key.doc.replace('|', chr(92) + '|')} |"
            )
    return "\n".join(lines) + "\n"
