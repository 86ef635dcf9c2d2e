"""Model FLOPs of one train step and peak device FLOP/s, for MFU (model FLOPs utilization).

For a decoder with L layers, width d, h query heads and k KV heads of size e, MLP width f and
vocabulary V, the weights used in matmuls per token are
    N = L (2 d h e + 2 d k e + 3 d f) + d V
(q and o projections, k and v projections, SwiGLU gate/up/down, and the LM head; the embedding
lookup is a gather, not a matmul, and norms/biases are negligible). A mixture-of-experts layer
with E experts of width F, r of them per token, puts its router and the r experts a token uses
in place of 3 d f: d E + 3 d F r (active parameters only: the other experts do no work for it),
plus 3 d F_s for a shared expert of width F_s. A matmul with an n-element weight costs 2n FLOPs
per token forward and 4n backward, hence the usual 6 N per trained token.

Causal attention on a sequence of T tokens: query i attends i + 1 keys, and QK^T and AV each cost
2 h e FLOPs per (query, key) pair, so one layer's forward costs sum_i 4 h e (i + 1) =
2 h e T (T + 1); with the backward (2x forward) a trained sequence costs 6 L h e T (T + 1), i.e.
    flops per token = 6 N + 6 L h e (T + 1).
A layer with chunked attention (chunks of C) has q full chunks and r = T - q C tokens left: its
queries attend q C (C + 1) / 2 + r (r + 1) / 2 keys in all instead of T (T + 1) / 2.
This counts only the causal half of the score matrix (PaLM's 12 L h e T counts the full square;
halve it to compare) and never counts recomputation (remat), so it is the MODEL FLOPs of MFU.
"""

from __future__ import annotations

from scalerl_jax.hardware.facts import facts_for_device_kind
from scalerl_jax.models.config import ModelConfig


def matmul_params(config: ModelConfig) -> int:
    """N: weights that enter a matmul once per token (module docstring; MoE layers: active only)."""
    d, f, h, k, e = (
        config.hidden_size,
        config.intermediate_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
    )
    attention = 2 * d * h * e + 2 * d * k * e
    experts = d * config.num_experts + 3 * d * config.moe_intermediate_size * config.num_experts_per_tok
    experts += 3 * d * config.shared_expert_intermediate_size
    layers = sum(attention + (experts if config.is_moe_layer(i) else 3 * d * f) for i in range(config.num_layers))
    return layers + d * config.vocab_size


def attended_keys(seq_len: int, chunk: int = 0) -> int:
    """Keys attended by all queries of a causal length-T sequence: T (T + 1) / 2, or with chunks of
    `chunk` (> 0) q C (C + 1) / 2 + r (r + 1) / 2 (module docstring)."""
    if not chunk or chunk >= seq_len:
        return seq_len * (seq_len + 1) // 2
    full, rest = divmod(seq_len, chunk)
    return full * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2


def train_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """6 N + 12 h e sum_layers keys_l / T: forward + backward model FLOPs per token of a length-T
    sequence (6 N + 6 L h e (T + 1) when no layer is chunked)."""
    if seq_len < 1:
        raise ValueError(f"train_flops_per_token: seq_len={seq_len} must be >= 1")
    keys = sum(
        attended_keys(seq_len, config.attention_chunk_size if config.is_chunked_layer(i) else 0)
        for i in range(config.num_layers)
    )
    attention = 12 * config.num_heads * config.head_dim * keys / seq_len
    return 6.0 * matmul_params(config) + float(attention)


def train_step_flops(config: ModelConfig, batch_size: int, seq_len: int) -> float:
    """Model FLOPs of one step on `batch_size` sequences of `seq_len` tokens."""
    return train_flops_per_token(config, seq_len) * batch_size * seq_len


def peak_bf16_flops_per_s(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device of this `device_kind` (`hardware.facts`, from the vendors'
    data sheets); None when unknown (e.g. CPU)."""
    facts = facts_for_device_kind(device_kind)
    return None if facts is None else facts.peak_bf16_flops_per_s


def devices_peak_flops_per_s(devices) -> float | None:
    """Summed peak dense bf16 FLOP/s of `devices` (e.g. the trainer's), the denominator of MFU;
    None when any device's kind is not in `hardware.facts.DEVICES`."""
    peaks = [peak_bf16_flops_per_s(device.device_kind) for device in devices]
    known = [peak for peak in peaks if peak is not None]
    if not peaks or len(known) != len(peaks):
        return None
    return float(sum(known))
