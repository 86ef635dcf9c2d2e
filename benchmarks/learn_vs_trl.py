"""Learning side by side with TRL: the same model, task, prompts and budget, one evaluator.

Ours is a run of --config whose evaluations are off its clock, as TRL's are off TRL's: only the
start is evaluated in the run (8 prompts), and its checkpoints are what `evaluate` scores. Then
three commands, run one after the other on an otherwise idle machine:

  trl       TRL's GRPOTrainer on the arithmetic ladder of --config (the problems a run of that
            config trains on, phrased by its prompt template inside the checkpoint's chat
            template), for --budget_min minutes of wall time from the command's start, its policy
            saved as a Hugging Face directory every --save_every_min minutes and at the end
            (OUT/policy_<step>, listed with their elapsed seconds in OUT/saves.jsonl; per-step
            reward and length in OUT/steps.jsonl).
  evaluate  every saved policy of both sides through `python -m scalerl_jax.cli.evaluate` on the
            config's held-out split, with the same samples and seed: ours are the run's
            checkpoints (`--step`; with --budget_min, those within that budget), theirs the saved
            directories, and the base checkpoint once as
            the start of both curves; wall time of ours = the run's `compute/wall_hours` at that
            step (its compute meter starts within seconds of the process).
  report    a table and a plot (pass rate against wall-clock minutes) of the evaluations, and the
            wall time at which ours first reaches TRL's final pass rate.

What both sides share, read from --config (configs/smollm2_arith.py): prompts per step and
generations per prompt (TRL: per_device_train_batch_size = prompts x generations,
num_generations = generations), learning rate with the same linear warmup (lr * min(1, (t+1) /
warmup) for update t, then constant), AdamW betas, epsilon, weight decay and gradient clipping,
sampling temperature (top-p 1, no top-k), completion length, the CISPO loss with the importance
weight truncated at rl.eps_max (TRL loss_type='cispo', epsilon_high), advantages divided by the
batch's reward std (scale_rewards='batch'), no KL, float32, and the reward: the config's own
grader (`reward_config_of`, answer styles hashes / answer_is / last_number, exact integers). What
stays ours alone is the rest of the recipe: PipelineRL-k, prompt-level aggregation,
zero-variance filtering and No-Positive-Resampling.

  .venv/bin/python -m scalerl_jax.main --config=configs/smollm2_arith.py --config.model.checkpoint=$SMOLLM \\
      --workdir=runs/smollm2_arith_vs_trl --config.num_steps=30 --config.eval.every=1000 \\
      --config.eval.num_prompts=8 --config.checkpoint.every=3 --config.checkpoint.keep=20
  PYTHONPATH=. .venv/bin/python benchmarks/learn_vs_trl.py trl --checkpoint $SMOLLM --out runs/trl_arith \\
      --budget_min 30 --save_every_min 4 [--config.KEY=VALUE ...]
  PYTHONPATH=. .venv/bin/python benchmarks/learn_vs_trl.py evaluate --checkpoint $SMOLLM \\
      --ours runs/smollm2_arith_vs_trl --trl runs/trl_arith --budget_min 30 --out runs/vs_trl.json
  PYTHONPATH=. .venv/bin/python benchmarks/learn_vs_trl.py report --results runs/vs_trl.json --out docs/results/smollm2_arith

Needs the `bench` extra (trl, datasets).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "smollm2_arith.py")
# Files of the base checkpoint that a saved TRL policy shares unchanged (save_pretrained writes
# config.json and the weights; the tokenizer and chat template are the base's).
SHARED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def load_config(path: str, overrides: Sequence[str] = ()):
    """The run config of `path` with `--config.KEY=VALUE` `overrides` (as `main` reads them)."""
    from scalerl_jax.config.argv import parse_config_argv

    config = parse_config_argv(["learn_vs_trl", f"--config={path}", *overrides])
    assert config is not None
    return config


def ladder_rows(config, split: str) -> list[dict[str, str]]:
    """The config's ladder split as rows {problem, answer, level}, in the run's order."""
    from scalerl_jax.config.adapters import ladder_config
    from scalerl_jax.data import ladder

    problems = ladder.generate_splits(ladder_config(config))[split]
    return [problem.row() for problem in problems]


# ------------------------------------------------------------------------------------------- trl
def run_trl(args: argparse.Namespace) -> None:
    """TRL's GRPOTrainer for --budget_min minutes (module docstring), policies saved as it goes."""
    started = time.perf_counter()
    import datasets  # pyright: ignore[reportMissingImports]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.trainer.grpo_config import GRPOConfig  # pyright: ignore[reportMissingImports]
    from trl.trainer.grpo_trainer import GRPOTrainer  # pyright: ignore[reportMissingImports]

    from scalerl_jax.config.adapters import reward_config_of
    from scalerl_jax.data import format_problem, score_completions

    config = load_config(args.config, args.overrides)
    reward_config = reward_config_of(config)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    rows = ladder_rows(config, "train")
    prompt = config.data.prompt_template
    dataset = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": format_problem(r["problem"], prompt)}], **r} for r in rows]
    )

    def reward(completions: list, answer: list[str], **_: Any) -> list[float | None]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(r) for r in score_completions(texts, list(answer), reward_config).rewards]

    o, b = config.optimizer, config.batch
    batch = b.prompts_per_step * b.generations_per_prompt
    trl_config = GRPOConfig(
        output_dir=os.path.join(args.out, "trainer"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=b.generations_per_prompt,
        max_completion_length=config.sampler.max_new_tokens,
        temperature=config.sampler.temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        loss_type="cispo",
        epsilon_high=config.rl.eps_max,
        scale_rewards="batch",
        learning_rate=o.lr,
        max_grad_norm=o.max_grad_norm,
        max_steps=100_000,  # the wall-clock budget ends the run
        bf16=False,
        fp16=False,
        use_cpu=True,
        seed=args.seed,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay
    )
    warmup = max(1, o.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / warmup))
    budget_s, save_every_s = 60 * args.budget_min, 60 * args.save_every_min
    saves_path, steps_path = os.path.join(args.out, "saves.jsonl"), os.path.join(args.out, "steps.jsonl")

    def save(step: int) -> None:
        elapsed = time.perf_counter() - started
        directory = os.path.join(args.out, f"policy_{step}")
        model.save_pretrained(directory)
        for name in SHARED_FILES:
            if os.path.exists(os.path.join(args.checkpoint, name)):
                shutil.copy(os.path.join(args.checkpoint, name), directory)
        with open(saves_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "elapsed_s": elapsed, "path": directory}) + "\n")
        print(f"[trl] step {step}: saved {directory} at {elapsed / 60:.1f} min", flush=True)

    class Budget(TrainerCallback):
        next_save_s = save_every_s

        def on_log(self, _args, state, control, logs=None, **kw):
            row = {"step": state.global_step, "elapsed_s": time.perf_counter() - started, **(logs or {})}
            with open(steps_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

        def on_step_begin(self, _args, state, control, **kw):
            self.step_began = time.perf_counter()

        def on_step_end(self, _args, state, control, **kw):
            now = time.perf_counter()
            elapsed, step_s = now - started, now - self.step_began
            if elapsed + step_s > budget_s:  # the next step would end past the budget
                control.should_training_stop = True
            elif elapsed >= self.next_save_s:
                save(state.global_step)
                self.next_save_s += save_every_s

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=trl_config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Budget()],
        optimizers=(optimizer, scheduler),
    )
    trainer.train()
    save(trainer.state.global_step)


