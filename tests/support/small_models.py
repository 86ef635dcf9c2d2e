"""The small random Llama the pipeline, sampler and train-step tests share (CPU, compiles fast)."""

from scalerl_jax.models import ModelConfig, get_preset


def small_llama(vocab_size: int = 64) -> ModelConfig:
    """tiny-llama cut to 2 layers of width 32 (4 query heads, 2 KV heads of 8)."""
    return get_preset(
        "tiny-llama",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
