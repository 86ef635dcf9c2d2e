"""`generate(model, prompts, ...)`: continuous-batching generation for users and tests."""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import Any

from flax import nnx

from scalerl_jax.sampler.batcher import Completion, ContinuousBatcher, Request
from scalerl_jax.sampler.engine import Engine, doubled_bucket
from scalerl_jax.sampler.engine_config import EngineConfig, InterruptionConfig


@functools.lru_cache(maxsize=4)
def cached_engine(graphdef: Hashable, model_config: Any, config: EngineConfig) -> Engine:
    """One `Engine` per (graphdef, model config, engine config), so repeated calls do not recompile."""
    return Engine(graphdef, model_config, config)


def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    num_slots: int = 8,
    seed: int = 0,
    stop_tokens: Sequence[int] = (),
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_size: int = 16,
    max_len: int | None = None,
    interruption: InterruptionConfig | None = None,
    prefill_chunk: int = 32,
    share_prompts: bool = True,
) -> list[Completion]:
    """Complete every prompt with `num_slots` decode slots; returns Completions in prompt order.

    Prompt i samples with the PRNG stream fold_in(key(seed), i), so results do not depend on
    `num_slots` or `chunk_size`. `max_len` (KV cache length) defaults to the longest prompt plus
    `max_new_tokens`, rounded up to a power-of-two multiple of 16. Engines
    are cached (`cached_engine`), so calls with the same shapes and knobs reuse the compiles.
    Equal prompts decoding at the same time share their prompt's KV pages unless
    `share_prompts=False` (`EngineConfig.share_prompts`).
    """
    if not prompts:
        return []
    longest = max(len(p) for p in prompts) + max_new_tokens
    if max_len is None:
        max_len = doubled_bucket(longest, min_bucket=16, max_len=longest * 2)
    graphdef, params = nnx.split(model)
    engine = cached_engine(
        graphdef,
        model.config,
        EngineConfig(
            num_slots=num_slots,
            max_len=max_len,
            chunk_size=chunk_size,
            top_k=top_k,
            top_p=top_p,
            max_stop_tokens=max(1, len(stop_tokens)),
            prefill_chunk=prefill_chunk,
            interruption=interruption,
            share_prompts=share_prompts,
        ),
    )
    batcher = ContinuousBatcher(engine, params, seed=seed)
    for index, prompt in enumerate(prompts):
        batcher.add_request(
            Request(
                request_id=index,
                prompt_tokens=list(prompt),
                max_new_tokens=max_new_tokens,
                seed=index,
                temperature=temperature,
                stop_tokens=tuple(stop_tokens),
            )
        )
    by_id = {completion.request_id: completion for completion in batcher.drain()}
    return [by_id[index] for index in range(len(prompts))]
