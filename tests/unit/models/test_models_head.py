"""FP32 head algorithm ('bf16x3') and 'auto' attention: fp64 numpy references, lowerings per backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scalerl_jax.cli.plan_memory import main as memory_main
from scalerl_jax.config import recipes
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.validation import validate
from scalerl_jax.models import Transformer, get_preset, init_kv_cache, sequence_logprobs
from scalerl_jax.models.layers import resolve_attention_impl
from scalerl_jax.models.logprobs import token_logprobs_from_logits
from scalerl_jax.models.memory import activation_terms
from scalerl_jax.models.transformer import fp32_logits

# Exact float32 over D <= 512 with logits of size ~10: errors ~1e-6. A bf16 head misses by ~1e-2.
FP32_ATOL = 2e-5


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _picked64(hidden: np.ndarray, weight: np.ndarray, targets: np.ndarray, temperature: float) -> np.ndarray:
    """log softmax(h W / temperature)[target] in float64 numpy."""
    logp = _log_softmax64(hidden.astype(np.float64) @ weight.astype(np.float64) / temperature)
    return np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _random_head(d: int = 256, v: int = 1000, seed: int = 0):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(3, 7, d)).astype(np.float32)
    weight = (rng.normal(size=(d, v)) * 0.5 / np.sqrt(d) * 4).astype(np.float32)  # logits ~ N(0, 4)
    targets = rng.integers(0, v, size=(3, 7))
    return hidden, weight, targets


@pytest.mark.parametrize("head_precision", ["bf16x3", "highest"])
def test_head_logprobs_match_fp64_numpy_on_cpu(head_precision):
    hidden, weight, targets = _random_head()
    logits = jax.jit(lambda h, w: fp32_logits(h, w, head_precision))(hidden, weight)
    logp, _ = token_logprobs_from_logits(logits, jnp.asarray(targets), 1.0, with_entropy=False)
    expected = _picked64(hidden, weight, targets, 1.0)
    assert np.abs(expected).max() > 1.0  # nontrivial log-probs
    np.testing.assert_allclose(np.asarray(logp), expected, rtol=0, atol=FP32_ATOL)


def test_bf16_operands_miss_the_fp32_tolerance():
    """The tolerance above can fail: the same head with bf16-rounded operands is off by far more."""
    hidden, weight, targets = _random_head()
    rounded = lambda a: jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    logits = fp32_logits(rounded(hidden), rounded(weight), "highest")
    logp, _ = token_logprobs_from_logits(logits, jnp.asarray(targets), 1.0, with_entropy=False)
    assert np.abs(np.asarray(logp) - _picked64(hidden, weight, targets, 1.0)).max() > 10 * FP32_ATOL


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])  # untied and tied head
def test_sequence_logprobs_with_bf16x3_head_match_fp64_numpy(preset):
    config = get_preset(preset, head_precision="bf16x3")
    model = Transformer(config, rngs=nnx.Rngs(3))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, size=(2, 13)), jnp.int32)
    temperature = 0.7
    got = np.asarray(jax.jit(lambda t: sequence_logprobs(model, t, temperature=temperature, chunk_size=4))(tokens))
    hidden = np.asarray(model.hidden(tokens), np.float64)
    weight = np.asarray(model.embed_tokens[...]).T if config.tie_word_embeddings else np.asarray(model.lm_head[...])
    expected = _picked64(hidden[:, :-1], weight, np.asarray(tokens)[:, 1:], temperature)
    np.testing.assert_allclose(got[:, 0], 0.0)
    np.testing.assert_allclose(got[:, 1:], expected, rtol=0, atol=FP32_ATOL)


def _head_grad_text(head_precision: str, platform: str) -> str:
    """StableHLO of d/d(h, W) sum(head(h, W) * g), lowered for `platform` (lowering needs no device)."""
    hidden, weight, _ = _random_head(d=64, v=96)
    cotangent = np.ones((3, 7, 96), np.float32)
    loss = lambda h, w: jnp.sum(fp32_logits(h, w, head_precision) * cotangent)  # noqa: E731
    traced = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(hidden, weight)
    return traced.lower(lowering_platforms=(platform,)).as_text()


def _dot_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "stablehlo.dot_general" in line]


def test_cuda_lowering_carries_bf16x3_algorithm_in_forward_and_backward():
    """Forward and both gradient dots lower to BF16_BF16_F32_X3 for CUDA; CPU keeps HIGHEST (exact).

    Only the lowering is checked: compiling for CUDA needs a GPU (none here), so the speed and the
    GPU numerics of the algorithm are unmeasured by this test.
    """
    cuda = _dot_lines(_head_grad_text("bf16x3", "cuda"))
    assert len(cuda) == 3
    for line in cuda:
        assert "lhs_precision_type = bf16" in line and "rhs_precision_type = bf16" in line
        assert "accumulation_type = f32" in line and "num_primitive_operations = 3" in line
        assert "tensor<" in line and "xf32>" in line.split("->")[-1]
    cpu = _dot_lines(_head_grad_text("bf16x3", "cpu"))
    assert len(cpu) == 3 and all("algorithm" not in line and "HIGHEST" in line for line in cpu)
    # The exact setting never carries the algorithm, on any platform (so the check above can fail).
    assert all("algorithm" not in line for line in _dot_lines(_head_grad_text("highest", "cuda")))


def test_model_head_lowers_per_platform():
    config = get_preset("tiny-llama", dtype="bfloat16", head_precision="bf16x3")
    model = Transformer(config, rngs=nnx.Rngs(0))
    hidden = jnp.zeros((2, 5, config.hidden_size), jnp.bfloat16)
    traced = nnx.jit(lambda m, h: m.head(h)).trace(model, hidden)
    cuda = _dot_lines(traced.lower(lowering_platforms=("cuda",)).as_text())
    cpu = _dot_lines(traced.lower(lowering_platforms=("cpu",)).as_text())
    assert len(cuda) == 1 and "num_primitive_operations = 3" in cuda[0] and "tensor<64x256xf32>" in cuda[0]
    assert len(cpu) == 1 and "HIGHEST" in cpu[0] and "algorithm" not in cpu[0]


@pytest.mark.parametrize(
    "impl,dtype,head_dim,platform,expected",
    [
        ("auto", "bfloat16", 16, "gpu", "cudnn"),
        ("auto", "bfloat16", 16, "cuda", "cudnn"),
        ("auto", "float16", 128, "gpu", "cudnn"),
        ("auto", "bfloat16", 16, "cpu", "xla"),
        ("auto", "bfloat16", 16, "tpu", "xla"),
        ("auto", "float32", 16, "gpu", "xla"),  # cuDNN flash attention has no float32 kernel
        ("auto", "bfloat16", 160, "gpu", "xla"),  # head_dim above cuDNN's pre-Hopper limit
        ("auto", "bfloat16", 20, "gpu", "xla"),  # head_dim not a multiple of 8
        ("xla", "bfloat16", 16, "gpu", "xla"),
        ("cudnn", "bfloat16", 16, "cpu", "cudnn"),  # explicit choices are taken as given
    ],
)
def test_resolve_attention_impl_per_backend(impl, dtype, head_dim, platform, expected):
    config = get_preset("tiny-llama", attention_impl=impl, dtype=dtype, head_dim=head_dim)
    assert resolve_attention_impl(config, platform) == expected


def test_auto_attention_on_cpu_equals_xla_forward_and_gradient():
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, size=(2, 11)), jnp.int32)

    def loss_and_grads(attention_impl):
        config = get_preset(
            "tiny-llama", dtype="bfloat16", attention_impl=attention_impl, scan_layers=True, remat_policy="full"
        )
        graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
        loss = lambda p: jnp.sum(sequence_logprobs(nnx.merge(graphdef, p), tokens, chunk_size=4))  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    auto_loss, auto_grads = loss_and_grads("auto")
    xla_loss, xla_grads = loss_and_grads("xla")
    assert np.isfinite(float(auto_loss)) and float(auto_loss) == float(xla_loss)
    for a, b in zip(jax.tree.leaves(auto_grads), jax.tree.leaves(xla_grads)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_auto_attention_traces_cudnn_when_the_backend_is_gpu(monkeypatch):
    """With the backend reported as 'gpu', a bf16 'auto' model traces cuDNN's attention (which on this
    CPU-only machine stops at cuDNN's own check), while a float32 one stays on xla."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)

    def trace(dtype):
        config = get_preset("tiny-llama", dtype=dtype, attention_impl="auto")
        return jax.eval_shape(lambda t: Transformer(config, rngs=nnx.Rngs(0))(t), tokens)

    with pytest.raises(RuntimeError, match="cuDNN"):
        trace("bfloat16")
    assert trace("float32").shape == (2, 8, 256)


