"""One run over two real processes (jax.distributed on CPU, gloo): three device layouts, the
PPO-off-policy losses against a one-process run on the same global layout, and a killed process."""

import os
import signal
import time

import numpy as np
import pytest
from multihost import TINY, full_log, logs, read_metrics, start, wait

# Two processes x two CPU devices (p0d0, p0d1, p1d0, p1d1); trainer devices come first.
LAYOUTS = {
    # trainer devices on process 0, generator devices on process 1 (a process with no trainer device)
    "trainer_on_0_generator_on_1": {"mesh.generator_fraction": 0.5},
    # trainer p0d0 + p0d1 + p1d0 (spans both processes; data-parallel over 3); generator p1d1, on
    # the follower trainer process
    "trainer_spans_both": {
        "mesh.generator_fraction": 0.25,
        "mesh.trainer_shape": "(-1,1,1)",
        "batch.prompts_per_step": 3,
    },
    # trainer p0d0; generator p0d1 + p1d0 + p1d1 (two generator processes, one of them the leader)
    "generators_span_both": {"mesh.generator_fraction": 0.75},
}


def check_run(workdir, num_steps: int, k: int) -> list[dict]:
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows] == list(range(num_steps + 1)), [r["step"] for r in rows]
    versions = [r["pipeline/version"] for r in rows[1:]]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert all(r["pipeline/lag_max"] <= k for r in rows[1:])
    assert all(np.isfinite(r["train/loss"]) for r in rows[1:])
    return rows


# The trainer-spanning layout (follower, batches by process rows, transfer to the leader's own
# generator) runs in the fast suite (~1 min); the other two with -m slow.
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("trainer_on_0_generator_on_1", marks=pytest.mark.slow),
        "trainer_spans_both",
        pytest.param("generators_span_both", marks=pytest.mark.slow),
    ],
)
def test_two_processes_complete_every_step(tmp_path, layout):
    workdir = str(tmp_path / "run")
    procs = start(workdir, {**TINY, **LAYOUTS[layout]}, processes=2)
    codes = wait(procs, timeout=400)
    assert codes == [0, 0], logs(workdir, 2)
    check_run(workdir, TINY["num_steps"], k=2)
    reporting = [rank for rank in range(2) if "held-out pass rate" in full_log(workdir, rank)]
    assert reporting == [0], logs(workdir, 2)  # only the leader writes metrics and reports progress


def test_three_devices_per_process_fit_the_global_trainer_mesh(tmp_path):
    # 2 processes x 3 CPU devices, round(6 x 0.34) = 2 generator devices: trainer p0d0..p0d2 + p1d0
    # (fsdp over 4 divides the embedding's 128), generator p1d1 + p1d2. Process 0 alone holds 3
    # trainer devices: its memory must be judged on the run's 4-device trainer mesh, not a 3-device one.
    workdir = str(tmp_path / "run")
    procs = start(workdir, {**TINY, "mesh.generator_fraction": 0.34}, processes=2, devices=3)
    assert wait(procs, timeout=400) == [0, 0], logs(workdir, 2)
    check_run(workdir, TINY["num_steps"], k=2)


@pytest.mark.slow
def test_a_generator_process_evaluates_beside_training(tmp_path):
    # The cluster's shape: the leader holds only trainer devices, the generator is another process.
    # With eval.concurrent its evaluation batcher samples the retained versions 0 and 2 while the
    # trainer goes on; their rows come when done, the last step's (3) in its own row.
    workdir = str(tmp_path / "run")
    overrides = {**TINY, **LAYOUTS["trainer_on_0_generator_on_1"], "eval.concurrent": True}
    codes = wait(start(workdir, overrides, processes=2), timeout=400)
    assert codes == [0, 0], logs(workdir, 2)
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval/pass_rate" in r] == [0, 2, 3]
    assert full_log(workdir, 0).count("(evaluated beside training)") == 2, logs(workdir, 2)


@pytest.mark.slow
def test_ppo_off_policy_losses_match_one_process(tmp_path):
    overrides = {
        **TINY,
        **LAYOUTS["trainer_spans_both"],
        "schedule.kind": "ppo_off_policy",
        "schedule.k": 2,
        "num_steps": 4,
        "eval.every": 4,
    }
    one = str(tmp_path / "one")
    assert wait(start(one, overrides, processes=1, devices=4), timeout=400) == [0], logs(one, 1)
    two = str(tmp_path / "two")
    assert wait(start(two, overrides, processes=2), timeout=400) == [0, 0], logs(two, 2)
    loss_one = [r["train/loss"] for r in read_metrics(one)[1:]]
    loss_two = [r["train/loss"] for r in read_metrics(two)[1:]]
    assert len(loss_one) == 4
    np.testing.assert_allclose(loss_two, loss_one, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_killed_process_stops_the_other_and_the_run_resumes(tmp_path):
    workdir = str(tmp_path / "run")
    overrides = {**TINY, **LAYOUTS["trainer_on_0_generator_on_1"], "num_steps": 6}
    procs = start(workdir, overrides, processes=2)
    metrics = os.path.join(workdir, "metrics.jsonl")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 3:  # steps 0..2 written
            break
        assert all(p.poll() is None for p in procs), logs(workdir, 2)
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGKILL)  # the generator process
    killed_at = time.monotonic()
    codes = wait(procs[:1], timeout=90)
    assert codes[0] != 0 and time.monotonic() - killed_at < 60, logs(workdir, 2)
    assert "lost process 1" in full_log(workdir, 0)
    procs = start(workdir, overrides, processes=2, log_dir=str(tmp_path / "rerun"))
    assert wait(procs, timeout=400) == [0, 0], logs(str(tmp_path / "rerun"), 2)
    check_run(workdir, 6, k=2)


@pytest.mark.slow
def test_hung_process_stops_the_other_within_a_minute(tmp_path):
    workdir = str(tmp_path / "run")
    procs = start(workdir, {**TINY, **LAYOUTS["trainer_on_0_generator_on_1"], "num_steps": 6}, processes=2)
    metrics = os.path.join(workdir, "metrics.jsonl")
    deadline = time.monotonic() + 300
    while not (os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 2):  # step 1 written
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs(workdir, 2)
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGSTOP)  # alive but silent: no heartbeat, no requests
    stopped_at = time.monotonic()
    try:
        codes = wait(procs[:1], timeout=90)
        assert codes[0] != 0 and time.monotonic() - stopped_at < 60, logs(workdir, 2)
        assert "lost process 1" in full_log(workdir, 0)
    finally:
        procs[1].kill()
        procs[1].wait()
