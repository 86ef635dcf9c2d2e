"""Hugging Face checkpoints: config.json + safetensors <-> `Transformer`, and the tokenizer.

Loading maps tensor names with `HF_TO_NNX` (a regex table per family: HF name -> NNX parameter
path and a layout transform), builds the model abstractly (`nnx.eval_shape`, no allocation) and places each
parameter onto its sharding as it is read (one parameter on the host at a time; with a mesh each
device receives only its shard via `jax.make_array_from_callback`). Pickled weights (`.bin`,
`.pt`) are refused. Missing, extra and mis-shaped tensors are named in the error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import safetensors
import safetensors.numpy
import tokenizers
from absl import logging
from flax import nnx
from jax.sharding import Mesh
from numpy.typing import DTypeLike

from scalerl_jax.models import hf_tokenizer, sharding
from scalerl_jax.models.config import DTYPES, ModelConfig
from scalerl_jax.models.hf_tokenizer import CheckpointFileError, MissingCheckpointFile
from scalerl_jax.models.transformer import Transformer

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# HF tensors that carry no parameters (recomputed RoPE buffers of old checkpoints): skipped and counted.
IGNORED_HF_TENSORS = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama4": "Llama4ForCausalLM",
}
# config.json `model_type` -> family. Llama 4 ships as the image-text model ('llama4': the text
# decoder's fields under `text_config`, its tensors under `LLAMA4_TEXT_PREFIX`); its text decoder
# alone is 'llama4_text', which is also what `save_hf` writes.
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "llama4_text": "llama4",
    "llama4": "llama4",
}
LLAMA4_TEXT_PREFIX = "language_model."
# Tensors of Llama 4's vision tower and projector: not part of the text policy; skipped and counted.
LLAMA4_VISION_TENSORS = re.compile(r"(vision_model|multi_modal_projector)\..*")

# HF name regex -> (NNX path inside a layer or at the top, layout transform). The first `(\d+)` group
# is the layer index, a second one the expert index (one HF tensor per expert, stacked on our
# leading `expert` axis). Transforms (HF layout -> ours): copy; linear: W[out, in] -> W.T; heads_in:
# W[N*D, E] -> W.T reshaped [E, N, D]; heads_out: W[E, H*D] -> W.T reshaped [H, D, E];
# heads_bias: b[N*D] -> [N, D]; heads_in_rope / heads_bias_rope: as heads_in / heads_bias with
# each head's dimensions reordered from RoPE pairs (x0, x1), (x2, x3), ... to halves (x0, x2, ...,
# x1, x3, ...) (`ROPE_PAIRS_TO_HALVES`); fused_gate / fused_up: the first / second half of the
# last axis of a fused [E, D, 2F] tensor.
_COMMON_NAMES = (
    (r"model\.embed_tokens\.weight", "embed_tokens", "copy"),
    (r"model\.norm\.weight", "final_norm.scale", "copy"),
    (r"lm_head\.weight", "lm_head", "linear"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "attn_norm.scale", "copy"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "mlp_norm.scale", "copy"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "attn.v_proj", "heads_in"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "attn.o_proj", "heads_out"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias", "attn.v_bias", "heads_bias"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.bias", "attn.o_bias", "copy"),
)
_QK_HALVES_NAMES = (
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "attn.q_proj", "heads_in"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "attn.k_proj", "heads_in"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", "attn.q_bias", "heads_bias"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", "attn.k_bias", "heads_bias"),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "attn.q_norm.scale", "copy"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "attn.k_norm.scale", "copy"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "mlp.gate_proj", "linear"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "mlp.up_proj", "linear"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "mlp.down_proj", "linear"),
)
_QWEN3_MOE_NAMES = (
    (r"model\.layers\.(\d+)\.mlp\.gate\.weight", "moe.router", "linear"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight", "moe.gate_proj", "linear"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.up_proj\.weight", "moe.up_proj", "linear"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight", "moe.down_proj", "linear"),
)
# Llama 4 ships q/k in RoPE-pair order (its rotary embedding multiplies complex pairs); loading
# reorders them to the halves our `apply_rope` rotates. q.k is a sum over all dimensions and
# the QK norm and temperature act per head, so attention is unchanged by the reordering.
_LLAMA4_NAMES = (
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "attn.q_proj", "heads_in_rope"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "attn.k_proj", "heads_in_rope"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", "attn.q_bias", "heads_bias_rope"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", "attn.k_bias", "heads_bias_rope"),
    (r"model\.layers\.(\d+)\.feed_forward\.gate_proj\.weight", "mlp.gate_proj", "linear"),
    (r"model\.layers\.(\d+)\.feed_forward\.up_proj\.weight", "mlp.up_proj", "linear"),
    (r"model\.layers\.(\d+)\.feed_forward\.down_proj\.weight", "mlp.down_proj", "linear"),
    (r"model\.layers\.(\d+)\.feed_forward\.router\.weight", "moe.router", "linear"),
    (r"model\.layers\.(\d+)\.feed_forward\.experts\.gate_up_proj", "moe.gate_proj", "fused_gate"),
    (r"model\.layers\.(\d+)\.feed_forward\.experts\.gate_up_proj", "moe.up_proj", "fused_up"),
    (r"model\.layers\.(\d+)\.feed_forward\.experts\.down_proj", "moe.down_proj", "copy"),
    (
        r"model\.layers\.(\d+)\.feed_forward\.shared_expert\.gate_proj\.weight",
        "moe.shared_expert.gate_proj",
        "linear",
    ),
    (r"model\.layers\.(\d+)\.feed_forward\.shared_expert\.up_proj\.weight", "moe.shared_expert.up_proj", "linear"),
    (
        r"model\.layers\.(\d+)\.feed_forward\.shared_expert\.down_proj\.weight",
        "moe.shared_expert.down_proj",
        "linear",
    ),
)
HF_TO_NNX: dict[str, tuple[tuple[str, str, str], ...]] = {
    "llama": _COMMON_NAMES + _QK_HALVES_NAMES,
    "qwen2": _COMMON_NAMES + _QK_HALVES_NAMES,
    "qwen3": _COMMON_NAMES + _QK_HALVES_NAMES,
    "qwen3_moe": _COMMON_NAMES + _QK_HALVES_NAMES + _QWEN3_MOE_NAMES,
    "llama4": _COMMON_NAMES + _LLAMA4_NAMES,
}
_COMPILED = {
    family: tuple((re.compile(pattern), path, transform) for pattern, path, transform in table)
    for family, table in HF_TO_NNX.items()
}
# Two of our parameters filled from one HF tensor: the transform of the first half -> the second's
# transform and parameter (its path with the first's name replaced).
FUSED_HALVES = {"fused_gate": ("fused_up", "gate_proj", "up_proj")}


# ----------------------------------------------------------------------------------------------
# Layout transforms
# ----------------------------------------------------------------------------------------------


def rope_pairs_to_halves(head_dim: int) -> np.ndarray:
    """Index order taking a head's RoPE pairs (x0, x1), (x2, x3), ... to halves: [0, 2, ..., 1, 3, ...]."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def hf_to_ours(tensor: np.ndarray, transform: str, our_shape: tuple[int, ...]) -> np.ndarray:
    """Convert one HF tensor to our layout (see `HF_TO_NNX`)."""
    if transform == "copy":
        return tensor
    if transform == "linear":
        return tensor.T
    if transform in ("heads_in", "heads_out"):
        return tensor.T.reshape(our_shape)
    if transform == "heads_bias":
        return tensor.reshape(our_shape)
    if transform in ("heads_in_rope", "heads_bias_rope"):
        base = hf_to_ours(tensor, transform.removesuffix("_rope"), our_shape)
        return base[..., rope_pairs_to_halves(our_shape[-1])]
    if transform in ("fused_gate", "fused_up"):
        width = our_shape[-1]
        return tensor[..., :width] if transform == "fused_gate" else tensor[..., width:]
    raise ValueError(f"unknown layout transform {transform!r}")


