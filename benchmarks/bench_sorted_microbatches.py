"""Length-sorted microbatches vs one padded batch: padding fraction and trained tokens/s.

Part 1 (host only, full scale): sequence lengths (prompt + completion) drawn from a lognormal
whose mean after capping at max_len is fitted to `--mean` (paper-like: 768 rows, mean ~9k, cap
16,384, 48 microbatches). For each layout, the padding fraction 1 - (sum of lengths) / (token
positions the step computes), the median over `--draws` batches, and the number of distinct
microbatch shapes per batch / in all draws:
  unsorted     every row padded to the bucket of the batch's longest row (today's step)
  sorted k/oct rows sorted by length into the microbatches, each padded to its own bucket,
               k buckets per octave (`pipeline.batching.octave_buckets`)
Part 2 (tiny model on CPU, same process): the same distribution scaled down (`--tiny_*`); the
unsorted `TrainStep` (power-of-two buckets, as today) vs `SortedTrainStep` (8 per octave) on the
same groups, steps interleaved, median step wall time after warm-up (every shape compiled);
prints trained tokens/s (real prompt + completion tokens per second) and the ratio.

  .venv/bin/python benchmarks/bench_sorted_microbatches.py [--draws 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from scalerl_jax.models import Transformer, get_preset
from scalerl_jax.pipeline.batching import build_train_batch, octave_buckets, padding_fraction, plan_sorted_microbatches
from scalerl_jax.pipeline.group import Group, Prompt
from scalerl_jax.sampler import Completion
from scalerl_jax.train import OptimizerConfig, TrainStepConfig, create_train_state, make_optimizer, make_train_step


def capped_lognormal_lengths(rng, rows: int, *, mean: float, max_len: int, min_len: int, sigma: float) -> np.ndarray:
    """`rows` lengths min(max_len, max(min_len, round(X))), X lognormal(mu, sigma), with mu set
    by bisection so that the capped mean (over a large sample) is `mean`."""
    z = np.random.default_rng(12345).standard_normal(200_000)
    low, high = 0.0, np.log(max_len) + 3 * sigma
    for _ in range(60):
        mu = (low + high) / 2
        capped = np.clip(np.exp(mu + sigma * z), min_len, max_len).mean()
        low, high = (mu, high) if capped < mean else (low, mu)
    return np.clip(np.round(np.exp(mu + sigma * rng.standard_normal(rows))), min_len, max_len).astype(np.int64)


def layout_padding(
    lengths: np.ndarray, layout: str, microbatches: int, min_bucket: int, max_len: int
) -> tuple[float, tuple[int, ...]]:
    """(padding fraction, the microbatch lengths) of one batch in `layout` ('unsorted' or
    'sorted:K')."""
    if layout == "unsorted":
        bucket = next(b for b in octave_buckets(min_bucket, max_len, 1) if b >= lengths.max())
        return padding_fraction(lengths, len(lengths) * bucket), (bucket,)
    per_octave = int(layout.split(":")[1])
    plan = plan_sorted_microbatches(lengths, microbatches, octave_buckets(min_bucket, max_len, per_octave))
    return padding_fraction(lengths, plan.padded_tokens), plan.lengths


def host_part(args) -> None:
    print(
        f"\n[padding, host] {args.rows} rows, {args.microbatches} microbatches, lognormal sigma "
        f"{args.sigma} fitted to mean {args.mean}, cap {args.max_len}; median of {args.draws} draws"
    )
    rng = np.random.default_rng(0)
    draws = [
        capped_lognormal_lengths(
            rng, args.rows, mean=args.mean, max_len=args.max_len, min_len=args.min_len, sigma=args.sigma
        )
        for _ in range(args.draws)
    ]
    print(
        f"  sample: mean {np.mean(draws):.0f}, median {np.median(draws):.0f}, "
        f"at the cap {np.mean(np.asarray(draws) == args.max_len):.1%}"
    )
    baseline = None
    for layout in ["unsorted"] + [f"sorted:{k}" for k in args.per_octave.split(",")]:
        results = [layout_padding(d, layout, args.microbatches, args.min_bucket, args.max_len) for d in draws]
        fraction = statistics.median(r[0] for r in results)
        per_batch = statistics.median(len(set(r[1])) for r in results)
        in_all = len({t for r in results for t in r[1]})
        baseline = fraction if baseline is None else baseline
        print(
            f"  {layout:<10} padding {fraction:6.1%}  computed positions: "
            f"{(1 - baseline) / (1 - fraction):.2f} of unsorted's  microbatch shapes per batch "
            f"{per_batch:.0f}, in all draws {in_all}"
        )


def groups_from_lengths(rng, lengths: np.ndarray, *, group_size: int, prompt_len: int, vocab: int) -> list[Group]:
    """Groups of `group_size` completions whose prompt + completion lengths are `lengths`."""
    groups = []
    for g in range(len(lengths) // group_size):
        prompt = tuple(rng.integers(1, vocab, prompt_len).tolist())
        completions = []
        for total in lengths[g * group_size : (g + 1) * group_size]:
            n = max(int(total) - prompt_len, 1)
            completions.append(
                Completion(
                    request_id=None,
                    prompt_tokens=[],
                    tokens=rng.integers(1, vocab, n).tolist(),
                    logprobs=(-rng.uniform(0.5, 3.0, n)).tolist(),
                    versions=[0] * n,
                    sampled=[True] * n,
                    interrupted=False,
                    truncated=False,
                    num_think_tokens=0,
                    num_answer_tokens=0,
                    finish_reason="stop",
                    think_budget=-1,
                )
            )
        rewards = np.where(rng.random(group_size) < 0.5, 1.0, -1.0).astype(np.float32)
        rewards[0], rewards[1] = 1.0, -1.0  # no zero-variance group
        groups.append(Group(g, Prompt(g, prompt), admit_version=0, completions=tuple(completions), rewards=rewards))
    return groups


def device_part(args) -> None:
    rows, max_len = args.tiny_rows, args.tiny_max_len
    lengths = capped_lognormal_lengths(
        np.random.default_rng(1),
        rows,
        mean=args.tiny_mean,
        max_len=max_len,
        min_len=args.tiny_prompt + 1,
        sigma=args.sigma,
    )
    groups = groups_from_lengths(
        np.random.default_rng(2), lengths, group_size=args.tiny_group, prompt_len=args.tiny_prompt, vocab=args.vocab
    )
    config = get_preset(
        "tiny-llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=args.hidden // 4,
        max_position_embeddings=max(512, max_len),
    )
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    optimizer = make_optimizer(OptimizerConfig())
    runs = []
    for sort in (False, True):
        buckets = octave_buckets(args.tiny_min_bucket, max_len, 8 if sort else 1)
        batch, info = build_train_batch(
            groups, rows=rows, length_buckets=buckets, microbatches=args.tiny_microbatches if sort else None
        )
        step = make_train_step(
            graphdef,
            optimizer,
            TrainStepConfig(num_microbatches=args.tiny_microbatches, logprob_chunk_size=128, sort_by_length=sort),
        )
        state = create_train_state(jax.tree.map(lambda x: x.copy(), params), optimizer)
        runs.append([step, state, jax.device_put(batch), info, []])
    print(
        f"\n[tiny model, CPU] {rows} rows, {args.tiny_microbatches} microbatches, lengths mean "
        f"{lengths.mean():.0f} cap {max_len}; hidden {args.hidden}, {args.layers} layers; "
        f"median of {args.repeats} steps after {args.warmup} warm-up"
    )
    for run in runs:
        for _ in range(args.warmup):
            run[1], metrics = run[0](run[1], run[2])
        jax.block_until_ready(metrics)
    for _ in range(args.repeats):
        for run in runs:  # interleaved: a change of machine load hits both alike
            start = time.perf_counter()
            run[1], metrics = run[0](run[1], run[2])
            jax.block_until_ready(metrics)
            run[4].append(time.perf_counter() - start)
    rates = []
    for name, (step, _, _, info, times) in zip(("unsorted", "sorted 8/oct"), runs):
        median = statistics.median(times)
        rates.append(info.sequence_tokens / median)
        shapes = sorted({t for _, t in info.padded_shapes})
        print(
            f"  {name:<13} padding {info.padding_frac:6.1%}  {median * 1e3:8.1f} ms/step  "
            f"{rates[-1]:9.0f} trained tokens/s  lengths {shapes}  compiled programs {step.num_traces}"
        )
    print(f"  sorted / unsorted trained tokens/s: {rates[1] / rates[0]:.2f}x")


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=768)
    parser.add_argument("--microbatches", type=int, default=48)
    parser.add_argument("--mean", type=float, default=9000)
    parser.add_argument("--max_len", type=int, default=16384)
    parser.add_argument("--min_len", type=int, default=256)
    parser.add_argument("--min_bucket", type=int, default=32)  # the runner's min_length_bucket
    parser.add_argument("--sigma", type=float, default=0.6)
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--per_octave", default="1,4,8")
    parser.add_argument("--tiny_rows", type=int, default=32)
    parser.add_argument("--tiny_group", type=int, default=4)
    parser.add_argument("--tiny_microbatches", type=int, default=8)
    parser.add_argument("--tiny_mean", type=float, default=140)
    parser.add_argument("--tiny_max_len", type=int, default=256)
    parser.add_argument("--tiny_prompt", type=int, default=32)
    parser.add_argument("--tiny_min_bucket", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip_device", action="store_true", help="only the host part")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    host_part(args)
    if not args.skip_device:
        device_part(args)


if __name__ == "__main__":
    main()
