"""Runs the main job as N real local processes (jax.distributed on CPU, gloo collectives)."""

import json
import os
import socket
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# A tiny run: 3 steps, a small warm start, checkpoints every step.
TINY = {
    "warm_start.steps": 8,
    "warm_start.batch_size": 16,
    "synthetic.sft_size": 64,
    "synthetic.train_size": 64,
    "synthetic.heldout_size": 8,
    "num_steps": 3,
    "batch.prompts_per_step": 4,
    "batch.generations_per_prompt": 2,
    "sampler.num_slots": 8,
    "eval.every": 2,
    "eval.num_prompts": 4,
    "eval.samples_per_prompt": 2,
    "eval.concurrent": False,  # one row per step: evaluations in the trainer thread
    "batch.length_buckets_per_octave": 1,  # 3 train buckets (32, 64, 112) to compile ahead, not 15
    "checkpoint.every": 1,
    "data.verify_workers": 1,
    "distributed.heartbeat_timeout_s": 20,
    "distributed.connect_timeout_s": 120,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flags(overrides: dict) -> list[str]:
    return [f"--config.{key}={value}" for key, value in overrides.items()]


def start(workdir, overrides: dict, *, processes: int, devices: int = 2, log_dir=None) -> list[subprocess.Popen]:
    """Starts `processes` processes of `python -m scalerl_jax.main` on `devices` CPU devices each."""
    port = free_port()
    log_dir = log_dir or workdir
    os.makedirs(log_dir, exist_ok=True)
    procs = []
    for rank in range(processes):
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            SCALERL_DISTRIBUTED="1" if processes > 1 else "0",
            SCALERL_COORDINATOR=f"127.0.0.1:{port}",
            SCALERL_NUM_PROCESSES=str(processes),
            SCALERL_PROCESS_ID=str(rank),
            SCALERL_ADVERTISE_HOST="127.0.0.1",
        )
        env.pop("XLA_FLAGS", None)
        if processes == 1:
            for name in ("SCALERL_COORDINATOR", "SCALERL_NUM_PROCESSES", "SCALERL_PROCESS_ID"):
                env.pop(name)
        log = open(os.path.join(log_dir, f"process{rank}.log"), "w")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "scalerl_jax.main",
                    "--config=configs/tiny.py",
                    f"--workdir={workdir}",
                    *flags({**overrides, "mesh.cpu_devices": devices}),
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def wait(procs, timeout: float) -> list[int]:
    """Exit codes; kills every process left after `timeout` seconds (then their code is -9)."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in procs]


def logs(log_dir, processes: int) -> str:
    out = []
    for rank in range(processes):
        with open(os.path.join(log_dir, f"process{rank}.log")) as f:
            out.append(f"===== process {rank}\n" + f.read()[-6000:])
    return "\n".join(out)


def full_log(log_dir, rank: int) -> str:
    with open(os.path.join(log_dir, f"process{rank}.log")) as f:
        return f.read()


def read_metrics(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
