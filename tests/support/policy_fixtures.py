"""Run directories built by hand for the export and evaluate tests.

A base checkpoint is a tiny Llama made by transformers (random, or a hand-set "bigram" model whose
next token depends only on the current one) plus a byte-level BPE tokenizer trained here; a run
directory holds a tiny-recipe config.json naming that base and real orbax checkpoints of train
states whose params are the base's perturbed with seeded noise (so an export that copied the base
would be caught).
"""

import json
import os

import jax
import numpy as np
import torch
import transformers
from flax import nnx
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from scalerl_jax import data as data_lib
from scalerl_jax.config import recipes
from scalerl_jax.config.resume import config_json, flat_config
from scalerl_jax.models import load_hf
from scalerl_jax.run import policy_source
from scalerl_jax.train import create_train_state
from scalerl_jax.train.checkpoint import RunCheckpointer

PROMPT_TEMPLATE = "{problem}\nAnswer in \\boxed{}."


def train_test_tokenizer(path: str):
    """A small BPE tokenizer (tokenizer.json + tokenizer_config.json) written to `path`."""
    corpus = [
        f"What is {a} + {b}?\nAnswer in \\boxed{{}}.<think>{a}+{b}</think>\\boxed{{{a + b}}}"
        for a in range(10)
        for b in range(10)
    ]
    return data_lib.train_tokenizer(corpus, 300, path)


def _llama_config(tokenizer, **overrides) -> transformers.LlamaConfig:
    ids = {key: tokenizer.token_to_id(token) for key, token in (("bos", "<s>"), ("eos", "</s>"), ("pad", "<pad>"))}
    fields = dict(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        tie_word_embeddings=False,
    )
    return transformers.LlamaConfig(**{**fields, **overrides})


def make_random_base(path: str, seed: int = 0) -> transformers.LlamaForCausalLM:
    """A random tiny Llama with its tokenizer at `path` (norm scales perturbed too)."""
    tokenizer = train_test_tokenizer(path)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_llama_config(tokenizer)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    return model


def make_bigram_base(path: str, transitions: dict[int, tuple[int, ...]], *, logit: float = 30.0, seed: int = 0) -> None:
    """A tiny Llama whose next-token distribution depends on the current token only.

    Attention and MLP outputs are zero (o_proj = down_proj = 0), so the final hidden state is
    rmsnorm(embed[x]); the head is solved so that for each `x` in `transitions` the logits are
    `logit` on every token of `transitions[x]` and 0 elsewhere (uniform over the successors).
    """
    tokenizer = train_test_tokenizer(path)
    config = _llama_config(tokenizer)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    sources = sorted(transitions)
    with torch.no_grad():
        for layer in model.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)  # ModuleList items are typed as Module
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight.double().numpy()
        normed = embed / np.sqrt((embed**2).mean(-1, keepdims=True) + config.rms_norm_eps)
        targets = np.zeros((len(sources), config.vocab_size))
        for row, x in enumerate(sources):
            targets[row, list(transitions[x])] = logit
        head = np.linalg.lstsq(normed[sources], targets, rcond=None)[0].T  # [V, H]: head @ n_x = targets
        model.lm_head.weight.copy_(torch.tensor(head, dtype=torch.float32))
    model.save_pretrained(path, safe_serialization=True)


def run_config(base_dir: str, **sampler):
    """The tiny recipe on `base_dir` (no warm start), small sampling budgets for fast tests."""
    config = recipes.tiny()
    del config["warm_start"], config["synthetic"]
    config.model.checkpoint = base_dir
    config.data.prompt_template = PROMPT_TEMPLATE
    config.data.verify_workers = 1
    config.sampler.update(
        {
            **dict(
                num_slots=8, chunk_steps=8, max_new_tokens=16, think_budget_min=8, think_budget_max=10, answer_budget=6
            ),
            **sampler,
        }
    )
    return config


def perturbed(params, seed: int, scale: float = 0.05):
    """`params` plus seeded Gaussian noise of std `scale` on every float leaf."""
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(
        treedef, [leaf + scale * rng.standard_normal(leaf.shape).astype(leaf.dtype) for leaf in leaves]
    )


def make_run_dir(run_dir: str, config, *, step_seeds: dict[int, int | None]) -> dict[int, object]:
    """Writes config.json and one checkpoint per step (params = base + noise of seed `step_seeds[step]`, the
    base itself where it is None);
    returns {step: params}."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(config_json(config), f, indent=2)
    model = load_hf(
        config.model.checkpoint,
        dtype=config.model.dtype,
        fp32_head=config.model.fp32_head,
        scan_layers=config.model.scan_layers,
        remat_policy=config.model.remat_policy,
    )
    _, params = nnx.split(model)
    optimizer = policy_source.run_optimizer(config)
    checkpointer = RunCheckpointer(run_dir, keep=len(step_seeds))
    saved = {}
    for step, seed in sorted(step_seeds.items()):
        step_params = perturbed(params, seed) if seed is not None else params
        checkpointer.save(
            step, create_train_state(step_params, optimizer), {"version": step}, config=flat_config(config)
        )
        saved[step] = step_params
    checkpointer.close()
    return saved
