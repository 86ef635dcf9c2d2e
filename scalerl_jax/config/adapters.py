"""A run config read into each library's own settings: the only place below the entry points,
besides the composition root, that knows the config's keys. Each library takes its dataclass
(`RewardConfig`, `PipelineConfig`, `EngineConfig`, `OptimizerConfig`, `TrainStepConfig`) and
knows nothing of `ml_collections`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import ml_collections

from scalerl_jax.contracts.batch_layout import Routing
from scalerl_jax.data import answers
from scalerl_jax.data.code_puzzles import PuzzleConfig
from scalerl_jax.data.ladder import LadderConfig
from scalerl_jax.data.mixture import MATH
from scalerl_jax.data.rewards import RewardConfig
from scalerl_jax.models.config import ModelConfig
from scalerl_jax.models.hf_tokenizer import CheckpointTokenizer
from scalerl_jax.pipeline.batching import MIN_LENGTH_BUCKET
from scalerl_jax.pipeline.config import PipelineConfig
from scalerl_jax.sampler.engine_config import EngineConfig, InterruptionConfig, interruption_from_tokenizer
from scalerl_jax.train.optimizer import OptimizerConfig
from scalerl_jax.train.step_config import TrainStepConfig


def interrupts(config: ml_collections.ConfigDict) -> bool:
    """Whether a run config's requests are interrupted: forced interruption applies only to the
    think format (a plain answer has no think phase)."""
    return config.rl.length_control == "interruption" and config.data.answer_format == "think"


def max_sequence_length(config: ml_collections.ConfigDict) -> int:
    """KV cache length per slot and the longest train row of a run config: prompt budget +
    completion budget."""
    return config.data.max_prompt_tokens + config.sampler.max_new_tokens


def ladder_config(config: ml_collections.ConfigDict) -> LadderConfig:
    """The arithmetic ladder of `config.ladder` (ValueError naming the key when it is invalid)."""
    s = config.ladder
    return LadderConfig(
        seed=s.seed,
        levels=tuple(s.levels),
        heldout_per_level=s.heldout_per_level,
        transfer_levels=tuple(s.transfer_levels),
        word_problem_fraction=s.word_problem_fraction,
    )


def domain_weights(config: ml_collections.ConfigDict) -> dict[str, float]:
    """The training prompts' domains and weights: `data.mixture`, or math alone when it is empty."""
    return {name: float(weight) for name, weight in config.data.mixture.items()} or {MATH: 1.0}


def puzzle_config(config: ml_collections.ConfigDict) -> PuzzleConfig:
    """The generated code puzzles of `config.code` (ValueError when its levels are invalid)."""
    c = config.code
    return PuzzleConfig(
        seed=c.seed,
        split_sizes=(("heldout", c.heldout_size), ("sft", c.sft_size), ("train", c.train_size)),
        levels=tuple((int(names), int(largest)) for names, largest in c.levels),
        operators=tuple(c.operators),
    )


def reward_config_of(config: ml_collections.ConfigDict) -> RewardConfig:
    """The run config's verifier: exact match on the generated tasks (`data.dataset` 'synthetic' or
    'ladder': integer golds), math-verify
    otherwise, or `data.reward_fn` when set; rewards `data.reward_correct` / `data.reward_incorrect`,
    answers extracted per `data.answer_format` after `sampler.think_end` by the styles of
    `data.answer_extraction`."""
    return RewardConfig(
        kind="exact" if config.data.dataset in ("synthetic", "ladder") else "math",
        correct_reward=config.data.reward_correct,
        incorrect_reward=config.data.reward_incorrect,
        answer_format=config.data.answer_format,
        think_end=config.sampler.think_end,
        reward_fn=config.data.reward_fn or None,
        answer_styles=answers.parse_styles(config.data.answer_extraction),
    )