# -------------------------------------------------------------------------------------- evaluate
def metrics_rows(run_dir: str) -> dict[int, dict]:
    """The run's metrics rows by step."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return {row["step"]: row for row in map(json.loads, filter(str.strip, f))}


def ours_policies(run_dir: str) -> list[tuple[int, float]]:
    """(step, wall seconds of the run's compute meter) of each checkpoint the run kept."""
    rows = metrics_rows(run_dir)
    steps = sorted(int(name) for name in os.listdir(os.path.join(run_dir, "checkpoints")) if name.isdigit())
    return [(step, rows[step]["compute/wall_hours"] * 3600) for step in steps if step in rows]


def evaluate_one(checkpoint: str, extra: Sequence[str], data: str, samples: int, seed: int) -> dict:
    """`scalerl_jax.cli.evaluate`'s report of one policy on `data`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        command = [
            sys.executable, "-m", "scalerl_jax.cli.evaluate", "--checkpoint", checkpoint, *extra,
            "--data", data, "--group-field", "level", "--samples", str(samples), "--seed", str(seed),
            "--completions", "--out", out,
        ]  # fmt: skip
        subprocess.run(command, check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def summarize(report: dict) -> dict:
    """The numbers the comparison keeps of an evaluation report."""
    metrics = report["metrics"]
    return {
        "pass_rate": metrics["pass_rate"],
        "by_level": {g: v["pass@1"] for g, v in report.get("groups", {}).items()},
        "answer_found_frac": metrics.get("answer_found_frac"),
        "mean_completion_tokens": metrics.get("mean_completion_tokens"),
        "truncated_frac": metrics.get("truncated_frac"),
        "per_prompt": report["per_prompt"],
    }


def run_evaluate(args: argparse.Namespace) -> None:
    """Every saved policy of both sides, one evaluator; results appended to --out as they finish."""
    config = load_config(args.config)
    data = os.path.join(os.path.dirname(os.path.abspath(args.out)), "vs_trl_heldout.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for row in ladder_rows(config, "heldout"):
            f.write(json.dumps(row) + "\n")
    done = {}
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            done = {(r["side"], r["step"]): r for r in json.load(f)}
    jobs = [("base", 0, 0.0, args.checkpoint, [f"--config={args.config}"])]
    jobs += [
        ("ours", step, t, args.ours, [f"--step={step}"])
        for step, t in ours_policies(args.ours)
        if args.budget_min is None or t <= 60 * args.budget_min
    ]
    with open(os.path.join(args.trl, "saves.jsonl"), encoding="utf-8") as f:
        for save in map(json.loads, filter(str.strip, f)):
            jobs.append(("trl", save["step"], save["elapsed_s"], save["path"], [f"--config={args.config}"]))
    for side, step, elapsed, checkpoint, extra in jobs:
        if (side, step) in done:
            continue
        started = time.perf_counter()
        result = summarize(evaluate_one(checkpoint, extra, data, args.samples, args.seed))
        done[(side, step)] = {"side": side, "step": step, "elapsed_s": elapsed, **result}
        print(f"{side} step {step} ({elapsed / 60:.1f} min): pass {result['pass_rate']:.3f} "
              f"[{time.perf_counter() - started:.0f} s]", flush=True)  # fmt: skip
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(sorted(done.values(), key=lambda r: (r["side"], r["step"])), f)


# ---------------------------------------------------------------------------------------- report
def curve(results: list[dict], side: str) -> list[dict]:
    """`side`'s evaluations in time order, starting at the base checkpoint's."""
    base = [dict(r, side=side) for r in results if r["side"] == "base"]
    return base + sorted((r for r in results if r["side"] == side), key=lambda r: r["elapsed_s"])


def time_to_reach(points: list[dict], target: float) -> float | None:
    """Seconds at the first evaluation whose pass rate is >= `target`, or None."""
    return next((p["elapsed_s"] for p in points if p["pass_rate"] >= target), None)


def run_report(args: argparse.Namespace) -> None:
    """The table (markdown) and the plot (png) of --results, into --out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.results, encoding="utf-8") as f:
        results = json.load(f)
    ours, trl = curve(results, "ours"), curve(results, "trl")
    levels = sorted(ours[0]["by_level"])
    lines = [
        "| side | step | wall min | pass rate | " + " | ".join(levels) + " | answer found | tokens | truncated |",
        "|---" * (7 + len(levels)) + "|",
    ]
    for name, points in (("ours", ours), ("trl", trl)):
        for p in points:
            lines.append(
                f"| {name} | {p['step']} | {p['elapsed_s'] / 60:.1f} | {p['pass_rate']:.3f} | "
                + " | ".join(f"{p['by_level'].get(level, float('nan')):.3f}" for level in levels)
                + f" | {p['answer_found_frac']:.3f} | {p['mean_completion_tokens']:.1f} | {p['truncated_frac']:.3f} |"
            )
    target, trl_total = trl[-1]["pass_rate"], trl[-1]["elapsed_s"]
    reached = time_to_reach(ours, target)
    verdict = f"TRL's final pass rate {target:.3f} (at {trl_total / 60:.1f} min): ours first reaches it at " + (
        "never" if reached is None else f"{reached / 60:.1f} min ({reached / trl_total:.2f} of TRL's wall time)"
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vs_trl.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n\n" + verdict + "\n")
    print("\n".join(lines) + "\n\n" + verdict)
    figure, axis = plt.subplots(figsize=(6.4, 4.0))
    for name, points, style in (("scalerl_jax", ours, "o-"), ("TRL GRPOTrainer", trl, "s--")):
        axis.plot([p["elapsed_s"] / 60 for p in points], [p["pass_rate"] for p in points], style, label=name)
    axis.set_xlabel("wall-clock minutes (2-core CPU)")
    axis.set_ylabel("held-out pass rate")
    axis.set_title("SmolLM2-135M-Instruct on the arithmetic ladder")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(args.out, "vs_trl.png"), dpi=120)
    print(f"wrote {args.out}/vs_trl.md and vs_trl.png")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command's flags; `--config.KEY=VALUE` flags (trl) override the config's keys."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    trl = commands.add_parser("trl", help="train with TRL for the budget, saving policies")
    trl.add_argument("--checkpoint", required=True, help="the base Hugging Face directory")
    trl.add_argument("--out", required=True)
    trl.add_argument("--budget_min", type=float, default=60.0)
    trl.add_argument("--save_every_min", type=float, default=10.0)
    trl.add_argument("--seed", type=int, default=0)
    evaluate = commands.add_parser("evaluate", help="evaluate every saved policy of both sides")
    evaluate.add_argument("--checkpoint", required=True, help="the base Hugging Face directory")
    evaluate.add_argument("--ours", required=True, help="the run directory")
    evaluate.add_argument("--trl", required=True, help="the trl command's --out")
    evaluate.add_argument("--out", required=True, help="results (json)")
    evaluate.add_argument(
        "--budget_min", type=float, help="only ours' checkpoints within this many minutes (TRL's --budget_min)"
    )
    evaluate.add_argument("--samples", type=int, default=2)
    evaluate.add_argument("--seed", type=int, default=0)
    report = commands.add_parser("report", help="table and plot")
    report.add_argument("--results", required=True)
    report.add_argument("--out", required=True)
    for sub in (trl, evaluate):
        sub.add_argument("--config", default=DEFAULT_CONFIG)
    args, overrides = parser.parse_known_args(argv)
    if overrides and args.command != "trl":
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    args.overrides = overrides
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    {"trl": run_trl, "evaluate": run_evaluate, "report": run_report}[args.command](args)


if __name__ == "__main__":
    main()
