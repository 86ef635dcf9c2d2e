"""Idle fractions and throughput: PipelineRL-8 vs PPO-off-policy-8 on CPU, real sampler and step.

A tiny random Llama generates on CPU device 0 (continuous batching, 16 slots); the jitted train
step runs on device 1; params are pushed with `jax.device_put`. Completions stop at a stop token
(token 1, probability ~1/vocab per step under the random model, so lengths are geometric: long
tailed) or at --max_new_tokens. Both schedules run the same number of steps with the same
G x n batch, alternating, --repeats times after a warm-up run that compiles every shape; the
medians are printed with the ratio PipelineRL / PPO. Idle fractions: trainer = time waiting
for a batch / wall time; generator = time blocked with nothing to decode / wall time. On 2 CPU
cores the two threads compete for the same cores, so the overlap PipelineRL buys on disjoint
accelerators shows here mostly as less waiting, not as the full speed-up (see sim_cluster.py).

  .venv/bin/python benchmarks/bench_pipeline_idle.py [--steps 16] [--repeats 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from scalerl_jax.models import Transformer, get_preset  # noqa: E402
from scalerl_jax.pipeline.config import PipelineConfig  # noqa: E402
from scalerl_jax.pipeline.group import Prompt  # noqa: E402
from scalerl_jax.pipeline.pipeline_rl import Pipeline  # noqa: E402
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig  # noqa: E402
from scalerl_jax.train import (
    OptimizerConfig,
    TrainStepConfig,
    create_train_state,  # noqa: E402
    make_optimizer,
    make_train_step,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16, help="train steps per run (a multiple of k)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts_per_step", type=int, default=4)
    parser.add_argument("--samples_per_prompt", type=int, default=4)
    parser.add_argument("--num_slots", type=int, default=16)
    parser.add_argument("--chunk_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--vocab_size", type=int, default=64)
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    return parser.parse_args()


class Bench:
    """Model, engine and train step compiled once; `run()` makes a fresh pipeline each time."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.config = get_preset(
            "tiny-llama",
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            intermediate_size=2 * args.hidden_size,
            num_layers=args.num_layers,
            num_heads=4,
            num_kv_heads=2,
            head_dim=args.hidden_size // 4,
        )
        self.graphdef, self.params = nnx.split(Transformer(self.config, rngs=nnx.Rngs(0)))
        self.max_len = 16 + args.max_new_tokens
        self.engine = Engine(
            self.graphdef,
            self.config,
            EngineConfig(num_slots=args.num_slots, max_len=self.max_len, chunk_size=args.chunk_size),
        )
        self.optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-4, warmup_steps=0))
        self.step = make_train_step(self.graphdef, self.optimizer, TrainStepConfig(logprob_chunk_size=32))
        self.generator_device, self.trainer_device = jax.devices()[0], jax.devices()[1]

    def run(self, schedule: str, num_steps: int):
        args = self.args
        copy = lambda: jax.tree.map(lambda x: x.copy(), self.params)
        batcher = ContinuousBatcher(self.engine, jax.device_put(copy(), self.generator_device))
        state = create_train_state(jax.device_put(copy(), self.trainer_device), self.optimizer)
        rng = np.random.default_rng(0)
        keys = iter(range(10**9))

        def prompt_source():
            length = int(rng.integers(4, 12))
            return Prompt(next(keys), tuple(rng.integers(3, args.vocab_size, size=length).tolist()))

        def reward_fn(prompt, completions):
            return [1.0 if len(c.tokens) % 2 == 0 else -1.0 for c in completions]

        pipeline = Pipeline(
            PipelineConfig(
                schedule=schedule,
                k=args.k,
                prompts_per_step=args.prompts_per_step,
                samples_per_prompt=args.samples_per_prompt,
                num_steps=num_steps,
                max_new_tokens=args.max_new_tokens,
                max_seq_len=self.max_len,
                min_length_bucket=self.max_len,
                temperature=1.0,
                stop_tokens=(1,),
            ),
            batcher=batcher,
            prompt_source=prompt_source,
            reward_fn=reward_fn,
            train_step=self.step,
            train_state=state,
        )
        result = pipeline.run()
        wall = result.wall_s
        waits = result.waits
        trained = len(result.trained_group_ids) * args.samples_per_prompt
        return {
            "trainer idle": waits.trainer_waiting_for_data / wall,
            "generator idle": (waits.generator_blocked_lag + waits.generator_blocked_full) / wall,
            "samples/s": trained / wall,
            "generated tok/s": result.generator.generated_tokens / wall,
            "wall s": wall,
        }


def main() -> None:
    args = parse_args()
    if args.steps % args.k:
        raise ValueError(f"--steps={args.steps} must be a multiple of --k={args.k} (whole PPO phases)")
    bench = Bench(args)
    print(
        f"devices: generator {bench.generator_device}, trainer {bench.trainer_device}; "
        f"G={args.prompts_per_step} x n={args.samples_per_prompt}, k={args.k}, "
        f"{args.steps} steps per run, {args.repeats} repeats"
    )
    bench.run("pipeline", 2)  # compile every shape
    bench.run("ppo_off_policy", args.k)
    results = {"pipeline": [], "ppo_off_policy": []}
    for _ in range(args.repeats):
        for schedule in results:
            results[schedule].append(bench.run(schedule, args.steps))
    names = list(results["pipeline"][0])
    medians = {s: {n: statistics.median(r[n] for r in runs) for n in names} for s, runs in results.items()}
    print(f"{'median':<22}" + "".join(f"{n:>17}" for n in names))
    for schedule, label in (("ppo_off_policy", f"PPO-off-policy-{args.k}"), ("pipeline", f"PipelineRL-{args.k}")):
        print(f"{label:<22}" + "".join(f"{medians[schedule][n]:>17.3f}" for n in names))
    ratio = medians["pipeline"]["samples/s"] / medians["ppo_off_policy"]["samples/s"]
    print(f"samples/s PipelineRL-{args.k} / PPO-off-policy-{args.k}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