def pipeline_config_of(
    config: ml_collections.ConfigDict,
    *,
    stop_tokens: Sequence[int],
    start_step: int,
    train_step_flops: Callable[[int, int], float] | None = None,
    peak_flops_per_s: float | None = None,
    routing: Routing | None = None,
) -> PipelineConfig:
    """The run config's schedule, batch shape, sampling and stopping, for a run resumed at
    version `start_step` (0 for a fresh run): the remaining `num_steps - start_step` steps
    (at least 0), first version `start_step`. `stop_tokens`: the tokenizer's stop ids. The
    MFU denominators and a mixture-of-experts policy's `routing` in the batches (the train
    step's, `TrainStepConfig.routing`) come from the caller (None on a generator process, which
    trains nothing), so the pipeline needs nothing of the model or the devices."""
    max_seq_len = max_sequence_length(config)
    return PipelineConfig(
        max_new_tokens=config.sampler.max_new_tokens,
        max_seq_len=max_seq_len,
        schedule=config.schedule.kind,
        k=config.schedule.k,
        prompts_per_step=config.batch.prompts_per_step,
        samples_per_prompt=config.batch.generations_per_prompt,
        num_steps=max(0, config.num_steps - start_step),
        capacity=config.schedule.queue_groups or None,
        zero_variance=(
            "refill" if config.rl.refill_zero_variance else "drop" if config.rl.zero_variance_filter else "none"
        ),
        temperature=config.sampler.temperature,
        stop_tokens=tuple(stop_tokens),
        interrupt=interrupts(config),
        min_length_bucket=min(MIN_LENGTH_BUCKET, max_seq_len),
        seed=config.seed,
        first_version=start_step,
        length_buckets_per_octave=config.batch.length_buckets_per_octave,
        sort_by_length=config.batch.sort_by_length,
        microbatches=config.batch.microbatches,
        mask_truncated=config.rl.mask_truncated_completions,
        train_step_flops=train_step_flops,
        peak_flops_per_s=peak_flops_per_s,
        routing=routing,
    )


def engine_config_of(config: ml_collections.ConfigDict, tokens: CheckpointTokenizer) -> EngineConfig:
    """The sampler engine of a run config's `sampler` section: slots, cache length
    (`max_sequence_length`), sampling knobs, room for the tokenizer's stop ids, the forced
    interruption (its phrase and think-end tag encoded by `tokens`, when `interrupts`), KV
    pages and the decode attention kernel."""
    s = config.sampler
    interruption = (
        interruption_from_tokenizer(
            tokens.tokenizer,
            phrase=s.interruption_phrase,
            end_think=s.think_end,
            think_budget_min=s.think_budget_min,
            think_budget_max=s.think_budget_max,
            answer_budget=s.answer_budget,
        )
        if interrupts(config)
        else None
    )
    return sampler_engine_config_of(config, max_stop_tokens=len(tokens.stop_ids), interruption=interruption)


def sampler_engine_config_of(
    config: ml_collections.ConfigDict, *, max_stop_tokens: int, interruption: InterruptionConfig | None
) -> EngineConfig:
    """The engine of a run config's `sampler` section, given what a tokenizer decides: room for
    `max_stop_tokens` stop ids and the encoded `interruption` (None: off)."""
    s = config.sampler
    return EngineConfig(
        num_slots=s.num_slots,
        max_len=max_sequence_length(config),
        chunk_size=s.chunk_steps,
        top_k=s.top_k,
        top_p=s.top_p,
        max_stop_tokens=max_stop_tokens,
        interruption=interruption,
        page_size=s.page_size,
        num_pages=s.num_pages,
        decode_kernel=s.decode_kernel,
        share_prompts=s.share_prompts,
        prefill_chunk=s.prefill_chunk,
        max_prefill_rows=s.max_prefill_rows,
    )


def optimizer_config_of(config: ml_collections.ConfigDict) -> OptimizerConfig:
    """The optimizer's knobs from a run config's `optimizer` section: lr, warmup_steps, b1, b2,
    eps, weight_decay, and max_grad_norm (0 there: no clipping)."""
    o = config.optimizer
    return OptimizerConfig(
        learning_rate=o.lr,
        warmup_steps=o.warmup_steps,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm or None,
    )


def train_step_config_of(config: ml_collections.ConfigDict, model_config: ModelConfig) -> TrainStepConfig:
    """The step's knobs from a run config: `rl.{objective, aggregation, advantage_normalization,
    eps_low, eps_high, eps_max}`, `batch.{microbatches, sort_by_length}`, `sampler.temperature`,
    `model.{logprob_chunk, router_aux_loss_coef}`, `rl.router_replay`, and `nan_policy` ('skip':
    a non-finite step keeps the old state); the policy's MoE layers and experts from
    `model_config` (a mixture-of-experts policy's batches always carry the sampler's routing, so
    that its mismatch with the trainer's is logged)."""
    rl = config.rl
    moe_layers = sum(model_config.is_moe_layer(i) for i in range(model_config.num_layers))
    return TrainStepConfig(
        objective=rl.objective,
        aggregation=rl.aggregation,
        advantage_normalization=rl.advantage_normalization,
        eps_low=rl.eps_low,
        eps_high=rl.eps_high,
        eps_max=rl.eps_max,
        num_microbatches=config.batch.microbatches,
        temperature=config.sampler.temperature,
        logprob_chunk_size=config.model.logprob_chunk,
        skip_nonfinite=config.nan_policy == "skip",
        sort_by_length=config.batch.sort_by_length,
        moe_layers=moe_layers,
        num_experts=model_config.num_experts,
        router_aux_loss_coef=config.model.router_aux_loss_coef,
        experts_per_token=model_config.num_experts_per_tok if moe_layers else 0,
        router_replay=rl.router_replay,
    )
