"""Model config, presets, RoPE, dtypes, chunked log-probs memory: checked against hand calculations."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scalerl_jax.models import ModelConfig, Transformer, get_preset, init_kv_cache, sequence_logprobs
from scalerl_jax.models.layers import rope_inverse_frequencies
from scalerl_jax.models.logprobs import chunked_head_logprobs
from scalerl_jax.models.transformer import DecoderLayer, remat_policy


def _abstract_param_count(name):
    abstract = nnx.eval_shape(lambda: Transformer(get_preset(name), rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract)))


@pytest.mark.parametrize(
    "name,expected",
    [
        # Published totals of the Hugging Face checkpoints (safetensors metadata):
        ("llama3.1-8b", 8_030_261_248),  # meta-llama/Llama-3.1-8B
        ("qwen3-8b", 8_190_735_360),  # Qwen/Qwen3-8B
        ("qwen2.5-7b", 7_615_616_512),  # Qwen/Qwen2.5-7B
        ("llama3.2-1b", 1_235_814_400),  # meta-llama/Llama-3.2-1B (tied embeddings)
    ],
)
def test_preset_param_counts_without_allocation(name, expected):
    assert _abstract_param_count(name) == expected
    assert get_preset(name).num_params() == expected


def test_llama31_8b_count_by_hand():
    # embed 128256*4096 = 525,336,576, twice (untied head); per layer: q,o 4096*4096 = 16,777,216 each,
    # k,v 4096*1024 = 4,194,304 each, MLP 3*4096*14336 = 176,160,768, 2 norms 8,192 -> 218,112,000;
    # 32 layers 6,979,584,000; final norm 4,096. Total 8,030,261,248.
    assert 2 * 525_336_576 + 32 * 218_112_000 + 4096 == 8_030_261_248 == get_preset("llama3.1-8b").num_params()


def test_llama31_rope_scaling_frequencies_by_hand():
    # theta 1e4, head_dim 16: inv_freq_i = 1e4^(-2i/16). Original context 64, low 1, high 4, factor 8:
    # i=0: wavelength 2pi = 6.28 < 64/4 -> kept 1.0.
    # i=1: inv 0.3162278, wavelength 19.869 in [16, 64]: smooth = (64/19.869 - 1)/3 = 0.7403565,
    #      (1 - smooth) * 0.3162278/8 + smooth * 0.3162278 = 0.2443846.
    # i=2: inv 0.1, wavelength 62.83: smooth = 0.0061972 -> 0.9938028*0.0125 + 0.0061972*0.1 = 0.0130423.
    # i>=3: wavelength > 64 -> divided by 8: 0.0316228/8 = 0.0039528, 0.01/8 = 0.00125.
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    got = rope_inverse_frequencies(16, 10_000.0, scaling)
    np.testing.assert_allclose(got[:5], [1.0, 0.2443846, 0.0130423, 0.0039528, 0.00125], rtol=2e-5)
    np.testing.assert_allclose(rope_inverse_frequencies(16, 10_000.0)[:3], [1.0, 0.3162278, 0.1], rtol=1e-6)


@pytest.mark.parametrize(
    "preset,fp32_head,expected_head_dtype",
    [
        ("tiny-llama", True, jnp.float32),  # untied: lm_head fp32
        ("tiny-llama", False, jnp.bfloat16),
        ("tiny-qwen3", True, jnp.float32),  # tied: the shared table is fp32
        ("tiny-qwen3", False, jnp.bfloat16),
    ],
)
def test_bf16_body_dtypes_and_fp32_head(preset, fp32_head, expected_head_dtype):
    config = get_preset(preset, dtype="bfloat16", fp32_head=fp32_head)
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    head = model.embed_tokens if config.tie_word_embeddings else model.lm_head
    assert head.get_value().dtype == expected_head_dtype
    assert isinstance(model.layers, DecoderLayer)  # scan_layers: one stacked layer
    assert model.layers.mlp.gate_proj.get_value().dtype == jnp.bfloat16
    tokens = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    build = lambda: Transformer(config, rngs=nnx.Rngs(0))  # noqa: E731
    assert jax.eval_shape(lambda t: build().hidden(t), tokens).dtype == jnp.bfloat16
    assert jax.eval_shape(lambda t: build()(t), tokens).dtype == jnp.float32


def test_fp32_head_matmul_is_float32_at_highest_precision():
    """With fp32_head the head's dot takes float32 operands at HIGHEST precision; without, bf16."""
    for fp32_head, operand_dtype in ((True, jnp.float32), (False, jnp.bfloat16)):
        config = get_preset("tiny-llama", dtype="bfloat16", fp32_head=fp32_head)
        closed = jax.make_jaxpr(lambda h: Transformer(config, rngs=nnx.Rngs(0)).head(h))(
            jnp.zeros((2, config.hidden_size), jnp.bfloat16)
        )
        dots = [eqn for eqn in closed.jaxpr.eqns if eqn.primitive.name == "dot_general"]
        assert len(dots) == 1
        assert [v.aval.dtype for v in dots[0].invars] == [operand_dtype, operand_dtype]
        precision = dots[0].params["precision"]
        assert (precision is not None and jax.lax.Precision.HIGHEST in tuple(precision)) == fp32_head


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        get_preset("nope")
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        get_preset("tiny-llama", num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="remat_policy='sometimes'"):
        get_preset("tiny-llama", remat_policy="sometimes")
    with pytest.raises(ValueError, match="unknown ModelConfig fields \\['hiddensize'\\]"):
        get_preset("tiny-llama", hiddensize=3)
    with pytest.raises(ValueError, match="rope_scaling is missing keys"):
        get_preset("tiny-llama", rope_scaling={"factor": 8.0})
    with pytest.raises(ValueError, match="unknown remat_policy"):
        remat_policy("bogus")
    assert isinstance(hash(get_preset("tiny-llama")), int)  # usable as a jit static argument


