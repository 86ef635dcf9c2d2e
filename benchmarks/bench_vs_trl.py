"""The same RL step with TRL's GRPOTrainer and with this project, on one machine, in one run.

Model: SmolLM2-135M-Instruct, a local Hugging Face directory (--checkpoint, else $SMOLLM2_DIR, else
`tests/support/real_models.smollm2_135m_instruct()` where that module exists). Prompts: the first --rows
GSM8K train rows (--data, default ../shared/data/gsm8k/train.jsonl from the project root), each
question the one user message of the model's chat template, and nothing added. Reward: both sides
call `benchmarks/gsm8k_reward.reward` (+1 when the completion's last number is the gold's `####`
answer, else -1): TRL as its reward function, ours as `data.reward_fn`.

The step, the same on both sides: --prompts x --generations completions (default 4 x 4 = 16) of
at most --max_new_tokens (default 128) new tokens, sampled at temperature 1 (top-p 1, no top-k);
CISPO with the importance weight truncated at 4 (TRL loss_type='cispo', epsilon_high=4; ours
rl.objective=cispo, rl.eps_max=4); the loss a mean over the batch's completion tokens (TRL's cispo
normalization; ours rl.aggregation=token); advantages centred per group and divided by the batch's
reward std (TRL scale_rewards='batch'; ours rl.advantage_normalization=batch); no KL (TRL beta=0);
no zero-variance filtering, no No-Positive-Resampling, no length control; one AdamW update per
batch (lr --lr constant, betas 0.9 / 0.999, eps 1e-8, weight decay 0.01 on every parameter, global
norm clip 1.0); float32; activations recomputed in the backward pass on both sides (TRL
gradient_checkpointing=True, its default; ours model.remat_policy=full, the recipe's) unless
--no_remat.

TRL (1.16: transformers' `generate`, one process, per_device_train_batch_size = the 16 completions,
gradient_accumulation_steps 1, num_iterations 1: each update trains on the batch just generated)
runs in this process with PyTorch's default threads. Ours runs `python -m scalerl_jax.main
--config=configs/scalerl_8b.py` with CPU-sized overrides (`ours_overrides`) in a subprocess: the
host split into 2 XLA CPU devices, one generator and one trainer, as on a cluster, and
PipelineRL-k (--k, default 1): the generator samples the next batch while the trainer trains,
every completion at most k versions old when trained. That asynchrony is the product, so it is
what is compared. --on_policy adds a second run of ours with schedule.kind=ppo_off_policy, k=1:
the batch generated with the current params, then trained on, TRL's order.

Timing. Each side runs warm-up steps (TRL --warmup; ours max(--warmup, k + 1), so that the
batches generated while it compiled are used up) and then --steps timed steps. Seconds per step =
wall time from the end of the last warm-up step to the end of the last timed step, / --steps: for
TRL between its `on_step_end` callbacks, for ours between the arrivals of those steps' rows in
metrics.jsonl (polled every 20 ms). Ours compiles every program before its first step; it runs one
more step after the timed ones, untimed, because a run evaluates its last step before writing its
row. Completion tokens per second = completion tokens trained in the timed steps / their wall time.
The ratio is TRL's seconds per step / ours (above 1: ours is faster), and ours tokens/s / TRL's.

Where the time goes. TRL, by timers around its methods: generation (`_generate_single_turn`:
transformers' generate), scoring (the rest of `_prepare_inputs`: tokenization, rewards,
advantages), forward + backward (the rest of `training_step`), optimizer (grad clip, AdamW,
zero_grad: from `training_step`'s return to `on_step_end`). Ours, from the rows of the timed
steps: the trainer thread's time in train steps (pipeline/step_s), waiting for a batch
(pipeline/trainer_wait_s) and pushing params (pipeline/push_s); the generator's time inside decode
chunks and the tokens it generated in the window, from the cumulative sampler/busy_frac and
sampler/tokens_per_s times the run's elapsed time (= cumulative step_s / pipeline/trainer_step_frac).

  PYTHONPATH=. .venv/bin/python benchmarks/bench_vs_trl.py --checkpoint DIR [--steps 4] [--on_policy]

Needs the `bench` extra (trl, datasets). On a shared machine the numbers are noisy: run it alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # `benchmarks.gsm8k_reward` when run as a script
    sys.path.insert(0, REPO_ROOT)

from benchmarks import gsm8k_reward  # noqa: E402

DEFAULT_DATA = os.path.join(REPO_ROOT, "..", "shared", "data", "gsm8k", "train.jsonl")
REWARD_FN = "benchmarks.gsm8k_reward:reward"
POLL_S = 0.02
# Optimizer settings both sides use (TRL through a torch AdamW over every parameter, as ours decays).
BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0
CISPO_EPS_MAX = 4.0
TEMPERATURE = 1.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--checkpoint", default="", help="SmolLM2-135M-Instruct HF dir (default: $SMOLLM2_DIR)")
    p.add_argument("--data", default=DEFAULT_DATA, help="GSM8K train jsonl (question, answer)")
    p.add_argument("--rows", type=int, default=64, help="GSM8K rows both sides draw prompts from")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--max_prompt_tokens", type=int, default=256, help="ours: longer prompts are dropped (counted)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (ours: at least k + 1)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per side")
    p.add_argument("--k", type=int, default=1, help="ours: PipelineRL-k")
    p.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="ours: gradient-accumulation microbatches of the step's rows (the same update; less memory)",
    )
    p.add_argument("--length_buckets_per_octave", type=int, default=2, help="ours: train step shapes per octave")
    p.add_argument("--no_remat", action="store_true", help="keep activations (both sides) instead of recomputing")
    p.add_argument("--on_policy", action="store_true", help="also run ours as PPO-off-policy-1 (TRL's order)")
    p.add_argument("--skip_trl", action="store_true", help="run only ours")
    p.add_argument("--skip_ours", action="store_true", help="run only TRL")
    p.add_argument(
        "--torch_threads",
        type=int,
        default=0,
        help="TRL: torch.set_num_threads (0: torch's default). On a machine shared with other jobs, "
        "more threads than free cores can slow torch 10x (measured: transformers' generate 2.2 s/token "
        "with 2 threads and one core busy elsewhere, 0.21 s/token with 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="", help="where run directories and logs go (default: a new temp dir)")
    args = p.parse_args(argv)
    for name in ("rows", "prompts", "generations", "max_new_tokens", "max_prompt_tokens", "steps", "k", "microbatches"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def resolve_checkpoint(flag: str) -> str:
    """The model directory: the flag, else $SMOLLM2_DIR, else the test fixture's builder if present."""
    path = flag or os.environ.get("SMOLLM2_DIR", "")
    if not path:
        try:
            path = str(importlib.import_module("tests.support.real_models").smollm2_135m_instruct())
        except (ImportError, AttributeError):
            path = ""
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        sys.exit(f"error: --checkpoint {path!r}: give SmolLM2-135M-Instruct's Hugging Face directory (or $SMOLLM2_DIR)")
    return path


