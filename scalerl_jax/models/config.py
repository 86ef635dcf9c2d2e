"""Decoder configuration (`ModelConfig`) and named presets for the Llama 3 / Qwen2.5 / Qwen3 /
Qwen3-MoE / Llama 4 families."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "llama4")
DTYPES = ("float32", "bfloat16", "float16")
# The dtypes a run trains in (`model.dtype`): float16 would need loss scaling, which the train step lacks.
RUN_DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots", "dots_with_no_batch_dims", "save_qkv_attn")
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")
HEAD_PRECISIONS = ("highest", "bf16x3", "high", "default")
# How a token's experts are chosen (`moe.route`) and how their outputs are computed (`moe.MoE`).
ROUTINGS = ("softmax_topk", "sigmoid_topk")
MOE_IMPLS = ("auto", "dense", "ragged")
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    `dtype` is the parameter and body dtype. With `fp32_head` the unembedding weight is kept in
    float32 (for tied embeddings the shared table is float32 and cast to `dtype` for the lookup)
    and the head matmul runs in float32 at `head_precision`: 'highest' (default) is true float32 on
    every backend (on GPU without tensor cores); 'bf16x3' lowers to the tensor-core algorithm
    `DotAlgorithmPreset.BF16_BF16_F32_X3` on CUDA and to `Precision.HIGH` (the MXU's 3-pass bf16)
    on TPU (each fp32 operand split as hi + lo in bf16, hi*hi + hi*lo + lo*hi accumulated in fp32:
    relative error ~1e-5 instead of bf16's ~4e-3) and to true float32 on every other backend, so
    CPU stays exact; 'high' / 'default' are XLA's
    backend-defined precisions (speed knobs). `attention_impl` is the training / prefill attention
    (the non-cached forward): 'xla' materializes the T x T scores, 'cudnn' is cuDNN flash attention
    (GPU, bf16/fp16 only), 'splash' is the Pallas TPU splash (flash) kernel (TPU; head_dim a
    multiple of 128; interpreted, slowly, elsewhere), 'auto' resolves at trace time for the
    platform of the active mesh's devices (see `layers.resolve_attention_impl`). `rope_scaling` is None or the
    Llama 3.1 scaling dict with the keys in `ROPE_SCALING_KEYS`. `qkv_bias` adds biases to the
    q/k/v projections (Qwen2.5), `o_bias` to the output projection (Llama `attention_bias`),
    `qk_norm` applies a per-head RMSNorm to q and k before RoPE (Qwen3).

    Per-layer attention (Llama 4's interleaved RoPE): layers in `nope_layers` use no position
    encoding at all; with `attn_temperature_tuning` their queries at position p are multiplied by
    1 + attn_scale * log(1 + floor((p + 1) / attn_floor_scale)). Layers in
    `chunked_attention_layers` attend locally: query p sees keys s <= p with
    floor(s / attention_chunk_size) = floor(p / attention_chunk_size). `qk_l2_norm` normalizes q and
    k of every RoPE layer after RoPE, per head and without a scale: x / sqrt(mean(x^2) + eps).

    Mixture of experts (`num_experts` > 0): every layer not in `dense_layers` replaces its SwiGLU
    MLP with `num_experts` SwiGLU experts of width `moe_intermediate_size`, of which each token
    uses `num_experts_per_tok` (top-k), picked by a float32 router (`routing`: 'softmax_topk' is
    softmax over the experts then top-k, renormalized over the k when `norm_topk_prob`, as
    Qwen3-MoE; 'sigmoid_topk' is top-k over the logits with weight sigmoid(logit), which scales
    the expert's input rather than its output, as Llama 4). With `shared_expert_intermediate_size`
    > 0 every MoE layer also runs one SwiGLU MLP of that width on every token and adds it (Llama
    4's shared expert). `moe_impl` computes the experts: 'dense' runs every expert on every token and
    weights them (E x the MLP's FLOPs, no data-dependent shapes: fast where E is small, as on CPU),
    'ragged' sorts the token-expert pairs by expert and runs one grouped matmul per projection
    (`jax.lax.ragged_dot`: k x the MLP's FLOPs on GPU / TPU), 'auto' is 'dense' on CPU and
    'ragged' elsewhere. Both are dropless: no token is ever dropped for capacity. Layers stack for
    `scan_layers` when their kinds (`layer_kind`) repeat with a period p shorter than the model
    (`layer_period`): p stacks of num_layers / p layers, each scan step applying one layer of each.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: Mapping[str, float] | tuple[tuple[str, float], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 8192
    dtype: str = "float32"
    fp32_head: bool = True
    head_precision: str = "highest"
    scan_layers: bool = True
    remat_policy: str = "none"
    attention_impl: str = "xla"
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    routing: str = "softmax_topk"
    norm_topk_prob: bool = True
    moe_impl: str = "auto"
    shared_expert_intermediate_size: int = 0
    nope_layers: tuple[int, ...] = ()
    chunked_attention_layers: tuple[int, ...] = ()
    attention_chunk_size: int = 0
    qk_l2_norm: bool = False
    attn_temperature_tuning: bool = False
    attn_floor_scale: float = 8192.0
    attn_scale: float = 0.1

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family={self.family!r}; expected one of {FAMILIES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype={self.dtype!r}; expected one of {DTYPES}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat_policy={self.remat_policy!r}; expected one of {REMAT_POLICIES}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.attention_impl={self.attention_impl!r}; expected one of {ATTENTION_IMPLS}")
        if self.head_precision not in HEAD_PRECISIONS:
            raise ValueError(f"ModelConfig.head_precision={self.head_precision!r}; expected one of {HEAD_PRECISIONS}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            missing = [k for k in ROPE_SCALING_KEYS if k not in scaling]
            if missing:
                raise ValueError(f"ModelConfig.rope_scaling is missing keys {missing}")
            # Frozen dataclass: store an immutable, hashable copy so the config can be a jit static.
            object.__setattr__(self, "rope_scaling", tuple(sorted((k, float(scaling[k])) for k in ROPE_SCALING_KEYS)))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for name in ("dense_layers", "nope_layers", "chunked_attention_layers"):
            layers = tuple(sorted({int(i) for i in getattr(self, name)}))
            outside = [i for i in layers if not 0 <= i < self.num_layers]
            if outside:
                raise ValueError(f"ModelConfig.{name} {outside} are not layers of a {self.num_layers}-layer model")
            object.__setattr__(self, name, layers)
        if self.chunked_attention_layers and self.attention_chunk_size <= 0:
            raise ValueError(
                f"ModelConfig.chunked_attention_layers={list(self.chunked_attention_layers)} need "
                f"attention_chunk_size > 0, got {self.attention_chunk_size}"
            )
        if self.attn_temperature_tuning and self.attn_floor_scale <= 0:
            raise ValueError(f"ModelConfig.attn_floor_scale={self.attn_floor_scale} must be positive")
        self._check_moe()
        if self.scan_layers and not self.stackable:
            raise ValueError(
                "ModelConfig: the layers' kinds (dense / MoE, RoPE / NoPE, chunked / full attention) do "
                "not repeat with a period shorter than the model, so they cannot be stacked for "
                "scan_layers; set scan_layers=False (a run: model.scan_layers=False)"
            )

    def _check_moe(self) -> None:
        """ValueError naming the field when the mixture-of-experts fields do not fit together."""
        if self.num_experts < 0:
            raise ValueError(f"ModelConfig.num_experts={self.num_experts} must be >= 0 (0: a dense model)")
        if not self.num_experts:
            if (
                self.dense_layers
                or self.num_experts_per_tok
                or self.moe_intermediate_size
                or self.shared_expert_intermediate_size
            ):
                raise ValueError(
                    "ModelConfig: dense_layers / num_experts_per_tok / moe_intermediate_size / "
                    "shared_expert_intermediate_size are for mixture-of-experts models; num_experts=0"
                )
            return
        if self.routing not in ROUTINGS:
            raise ValueError(f"ModelConfig.routing={self.routing!r}; expected one of {ROUTINGS}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"ModelConfig.moe_impl={self.moe_impl!r}; expected one of {MOE_IMPLS}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
            )
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"ModelConfig.moe_intermediate_size={self.moe_intermediate_size} must be positive")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"ModelConfig.shared_expert_intermediate_size={self.shared_expert_intermediate_size} must be >= 0"
            )
        if self.routing == "sigmoid_topk" and self.norm_topk_prob:
            raise ValueError(
                "ModelConfig: routing='sigmoid_topk' weights are not renormalized; set norm_topk_prob=False"
            )

    @property
    def layer_period(self) -> int:
        """The smallest p dividing num_layers with layer_kind(i) == layer_kind(i mod p) for every layer:
        1 when all layers are alike, 4 for Llama 4 Scout (three chunked RoPE layers, then one NoPE)."""
        kinds = [self.layer_kind(i) for i in range(self.num_layers)]
        return next(
            p
            for p in range(1, self.num_layers + 1)
            if self.num_layers % p == 0 and all(kinds[i] == kinds[i % p] for i in range(self.num_layers))
        )

    @property
    def stackable(self) -> bool:
        """Whether `scan_layers` can stack the layers: the kinds repeat (`layer_period` < num_layers)
        or the model has one layer."""
        return self.layer_period < self.num_layers or self.num_layers == 1

    def layer_kind(self, layer: int) -> tuple[bool, bool, bool]:
        """(has experts, uses RoPE, chunked attention) of layer `layer`: layers stack only when equal."""
        return self.is_moe_layer(layer), self.uses_rope(layer), self.is_chunked_layer(layer)

    def uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` applies RoPE (it is not one of `nope_layers`)."""
        return layer not in self.nope_layers

    def is_chunked_layer(self, layer: int) -> bool:
        """Whether layer `layer` attends only within its `attention_chunk_size` chunk."""
        return layer in self.chunked_attention_layers

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` has experts in place of the dense MLP."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def rope_scaling_dict(self) -> dict[str, float] | None:
        """`rope_scaling` as a plain dict (it is stored as a sorted tuple of pairs to stay hashable)."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def replace(self, **overrides: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **overrides)

    def num_params(self) -> int:
        """Exact parameter count from the shapes (embedding counted once when tied)."""
        d, f, h, k, hd = (self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim)
        attn = d * h * hd * 2 + d * k * hd * 2
        attn += (h * hd + 2 * k * hd) if self.qkv_bias else 0
        attn += d if self.o_bias else 0
        attn += 2 * hd if self.qk_norm else 0
        moe = d * self.num_experts + self.num_experts * 3 * d * self.moe_intermediate_size  # router + experts
        moe += 3 * d * self.shared_expert_intermediate_size
        layers = sum(attn + 2 * d + (moe if self.is_moe_layer(i) else 3 * d * f) for i in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + layers + d + head


_LLAMA31_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA32_SCALING = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B: 8,030,261,248 parameters.
    "llama3.1-8b": dict(
        family="llama",
        vocab_size=128_256,
        hidden_size=4096,
        intermediate_size=14_336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500_000.0,
        rope_scaling=_LLAMA31_SCALING,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=131_072,
        dtype="bfloat16",
        bos_token_id=128_000,
        eos_token_id=128_001,
    ),
    # meta-llama/Llama-3.2-1B (tied embeddings, rope factor 32).
    "llama3.2-1b": dict(
        family="llama",
        vocab_size=128_256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500_000.0,
        rope_scaling=_LLAMA32_SCALING,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=131_072,
        dtype="bfloat16",
        bos_token_id=128_000,
        eos_token_id=128_001,
    ),
    # Qwen/Qwen3-8B.
    "qwen3-8b": dict(
        family="qwen3",
        vocab_size=151_936,
        hidden_size=4096,
        intermediate_size=12_288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qk_norm=True,
        max_position_embeddings=40_960,
        dtype="bfloat16",
        bos_token_id=151_643,
        eos_token_id=151_645,
    ),
    # Qwen/Qwen3-30B-A3B: 128 experts of width 768 in every layer, 8 per token.
    "qwen3-30b-a3b": dict(
        family="qwen3_moe",
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qk_norm=True,
        max_position_embeddings=40_960,
        dtype="bfloat16",
        bos_token_id=151_643,
        eos_token_id=151_645,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    # meta-llama/Llama-4-Scout-17B-16E, text decoder: 16 experts of width 8192 in every layer, 1
    # per token, beside a shared expert; every 4th layer NoPE with full attention, the others RoPE
    # with attention in chunks of 8192: scanned in periods of 4 layers.
    "llama4-scout": dict(
        family="llama4",
        vocab_size=202_048,
        hidden_size=5120,
        intermediate_size=16_384,
        num_layers=48,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500_000.0,
        rope_scaling={
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=10_485_760,
        dtype="bfloat16",
        bos_token_id=200_000,
        eos_token_id=(200_001, 200_007, 200_008),
        num_experts=16,
        num_experts_per_tok=1,
        moe_intermediate_size=8192,
        shared_expert_intermediate_size=8192,
        routing="sigmoid_topk",
        norm_topk_prob=False,
        nope_layers=tuple(range(3, 48, 4)),
        chunked_attention_layers=tuple(i for i in range(48) if i % 4 != 3),
        attention_chunk_size=8192,
        qk_l2_norm=True,
        attn_temperature_tuning=True,
        attn_floor_scale=8192.0,
        attn_scale=0.1,
    ),
    # Qwen/Qwen2.5-7B.
    "qwen2.5-7b": dict(
        family="qwen2",
        vocab_size=152_064,
        hidden_size=3584,
        intermediate_size=18_944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=True,
        max_position_embeddings=32_768,
        dtype="bfloat16",
        bos_token_id=151_643,
        eos_token_id=151_643,
    ),
    # Tiny test presets (float32, CPU). tiny-llama's rope scaling makes all three Llama 3.1 frequency
    # bands (kept, interpolated, divided by factor) appear with head_dim 16.
    "tiny-llama": dict(
        family="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10_000.0,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        dtype="float32",
    ),
    "tiny-qwen2": dict(
        family="qwen2",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        qkv_bias=True,
        max_position_embeddings=512,
        dtype="float32",
    ),
    "tiny-qwen3": dict(
        family="qwen3",
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        dtype="float32",
    ),
    # The tiny Qwen3 with 8 SwiGLU experts, 2 per token, in place of each layer's MLP (configs/tiny_moe.py).
    "tiny-qwen3-moe": dict(
        family="qwen3_moe",
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        qk_norm=True,
        max_position_embeddings=512,
        dtype="float32",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset (see `PRESETS`) with `overrides` applied, e.g. `get_preset('tiny-llama', dtype='bfloat16')`."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ValueError(f"get_preset({name!r}): unknown ModelConfig fields {sorted(unknown)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
