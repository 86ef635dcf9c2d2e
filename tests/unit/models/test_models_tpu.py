"""TPU as an attention target: the platform comes from the mesh, the splash kernel for training /
prefill, the XLA paged decode kernel, the FP32 head's bf16x3 mode.

Programs are compiled deviceless for a v5e 2x2 slice (libtpu on this CPU host: no TPU runs here).
Numerics of the splash kernel are checked in Pallas interpret mode on CPU against `grouped_attention`
and an fp64 numpy reference.
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import ArrayLike

from scalerl_jax.models import Transformer, get_preset, init_kv_cache, sequence_logprobs, sharding
from scalerl_jax.models.layers import (
    attend_in_chunks,
    grouped_attention,
    resolve_attention_impl,
    resolve_decode_kernel,
    splash_attention,
    splash_block,
)
from scalerl_jax.models.memory import activation_terms
from scalerl_jax.models.transformer import fp32_logits
from scalerl_jax.sampler.engine import Engine
from scalerl_jax.sampler.engine_config import EngineConfig

FLOAT32_ATOL = 1e-5


@functools.lru_cache(maxsize=1)
def _v5e_devices() -> tuple:
    """The 4 chips of a deviceless v5e 2x2 topology (compile-only devices).

    libtpu takes a host-wide lock file unless told that several processes may load it; compiling
    without devices needs no exclusive TPU, so concurrent test processes share it.
    """
    from jax.experimental import topologies

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    try:
        topology = topologies.get_topology_desc(
            topology_name="v5e:2x2",
            platform="tpu",
            chip_config_name="default",
            chips_per_host_bounds=(2, 2, 1),
            num_slices=1,
            wrap=(False, False, False),
        )
    except RuntimeError as error:  # no libtpu (or no TPU plugin) in this environment
        pytest.skip(f"no deviceless TPU topology: {error}")
    return tuple(topology.devices)


def _v5e_mesh() -> jax.sharding.Mesh:
    """(data 1, fsdp 2, tensor 2) over the v5e 2x2 chips."""
    return sharding.make_mesh((1, 2, 2), devices=list(_v5e_devices()))


def _tpu_config(**overrides):
    """tiny-llama in bfloat16 with head_dim 128 (4 query heads, 2 KV heads), attention 'auto'."""
    fields = dict(dtype="bfloat16", attention_impl="auto", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128)
    return get_preset("tiny-llama", **{**fields, **overrides})


def _abstract_params(config, mesh):
    """(graphdef, params as ShapeDtypeStructs sharded on `mesh` by the default rules)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    shardings = sharding.param_shardings(state, mesh)
    return graphdef, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def _causal_reference64(q: ArrayLike, k: ArrayLike, v: ArrayLike) -> np.ndarray:
    """softmax(q k^T / sqrt(D), s <= t) v in float64; q [B, T, H, D], k/v [B, T, K, D], head h reads h // (H/K)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    length = q.shape[1]
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", probs, v)


# ----------------------------------------------------------------------------- platform from the mesh


def test_trace_platform_is_the_active_mesh_platform():
    assert sharding.trace_platform() == jax.default_backend() == "cpu"
    with sharding.use_mesh_rules(_v5e_mesh()):
        assert sharding.trace_platform() == "tpu"
    with sharding.use_mesh_rules(sharding.make_mesh((1, 2, 2), devices=jax.devices()[:4])):
        assert sharding.trace_platform() == "cpu"
    assert sharding.trace_platform() == "cpu"


@pytest.mark.parametrize(
    "impl,dtype,head_dim,seq_len,expected",
    [
        ("auto", "bfloat16", 128, None, "splash"),
        ("auto", "bfloat16", 128, 2048, "splash"),
        ("auto", "float32", 256, 1000, "splash"),  # any length >= 128 (padded to the tile)
        ("auto", "bfloat16", 128, 64, "xla"),  # short call: the T x T scores are small
        ("auto", "bfloat16", 64, 2048, "xla"),  # head_dim not a multiple of the 128 lanes
        ("auto", "float16", 128, 2048, "xla"),  # no float16 on TPU
        ("xla", "bfloat16", 128, 2048, "xla"),
        ("splash", "bfloat16", 16, 8, "splash"),  # explicit choices are taken as given
    ],
)
def test_resolve_attention_impl_on_tpu(impl, dtype, head_dim, seq_len, expected):
    config = get_preset("tiny-llama", attention_impl=impl, dtype=dtype, head_dim=head_dim)
    assert resolve_attention_impl(config, "tpu", seq_len) == expected


def test_auto_never_resolves_to_splash_off_tpu():
    config = _tpu_config()
    assert resolve_attention_impl(config, "cpu", 2048) == "xla"
    assert resolve_attention_impl(config, "gpu", 2048) == "cudnn"


@pytest.mark.parametrize("length,block", [(1, 128), (128, 128), (200, 256), (384, 384), (1000, 512), (2048, 512)])
def test_splash_block_divides_the_padded_length(length, block):
    assert splash_block(length) == block
    padded = -(-length // 128) * 128
    assert padded % block == 0 and block % 128 == 0


def test_tracing_under_a_tpu_mesh_picks_the_splash_kernel():
    """The same 'auto' model lowers to the Pallas TPU kernel under a TPU mesh and to XLA's dots without one."""
    config = _tpu_config()
    mesh = _v5e_mesh()
    graphdef, params = _abstract_params(config, mesh)
    tokens = jax.ShapeDtypeStruct((2, 256), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    with sharding.use_mesh_rules(mesh):
        tpu_text = forward.lower(params, tokens).as_text()
    cpu_graphdef, cpu_state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    cpu_text = (
        jax.jit(lambda p, t: nnx.merge(cpu_graphdef, p)(t))
        .lower(cpu_state, jax.ShapeDtypeStruct((2, 256), jnp.int32))
        .as_text()
    )
    assert "tpu_custom_call" in tpu_text and "splash" in tpu_text
    assert "tpu_custom_call" not in cpu_text and "256x256xf32" in cpu_text


# ----------------------------------------------------------------------------- splash numerics (interpret mode)


def _random_qkv(batch: int, length: int, heads: int, kv_heads: int, dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, length, heads, dim)).astype(np.float32)
    k = rng.normal(size=(batch, length, kv_heads, dim)).astype(np.float32)
    v = rng.normal(size=(batch, length, kv_heads, dim)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _xla_causal(q, k, v):
    batch, length = q.shape[:2]
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
    return grouped_attention(q, k, v, causal)


def test_splash_matches_xla_and_float64_forward_and_gradient():
    """Float32, GQA (4 query heads on 2 KV heads), T = 200 padded to one 256 tile: output and the
    gradients of sum(out * w) against `grouped_attention` (and the forward against fp64 numpy)."""
    q, k, v = _random_qkv(2, 200, 4, 2, 16)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape).astype(np.float32))
    splash_out = splash_attention(q, k, v)
    np.testing.assert_allclose(np.asarray(splash_out), _causal_reference64(q, k, v), atol=FLOAT32_ATOL)
    np.testing.assert_allclose(np.asarray(splash_out), np.asarray(_xla_causal(q, k, v)), atol=FLOAT32_ATOL)

    def grads(attend):
        return jax.grad(lambda q_, k_, v_: jnp.sum(attend(q_, k_, v_) * weights), argnums=(0, 1, 2))(q, k, v)

    for got, want in zip(grads(splash_attention), grads(_xla_causal)):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=FLOAT32_ATOL)