def ours_to_hf(array: np.ndarray, transform: str, partner: np.ndarray | None = None) -> np.ndarray:
    """Inverse of `hf_to_ours`; a fused tensor is rebuilt from its first half (`array`, transform
    'fused_gate') and its second (`partner`)."""
    if transform == "copy":
        return array
    if transform == "linear":
        return array.T
    if transform == "heads_in":
        return array.reshape(array.shape[0], -1).T
    if transform == "heads_out":
        return array.reshape(-1, array.shape[-1]).T
    if transform == "heads_bias":
        return array.reshape(-1)
    if transform in ("heads_in_rope", "heads_bias_rope"):
        halves_to_pairs = np.argsort(rope_pairs_to_halves(array.shape[-1]))
        return ours_to_hf(array[..., halves_to_pairs], transform.removesuffix("_rope"))
    if transform == "fused_gate":
        if partner is None:
            raise ValueError("ours_to_hf: a fused tensor needs its second half (partner)")
        return np.concatenate([array, partner], axis=-1)
    raise ValueError(f"unknown layout transform {transform!r}")


def hf_shape(our_shape: tuple[int, ...], transform: str) -> tuple[int, ...]:
    """The HF tensor shape that `hf_to_ours` turns into `our_shape`."""
    if transform in ("fused_gate", "fused_up"):
        return our_shape[:-1] + (2 * our_shape[-1],)
    return ours_to_hf(np.empty(our_shape, np.int8), transform).shape


def _hf_name(pattern: re.Pattern, layer: int | None, expert: int | None = None) -> str:
    name = pattern.pattern.replace(r"\.", ".")
    for index in (layer, expert):
        if index is not None:
            name = name.replace(r"(\d+)", str(index), 1)
    return name


# ----------------------------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------------------------


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, float] | None]:
    """(rope_theta, Llama 3.1 scaling or None) from `rope_parameters` (transformers >= 5) or
    `rope_theta` + `rope_scaling` (older files)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise CheckpointFileError(
            f"config.json: rope type {rope_type!r} is not supported (only 'default' and 'llama3')"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in merged]
    if missing:
        raise CheckpointFileError(f"config.json: llama3 rope scaling is missing {missing}")
    return theta, {k: float(merged[k]) for k in keys}


def _as_number(key: str, value: Any, kind: type[int] | type[float]) -> Any:
    """`kind(value)` for config.json field `key`; a value it cannot convert is named."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        noun = "an integer" if kind is int else "a number"
        raise CheckpointFileError(f"config.json: field {key!r} = {value!r}; expected {noun}") from None


