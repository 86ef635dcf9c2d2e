"""What a run config says about prompts, sampling and scoring, for training and evaluation alike.

The training run (`run.build`) and the evaluate command (`cli.evaluate`) build their prompt encoder,
requests and verifier here, and their sampler engine with `config.adapters.engine_config_of`, from the
same config keys and the checkpoint's own tokenizer (`models.load_checkpoint_tokenizer`), so a
policy is evaluated exactly as it was trained.

One key, `data.answer_format`, drives both the sampler's length control and the reward's answer
extraction: 'think' (forced interruption applies when `rl.length_control` is 'interruption'; the
answer is the last box after `sampler.think_end`) or 'plain' (no think phase: no interruption,
the last box anywhere).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import ml_collections

from scalerl_jax import data as data_lib
from scalerl_jax.config.adapters import interrupts
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.models import CheckpointTokenizer
from scalerl_jax.models.hf_tokenizer import (
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG_FILE,
    MODEL_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    read_json,
)
from scalerl_jax.sampler import Completion, ContinuousBatcher, Request


def check_think_end(config: ml_collections.ConfigDict, tokens: CheckpointTokenizer, checkpoint_dir: str) -> None:
    """A recipe that interrupts thinking needs the think-end tag as one token of the tokenizer."""
    if interrupts(config) and tokens.tokenizer.token_to_id(config.sampler.think_end) is None:
        raise ConfigError(
            f"config keys `rl.length_control` = 'interruption' and `data.answer_format` = 'think' need the "
            f"think-end tag `sampler.think_end` = {config.sampler.think_end!r} as a token of the checkpoint's "
            f"tokenizer, and {os.path.join(checkpoint_dir, 'tokenizer.json')} has none. For a base model "
            "without a think phase set --config.data.answer_format=plain"
        )


def check_token_ids(config: ml_collections.ConfigDict, tokens: CheckpointTokenizer, checkpoint_dir: str) -> None:
    """Every id the run feeds the model or stops on is a row of the model's embedding: every id of
    `tokenizer.json` (a prompt may hold any of them), the named special tokens, the stop ids and
    (when the run interrupts thinking) the think-end tag must be below `config.json`'s `vocab_size`.
    An id past it would be clamped by the gather on device (a wrong row, silently) or never sampled;
    ConfigError naming the sizes, the ids and the files. A tokenizer smaller than the embedding is
    fine (checkpoints pad their embedding). A config.json without an integer `vocab_size` is left to
    the model loader, which names it."""
    config_file = os.path.join(checkpoint_dir, MODEL_CONFIG_FILE)
    if not os.path.isfile(config_file):
        return
    try:
        vocab_size = read_json(config_file).get("vocab_size")
    except (ValueError, AttributeError):
        return  # malformed: the model loader names it
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        return
    tokenizer = tokens.tokenizer
    outside = []
    largest_id = max(tokenizer.get_vocab(with_added_tokens=True).values())
    if largest_id >= vocab_size:
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        outside.append(f"{TOKENIZER_FILE} has {size} tokens (ids up to {largest_id})")
    for field, token in tokens.special_tokens.items():
        token_id = tokenizer.token_to_id(token)
        if token_id is not None and token_id >= vocab_size:
            outside.append(f"{field} {token!r} = {token_id}")
    stops = [i for i in tokens.stop_ids if i >= vocab_size]
    if stops:
        outside.append(f"stop ids {stops}")
    think_end = tokenizer.token_to_id(config.sampler.think_end)
    if interrupts(config) and think_end is not None and think_end >= vocab_size:
        outside.append(f"think-end tag `sampler.think_end` {config.sampler.think_end!r} = {think_end}")
    if outside:
        files = ", ".join((TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, GENERATION_CONFIG_FILE))
        raise ConfigError(
            f"{config_file}: vocab_size = {vocab_size}, but the tokenizer files of {checkpoint_dir} ({files}) "
            f"give ids outside it: {'; '.join(outside)}. The model has no rows for them: a tokenizer from "
            "another model?"
        )


def make_prompt_encoder(
    config: ml_collections.ConfigDict, tokens: CheckpointTokenizer, checkpoint_dir: str, *, template: str = ""
) -> data_lib.PromptEncoder:
    """Problems -> prompt ids: `template` (default `data.prompt_template`), inside the checkpoint's chat template when
    `data.use_chat_template`, at most `data.max_prompt_tokens` ids (longer ones are skipped)."""
    if config.data.use_chat_template and tokens.chat_template is None:
        raise ConfigError(
            f"config key `data.use_chat_template` = True, but the checkpoint {checkpoint_dir} has no chat "
            f"template ({os.path.join(checkpoint_dir, CHAT_TEMPLATE_FILE)} does not exist and "
            f"{os.path.join(checkpoint_dir, TOKENIZER_CONFIG_FILE)} has no `chat_template`); set it to False "
            "for a base model's plain prompts"
        )
    return data_lib.PromptEncoder(
        tokens.tokenizer,
        data_lib.PromptFormat(
            template=template or config.data.prompt_template,
            max_prompt_tokens=config.data.max_prompt_tokens,
            chat_template=tokens.chat_template if config.data.use_chat_template else None,
        ),
        special_tokens=tokens.special_tokens,
    )


def make_sample_fn(
    batcher: ContinuousBatcher, config: ml_collections.ConfigDict, stop_ids: Sequence[int], *, seed_offset: int = 0
) -> Callable[[list[list[int]]], list[Completion]]:
    """`prompts -> completions` (one per prompt, in order) through `batcher` with the run's temperature,
    budget and length control; request i samples with the PRNG stream `seed_offset + i`."""

    def sample(prompts: list[list[int]]) -> list[Completion]:
        for i, prompt in enumerate(prompts):
            batcher.add_request(
                Request(
                    request_id=i,
                    prompt_tokens=list(prompt),
                    max_new_tokens=config.sampler.max_new_tokens,
                    seed=seed_offset + i,
                    temperature=config.sampler.temperature,
                    stop_tokens=tuple(stop_ids),
                    interrupt=interrupts(config),
                )
            )
        done = {c.request_id: c for c in batcher.drain()}
        return [done[i] for i in range(len(prompts))]

    return sample