def test_splash_model_on_a_cpu_mesh_matches_xla():
    """A float32 'splash' model under a (1, 2, 2) CPU mesh (the kernel in shard_map, interpreted):
    log-probs and parameter gradients equal the 'xla' model's to 1e-5."""
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, size=(2, 130)), jnp.int32)
    _splash_matches_xla_on_a_cpu_mesh(lambda impl: get_preset("tiny-llama", attention_impl=impl), tokens, rtol=0.0)


def _splash_matches_xla_on_a_cpu_mesh(config_of, tokens, *, rtol):
    """The summed log-probs and parameter gradients of `config_of('splash')` and `config_of('xla')`
    (the same random init) under a (1, 2, 2) CPU mesh agree (gradients to FLOAT32_ATOL + rtol)."""
    mesh = sharding.make_mesh((1, 2, 2), devices=jax.devices()[:4])

    def logprobs_and_grads(impl):
        graphdef, params = nnx.split(Transformer(config_of(impl), rngs=nnx.Rngs(0)))
        loss = lambda p: jnp.sum(sequence_logprobs(nnx.merge(graphdef, p), tokens, chunk_size=64))  # noqa: E731
        with sharding.use_mesh_rules(mesh):
            return jax.jit(jax.value_and_grad(loss))(params)

    splash_loss, splash_grads = logprobs_and_grads("splash")
    xla_loss, xla_grads = logprobs_and_grads("xla")
    np.testing.assert_allclose(float(splash_loss), float(xla_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(splash_grads), jax.tree.leaves(xla_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=FLOAT32_ATOL, rtol=rtol)


def _chunked_reference64(q: ArrayLike, k: ArrayLike, v: ArrayLike, chunk: int) -> np.ndarray:
    """Llama 4's chunked causal attention in float64: each chunk of `chunk` positions attends
    causally within itself (`_causal_reference64` on every slice)."""
    q, k, v = (np.asarray(x) for x in (q, k, v))
    length = q.shape[1]
    pieces = [slice(start, min(start + chunk, length)) for start in range(0, length, chunk)]
    return np.concatenate([_causal_reference64(q[:, p], k[:, p], v[:, p]) for p in pieces], axis=1)


def test_chunked_attention_by_splash_on_chunks_folded_into_the_batch():
    """T = 300 in chunks of 128 (two whole chunks and 44 positions): splash on the folded chunks
    (interpret mode) equals the float64 chunked reference, forward and the gradient of the XLA mask."""
    q, k, v = _random_qkv(2, 300, 4, 2, 16, seed=3)
    got = attend_in_chunks(splash_attention, q, k, v, 128)
    np.testing.assert_allclose(np.asarray(got), _chunked_reference64(q, k, v, 128), atol=FLOAT32_ATOL)
    starts = (jnp.arange(300) // 128) * 128
    mask = (jnp.arange(300)[None, :] <= jnp.arange(300)[:, None]) & (jnp.arange(300)[None, :] >= starts[:, None])
    weights = jnp.asarray(np.random.default_rng(4).normal(size=q.shape).astype(np.float32))

    def grads(attend):
        return jax.grad(lambda *qkv: jnp.sum(attend(*qkv) * weights), argnums=(0, 1, 2))(q, k, v)

    folded = grads(lambda q_, k_, v_: attend_in_chunks(splash_attention, q_, k_, v_, 128))
    masked = grads(lambda q_, k_, v_: grouped_attention(q_, k_, v_, jnp.broadcast_to(mask, (2, 300, 300))))
    for a, b in zip(folded, masked):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=FLOAT32_ATOL)


def _chunked_config(**overrides):
    """`_tpu_config` as a Llama 4 text decoder: layers 0 and 2 chunked (chunks of 512), 1 and 3 NoPE."""
    fields = dict(
        family="llama4",
        num_layers=4,
        nope_layers=(1, 3),
        chunked_attention_layers=(0, 2),
        attention_chunk_size=512,
        qk_l2_norm=True,
        attn_temperature_tuning=True,
    )
    return _tpu_config(**{**fields, **overrides})


def test_a_chunked_model_trains_by_splash_on_v5e_without_a_t_by_t_buffer():
    """jit(grad(loss)) of a chunked-attention model at T = 2048 (4 chunks of 512) on a v5e 2x2 mesh,
    scanned in periods of 2: every layer takes the Pallas kernel and no [.., 2048, 2048] or
    [.., 512, 512] float32 array is built; the 'xla' lowering does build the chunk mask's 2048 x 2048."""
    config = _chunked_config(remat_policy="full")
    assert config.scan_layers and config.layer_period == 2
    mesh = _v5e_mesh()
    graphdef, params = _abstract_params(config, mesh)
    tokens = jax.ShapeDtypeStruct((4, 2048), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
    loss = lambda p, t: jnp.sum(sequence_logprobs(nnx.merge(graphdef, p), t, chunk_size=512))  # noqa: E731
    with sharding.use_mesh_rules(mesh):
        text = jax.jit(jax.grad(loss)).lower(params, tokens).as_text()
    assert "tpu_custom_call" in text
    assert not re.search(r"(2048|512)x(2048|512)xf32", text)
    xla_graphdef, _ = _abstract_params(config.replace(attention_impl="xla"), mesh)
    xla_loss = lambda p, t: jnp.sum(sequence_logprobs(nnx.merge(xla_graphdef, p), t, chunk_size=512))  # noqa: E731
    with sharding.use_mesh_rules(mesh):
        xla_text = jax.jit(jax.grad(xla_loss)).lower(params, tokens).as_text()
    assert "2048x2048xf32" in xla_text and "tpu_custom_call" not in xla_text


def test_a_chunked_splash_model_on_a_cpu_mesh_matches_xla():
    """Float32, chunks of 128, T = 300 under a (1, 2, 2) CPU mesh (splash interpreted in shard_map
    on the folded chunks): log-probs and gradients equal the 'xla' model's (its chunk mask)."""
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, size=(2, 300)), jnp.int32)

    def config_of(impl):
        return _chunked_config(dtype="float32", attention_impl=impl, attention_chunk_size=128)

    _splash_matches_xla_on_a_cpu_mesh(config_of, tokens, rtol=1e-5)  # gradients up to ~25


# ----------------------------------------------------------------------------- compiled for v5e


def test_train_gradient_compiles_for_v5e_with_splash_and_no_t_by_t_buffer():
    """jit(grad(loss)) of a bf16 Llama at T = 2048 on a v5e 2x2 mesh: the Pallas TPU kernel is in the
    compiled HLO (forward and backward), no [.., 2048, 2048] float32 array is, and the temporaries
    are far below one T x T float32 score buffer of the device's 2 sequences x 2 heads."""
    config = _tpu_config(remat_policy="full")
    mesh = _v5e_mesh()
    graphdef, params = _abstract_params(config, mesh)
    batch, length = 4, 2048
    tokens = jax.ShapeDtypeStruct(
        (batch, length), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    )
    loss = lambda p, t: jnp.sum(sequence_logprobs(nnx.merge(graphdef, p), t, chunk_size=512))  # noqa: E731
    with sharding.use_mesh_rules(mesh):
        lowered = jax.jit(jax.grad(loss)).lower(params, tokens)
    compiled = lowered.compile()
    text, memory = compiled.as_text(), compiled.memory_analysis()
    assert text is not None and memory is not None
    assert text.count("tpu_custom_call") >= 3  # forward, and the dq / dkv kernels of the backward
    assert not re.search(r"f32\[[0-9,]*2048,2048\]", text)
    # Per device: 4 / (data * fsdp) = 2 sequences, 4 / tensor = 2 heads, 2048^2 float32 scores each.
    scores_bytes = 2 * 2 * length * length * 4
    assert scores_bytes == 67_108_864
    assert memory.temp_size_in_bytes < scores_bytes / 4

    # The 'xla' lowering of the same model does build the T x T scores (the check above can fail).
    with sharding.use_mesh_rules(mesh):
        xla_graphdef, _ = _abstract_params(config.replace(attention_impl="xla"), mesh)
        xla_loss = lambda p, t: jnp.sum(sequence_logprobs(nnx.merge(xla_graphdef, p), t, chunk_size=512))  # noqa: E731
        xla_text = jax.jit(jax.grad(xla_loss)).lower(params, tokens).as_text()
    assert "2048x2048xf32" in xla_text and "tpu_custom_call" not in xla_text


def test_prefill_on_tpu_uses_splash_and_decode_does_not():
    """forward_cached over 256 prompt tokens takes the splash kernel under a TPU mesh; a one-token
    decode step keeps the blockwise XLA attention over the cache."""
    config = _tpu_config()
    mesh = _v5e_mesh()
    graphdef, params = _abstract_params(config, mesh)
    batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    cache = jax.eval_shape(lambda: init_kv_cache(config, 2, 256))

    def lowered_text(length):
        positions = jax.ShapeDtypeStruct((2, length), jnp.int32, sharding=batch_sharding)
        tokens = jax.ShapeDtypeStruct((2, length), jnp.int32, sharding=batch_sharding)
        step = jax.jit(lambda p, t, pos, c: nnx.merge(graphdef, p).forward_cached(t, pos, c))
        with sharding.use_mesh_rules(mesh):
            return step.lower(params, tokens, positions, cache).as_text()

    assert "tpu_custom_call" in lowered_text(256)
    assert "tpu_custom_call" not in lowered_text(1)


# ----------------------------------------------------------------------------- decode kernel


def test_decode_kernel_on_tpu_is_the_xla_paged_kernel():
    assert resolve_decode_kernel("auto", "tpu") == "xla"
    assert resolve_decode_kernel("xla", "tpu") == "xla"
    with pytest.raises(ValueError, match="Triton.*cannot run on TPU"):
        resolve_decode_kernel("pallas", "tpu")
    assert resolve_decode_kernel("pallas", "gpu") == "pallas"  # the GPU kernel is unchanged


# ----------------------------------------------------------------------------- FP32 head on TPU


def test_bf16x3_head_compiles_to_the_three_pass_mode_on_tpu_and_stays_exact_on_cpu():
    """sum(fp32_logits(h, W) * g) and its d/d(h, W): lowered for TPU every dot is at HIGH and the v5e
    compiler keeps all three (forward, d/dh, d/dW) as 3-pass bf16 (`operand_precision={high,high}`)
    convolutions, not one bf16 pass (no attribute); the CPU lowering keeps HIGHEST, no algorithm."""
    mesh = _v5e_mesh()
    replicated = NamedSharding(mesh, PartitionSpec())
    hidden = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=replicated)
    weight = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=replicated)
    cotangent = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=replicated)
    loss = lambda h, w, g: jnp.sum(fp32_logits(h, w, "bf16x3") * g)  # noqa: E731
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    lowered = grad.lower(hidden, weight, cotangent)
    tpu_dots = [line for line in lowered.as_text().splitlines() if "stablehlo.dot_general" in line]
    assert len(tpu_dots) == 3 and all("precision = [HIGH, HIGH]" in line for line in tpu_dots)
    compiled_text = lowered.compile().as_text()
    assert compiled_text is not None
    compiled_dots = [line for line in compiled_text.splitlines() if "convolution(" in line]
    assert len(compiled_dots) == 3 and all("operand_precision={high,high}" in line for line in compiled_dots)

    zeros = (jnp.zeros((64, 256)), jnp.zeros((256, 512)), jnp.zeros((64, 512)))
    cpu_text = grad.trace(*zeros).lower(lowering_platforms=("cpu",)).as_text()
    cpu_dots = [line for line in cpu_text.splitlines() if "stablehlo.dot_general" in line]
    assert len(cpu_dots) == 3 and all("HIGHEST" in line and "algorithm" not in line for line in cpu_dots)