# Fields that make a config.json a mixture-of-experts model: never read as a dense one.
MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")
# Every field a Qwen3-MoE config.json may have (as shipped, or as transformers >= 5 writes it):
# another one (a routing mode this loader does not implement, say) is refused, not ignored.
QWEN3_MOE_FIELDS = frozenset(
    (
        *MOE_FIELDS,
        "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
        "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "attention_dropout",
        "use_sliding_window", "sliding_window", "max_window_layers", "tie_word_embeddings",
        "initializer_range", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
        "mlp_only_layers", "norm_topk_prob", "output_router_logits", "router_aux_loss_coef",
    )
)  # fmt: skip


def _moe_fields_from_hf(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The ModelConfig MoE fields of a Qwen3-MoE config.json: layer i keeps its dense MLP when it is
    in `mlp_only_layers` or when (i + 1) is not a multiple of `decoder_sparse_step`."""
    unknown = sorted(set(hf) - QWEN3_MOE_FIELDS)
    if unknown:
        raise CheckpointFileError(
            f"config.json: field {unknown[0]!r} is not one this loader knows for qwen3_moe "
            f"(unknown: {unknown}); refusing rather than ignoring it"
        )
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    for key, value in (("num_experts", experts), ("num_experts_per_tok", hf.get("num_experts_per_tok"))):
        if value is None:
            raise CheckpointFileError(f"config.json: missing required field {key!r}")
    step = _as_number("decoder_sparse_step", hf.get("decoder_sparse_step", 1), int)
    if step < 1:
        raise CheckpointFileError(f"config.json: field 'decoder_sparse_step' = {step}; expected >= 1")
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list):
        raise CheckpointFileError(f"config.json: field 'mlp_only_layers' = {only!r}; expected a list of layers")
    dense = {_as_number("mlp_only_layers", i, int) for i in only} | {i for i in range(num_layers) if (i + 1) % step}
    return dict(
        num_experts=_as_number("num_experts", experts, int),
        num_experts_per_tok=_as_number("num_experts_per_tok", hf["num_experts_per_tok"], int),
        moe_intermediate_size=_as_number("moe_intermediate_size", hf.get("moe_intermediate_size"), int),
        dense_layers=tuple(sorted(dense)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        routing="softmax_topk",
    )


# Every field a Llama 4 text config may have (Llama4TextConfig as shipped and as transformers >= 5
# writes it); another one is refused, not ignored.
LLAMA4_TEXT_FIELDS = frozenset(
    (
        "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
        "vocab_size", "hidden_size", "intermediate_size", "intermediate_size_mlp", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
        "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias",
        "attention_dropout", "tie_word_embeddings", "initializer_range", "use_cache", "bos_token_id",
        "eos_token_id", "pad_token_id", "num_local_experts", "num_experts_per_tok", "moe_layers",
        "interleave_moe_layer_step", "use_qk_norm", "no_rope_layers", "no_rope_layer_interval",
        "attention_chunk_size", "layer_types", "attn_temperature_tuning", "floor_scale", "attn_scale",
        "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "for_llm_compressor",
        "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "output_attentions",
        "output_hidden_states", "problem_type", "return_dict",
    )
)  # fmt: skip
# Llama4TextConfig's defaults for fields a config.json may leave out.
_LLAMA4_DEFAULTS = dict(
    intermediate_size_mlp=16384,
    num_experts_per_tok=1,
    interleave_moe_layer_step=1,
    use_qk_norm=True,
    no_rope_layer_interval=4,
    attention_chunk_size=8192,
    attn_temperature_tuning=True,
    floor_scale=8192,
    attn_scale=0.1,
    rms_norm_eps=1e-5,
)


def _int_list(hf: dict[str, Any], key: str) -> list[int]:
    """config.json field `key` as a list of integers; anything else is named."""
    value = hf[key]
    if not isinstance(value, list):
        raise CheckpointFileError(f"config.json: field {key!r} = {value!r}; expected a list of integers")
    return [_as_number(key, v, int) for v in value]


def _llama4_fields_from_hf(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields particular to a Llama 4 text config.json: MoE layers (`moe_layers`, or
    every `interleave_moe_layer_step`-th), NoPE layers (`no_rope_layers[i]` = 0, or every
    `no_rope_layer_interval`-th), chunked layers (`layer_types`, or the RoPE layers when
    `attention_chunk_size` is set), the sigmoid router with a shared expert as wide as the experts
    (`intermediate_size`; dense layers use `intermediate_size_mlp`), QK norm and temperature tuning."""
    unknown = sorted(set(hf) - LLAMA4_TEXT_FIELDS)
    if unknown:
        raise CheckpointFileError(
            f"config.json: field {unknown[0]!r} is not one this loader knows for llama4 "
            f"(unknown: {unknown}); refusing rather than ignoring it"
        )
    hf = {**_LLAMA4_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k == "attention_chunk_size"}}
    if "num_local_experts" not in hf:
        raise CheckpointFileError("config.json: missing required field 'num_local_experts'")
    for key in ("router_jitter_noise", "for_llm_compressor"):
        if hf.get(key):
            raise CheckpointFileError(f"config.json: field {key!r} = {hf[key]!r} is not supported (expected 0 / false)")
    if hf.get("moe_layers") is not None:
        moe_layers = set(_int_list(hf, "moe_layers"))
    else:
        step = _as_number("interleave_moe_layer_step", hf["interleave_moe_layer_step"], int)
        if step < 1:
            raise CheckpointFileError(f"config.json: field 'interleave_moe_layer_step' = {step}; expected >= 1")
        moe_layers = set(range(step - 1, num_layers, step))
    if hf.get("no_rope_layers"):
        uses_rope = _int_list(hf, "no_rope_layers")
        if len(uses_rope) < num_layers:
            raise CheckpointFileError(
                f"config.json: field 'no_rope_layers' has {len(uses_rope)} entries for {num_layers} layers"
            )
    else:
        interval = _as_number("no_rope_layer_interval", hf["no_rope_layer_interval"], int)
        uses_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
    chunk = hf["attention_chunk_size"]
    chunk = None if chunk is None else _as_number("attention_chunk_size", chunk, int)
    layer_types = hf.get("layer_types") or [
        "chunked_attention" if uses_rope[i] and chunk is not None else "full_attention" for i in range(num_layers)
    ]
    strange = sorted({t for t in layer_types if t not in ("chunked_attention", "full_attention")})
    if strange:
        raise CheckpointFileError(f"config.json: layer_types {strange} are not supported for llama4")
    chunked = tuple(i for i, kind in enumerate(layer_types[:num_layers]) if kind == "chunked_attention")
    if chunked and chunk is None:
        raise CheckpointFileError("config.json: chunked_attention layers need 'attention_chunk_size'")
    dense = tuple(i for i in range(num_layers) if i not in moe_layers)
    nope = tuple(i for i in range(num_layers) if not uses_rope[i])
    return dict(
        intermediate_size=_as_number("intermediate_size_mlp", hf["intermediate_size_mlp"], int),
        num_experts=_as_number("num_local_experts", hf["num_local_experts"], int),
        num_experts_per_tok=_as_number("num_experts_per_tok", hf["num_experts_per_tok"], int),
        moe_intermediate_size=_as_number("intermediate_size", hf["intermediate_size"], int),
        shared_expert_intermediate_size=_as_number("intermediate_size", hf["intermediate_size"], int),
        dense_layers=dense,
        routing="sigmoid_topk",
        norm_topk_prob=False,
        nope_layers=nope,
        chunked_attention_layers=chunked,
        attention_chunk_size=chunk or 0,
        qk_l2_norm=bool(hf["use_qk_norm"]),
        attn_temperature_tuning=bool(hf["attn_temperature_tuning"]),
        attn_floor_scale=_as_number("floor_scale", hf["floor_scale"], float),
        attn_scale=_as_number("attn_scale", hf["attn_scale"], float),
        rms_norm_eps=_as_number("rms_norm_eps", hf["rms_norm_eps"], float),
    )