def test_kv_cache_shape_and_bad_cache_is_named():
    config = get_preset("tiny-qwen2", dtype="bfloat16")
    cache = init_kv_cache(config, batch=3, max_len=10)
    assert cache["k"].shape == (2, 3, 10, 2, 16) and cache["v"].dtype == jnp.bfloat16
    model = Transformer(get_preset("tiny-qwen2"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="KV cache 'k' has shape"):
        model.forward_cached(jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32), cache)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_logprobs_never_hold_full_logits(with_entropy):
    """Compiled forward+backward of the chunked head log-probs needs far less scratch memory than
    one float32 [B, T, V] logits array (B=2, T=1024, V=8192: 64 MiB; a chunk of 64: 4 MiB),
    while the same code with a single chunk does hold it (so the measurement can tell)."""
    batch, length, dim, vocab = 2, 1024, 64, 8192
    full_logits_bytes = batch * length * vocab * 4
    hidden = jax.ShapeDtypeStruct((batch, length, dim), jnp.float32)
    weight = jax.ShapeDtypeStruct((dim, vocab), jnp.float32)
    targets = jax.ShapeDtypeStruct((batch, length), jnp.int32)

    def scratch_bytes(chunk_size):
        def objective(h, w, t):
            logp, entropy = chunked_head_logprobs(
                lambda x: x @ w, h, t, temperature=0.9, chunk_size=chunk_size, with_entropy=with_entropy
            )
            if with_entropy:
                assert entropy is not None
                return jnp.sum(logp) + jnp.sum(entropy)
            return jnp.sum(logp) + 0.0

        compiled = jax.jit(jax.grad(objective, argnums=(0, 1))).lower(hidden, weight, targets).compile()
        analysis = compiled.memory_analysis()
        if analysis is None:
            pytest.skip("backend reports no memory analysis")
        return analysis.temp_size_in_bytes

    chunked, unchunked = scratch_bytes(64), scratch_bytes(length)
    print(f"scratch bytes: chunked {chunked:,}, one chunk {unchunked:,}, full logits {full_logits_bytes:,}")
    assert unchunked >= full_logits_bytes
    assert chunked < full_logits_bytes / 2


def test_sequence_logprobs_rejects_bad_temperature():
    model = Transformer(get_preset("tiny-llama"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="temperature=0"):
        sequence_logprobs(model, jnp.zeros((1, 4), jnp.int32), temperature=0)


def test_model_config_is_frozen():
    config = get_preset("tiny-llama")
    assert isinstance(config, ModelConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 3  # pyright: ignore[reportAttributeAccessIssue]  (the frozen write under test)
    assert config.replace(dtype="bfloat16").rope_scaling_dict == config.rope_scaling_dict
