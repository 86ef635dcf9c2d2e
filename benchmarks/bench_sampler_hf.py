"""Our sampler vs Hugging Face transformers `generate` on the same tiny model and batch, on CPU.

A random `LlamaForCausalLM` is created with transformers, saved as safetensors and loaded with
`load_hf`, so both sides run the same weights; with `--checkpoint DIR` both sides load that local
Hugging Face directory instead (e.g. SmolLM2-135M-Instruct: `python tests/support/real_models.py smollm2`
prints it), in float32, and the prompts are random ids below its vocabulary size. Both decode the same batch of equal-length
prompts greedily for `--max_new` tokens (no EOS), HF with its KV cache (`generate`, batch =
all prompts), ours with `generate(..., num_slots=batch)`. Reported: generated tokens per second,
median over `--repeats` after one warm-up run each (ours compiles in the warm-up; the engine is
cached across calls), and whether the tokens agree.

  .venv/bin/python benchmarks/bench_sampler_hf.py
  .venv/bin/python benchmarks/bench_sampler_hf.py --checkpoint DIR --batch 64 --prompt_len 160 --max_new 64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch
import transformers

from scalerl_jax.models import load_hf
from scalerl_jax.sampler import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--max_new", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--chunk_size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpoint", default="", help="a local HF directory both sides load (default: random)")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * (args.prompt_len + args.max_new),
        initializer_range=0.15,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    if args.checkpoint:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
        model = load_hf(args.checkpoint, dtype="float32")
        config = hf_model.config
    else:
        hf_model = transformers.LlamaForCausalLM(config).eval()
        with tempfile.TemporaryDirectory() as path:
            hf_model.save_pretrained(path, safe_serialization=True)
            model = load_hf(path, dtype="float32")
    prompts = np.random.default_rng(0).integers(1, config.vocab_size, (args.batch, args.prompt_len))

    def run_hf() -> np.ndarray:
        with torch.no_grad():
            # transformers types generate's self as a GenerativePreTrainedModel protocol that its own
            # LlamaForCausalLM does not satisfy (hf_quantizer, encoder); the call is the documented one.
            out = hf_model.generate(  # pyright: ignore[reportAttributeAccessIssue]
                torch.tensor(prompts),
                attention_mask=torch.ones_like(torch.tensor(prompts)),
                max_new_tokens=args.max_new,
                min_new_tokens=args.max_new,  # a real checkpoint's end-of-sequence id does not stop it
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[:, args.prompt_len :].numpy()

    def run_ours() -> np.ndarray:
        completions = generate(
            model, prompts.tolist(), max_new_tokens=args.max_new, num_slots=args.batch, chunk_size=args.chunk_size
        )
        return np.array([c.tokens for c in completions])

    rates, outputs = {}, {}
    for name, run in (("transformers", run_hf), ("scalerl_jax", run_ours)):
        outputs[name] = run()  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        rates[name] = args.batch * args.max_new / statistics.median(times)
    agree = float((outputs["transformers"] == outputs["scalerl_jax"]).mean())
    model_name = args.checkpoint or f"random llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}"
    print(
        f"batch {args.batch} x prompt {args.prompt_len} -> {args.max_new} new tokens, greedy, {model_name}; "
        f"torch threads {torch.get_num_threads()}"
    )
    for name, rate in rates.items():
        print(f"{name:>12}: {rate:10.1f} tokens/s")
    print(
        f"ratio scalerl_jax/transformers: {rates['scalerl_jax'] / rates['transformers']:.2f}x "
        f"(target >= 2x); token agreement {agree:.3f}"
    )


if __name__ == "__main__":
    main()
