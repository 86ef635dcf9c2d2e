"""Cluster planning: simulated utilization of PipelineRL-k vs PPO-off-policy-k (pipeline/sim.py).

Default: the paper's setting, 64 generator GPUs and 16 trainer GPUs, 48 prompts x 16 completions
= 768 completions per step, prompts of 1,024 tokens and completions up to 15,360 (16k total),
long-tailed lengths (lognormal, median 4,000, prompt-level sigma 0.5 and sample-level sigma 0.6).
Per-token costs default to an 8B dense model on H100-class GPUs, derived from hardware numbers
(replace them with measured ones from the sampler and train-step benchmarks):
  decode_step_s      6.0e-3  16 GB of bf16 weights read per decode step at ~2.7 TB/s
  decode_slot_s      2.0e-5  2 x 8e9 FLOP per token at ~800 TFLOP/s
  decode_kv_token_s  4.9e-8  131 kB of K/V per cached token (32 layers, 8 kv heads, 128 dims,
                             bf16) read per step at ~2.7 TB/s
  prefill_token_s    3.2e-5  2 x 8e9 FLOP per token at ~50% of 989 TFLOP/s
  train_token_s      1.0e-4  6 x 8e9 FLOP per token (forward + backward) at ~50% MFU
  weight_push_s 1.0, weight_load_s 0.5  broadcasting 16 GB to the generators
Each row is a separate simulated run of `--steps` trainer steps (the first k + 2 excluded);
ratios are samples/s over PPO-off-policy with the same k.

  .venv/bin/python benchmarks/sim_cluster.py [--ks 1,2,4,8] [--steps 40] [--train_token_s 1e-4]

Evaluation (`--eval_every N`, the recipe's: 100 steps, 1,000 prompts x 16 samples, lengths as
training's): PipelineRL-k without evaluation, then once per `--eval_modes` entry: 'blocking' (the
trainer waits for every evaluation, today's pipeline) and 'async' (evaluation requests go first
on the generators while the trainer keeps stepping); with `--eval_spare_slots` also each mode with
evaluation requests only in the slots training leaves free. `trn idle` counts the evaluation wait;
`eval wait` is the part of it spent waiting for an evaluation. Without `--steps`, each run is
k + 2 warm-up steps plus `--eval_periods` whole evaluation periods.

  .venv/bin/python benchmarks/sim_cluster.py --ks 8 --eval_every 100 --eval_modes blocking,async

Split (`--pick_split`): simulates PipelineRL-k at every generator / trainer split of the cluster's
devices whose trainer count divides `--rows_per_microbatch` (the recipe's 768 / 48 = 16) and picks
the one of highest samples/s (`sim.pick_split`), the way `mesh.generator_fraction='auto'` would
for the cluster.

  .venv/bin/python benchmarks/sim_cluster.py --ks 8 --pick_split --rows_per_microbatch 768
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from scalerl_jax.pipeline.sim import EVAL_MODES, ClusterSpec, EvalSpec, pick_split, simulate


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ks", default="1,2,4,8", help="comma-separated k values")
    parser.add_argument("--steps", type=int, default=None, help="trainer steps per simulated run (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval_every", type=int, default=0, help="evaluate every N steps (0: the k table)")
    parser.add_argument("--eval_prompts", type=int, default=1000)
    parser.add_argument("--eval_samples", type=int, default=16)
    parser.add_argument("--eval_modes", default="blocking,async", help=f"comma-separated, of {EVAL_MODES}")
    parser.add_argument(
        "--eval_spare_slots",
        action="store_true",
        help="also each mode with evaluation only in the slots training leaves free (no priority)",
    )
    parser.add_argument("--eval_periods", type=int, default=3, help="evaluation periods per run without --steps")
    parser.add_argument("--pick_split", action="store_true", help="simulate the device splits and pick one")
    parser.add_argument("--rows_per_microbatch", type=int, default=16, help="--pick_split: trainer counts divide it")
    for field in dataclasses.fields(ClusterSpec):
        parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    spec = ClusterSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ClusterSpec)})
    ks = [int(k) for k in args.ks.split(",")]
    describe(spec)
    if args.pick_split:
        split_table(args, spec, ks)
    elif args.eval_every:
        eval_table(args, spec, ks)
    else:
        k_table(args, spec, ks)


def describe(spec: ClusterSpec) -> None:
    print(
        f"cluster: {spec.num_generators} generator GPUs x {spec.slots_per_generator} slots, "
        f"{spec.num_trainers} trainer GPUs; {spec.prompts_per_step} x {spec.samples_per_prompt} "
        f"= {spec.prompts_per_step * spec.samples_per_prompt} completions per step, "
        f"completions <= {spec.max_completion_tokens} tokens (median {spec.length_median:.0f})"
    )


def k_table(args: argparse.Namespace, spec: ClusterSpec, ks: list[int]) -> None:
    steps = args.steps or 40
    header = (
        f"{'schedule':<18}{'step s':>8}{'samples/s':>10}{'vs PPO':>8}{'GPU util':>9}"
        f"{'gen busy':>9}{'gen slots':>10}{'trn busy':>9}{'gen idle':>9}{'trn idle':>9}"
        f"{'lag mean':>9}{'lag max':>8}{'span':>6}"
    )
    print(header)
    for k in ks:
        rows = {}
        for schedule in ("ppo_off_policy", "pipeline"):
            start = time.perf_counter()
            rows[schedule] = (
                simulate(spec, schedule=schedule, k=k, num_steps=steps, seed=args.seed),
                time.perf_counter() - start,
            )
        base = rows["ppo_off_policy"][0].samples_per_s
        for schedule, (r, seconds) in rows.items():
            name = f"{'PipelineRL' if schedule == 'pipeline' else 'PPO-off-policy'}-{k}"
            print(
                f"{name:<18}{r.step_time_s:>8.1f}{r.samples_per_s:>10.2f}"
                f"{r.samples_per_s / base:>7.2f}x{r.gpu_utilization:>9.2f}"
                f"{r.generator_busy_frac:>9.2f}{r.generator_slot_util:>10.2f}"
                f"{r.trainer_busy_frac:>9.2f}{r.generator_idle_frac:>9.2f}"
                f"{r.trainer_idle_frac:>9.2f}{r.lag_mean:>9.2f}{r.lag_max:>8d}"
                f"{r.versions_spanned_mean:>6.2f}   ({seconds:.1f} s to simulate)"
            )


def eval_table(args: argparse.Namespace, spec: ClusterSpec, ks: list[int]) -> None:
    modes = [m for m in args.eval_modes.split(",") if m]
    print(
        f"evaluation every {args.eval_every} steps: {args.eval_prompts} prompts x {args.eval_samples} samples "
        f"= {args.eval_prompts * args.eval_samples} completions"
    )
    print(
        f"{'run':<34}{'steps':>6}{'step s':>8}{'samples/s':>10}{'vs none':>8}{'trn idle':>9}"
        f"{'eval wait':>10}{'gen idle':>9}{'evals':>6}{'eval s':>8}{'lag max':>8}"
    )
    for k in ks:
        steps = args.steps or (k + 2 + args.eval_periods * args.eval_every)
        runs: list[tuple[str, EvalSpec | None]] = [("none", None)]
        runs += [(m, EvalSpec(args.eval_every, args.eval_prompts, args.eval_samples, mode=m)) for m in modes]
        if args.eval_spare_slots:
            runs += [
                (f"{m} spare", EvalSpec(args.eval_every, args.eval_prompts, args.eval_samples, mode=m, priority=False))
                for m in modes
            ]
        base = None
        for name, evaluation in runs:
            start = time.perf_counter()
            r = simulate(spec, schedule="pipeline", k=k, num_steps=steps, seed=args.seed, evaluation=evaluation)
            seconds = time.perf_counter() - start
            base = base or r.samples_per_s
            label = f"PipelineRL-{k} eval {name}"
            print(
                f"{label:<34}{r.steps:>6d}{r.step_time_s:>8.1f}{r.samples_per_s:>10.2f}"
                f"{r.samples_per_s / base:>7.2f}x{r.trainer_idle_frac:>9.3f}{r.trainer_eval_wait_frac:>10.3f}"
                f"{r.generator_idle_frac:>9.3f}{r.evals:>6d}{r.eval_s_mean:>8.0f}{r.lag_max:>8d}"
                f"   ({seconds:.1f} s to simulate)"
            )


def split_table(args: argparse.Namespace, spec: ClusterSpec, ks: list[int]) -> None:
    total = spec.num_generators + spec.num_trainers
    counts = [g for g in range(1, total) if args.rows_per_microbatch % (total - g) == 0]
    evaluation = (
        EvalSpec(args.eval_every, args.eval_prompts, args.eval_samples, mode=args.eval_modes.split(",")[0])
        if args.eval_every
        else None
    )
    for k in ks:
        start = time.perf_counter()
        choice = pick_split(
            spec,
            total,
            counts,
            schedule="pipeline",
            k=k,
            num_steps=args.steps or 40,
            seed=args.seed,
            evaluation=evaluation,
        )
        print(choice.reasoning)
        print(
            f"mesh.generator_fraction = {choice.num_generators}/{total} = {choice.num_generators / total:.4f}"
            f"   ({time.perf_counter() - start:.1f} s to simulate)"
        )


if __name__ == "__main__":
    main()