def test_prefill_on_gpu_traces_cudnn_attention_and_decode_does_not(monkeypatch):
    """The engine's prefill (forward_cached over several tokens of a fresh sequence) takes cuDNN flash
    attention where 'auto' resolves to it, as training does, instead of T x T scores; a one-token
    decode step keeps its blockwise attention over the cache."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    config = get_preset("tiny-llama", dtype="bfloat16", attention_impl="auto")

    def trace(length):
        model = Transformer(config, rngs=nnx.Rngs(0))
        cache = init_kv_cache(config, 2, 16)
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (2, length))
        return jax.eval_shape(
            lambda t: model.forward_cached(t, positions, cache)[0], jax.ShapeDtypeStruct((2, length), jnp.int32)
        )

    with pytest.raises(RuntimeError, match="cuDNN"):
        trace(8)
    assert trace(1).shape == (2, 1, config.hidden_size)


def test_memory_plan_counts_scores_only_for_xla():
    config = get_preset("llama3.1-8b")
    mesh = {"data": 1, "fsdp": 8, "tensor": 1}
    terms = {
        (impl, platform): activation_terms(
            config.replace(attention_impl=impl),
            mesh,
            microbatch=8,
            seq_len=16_384,
            remat_policy="full",
            logprob_chunk=1024,
            platform=platform,
        )["one_layer_working_set"]
        for impl, platform in (("auto", "gpu"), ("cudnn", "gpu"), ("auto", "cpu"), ("xla", "gpu"))
    }
    assert terms[("auto", "gpu")] == terms[("cudnn", "gpu")]
    assert terms[("auto", "cpu")] == terms[("xla", "gpu")]
    # Per token of b=1 sequence of T=16384 and 32 heads, xla keeps fp32 + bf16 scores, 32 T (4 + 2)
    # bytes, flash an fp32 statistic and a bf16 output row, 32 (4 + 128 * 2): the difference times T
    # is 51,403,292,672 bytes (47.9 GiB) for one layer.
    assert 16_384 * 32 * (16_384 * 6 - 260) == 51_403_292_672
    assert abs(terms[("xla", "gpu")] - terms[("cudnn", "gpu")] - 51_403_292_672) <= 1


def test_memory_cli_resolves_auto_for_the_platform(capsys):
    memory_main(["--seq_len", "16384", "--microbatch", "8", "--remat", "full"])
    assert "attention auto -> cudnn on gpu" in capsys.readouterr().out
    memory_main(["--seq_len", "16384", "--microbatch", "8", "--remat", "full", "--platform", "cpu"])
    assert "attention auto -> xla on cpu" in capsys.readouterr().out


def test_8b_recipe_defaults_and_validation_name_the_key():
    config = recipes.scalerl_8b()
    assert config.model.head_precision == "bf16x3" and config.model.attention_impl == "auto"
    config.model.head_precision = "tf32"
    config.model.attention_impl = "flash"
    with pytest.raises(ConfigError) as error:
        validate(config, check_files=False)
    message = str(error.value)
    assert "`model.head_precision` = 'tf32'" in message and "`model.attention_impl` = 'flash'" in message
