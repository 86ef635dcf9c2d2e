"""Our sampler vs Hugging Face transformers `generate` on the same tiny model and batch, on CPU.

A random `LlamaForCausalLM` is created with transformers, saved as safetensors and loaded with
`load_hf`, so both sides run the same weights; with `--checkpoint DIR` both sides load that local
Hugging Face directory instead (e.g. SmolLM2-135M-Instruct: `python tests/support/real_models.py smollm2`
prints it), in float32, and the prompts are random ids below its vocabulary size. Both decode the same batch of equal-length
prompts greedily for `--max_new` tokens (no EOS), HF with its KV cache (`generate`, batch =
all prompts), ours with `generate(..., num_slots=batch)`. Reported: generated tokens per second,
median over `--repeats` after one warm-up run each (ours compiles in the warm-up; the engine is
cached across calls), and whether the tokens agree.

The RL shape (`--gsm8k FILE --samples G`, with `--checkpoint`): the first `--batch` questions of a
GSM8K jsonl, each the one user message of the checkpoint's chat template (prompts of their own
lengths, left padded for transformers), each sampled G times at `--temperature` up to `--max_new`
tokens, stopping at the checkpoint's end-of-sequence id (so completion lengths are long-tailed,
as in a run). transformers: one `generate` with `num_return_sequences=G`; ours: the batch x G
requests on as many slots, once with the samples of a prompt sharing its KV pages (one prefill per
prompt) and once each prefilling its own copy (`share_prompts=False`). Rates count completion
tokens up to and including the end-of-sequence token.

  .venv/bin/python benchmarks/bench_sampler_hf.py
  .venv/bin/python benchmarks/bench_sampler_hf.py --checkpoint DIR --batch 64 --prompt_len 160 --max_new 64
  .venv/bin/python benchmarks/bench_sampler_hf.py --checkpoint DIR --gsm8k ../shared/data/gsm8k/train.jsonl \
      --batch 8 --samples 8 --max_new 128 --temperature 1.0
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import torch
import transformers
from flax import nnx

from scalerl_jax.models import load_hf
from scalerl_jax.sampler import ContinuousBatcher, EngineConfig, Request, generate
from scalerl_jax.sampler.api import cached_engine
from scalerl_jax.sampler.engine import doubled_bucket, row_bucket


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
    parser.add_argument("--gsm8k", default="", help="RL shape: GSM8K jsonl whose questions are the prompts")
    parser.add_argument("--samples", type=int, default=8, help="RL shape: samples per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="RL shape: sampling temperature")
    args = parser.parse_args()
    if args.gsm8k:
        if not args.checkpoint:
            parser.error("--gsm8k needs --checkpoint (its tokenizer, chat template and end-of-sequence id)")
        rl_shape(args)
        return

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


def rl_shape(args: argparse.Namespace) -> None:
    """The RL shape (module docstring): prompts of their own lengths, G samples each, EOS stops."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.checkpoint)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    model = load_hf(args.checkpoint, dtype="float32")
    eos = int(hf_model.generation_config.eos_token_id or hf_model.config.eos_token_id)
    with open(args.gsm8k) as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(args.batch), f)]
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(len(p) for p in prompts)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    padded = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def completion_tokens(rows: list[list[int]]) -> int:
        """Tokens of each row up to and including its first end-of-sequence token."""
        return sum(row.index(eos) + 1 if eos in row else len(row) for row in rows)

    def run_hf() -> int:
        with torch.no_grad():
            out = hf_model.generate(  # pyright: ignore[reportAttributeAccessIssue]
                padded,
                attention_mask=mask,
                max_new_tokens=args.max_new,
                do_sample=True,
                temperature=args.temperature,
                top_k=0,
                top_p=1.0,
                num_return_sequences=args.samples,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        return completion_tokens(out[:, width:].tolist())

    graphdef, params = nnx.split(model)
    prefill_work: dict[bool, tuple[float, float]] = {}

    def run_ours(share: bool) -> int:
        repeated = [prompt for prompt in prompts for _ in range(args.samples)]
        longest = width + args.max_new
        engine = cached_engine(
            graphdef,
            model.config,
            EngineConfig(
                num_slots=len(repeated),
                max_len=doubled_bucket(longest, min_bucket=16, max_len=2 * longest),
                chunk_size=args.chunk_size,
                share_prompts=share,
            ),
        )
        batcher = ContinuousBatcher(engine, params)
        for index, prompt in enumerate(repeated):
            batcher.add_request(
                Request(index, prompt, args.max_new, seed=index, temperature=args.temperature, stop_tokens=(eos,))
            )
        completions = batcher.drain()
        prefill_work[share] = (batcher.counters["prefill_tokens"], batcher.counters["prefill_computed_tokens"])
        return completion_tokens([c.tokens for c in completions])

    runs = {
        "transformers": run_hf,
        "ours, shared prompts": lambda: run_ours(True),
        "ours, unshared": lambda: run_ours(False),
    }
    rates, tokens = {}, {}
    for name, run in runs.items():
        run()  # warm-up (ours: compiles)
        times, counts = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            counts.append(run())
            times.append(time.perf_counter() - start)
        rates[name] = statistics.median(c / t for c, t in zip(counts, times))
        tokens[name] = statistics.median(counts)
    lengths = sorted(len(p) for p in prompts)
    print(
        f"{args.batch} GSM8K prompts ({lengths[0]}-{lengths[-1]} tokens, median {lengths[len(lengths) // 2]}) x "
        f"{args.samples} samples at temperature {args.temperature}, up to {args.max_new} new tokens, stop at EOS; "
        f"{args.checkpoint}; torch threads {torch.get_num_threads()}; median of {args.repeats}"
    )
    for name, rate in rates.items():
        print(f"{name:>22}: {rate:8.1f} completion tokens/s ({tokens[name]:.0f} tokens a run)")
    before = bucketed_prefill_tokens([len(p) for p in prompts for _ in range(args.samples)])
    print(
        f"prefill tokens computed (padding): before, each sample's prompt in power-of-two buckets "
        f"{before:,} ({1 - lengths_sum(prompts, args.samples) / before:.0%}); unshared pieces "
        f"{prefill_work[False][1]:,.0f} ({1 - prefill_work[False][0] / prefill_work[False][1]:.0%}); shared pieces "
        f"{prefill_work[True][1]:,.0f} ({1 - prefill_work[True][0] / prefill_work[True][1]:.0%})"
    )
    hf = rates["transformers"]
    print(
        f"ratio ours/transformers: shared {rates['ours, shared prompts'] / hf:.2f}x (target >= 2x), "
        f"unshared {rates['ours, unshared'] / hf:.2f}x; shared/unshared "
        f"{rates['ours, shared prompts'] / rates['ours, unshared']:.2f}x"
    )


def lengths_sum(prompts: list[list[int]], samples: int) -> int:
    """Prompt tokens of every sample."""
    return samples * sum(len(p) for p in prompts)


def bucketed_prefill_tokens(lengths: list[int], *, min_bucket: int = 16, max_rows: int = 8) -> int:
    """Tokens the prefill computed before it ran in pieces: each prompt whole in the smallest
    power-of-two multiple of `min_bucket` holding it, prompts of a bucket in calls of at most
    `max_rows` rows padded to a power of two."""
    by_bucket: dict[int, int] = {}
    for length in lengths:
        bucket = doubled_bucket(length, min_bucket=min_bucket, max_len=1 << 30)
        by_bucket[bucket] = by_bucket.get(bucket, 0) + 1
    total = 0
    for bucket, count in by_bucket.items():
        full, rest = divmod(count, max_rows)
        total += bucket * (full * max_rows + (row_bucket(rest, max_rows=max_rows) if rest else 0))
    return total


if __name__ == "__main__":
    main()