def read_rows(path: str, n: int) -> list[dict[str, str]]:
    """The first `n` rows of a GSM8K jsonl as {question, answer}; exits naming the file and line if bad."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if len(rows) == n:
                break
            try:
                row = json.loads(line)
                rows.append({"question": str(row["question"]), "answer": str(row["answer"])})
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                sys.exit(f"error: {path}:{line_number}: not a GSM8K row with question and answer ({e})")
    if len(rows) < n:
        sys.exit(f"error: {path} has {len(rows)} rows; --rows asks for {n}")
    return rows


@dataclasses.dataclass
class SideResult:
    """One side's timed window: seconds, steps, completion tokens, and where the time went."""

    name: str
    window_s: float
    steps: int
    completion_tokens: int
    shares: dict[str, float]  # label -> fraction of window_s
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def s_per_step(self) -> float:
        return self.window_s / self.steps

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.window_s


# ------------------------------------------------------------------------------------------- TRL
class _Clock:
    """Per-step timers of TRL's trainer: method wrappers add their seconds to the current step's
    buckets; `on_step_end` closes the step (the TrainerCallback hooks are attached by `run_trl`)."""

    def __init__(self) -> None:
        self.step_ends: list[float] = []
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}
        self.training_step_end = 0.0

    def wrap(self, obj: Any, method: str, bucket: str, after: Callable[[Any], None] | None = None) -> None:
        original = getattr(obj, method)

        def timed(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            out = original(*a, **kw)
            end = time.perf_counter()
            self.current[bucket] = self.current.get(bucket, 0.0) + end - start
            if bucket == "training_step":
                self.training_step_end = end
            if after is not None:
                after(out)
            return out

        setattr(obj, method, timed)

    def count_tokens(self, out: Any) -> None:
        completion_ids = out[0]  # (completion_ids, logprobs)
        self.current["tokens"] = self.current.get("tokens", 0.0) + sum(len(ids) for ids in completion_ids)

    def step_end(self) -> None:
        now = time.perf_counter()
        self.current["optimizer"] = now - self.training_step_end
        self.step_ends.append(now)
        self.steps.append(self.current)
        self.current = {}


def run_trl(args: argparse.Namespace, checkpoint: str, rows: list[dict[str, str]], workdir: str) -> SideResult:
    """TRL's GRPOTrainer for --warmup + --steps steps; the timed window's result."""
    # datasets and trl come with the `bench` extra, which `make test` does not install.
    import datasets  # pyright: ignore[reportMissingImports]
    import torch
    import trl  # pyright: ignore[reportMissingImports]
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.trainer.grpo_config import GRPOConfig  # pyright: ignore[reportMissingImports]
    from trl.trainer.grpo_trainer import GRPOTrainer  # pyright: ignore[reportMissingImports]

    torch.manual_seed(args.seed)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    loss_type = "cispo" if "cispo" in (GRPOConfig.__doc__ or "") else "dapo"
    batch = args.prompts * args.generations
    config = GRPOConfig(
        output_dir=os.path.join(workdir, "trl"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        loss_type=loss_type,
        epsilon_high=CISPO_EPS_MAX,
        scale_rewards="batch",
        mask_truncated_completions=False,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=MAX_GRAD_NORM,
        max_steps=args.warmup + args.steps,
        bf16=False,
        fp16=False,
        gradient_checkpointing=not args.no_remat,
        use_cpu=True,
        seed=args.seed,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], **r} for r in rows])
    clock = _Clock()

    class StepEnd(TrainerCallback):
        def on_step_end(self, *a: Any, **kw: Any) -> None:
            clock.step_end()

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[gsm8k_reward.trl_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepEnd()],
        optimizers=(optimizer, None),
    )
    clock.wrap(trainer, "_generate_single_turn", "generate", after=clock.count_tokens)
    clock.wrap(trainer, "_prepare_inputs", "prepare")
    clock.wrap(trainer, "training_step", "training_step")
    start = time.perf_counter()
    trainer.train()
    print(f"[trl] {len(clock.steps)} steps in {time.perf_counter() - start:.1f} s (loss_type={loss_type})", flush=True)

    timed = clock.steps[args.warmup :]
    window = clock.step_ends[-1] - (clock.step_ends[args.warmup - 1] if args.warmup else start)
    total = {key: sum(s.get(key, 0.0) for s in timed) for key in ("generate", "prepare", "training_step", "optimizer")}
    shares = {
        "generate": total["generate"] / window,
        "score": (total["prepare"] - total["generate"]) / window,
        "fwd+bwd": (total["training_step"] - total["prepare"]) / window,
        "optimizer": total["optimizer"] / window,
    }
    shares["other"] = 1.0 - sum(shares.values())
    notes = [f"loss_type={loss_type}", f"trl {trl.__version__}", f"torch threads {torch.get_num_threads()}"]
    tokens = int(sum(s.get("tokens", 0.0) for s in timed))
    del trainer, model, optimizer
    gc.collect()
    return SideResult("trl", window, len(timed), tokens, shares, notes)


