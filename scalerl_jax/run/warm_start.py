"""Supervised warm start of the tiny policy, written as a Hugging Face checkpoint directory.

The embedded default run goes through the same doors as the 8B run: this module trains a
byte-level BPE tokenizer on the synthetic task (`tokenizer.json`), trains a small decoder by
next-token cross-entropy on the task's demonstrations (worked traces, and a configured fraction
of answer-only replies: `with_direct_answers`), and saves it with `save_hf` (config.json +
safetensors). The RL run then loads that directory with `load_hf`. The directory is cached under
the workdir, keyed by a digest of everything that determines it, and written atomically (a
temporary directory renamed when complete), so a killed warm start is redone, never half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from scalerl_jax import data as data_lib
from scalerl_jax.config.adapters import puzzle_config
from scalerl_jax.data.code_puzzles import PUZZLES
from scalerl_jax.data.code_puzzles import TEMPLATE as PUZZLE_TEMPLATE
from scalerl_jax.data.code_puzzles import generate_splits as generate_puzzles
from scalerl_jax.models import Transformer, get_preset, load_checkpoint_tokenizer, save_hf, sequence_logprobs

COMPLETE_MARKER = "warm_start_complete.json"


def synthetic_task(config: ml_collections.ConfigDict) -> data_lib.SyntheticTaskConfig:
    """The synthetic task of `config.synthetic` (seed, split sizes, difficulty levels)."""
    s = config.synthetic
    return data_lib.SyntheticTaskConfig(
        seed=s.seed,
        split_sizes=(("heldout", s.heldout_size), ("sft", s.sft_size), ("train", s.train_size)),
        levels=tuple(data_lib.Level(num_ops, max_operand) for num_ops, max_operand in s.levels),
    )


def code_demonstrations(config: ml_collections.ConfigDict) -> list[dict]:
    """The code puzzles' warm-start rows (`problem`, `solution`: the reference expression), in a
    run whose code domain is the generated puzzles; else none."""
    if "code" not in config or config.code.task != PUZZLES:
        return []
    return [{"problem": p.text, "solution": p.reference} for p in generate_puzzles(puzzle_config(config))["sft"]]


def code_corpus(config: ml_collections.ConfigDict, rows: list[dict]) -> list[str]:
    """The code rows' texts for the tokenizer: each prompt in the code template, each solution."""
    if not rows:
        return []
    template = puzzle_template(config)
    return [text for row in rows for text in (data_lib.format_problem(row["problem"], template), row["solution"])]


def puzzle_template(config: ml_collections.ConfigDict) -> str:
    """The puzzles' user turn: `code.prompt_template`, else the puzzles' own."""
    return config.code.prompt_template or PUZZLE_TEMPLATE


