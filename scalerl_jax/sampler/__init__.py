"""JetStream-style continuous-batching sampler: engine (prefill/insert/generate), batcher, generate()."""

from scalerl_jax.sampler.api import generate
from scalerl_jax.sampler.batcher import Batcher, Completion, ContinuousBatcher, Request
from scalerl_jax.sampler.engine import ChunkResult, DecodeState, Engine, PromptPiece, SlotSettings
from scalerl_jax.sampler.engine_config import (
    EngineConfig,
    InterruptionConfig,
    interruption_from_tokenizer,
)
from scalerl_jax.sampler.sampling import masked_log_probs, sample_tokens, top_k_mask, top_p_mask

__all__ = [
    "Batcher",
    "ChunkResult",
    "Completion",
    "ContinuousBatcher",
    "DecodeState",
    "Engine",
    "EngineConfig",
    "InterruptionConfig",
    "PromptPiece",
    "Request",
    "SlotSettings",
    "generate",
    "interruption_from_tokenizer",
    "masked_log_probs",
    "sample_tokens",
    "top_k_mask",
    "top_p_mask",
]