def _text_config_of(hf: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's fields of an image-text Llama 4 config.json (`text_config`), with the
    dtype and embedding tying of the whole model where the text part leaves them out."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointFileError("config.json: model_type 'llama4' without a 'text_config' object")
    inherited = {k: hf[k] for k in ("torch_dtype", "dtype", "tie_word_embeddings") if k in hf and k not in text}
    return {**text, **inherited, "model_type": "llama4_text"}


def config_from_hf(
    hf: dict[str, Any], *, dtype: DTypeLike | None = None, fp32_head: bool = True, **overrides: Any
) -> ModelConfig:
    """ModelConfig from a parsed HF config.json (model_type llama / qwen2 / qwen3 / qwen3_moe /
    llama4_text, or llama4: its text decoder); `dtype` is any dtype-like (see `dtype_name`), default
    the checkpoint's. A dense family's file with MoE fields, or an MoE family's file with a field
    this loader does not know, is refused."""
    dtype = dtype_name(dtype)
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointFileError(
            f"config.json: model_type={model_type!r} is not supported; expected one of {sorted(MODEL_TYPES)}"
        )
    if model_type == "llama4":
        hf = _text_config_of(hf)
    family = MODEL_TYPES[model_type]
    moe_fields = [key for key in MOE_FIELDS if key in hf]
    if family not in ("qwen3_moe", "llama4") and moe_fields:
        raise CheckpointFileError(
            f"config.json: model_type={family!r} with mixture-of-experts field {moe_fields[0]!r}; "
            "refusing to load it as a dense model"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointFileError(f"config.json: hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
    if hf.get("mlp_bias", False):
        raise CheckpointFileError("config.json: mlp_bias=true is not supported")
    if hf.get("use_sliding_window", False):
        raise CheckpointFileError("config.json: use_sliding_window=true is not supported")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in hf:
            raise CheckpointFileError(f"config.json: missing required field {key!r}")
    heads = _as_number("num_attention_heads", hf["num_attention_heads"], int)
    attention_bias = bool(hf.get("attention_bias", False))
    theta, scaling = _rope_from_hf(hf)
    checkpoint_dtype = hf.get("dtype") or hf.get("torch_dtype")
    fields = dict(
        family=family,
        vocab_size=_as_number("vocab_size", hf["vocab_size"], int),
        hidden_size=_as_number("hidden_size", hf["hidden_size"], int),
        intermediate_size=_as_number("intermediate_size", hf["intermediate_size"], int),
        num_layers=_as_number("num_hidden_layers", hf["num_hidden_layers"], int),
        num_heads=heads,
        num_kv_heads=_as_number("num_key_value_heads", hf.get("num_key_value_heads") or heads, int),
        head_dim=_as_number(
            "head_dim", hf.get("head_dim") or _as_number("hidden_size", hf["hidden_size"], int) // heads, int
        ),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=_as_number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6), float),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        max_position_embeddings=_as_number("max_position_embeddings", hf.get("max_position_embeddings", 8192), int),
        dtype=dtype or (checkpoint_dtype if checkpoint_dtype in ("float32", "bfloat16", "float16") else "float32"),
        fp32_head=fp32_head,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
    )
    if family == "qwen3_moe":
        fields.update(_moe_fields_from_hf(hf, _as_number("num_hidden_layers", hf["num_hidden_layers"], int)))
    if family == "llama4":
        fields.update(_llama4_fields_from_hf(hf, _as_number("num_hidden_layers", hf["num_hidden_layers"], int)))
    # Scanned unless the layer kinds do not repeat (`ModelConfig.stackable`).
    stackable = ModelConfig(**{**fields, "scan_layers": False}).stackable
    return ModelConfig(**{**fields, "scan_layers": stackable, **overrides})


def _llama3_scaling_to_hf(scaling: dict[str, float]) -> dict[str, Any]:
    original = scaling["original_max_position_embeddings"]
    return {"rope_type": "llama3", **scaling, "original_max_position_embeddings": int(original)}


def config_to_hf(config: ModelConfig, *, dtype: str | None = None) -> dict[str, Any]:
    """HF config.json dict for `config` (loadable by transformers' Auto classes)."""
    if config.family == "qwen2" and (not config.qkv_bias or config.o_bias):
        raise ValueError("qwen2 checkpoints need qkv_bias=True and o_bias=False")
    if config.family in ("llama", "qwen3", "qwen3_moe", "llama4") and config.qkv_bias != config.o_bias:
        raise ValueError(
            f"{config.family} checkpoints have one attention_bias for q/k/v/o; "
            f"got qkv_bias={config.qkv_bias}, o_bias={config.o_bias}"
        )
    if config.family == "llama4":
        _check_llama4_exportable(config)
    rope_scaling = config.rope_scaling_dict
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[config.family]],
        "model_type": "llama4_text" if config.family == "llama4" else config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if rope_scaling is None else _llama3_scaling_to_hf(rope_scaling),
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range,
        "torch_dtype": dtype or config.dtype,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_id) if isinstance(config.eos_token_id, tuple) else config.eos_token_id,
        "use_cache": True,
    }
    if config.family == "qwen2":
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers)
    else:
        hf.update(attention_bias=config.qkv_bias, attention_dropout=0.0)
        if config.family in ("qwen3", "qwen3_moe"):
            hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers)
        else:
            hf.update(mlp_bias=False)
    if config.family == "qwen3_moe":
        hf.update(
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=list(config.dense_layers),
            norm_topk_prob=config.norm_topk_prob,
        )
    if config.family == "llama4":
        hf.pop("mlp_bias")
        layers = range(config.num_layers)
        hf.update(
            intermediate_size=config.moe_intermediate_size,
            intermediate_size_mlp=config.intermediate_size,
            num_local_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_layers=[i for i in layers if config.is_moe_layer(i)],
            no_rope_layers=[int(config.uses_rope(i)) for i in layers],
            layer_types=["chunked_attention" if config.is_chunked_layer(i) else "full_attention" for i in layers],
            attention_chunk_size=config.attention_chunk_size or None,
            use_qk_norm=config.qk_l2_norm,
            attn_temperature_tuning=config.attn_temperature_tuning,
            floor_scale=int(config.attn_floor_scale)
            if config.attn_floor_scale.is_integer()
            else config.attn_floor_scale,
            attn_scale=config.attn_scale,
            router_jitter_noise=0.0,
        )
    return hf