def _digest(config: ml_collections.ConfigDict) -> str:
    payload = json.dumps(
        {
            "synthetic": config.synthetic.to_dict(),
            "warm_start": config.warm_start.to_dict(),
            "template": config.data.prompt_template,
            "tokenizer_layout": data_lib.TOKENIZER_LAYOUT,
            **({"code": config.code.to_dict()} if "code" in config else {}),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def sft_loss(model: Transformer, tokens: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over the masked targets: -sum(m * log p(x_t | x_<t)) / sum(m)."""
    logp = sequence_logprobs(model, tokens)
    return -jnp.sum(logp * loss_mask) / jnp.maximum(jnp.sum(loss_mask), 1.0)


def with_direct_answers(rows: list[dict], fraction: float, rng: np.random.Generator) -> list[dict]:
    """Rows whose `solution` is replaced, for a random `fraction` of them, by the answer alone.

    The demonstrations then mix worked traces with answer-only replies, as a base model's data
    does: the warm-started policy sometimes skips the trace, and answers without one are mostly
    wrong on multi-step chains. Learning to reason before answering is left for RL to discover.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"warm_start.direct_answer_fraction={fraction} must be in [0, 1]")
    direct = rng.random(len(rows)) < fraction
    return [dict(row, solution=data_lib.direct_answer(row["answer"])) if d else row for row, d in zip(rows, direct)]


def build_warm_start(config: ml_collections.ConfigDict, workdir: str) -> str:
    """Returns the path of the warm-started tiny policy's HF directory, building it if needed."""
    root = os.path.join(workdir, "warm_start")
    path = os.path.join(root, _digest(config))
    if os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        logging.info("warm start: reusing %s", path)
        return path
    ws = config.warm_start
    start = time.time()
    task = synthetic_task(config)
    builder = data_lib.build_synthetic(os.path.join(workdir, "tfds"), task)
    sft_rows = data_lib.read_split(builder, "sft")
    staging = path + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    code_rows = code_demonstrations(config)
    corpus = data_lib.tokenizer_corpus(
        data_lib.generate_splits(task)["sft"],
        config.data.prompt_template,
        extra_texts=(config.sampler.interruption_phrase, *code_corpus(config, code_rows)),
    )
    data_lib.train_tokenizer(corpus, ws.tokenizer_vocab_size, staging)
    # Read back as the RL run reads any checkpoint, so SFT prompts are the RL prompts (bos + text).
    checkpoint = load_checkpoint_tokenizer(staging)
    tokenizer = checkpoint.tokenizer

    def demonstrations(rows: list[dict], template: str) -> tuple[np.ndarray, np.ndarray]:
        encoder = data_lib.PromptEncoder(
            tokenizer,
            data_lib.PromptFormat(template=template, max_prompt_tokens=config.data.max_prompt_tokens),
            special_tokens=checkpoint.special_tokens,
        )
        return data_lib.sft_arrays(
            rows, encoder, tokenizer, max_len=ws.max_len, eos_id=checkpoint.eos_id, pad_id=checkpoint.pad_id
        )

    sft_rows = with_direct_answers(sft_rows, ws.direct_answer_fraction, np.random.default_rng([ws.seed, 1]))
    tokens, masks = demonstrations(sft_rows, config.data.prompt_template)
    if code_rows:
        code_tokens, code_masks = demonstrations(code_rows, puzzle_template(config))
        tokens, masks = np.concatenate([tokens, code_tokens]), np.concatenate([masks, code_masks])

    model_config = get_preset(
        config.model.preset,
        **ws.model_overrides.to_dict(),
        vocab_size=tokenizer.get_vocab_size(),
        bos_token_id=checkpoint.bos_id,
        eos_token_id=checkpoint.eos_id,
        fp32_head=config.model.fp32_head,
    )
    model = Transformer(model_config, rngs=nnx.Rngs(ws.seed))
    warmup = min(ws.warmup_steps, ws.steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, ws.lr, warmup, max(ws.steps, warmup + 1), ws.lr * 0.1)
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=ws.weight_decay), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens, masks):
        loss, grads = nnx.value_and_grad(sft_loss)(model, tokens, masks)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(ws.seed)
    for i in range(ws.steps):
        batch = rng.integers(0, len(tokens), ws.batch_size)
        loss = step(model, optimizer, jnp.asarray(tokens[batch]), jnp.asarray(masks[batch]))
        if i % ws.log_every == 0 or i == ws.steps - 1:
            logging.info(
                "warm start: step %d/%d  sft loss %.4f  (%.0fs)", i + 1, ws.steps, float(loss), time.time() - start
            )
    save_hf(model, staging)
    with open(os.path.join(staging, COMPLETE_MARKER), "w") as f:
        json.dump({"steps": ws.steps, "final_loss": float(loss), "seconds": time.time() - start}, f)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(staging, path)
    logging.info("warm start: wrote %s in %.0fs", path, time.time() - start)
    return path


def checkpoint_dir(config: ml_collections.ConfigDict, workdir: str) -> str:
    """The HF directory `build_warm_start(config, workdir)` writes (whether built yet or not)."""
    return os.path.join(workdir, "warm_start", _digest(config))