# ------------------------------------------------------------------------------------------- ours
def ours_overrides(args: argparse.Namespace, checkpoint: str, data_path: str, *, on_policy: bool) -> list[str]:
    """`--config.KEY=VALUE` flags turning configs/scalerl_8b.py into the benchmark's CPU run."""
    k = 1 if on_policy else args.k
    num_steps = max(args.warmup, k + 1) + args.steps + 1
    values: dict[str, Any] = {
        "num_steps": num_steps,
        "model.checkpoint": checkpoint,
        "model.dtype": "float32",
        "model.remat_policy": "none" if args.no_remat else "full",
        "data.dataset": "jsonl",
        "data.path": data_path,
        "data.problem_field": "question",
        "data.answer_field": "answer",
        "data.prompt_template": "{problem}",
        "data.max_prompt_tokens": args.max_prompt_tokens,
        "data.answer_format": "plain",
        "data.reward_fn": REWARD_FN,
        "data.verify_workers": 1,
        "data.heldout_size": 1,  # the run evaluates its first and last step: one prompt, one sample
        "eval.num_prompts": 1,
        "eval.samples_per_prompt": 1,
        "eval.every": 1_000_000,
        "checkpoint.every": 1_000_000,
        "batch.prompts_per_step": args.prompts,
        "batch.generations_per_prompt": args.generations,
        "batch.microbatches": args.microbatches,
        "batch.length_buckets_per_octave": args.length_buckets_per_octave,
        "rl.objective": "cispo",
        "rl.eps_max": CISPO_EPS_MAX,
        "rl.aggregation": "token",
        "rl.advantage_normalization": "batch",
        "rl.zero_variance_filter": False,
        "rl.no_positive_resampling": False,
        "rl.length_control": "none",
        "sampler.temperature": TEMPERATURE,
        "sampler.top_p": 1.0,
        "sampler.top_k": 0,
        "sampler.num_slots": args.prompts * args.generations,
        "sampler.chunk_steps": 16,
        "sampler.max_new_tokens": args.max_new_tokens,
        # answer_format=plain has no think phase; the budgets only have to fit max_new_tokens.
        "sampler.think_budget_min": args.max_new_tokens,
        "sampler.think_budget_max": args.max_new_tokens,
        "sampler.answer_budget": 1,
        "schedule.kind": "ppo_off_policy" if on_policy else "pipeline",
        "schedule.k": k,
        "optimizer.lr": args.lr,
        "optimizer.warmup_steps": 0,
        "optimizer.b1": BETAS[0],
        "optimizer.b2": BETAS[1],
        "optimizer.eps": ADAM_EPS,
        "optimizer.weight_decay": WEIGHT_DECAY,
        "optimizer.max_grad_norm": MAX_GRAD_NORM,
        "mesh.require_accelerator": False,
        "mesh.cpu_devices": 2,
        "mesh.generator_fraction": 0.5,
        "seed": args.seed,
    }
    return [f"--config.{key}={value}" for key, value in values.items()]