def _check_llama4_exportable(config: ModelConfig) -> None:
    """ValueError naming the field when `config` is not something Llama4TextConfig can express."""
    if config.num_experts < 1 or config.routing != "sigmoid_topk":
        raise ValueError("llama4 checkpoints have experts routed by 'sigmoid_topk'")
    if config.shared_expert_intermediate_size != config.moe_intermediate_size:
        raise ValueError(
            "llama4 checkpoints have one intermediate_size for the experts and the shared expert; got "
            f"moe_intermediate_size={config.moe_intermediate_size}, "
            f"shared_expert_intermediate_size={config.shared_expert_intermediate_size}"
        )
    if config.qk_norm:
        raise ValueError("llama4 checkpoints have no per-head q/k norm weights (qk_norm=True)")


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def _weight_files(path: str) -> list[str]:
    """Safetensors files of a checkpoint directory (index file, single file, or all *.safetensors)."""
    if not os.path.isdir(path):
        raise MissingCheckpointFile(f"checkpoint directory {path!r} does not exist")
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.exists(index):
        weight_map = hf_tokenizer.read_json(index).get("weight_map")
        if not weight_map:
            raise CheckpointFileError(f"{index}: no 'weight_map'")
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not os.path.exists(os.path.join(path, name))]
        if missing:
            raise MissingCheckpointFile(f"{index} lists missing shard files {missing}")
        return [os.path.join(path, name) for name in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        return files
    pickled = sorted(name for name in os.listdir(path) if name.endswith(PICKLE_SUFFIXES))
    if pickled:
        raise CheckpointFileError(
            f"{path}: only pickled weights {pickled}; refusing to unpickle (arbitrary code execution). "
            "Convert the checkpoint to safetensors (e.g. save_pretrained(..., safe_serialization=True))."
        )
    raise MissingCheckpointFile(f"{path}: no *.safetensors weights and no {SAFETENSORS_INDEX}")


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where one HF tensor lives (`hf_name` as stored, with the layout's prefix) and what it becomes."""

    hf_name: str
    file: str
    nnx_path: str
    layer: int | None
    expert: int | None
    transform: str


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a checkpoint's tensor names relate to the text decoder's: a prefix on every text tensor
    (`LLAMA4_TEXT_PREFIX` in an image-text Llama 4) and the tensors that are not the decoder's."""

    family: str
    prefix: str = ""
    foreign: re.Pattern | None = None


def _layout_of(hf: dict[str, Any], family: str) -> _Layout:
    if hf.get("model_type") == "llama4":
        return _Layout(family, LLAMA4_TEXT_PREFIX, LLAMA4_VISION_TENSORS)
    return _Layout(family)


def _index_tensors(files: list[str], layout: _Layout) -> tuple[dict[str, _Source], list[str], dict[str, int]]:
    """(sources by HF name without the layout's prefix, unmatched HF names, skipped-tensor counts
    by kind) over all files."""
    sources: dict[str, _Source] = {}
    extra: list[str] = []
    skipped = {"rotary inv_freq buffers": 0, "vision tower tensors": 0}
    for file in files:
        with _safe_open(file) as f:
            names = list(f.keys())
        for stored in names:
            if layout.foreign is not None and layout.foreign.fullmatch(stored):
                skipped["vision tower tensors"] += 1
                continue
            name = stored.removeprefix(layout.prefix) if stored.startswith(layout.prefix) else None
            if name is None:
                extra.append(stored)
                continue
            if name in sources:
                raise CheckpointFileError(f"tensor {stored!r} appears in both {sources[name].file} and {file}")
            if any(p.fullmatch(name) for p in IGNORED_HF_TENSORS):
                skipped["rotary inv_freq buffers"] += 1
                continue
            for pattern, nnx_path, transform in _COMPILED[layout.family]:
                match = pattern.fullmatch(name)
                if match:
                    indices = [int(g) for g in match.groups()] + [None, None]
                    sources[name] = _Source(stored, file, nnx_path, indices[0], indices[1], transform)
                    break
            else:
                extra.append(stored)
    return sources, extra, skipped


def _path_str(path: tuple[Any, ...]) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)


def _named_variables(state: Any) -> dict[str, nnx.Variable]:
    """{'a.b.c': variable} for every variable of an NNX state."""
    found: dict[str, nnx.Variable] = {}

    def visit(path: tuple[Any, ...], leaf: Any) -> Any:
        if isinstance(leaf, nnx.Variable):
            found[_path_str(path)] = leaf
        return leaf

    jax.tree_util.tree_map_with_path(visit, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return found


@dataclasses.dataclass(frozen=True)
class _Target:
    """One model parameter and the HF tensors (one per layer when stacked) that fill it."""

    path: str
    layer_path: str  # path inside a layer ('attn.q_proj') or at the top ('embed_tokens')
    layers: tuple[int | None, ...]  # HF layer indices in order of the leading axis; (None,) if unstacked
    stacked: bool
    experts: tuple[int | None, ...] = (None,)  # HF expert indices along our `expert` axis; (None,) if none

    def pieces(self) -> Iterator[tuple[tuple[int, ...], int | None, int | None]]:
        """(index into our array, HF layer, HF expert) of each HF tensor that fills this parameter."""
        for i, layer in enumerate(self.layers):
            for j, expert in enumerate(self.experts):
                yield (i,) * self.stacked + (j,) * (expert is not None), layer, expert


def _targets(config: ModelConfig, paths: list[str]) -> list[_Target]:
    """How each parameter path maps onto HF layer (and expert) indices."""
    targets = []
    period = config.layer_period
    for path in paths:
        parts = path.split(".")
        if parts[0] != "layers":
            targets.append(_Target(path, path, (None,), False))
            continue
        if config.scan_layers and period == 1:
            layer_path, layers, stacked = ".".join(parts[1:]), tuple(range(config.num_layers)), True
        elif config.scan_layers:  # stack j of a period-p scan holds layers j, j + p, j + 2p, ...
            layer_path, layers, stacked = (
                ".".join(parts[2:]),
                tuple(range(int(parts[1]), config.num_layers, period)),
                True,
            )
        else:
            layer_path, layers, stacked = ".".join(parts[2:]), (int(parts[1]),), False
        per_expert = {nnx_path for pattern, nnx_path, _ in _COMPILED[config.family] if pattern.groups == 2}
        experts = tuple(range(config.num_experts)) if layer_path in per_expert else (None,)
        targets.append(_Target(path, layer_path, layers, stacked, experts))
    return targets


def _expected_hf_names(
    targets: list[_Target], family: str
) -> dict[tuple[str, int | None, int | None], tuple[str, str]]:
    """{(layer_path, layer, expert): (hf_name, transform)} the model needs (names without a prefix)."""
    by_path = {nnx_path: (pattern, transform) for pattern, nnx_path, transform in _COMPILED[family]}
    needed = {}
    for target in targets:
        if target.layer_path not in by_path:
            raise ValueError(f"parameter {target.path!r} has no Hugging Face name in HF_TO_NNX")
        pattern, transform = by_path[target.layer_path]
        for _, layer, expert in target.pieces():
            needed[(target.layer_path, layer, expert)] = (_hf_name(pattern, layer, expert), transform)
    return needed


def _read_param(
    target: _Target,
    shape: tuple[int, ...],
    dtype: np.dtype,
    needed: dict,
    sources: dict[str, _Source],
    open_file: Callable[[str], Any],
) -> np.ndarray:
    """Host array of one parameter in our layout and dtype (layers stacked on axis 0 when stacked,
    then experts)."""
    host = np.empty(shape, dtype)
    for index, layer, expert in target.pieces():
        piece_shape = shape[len(index) :]
        hf_name, transform = needed[(target.layer_path, layer, expert)]
        file, stored = sources[hf_name].file, sources[hf_name].hf_name
        tensor = _get_tensor(open_file(file), file, stored)
        expected = hf_shape(piece_shape, transform)
        if tuple(tensor.shape) != expected:
            config_file = os.path.join(os.path.dirname(file), "config.json")
            raise CheckpointFileError(
                f"{file}: tensor {stored!r} has shape {tuple(tensor.shape)}, but {config_file} gives "
                f"{expected} (parameter {target.path}); the weights and config.json disagree"
            )
        host[index] = hf_to_ours(tensor, transform, piece_shape).astype(dtype)
    return host


@contextlib.contextmanager
def _safe_open(file: str) -> Iterator[Any]:
    """`safetensors.safe_open(file)` whose errors (corrupt or truncated file) name the file."""
    try:
        handle = safetensors.safe_open(file, framework="np")
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        raise CheckpointFileError(f"{file}: not a readable safetensors file ({e})") from e
    with handle as f:
        yield f


def _get_tensor(handle: Any, file: str, name: str) -> np.ndarray:
    """Tensor `name` of an open safetensors file; errors name the file and tensor."""
    try:
        return handle.get_tensor(name)
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        raise CheckpointFileError(f"{file}: cannot read tensor {name!r} ({e})") from e


@contextlib.contextmanager
def _open_files() -> Iterator[Callable[[str], Any]]:
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def open_file(file: str) -> Any:
            if file not in handles:
                handles[file] = stack.enter_context(_safe_open(file))
            return handles[file]

        yield open_file


def dtype_name(dtype: DTypeLike | None) -> str | None:
    """The ModelConfig name ('float32', 'bfloat16', 'float16') of a dtype-like, None for None.

    Accepts names ("bfloat16"), numpy / jax scalar types (`np.float32`, `jnp.bfloat16`) and
    `np.dtype`s; anything else, or another dtype, is a ValueError naming the value.
    """
    if dtype is None:
        return None
    try:
        name = np.dtype(jax.numpy.dtype(dtype)).name
    except TypeError as e:
        raise ValueError(f"dtype={dtype!r} is not a dtype; expected one of {DTYPES}") from e
    if name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} ({name}) is not supported; expected one of {DTYPES}")
    return name


def _read_config_json(path: str) -> dict[str, Any]:
    """The parsed `path/config.json` (a JSON object)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise MissingCheckpointFile(f"{config_file} does not exist")
    hf = hf_tokenizer.read_json(config_file)
    if not isinstance(hf, dict):
        raise CheckpointFileError(f"{config_file}: expected a JSON object, got {type(hf).__name__}")
    return hf


def load_hf_config(
    path: str, *, dtype: DTypeLike | None = None, fp32_head: bool = True, **overrides: Any
) -> ModelConfig:
    """ModelConfig from `path/config.json` (`dtype`: any dtype-like, see `dtype_name`)."""
    config_file = os.path.join(path, "config.json")
    hf = _read_config_json(path)
    try:
        return config_from_hf(hf, dtype=dtype, fp32_head=fp32_head, **overrides)
    except CheckpointFileError as e:  # its messages begin "config.json: "; name the file itself
        message = str(e)
        if message.startswith("config.json"):
            message = config_file + message.removeprefix("config.json")
        raise CheckpointFileError(message) from e


def abstract_hf(
    path: str, *, dtype: DTypeLike | None = None, fp32_head: bool = True, **config_overrides: Any
) -> tuple[Any, Any, ModelConfig]:
    """(graphdef, abstract params state, ModelConfig) of the checkpoint at `path`, reading only its
    config.json and allocating nothing: what a process that receives its params from elsewhere
    (a generator fed by weight transfer) needs to build its engine and target shardings."""
    config = load_hf_config(path, dtype=dtype, fp32_head=fp32_head, **config_overrides)
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    return graphdef, abstract_state, config


def load_hf(
    path: str,
    *,
    dtype: DTypeLike | None = None,
    fp32_head: bool = True,
    mesh: Mesh | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    **config_overrides: Any,
) -> Transformer:
    """A `Transformer` with the weights of the local HF checkpoint directory `path`.

    dtype: body/param dtype, any dtype-like ("bfloat16", `jnp.bfloat16`, `np.float32`, an `np.dtype`;
    default: the checkpoint's `torch_dtype`, else float32). fp32_head
    keeps the unembedding in float32. With `mesh`, each parameter is placed on its
    `param_shardings(..., mesh, rules)` sharding as it is read; otherwise on the default device.
    `config_overrides` set other ModelConfig fields (scan_layers, remat_policy, attention_impl...).
    An image-text Llama 4 checkpoint loads its text decoder; the vision tower's tensors are counted
    and skipped.
    """
    graphdef, abstract_state, config = abstract_hf(path, dtype=dtype, fp32_head=fp32_head, **config_overrides)
    files = _weight_files(path)
    sources, extra, skipped = _index_tensors(files, _layout_of(_read_config_json(path), config.family))
    variables = _named_variables(abstract_state)
    targets = _targets(config, list(variables))
    needed = _expected_hf_names(targets, config.family)
    needed_names = {name for name, _ in needed.values()}
    missing = sorted(needed_names - set(sources))
    extra += sorted(set(sources) - needed_names)
    if missing or extra:
        raise CheckpointFileError(
            f"checkpoint {path} does not match the {config.family} config: "
            f"missing tensors {missing}; unexpected tensors {sorted(extra)}"
        )
    for kind, count in skipped.items():
        if count:
            logging.info("load_hf(%s): skipped %d %s", path, count, kind)
    shardings = _named_variables(sharding.param_shardings(abstract_state, mesh, rules)) if mesh is not None else {}
    values: dict[str, jax.Array] = {}
    with _open_files() as open_file:
        for target in targets:
            abstract_value = variables[target.path].get_value()
            host = _read_param(
                target, tuple(abstract_value.shape), np.dtype(abstract_value.dtype), needed, sources, open_file
            )
            if mesh is None:
                values[target.path] = jax.device_put(host)
            else:
                placement = shardings[target.path].get_value()
                values[target.path] = jax.make_array_from_callback(host.shape, placement, lambda idx, h=host: h[idx])
            del host
    state = jax.tree_util.tree_map_with_path(
        lambda p, v: v.replace(values[_path_str(p)]) if isinstance(v, nnx.Variable) else v,
        abstract_state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.merge(graphdef, state)


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def _hf_tensors_of(model: Transformer) -> Iterator[tuple[str, Callable[[], list[tuple[str, np.ndarray]]], int]]:
    """(parameter path, thunk giving its [(hf_name, array)], bytes per element) in model order."""
    config = model.config
    variables = _named_variables(nnx.state(model))
    targets = _targets(config, list(variables))
    needed = _expected_hf_names(targets, config.family)
    fused_second_halves = {second for second, _, _ in FUSED_HALVES.values()}

    def host_array(path: str) -> np.ndarray:
        array = variables[path].get_value()
        if not array.is_fully_addressable:
            raise ValueError(f"save_hf: parameter {path} is not fully addressable from this process")
        return np.asarray(jax.device_get(array))

    for target in targets:

        def tensors(target: _Target = target) -> list[tuple[str, np.ndarray]]:
            host, partner, out = host_array(target.path), None, []
            for index, layer, expert in target.pieces():
                hf_name, transform = needed[(target.layer_path, layer, expert)]
                if transform in fused_second_halves:
                    continue  # written with its first half
                if transform in FUSED_HALVES:
                    _, first, second = FUSED_HALVES[transform]
                    partner = host_array(target.path.replace(first, second)) if partner is None else partner
                    out.append((hf_name, np.ascontiguousarray(ours_to_hf(host[index], transform, partner[index]))))
                else:
                    out.append((hf_name, np.ascontiguousarray(ours_to_hf(host[index], transform))))
            return out

        yield target.path, tensors, variables[target.path].get_value().size


def save_hf(model: Transformer, path: str, *, dtype: str | None = None, max_shard_bytes: int = 5 * 1024**3) -> None:
    """Write `model` as a HF checkpoint: config.json + safetensors (sharded with an index file when
    larger than `max_shard_bytes`). All tensors are stored in `dtype` (default: the body dtype)."""
    config = model.config
    out_dtype = np.dtype(jax.numpy.dtype(dtype or config.dtype))
    os.makedirs(path, exist_ok=True)
    params = list(_hf_tensors_of(model))
    shards: list[list[Callable[[], list[tuple[str, np.ndarray]]]]] = [[]]
    shard_bytes = 0
    for _, thunk, size in params:
        nbytes = size * out_dtype.itemsize
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(thunk)
        shard_bytes += nbytes
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for number, thunks in enumerate(shards, start=1):
        file = SAFETENSORS_SINGLE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: array.astype(out_dtype) for thunk in thunks for name, array in thunk()}
        safetensors.numpy.save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        total_bytes += sum(t.nbytes for t in tensors.values())
    if len(shards) > 1:
        with open(os.path.join(path, SAFETENSORS_INDEX), "w") as f:
            json.dump(
                {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2
            )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config, dtype=str(out_dtype)), f, indent=2)


# ----------------------------------------------------------------------------------------------
# Tokenizer (see `hf_tokenizer`)
# ----------------------------------------------------------------------------------------------


def load_tokenizer(path: str) -> tokenizers.Tokenizer:
    """`tokenizers.Tokenizer` from `path/tokenizer.json`; `load_checkpoint_tokenizer` also reads the
    special tokens, stop ids and chat template."""
    return hf_tokenizer.load_tokenizer_file(path)


load_chat_template = hf_tokenizer.load_chat_template
