"""The sampler engine's settings: `EngineConfig` (static shapes and sampling knobs) and
`InterruptionConfig` (forced interruption of thinking). A run config is read into them by
`scalerl_jax.config.adapters`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from scalerl_jax.models.layers import resolve_decode_kernel

if TYPE_CHECKING:
    pass


@dataclasses.dataclass(frozen=True)
class InterruptionConfig:
    """Forced interruption of thinking (ScaleRL's length control).

    `phrase_ids`: tokens teacher-forced when the think budget is reached (typically the tokens
    of "Okay, time is up. ... </think>"). `end_think_ids`: the token sequence that closes thinking
    naturally (the tokens of "</think>"). The think budget of each request is drawn uniformly in
    [`think_budget_min`, `think_budget_max`]; after thinking closes at most `answer_budget`
    tokens are sampled.
    """

    phrase_ids: tuple[int, ...]
    end_think_ids: tuple[int, ...]
    think_budget_min: int
    think_budget_max: int
    answer_budget: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "phrase_ids", tuple(int(t) for t in self.phrase_ids))
        object.__setattr__(self, "end_think_ids", tuple(int(t) for t in self.end_think_ids))
        if not self.phrase_ids:
            raise ValueError("InterruptionConfig.phrase_ids is empty")
        if not self.end_think_ids:
            raise ValueError("InterruptionConfig.end_think_ids is empty")
        if not 1 <= self.think_budget_min <= self.think_budget_max:
            raise ValueError(
                f"InterruptionConfig think budget range [{self.think_budget_min}, "
                f"{self.think_budget_max}] must satisfy 1 <= min <= max"
            )
        if self.answer_budget < 1:
            raise ValueError(f"InterruptionConfig.answer_budget={self.answer_budget} must be >= 1")


def interruption_from_tokenizer(
    tokenizer: Any,
    *,
    phrase: str,
    end_think: str,
    think_budget_min: int,
    think_budget_max: int,
    answer_budget: int,
) -> InterruptionConfig:
    """Build an `InterruptionConfig` by encoding `phrase` and `end_think` with a `tokenizers.Tokenizer`."""
    phrase_ids = tokenizer.encode(phrase, add_special_tokens=False).ids
    end_think_ids = tokenizer.encode(end_think, add_special_tokens=False).ids
    return InterruptionConfig(
        tuple(phrase_ids), tuple(end_think_ids), think_budget_min, think_budget_max, answer_budget
    )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static shape and sampling knobs of an `Engine` (changing any of them recompiles).

    `max_len`: KV cache length per slot = the longest prompt + completion. `chunk_size`: decode
    steps per jitted `generate` call. `top_k` (0 = off) and `top_p` (1.0 = off) apply to every
    sampled slot; temperature is per slot. `max_stop_tokens`: capacity of the per-slot stop set.
    `prefill_chunk`: tokens per prompt piece (a prompt is prefilled in pieces of this many tokens,
    one per row of a prefill call). `max_prefill_rows`: most pieces prefilled by one call (row
    counts are powers of two up to it, so prefill compiles <= (log2(max_prefill_rows) + 1) x
    number of windows); also the most requests one `fork` call starts.
    `interruption`: None disables forced interruption for every request.
    `decode_block`: keys a decode step reads per piece of a cache layer (bounds its scratch memory
    to one piece); 0 picks by backend: `engine.CPU_DECODE_BLOCK` on CPU (where XLA would otherwise
    copy the whole window out of the cache), `engine.TPU_DECODE_BLOCK` on TPU (measured by
    compilation), the whole window on GPU (XLA fuses the cache slice into the attention
    reductions: 0.13 GiB of temporaries for the 8B chunk at window 16,384 in `compile_check`).
    `min_decode_window`: smallest decode attention window (see `Engine.generate`; windows double
    up to `max_len`, one `generate` compile each).
    `page_size`: tokens per KV page. `num_pages`: pages in the shared pool (0 = num_slots x
    ceil(max_len / page_size): every slot can reach max_len at once and nothing is ever preempted;
    fewer pages serve as many slots as the live tokens allow, the batcher preempting the youngest
    sequence when a group runs short). `decode_kernel`: 'xla' (blockwise attention over the live
    window's pages, every backend), 'pallas' (`models.paged_attention`, reads each slot's own
    length; GPU) or 'auto' (`layers.resolve_decode_kernel`).
    `share_prompts`: a request whose prompt a live slot of its page group holds (prefilled under
    the same params) shares that slot's prompt pages instead of prefilling it again (`Engine.fork`).
    """

    num_slots: int
    max_len: int
    chunk_size: int = 16
    top_k: int = 0
    top_p: float = 1.0
    max_stop_tokens: int = 4
    prefill_chunk: int = 32
    max_prefill_rows: int = 16
    interruption: InterruptionConfig | None = None
    decode_block: int = 0
    min_decode_window: int = 256
    page_size: int = 16
    num_pages: int = 0
    decode_kernel: str = "auto"
    share_prompts: bool = True

    def __post_init__(self) -> None:
        if self.decode_block < 0:
            raise ValueError(f"EngineConfig.decode_block={self.decode_block} must be >= 0 (0 = by backend)")
        if self.num_pages < 0:
            raise ValueError(f"EngineConfig.num_pages={self.num_pages} must be >= 0 (0 = every slot at max_len)")
        resolve_decode_kernel(self.decode_kernel, "cpu")
        for name in (
            "num_slots",
            "max_len",
            "chunk_size",
            "max_stop_tokens",
            "prefill_chunk",
            "max_prefill_rows",
            "min_decode_window",
            "page_size",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)} must be >= 1")
        if self.max_len < 2:
            raise ValueError(f"EngineConfig.max_len={self.max_len} must be >= 2")
        if self.top_k < 0:
            raise ValueError(f"EngineConfig.top_k={self.top_k} must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"EngineConfig.top_p={self.top_p} must be in (0, 1]")