def _poll_rows(process: subprocess.Popen, metrics_path: str) -> list[tuple[float, dict]]:
    """(arrival time, row) of every metrics row the run writes, until it exits."""
    arrivals: list[tuple[float, dict]] = []
    offset, pending = 0, b""
    while True:
        done = process.poll() is not None
        if os.path.exists(metrics_path):
            with open(metrics_path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            now = time.perf_counter()
            offset += len(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            arrivals.extend((now, json.loads(line)) for line in lines if line.strip())
        if done:
            return arrivals
        time.sleep(POLL_S)


def elapsed_at(rows: Sequence[dict]) -> list[float]:
    """The pipeline's elapsed seconds at each train row: cumulative pipeline/step_s over
    pipeline/trainer_step_frac (= that sum / elapsed)."""
    cumulative, out = 0.0, []
    for row in rows:
        cumulative += row["pipeline/step_s"]
        out.append(cumulative / row["pipeline/trainer_step_frac"])
    return out


def ours_window(arrivals: list[tuple[float, dict]], warmup: int, steps: int, name: str) -> SideResult:
    """The timed window of steps warmup + 1 .. warmup + steps from the rows' arrivals."""
    train = [(t, row) for t, row in arrivals if "pipeline/step_s" in row]
    if len(train) < warmup + steps:
        raise RuntimeError(f"{name}: {len(train)} train rows; the window needs {warmup + steps}")
    rows = [row for _, row in train]
    elapsed = elapsed_at(rows)
    a, b = warmup - 1, warmup + steps - 1  # rows closing the last warm-up step and the last timed step
    window = train[b][0] - train[a][0]
    timed = rows[a + 1 : b + 1]
    completions = [row["train/num_samples"] for row in timed]
    tokens = int(round(sum(row["train/completion_len_mean"] * n for row, n in zip(timed, completions, strict=True))))

    def cumulative(key: str, i: int) -> float:
        return rows[i][key] * elapsed[i]

    generator_busy = cumulative("sampler/busy_frac", b) - cumulative("sampler/busy_frac", a)
    generated = cumulative("sampler/tokens_per_s", b) - cumulative("sampler/tokens_per_s", a)
    shares = {
        "train step": sum(row["pipeline/step_s"] for row in timed) / window,
        "wait for batch": sum(row["pipeline/trainer_wait_s"] for row in timed) / window,
        "push": sum(row["pipeline/push_s"] for row in timed) / window,
    }
    shares["other"] = 1.0 - sum(shares.values())
    shares["generator busy"] = generator_busy / window
    lag = sum(row["pipeline/lag_mean"] for row in timed) / len(timed)
    notes = [
        f"generator {generated / window:.1f} tok/s in the window",
        f"mean lag {lag:.2f}",
        f"steps {[round(row['pipeline/step_s'], 2) for row in timed]} s in train steps",
    ]
    return SideResult(name, window, len(timed), tokens, shares, notes)


def run_ours(args: argparse.Namespace, checkpoint: str, data_path: str, workdir: str, *, on_policy: bool) -> SideResult:
    """`python -m scalerl_jax.main` in a subprocess; the timed window from its metrics rows."""
    name = "ours-onpolicy" if on_policy else f"ours-pipeline{args.k}"
    run_dir = tempfile.mkdtemp(prefix=f"{name}_", dir=workdir)
    log_path = os.path.join(workdir, f"{name}.log")
    command = [
        sys.executable,
        "-m",
        "scalerl_jax.main",
        "--config=configs/scalerl_8b.py",
        f"--workdir={run_dir}",
        *ours_overrides(args, checkpoint, data_path, on_policy=on_policy),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        arrivals = _poll_rows(process, os.path.join(run_dir, "metrics.jsonl"))
    print(f"[{name}] exit {process.returncode} after {time.perf_counter() - start:.1f} s; log {log_path}", flush=True)
    if process.returncode != 0:
        with open(log_path, encoding="utf-8") as f:
            sys.stderr.write("".join(f.readlines()[-30:]))
        raise RuntimeError(f"{name}: scalerl_jax.main exited {process.returncode} (log {log_path})")
    warmup = max(args.warmup, (1 if on_policy else args.k) + 1)
    return ours_window(arrivals, warmup, args.steps, name)


# ------------------------------------------------------------------------------------------- report
def describe(result: SideResult) -> str:
    shares = ", ".join(f"{label} {share:.0%}" for label, share in result.shares.items())
    notes = "; ".join(result.notes)
    return (
        f"{result.name}: {result.s_per_step:.2f} s/step, {result.tokens_per_s:.1f} completion tok/s "
        f"({result.completion_tokens} tokens in {result.steps} steps, {result.window_s:.1f} s) | {shares} | {notes}"
    )


def summary(trl_result: SideResult, ours: SideResult) -> str:
    """The final line: both sides' seconds per step and tokens/s, the ratios, the generation shares."""
    return (
        f"trl s/step {trl_result.s_per_step:.2f} | {ours.name} s/step {ours.s_per_step:.2f} | "
        f"ratio {trl_result.s_per_step / ours.s_per_step:.2f}x (s/step), "
        f"{ours.tokens_per_s / trl_result.tokens_per_s:.2f}x (tok/s) | "
        f"ours tok/s {ours.tokens_per_s:.1f} | trl tok/s {trl_result.tokens_per_s:.1f} | "
        f"gen share trl {trl_result.shares['generate']:.0%} | "
        f"ours trainer waiting {ours.shares['wait for batch']:.0%}, in train steps {ours.shares['train step']:.0%}, "
        f"generator busy {ours.shares['generator busy']:.0%}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    checkpoint = resolve_checkpoint(args.checkpoint)
    rows = read_rows(args.data, args.rows)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_vs_trl_")
    os.makedirs(workdir, exist_ok=True)
    data_path = os.path.join(workdir, "gsm8k_rows.jsonl")
    with open(data_path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"checkpoint {checkpoint} | {len(rows)} GSM8K rows | workdir {workdir} | cpus {os.cpu_count()}", flush=True)

    # Ours first: its subprocess starts with this process's torch idle (TRL is imported later).
    ours: list[SideResult] = []
    if not args.skip_ours:
        for on_policy in (False, True) if args.on_policy else (False,):
            ours.append(run_ours(args, checkpoint, data_path, workdir, on_policy=on_policy))
            print(describe(ours[-1]), flush=True)
    trl_result = None if args.skip_trl else run_trl(args, checkpoint, rows, workdir)
    print()
    for result in ([trl_result] if trl_result else []) + ours:
        print(describe(result))
    if trl_result is not None:
        for result in ours:
            print(summary(trl_result, result))


if __name__ == "__main__":
    main()