# ----------------------------------------------------------------------------- memory planner


def test_memory_plan_counts_flash_attention_for_splash_on_tpu():
    """On 'tpu' the 'auto' 8B keeps splash's O(T) statistics, the same bytes as cuDNN on GPU; a
    'xla' model (or a head_dim the kernel tiles badly) keeps the T x T scores."""
    config = get_preset("llama3.1-8b")
    mesh = {"data": 1, "fsdp": 8, "tensor": 1}

    def working_set(cfg, platform, seq_len=16_384):
        return activation_terms(
            cfg,
            mesh,
            microbatch=8,
            seq_len=seq_len,
            remat_policy="full",
            logprob_chunk=1024,
            platform=platform,
        )["one_layer_working_set"]

    auto = config.replace(attention_impl="auto")
    assert resolve_attention_impl(auto, "tpu", 16_384) == "splash"
    assert (
        working_set(auto, "tpu")
        == working_set(auto, "gpu")
        == working_set(config.replace(attention_impl="cudnn"), "gpu")
    )
    # xla keeps 32 T (4 + 2) bytes per token, flash 32 (4 + 128 * 2): 51,403,292,672 bytes more at T = 16384.
    difference = working_set(config.replace(attention_impl="xla"), "tpu") - working_set(auto, "tpu")
    assert abs(difference - 16_384 * 32 * (16_384 * 6 - 260)) <= 1
    assert working_set(auto.replace(head_dim=64), "tpu") == working_set(
        auto.replace(head_dim=64, attention_impl="xla"), "tpu"
    )


