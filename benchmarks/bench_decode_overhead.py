"""What a decode step costs beyond the model's forward: the engine's chunk against a bare forward.

Both sides run `--chunk` decode steps in one jitted loop (so per-call dispatch is amortised the
same way) over the same weights, the same paged KV cache and the same live lengths: every slot
holds a prompt of `live` tokens (prefilled by the engine), and the chunk feeds one token per slot.
- forward (the floor): `forward_paged` (one token per slot, the engine's page view) + the fp32
  head + argmax (`sampling.first_argmax`: the next token, so the logits are consumed), nothing else.
- engine: `Engine.generate` as the batcher calls it (host page bookkeeping included), all slots
  active: sampling (temperature 1: top-k/top-p as configured, behaviour log-prob, PRNG per slot),
  stop / budget / interruption bookkeeping and the per-step output buffers; `greedy` is the same
  at temperature 0.
Printed per (model, batch, live length): ms per decode step (chunk wall time / steps, median of
`--repeats` after a compile run) and the ratios engine / forward (goal <= 1.15 at batch >= 32),
each the median of the per-repeat ratios: the sides run back to back in every repeat, so on a
shared, noisy CPU a ratio compares runs under about the same load.

  .venv/bin/python benchmarks/bench_decode_overhead.py
  .venv/bin/python benchmarks/bench_decode_overhead.py --models small --batches 32 --lives 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scalerl_jax.models import Transformer, get_preset
from scalerl_jax.sampler import Engine, EngineConfig
from scalerl_jax.sampler.engine import DecodeState, host_settings
from scalerl_jax.sampler.engine_config import InterruptionConfig
from scalerl_jax.sampler.sampling import first_argmax

# tiny: the tiny-llama preset (vocab 256), where fixed per-step costs show. small: a ~12M-parameter
# Llama-style model whose head (256 x 16,384) is a third of its weights, so the per-token work over
# the vocabulary (head, sampling) weighs more than in an 8B model (head ~7% of the weights).
MODELS = {
    "tiny": dict(max_position_embeddings=4096),
    "small": dict(
        vocab_size=16_384,
        hidden_size=256,
        intermediate_size=1024,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        max_position_embeddings=4096,
    ),
}


def bare_forward_chunk(engine: Engine, params, state: DecodeState, window: int, table, held, *, steps: int):
    """`steps` decode steps of the model alone: forward_paged + head + argmax per step."""
    model = nnx.merge(engine.graphdef, params)

    def body(_, current: DecodeState) -> DecodeState:
        view = engine._paged_view(current, window, table, held)
        hidden, cache, _ = model.forward_paged(current.tokens[:, None], current.positions[:, None], current.cache, view)
        tokens = first_argmax(model.head(hidden[:, 0]).astype(jnp.float32))
        return current._replace(cache=cache, tokens=tokens, positions=current.positions + 1)

    return jax.lax.fori_loop(0, steps, body, state)


def make_engine(graphdef, config, args, batch: int, live: int, interrupt: bool) -> Engine:
    interruption = (
        InterruptionConfig(
            phrase_ids=(1, 2, 3, 4, 5),
            end_think_ids=(7, 8),
            think_budget_min=10**6,
            think_budget_max=10**6,
            answer_budget=10**6,
        )
        if interrupt
        else None
    )
    return Engine(
        graphdef,
        config,
        EngineConfig(
            num_slots=batch,
            max_len=live + 2 * args.chunk,
            chunk_size=args.chunk,
            top_k=args.top_k,
            top_p=args.top_p,
            prefill_chunk=16,
            max_prefill_rows=batch,
            interruption=interruption,
        ),
    )


def fresh_state(engine: Engine, params, prompts: np.ndarray, temperature: float) -> DecodeState:
    """Every slot holds one prompt (KV length = prompt length), decoding with no end in sight."""
    slots = prompts.shape[0]
    settings = host_settings(
        seeds=np.zeros(slots),
        streams=np.arange(slots),
        max_new_tokens=np.full(slots, 10**6),
        temperature=np.full(slots, temperature),
        stop_tokens=np.full((slots, engine.config.max_stop_tokens), -1),
        interrupt=np.full(slots, engine.config.interruption is not None),
    )
    state = engine.start_prompts(params, engine.init_decode_state(), range(slots), prompts.tolist(), settings)
    return jax.block_until_ready(state)


def measure(engine: Engine, params, prompts: np.ndarray, repeats: int) -> dict[str, float]:
    """Median ms per decode step of: forward, engine (temperature 1), greedy (temperature 0), and
    the medians of the per-repeat ratios engine / forward and greedy / forward (the three run back
    to back in each repeat, so a ratio compares runs under the same load)."""
    chunk = engine.config.chunk_size
    forward = jax.jit(bare_forward_chunk, static_argnums=(0, 3), static_argnames=("steps",), donate_argnums=(2,))
    times: dict[str, list[float]] = {"forward": [], "engine": [], "greedy": []}
    for rep in range(repeats + 1):  # the first run compiles
        for name in times:
            state = fresh_state(engine, params, prompts, 0.0 if name == "greedy" else 1.0)
            start = time.perf_counter()
            if name == "forward":
                window, table, held = engine.prepare_chunk()
                out = forward(engine, params, state, window, table, held, steps=chunk)
                steps = chunk
            else:
                out, result = engine.generate(params, state)
                steps = int(result.steps)
                assert steps == chunk, steps
            jax.block_until_ready(out)
            if rep:
                times[name].append(1e3 * (time.perf_counter() - start) / steps)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name in ("engine", "greedy"):
        medians[f"{name}/forward"] = statistics.median(a / b for a, b in zip(times[name], times["forward"]))
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,small", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--batches", default="8,32,64")
    parser.add_argument("--lives", default="64,512", help="live (KV) lengths")
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--interrupt", action="store_true", help="forced interruption on (never reached)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    print(
        f"backend {jax.default_backend()}, chunk {args.chunk}, top_k {args.top_k}, top_p {args.top_p}, "
        f"interruption {'on' if args.interrupt else 'off'}; ms per decode step, median of {args.repeats}"
    )
    print(
        f"{'model':<7}{'params':>8}{'batch':>7}{'live':>6}{'forward':>10}{'engine':>10}{'greedy':>10}"
        f"{'eng/fwd':>9}{'grd/fwd':>9}"
    )
    for name in args.models.split(","):
        config = get_preset("tiny-llama", **MODELS[name])
        graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
        count = sum(leaf.size for leaf in jax.tree.leaves(params))
        rng = np.random.default_rng(0)
        for batch in (int(b) for b in args.batches.split(",")):
            for live in (int(n) for n in args.lives.split(",")):
                engine = make_engine(graphdef, config, args, batch, live, args.interrupt)
                prompts = rng.integers(0, config.vocab_size, (batch, live))
                ms = measure(engine, params, prompts, args.repeats)
                print(
                    f"{name:<7}{count / 1e6:>7.1f}M{batch:>7}{live:>6}{ms['forward']:>10.3f}{ms['engine']:>10.3f}"
                    f"{ms['greedy']:>10.3f}{ms['engine/forward']:>9.2f}{ms['greedy/forward']:>9.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
