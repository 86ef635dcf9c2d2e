"""What a larger evaluation costs the tiny run: the 120-step default at several samples per prompt.

Each size runs `python -m scalerl_jax.main --config=configs/tiny.py` from a fresh workdir that links
one shared, already built warm start (built by the first run when missing), one after another,
--repeats times in alternation. Printed per size: the median wall time of the run (`compute/
wall_hours` at the last step: the RL run alone, warm start excluded), the median ratio to the
first size, and the trainer's idle fraction (`pipeline/trainer_idle_frac`, waiting for batches)
and generator idle fraction at the last step. On 2 cores the concurrent evaluation takes its
compute from training, so its cost shows as wall time.

  .venv/bin/python benchmarks/bench_eval_size.py [--sizes 2,4] [--repeats 1] [--workdir /tmp/bench_eval_size]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.py"


def run(workdir: Path, samples: int) -> dict:
    """One tiny run at `samples` per prompt; its last metrics row."""
    command = [
        sys.executable,
        "-m",
        "scalerl_jax.main",
        f"--config={CONFIG}",
        f"--workdir={workdir}",
        f"--config.eval.samples_per_prompt={samples}",
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lines = (workdir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="2,4", help="samples per prompt, comma-separated; the first is the baseline")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workdir", default="/tmp/bench_eval_size")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    root = Path(args.workdir)
    shared = root / "warm_start"
    walls: dict[int, list[float]] = {s: [] for s in sizes}
    last: dict[int, dict] = {}
    for repeat in range(args.repeats):
        for samples in sizes:
            workdir = root / f"samples{samples}_r{repeat}"
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir(parents=True)
            if shared.is_dir():
                (workdir / "warm_start").symlink_to(shared.resolve())
            row = run(workdir, samples)
            if not shared.is_dir():
                shutil.copytree(workdir / "warm_start", shared)
            walls[samples].append(row["compute/wall_hours"] * 60)
            last[samples] = row
            print(f"repeat {repeat} samples {samples}: {walls[samples][-1]:.2f} min, pass {row['eval/pass_rate']:.3f}")
    base = statistics.median(walls[sizes[0]])
    print(f"\n128 prompts x K samples every 5 steps, 120 steps ({args.repeats} repeat(s), medians):")
    print("| K | eval samples / step | wall min | ratio | trainer idle | generator idle |")
    print("|---|---|---|---|---|---|")
    for samples in sizes:
        wall = statistics.median(walls[samples])
        row = last[samples]
        print(
            f"| {samples} | {128 * samples / 5:.0f} | {wall:.2f} | {wall / base:.2f} | "
            f"{row.get('pipeline/trainer_idle_frac', float('nan')):.3f} | "
            f"{row.get('pipeline/generator_idle_frac', float('nan')):.3f} |"
        )


if __name__ == "__main__":
    main()