def test_engine_decode_chunk_compiles_for_v5e_with_the_xla_paged_kernel():
    """An Engine on the v5e mesh resolves 'auto' decode to 'xla' and its jitted decode chunk
    (`_generate_jit`, state sharded as `init_decode_state` makes it) compiles for TPU without the
    splash kernel; asking that mesh for 'pallas' decode is a ValueError."""
    config = _tpu_config()
    mesh = _v5e_mesh()
    graphdef, params = _abstract_params(config, mesh)
    engine = Engine(graphdef, config, EngineConfig(num_slots=8, max_len=512, chunk_size=4), mesh=mesh)
    assert engine.decode_kernel == "xla"
    init = jax.jit(engine.init_decode_state).lower().compile()
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(engine.init_decode_state),
        init.output_shardings,
    )
    window = engine.decode_window()
    with sharding.use_mesh_rules(mesh):
        lowered = engine._generate_jit.lower(params, state, window, engine.pages.table.copy(), engine._held_lengths())
    text = lowered.compile().as_text()
    assert text is not None and "tpu_custom_call" not in text
    with pytest.raises(ValueError, match="cannot run on TPU"):
        Engine(graphdef, config, EngineConfig(num_slots=8, max_len=512, decode_kernel="pallas"), mesh=mesh)
