"""Small random mixture-of-experts models as transformers builds them (no download), for parity
tests: Qwen3-MoE and Llama 4 text configs of a few hundred thousand parameters, weights moved off
transformers' initialisation, transformers' greedy continuation, and checkpoint-directory helpers."""

from __future__ import annotations

import json
import os

import numpy as np

VOCAB = 256
QWEN3_MOE_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
# Every Llama 4 feature matters within 20 tokens: chunks of 8, temperature steps of 4, Llama 3 RoPE
# scaling with low = high frequency factor (as Scout ships).
LLAMA4_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=32,
    intermediate_size_mlp=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    max_position_embeddings=256,
    attention_chunk_size=8,
    floor_scale=4,
    attn_scale=0.5,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=10_000.0,
        factor=16.0,
        low_freq_factor=1.0,
        high_freq_factor=1.0,
        original_max_position_embeddings=16,
    ),
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def randomize_moe(model) -> None:
    """Routers drawn N(0, 1), Llama 4's fused experts N(0, 0.1^2), norm scales 1 + N(0, 0.1^2):
    transformers initialises routers (and Llama 4's experts) to zero, which would tie every expert."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "router.weight")):
                param.copy_(torch.randn_like(param))
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(0.1 * torch.randn_like(param))
            elif "norm" in name:
                param.add_(0.1 * torch.randn_like(param))


def transformers_greedy(torch_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt` (no stop token)."""
    import torch

    with torch.no_grad():
        out = torch_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def tensor_names(path: str) -> list[str]:
    """The tensor names of a single-file safetensors checkpoint directory."""
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        return list(f.keys())


def rewrite_config(src: str, dst: str, edit) -> None:
    """`dst`: hard links to `src`'s files, with config.json rewritten by `edit(config_dict)`."""
    os.makedirs(dst)
    for name in os.listdir(src):
        os.link(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    edit(config)
    os.unlink(os.path.join(dst, "config.json"))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)


def random_tokens(batch: int = 2, length: int = 20, seed: int = 0) -> np.ndarray:
    """Token ids in [1, VOCAB), [batch, length]."""
    return np.random.RandomState(seed).randint(1, VOCAB, (batch, length))
