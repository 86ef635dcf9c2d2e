"""A short chaos soak (benchmarks/soak.py) of the main job on the tiny config: a few dozen steps, one
fault of each kind (SIGTERM, kill -9, a verifier worker killed, a full disk during a checkpoint save,
a read-only workdir), each stopped run resumed. What the soak checks is checked here again from the
files it leaves: the run's metrics.jsonl (training rows exactly once a step, evaluation rows at most
once), the runs' logs (the full disk's one line naming the path), /proc (nothing left behind).
Needs root to mount the workdir's filesystem; skipped, saying so, where mounting is impossible."""

import collections
import json
import os
import subprocess
import sys

import pytest
from main_runs import SMALL
from repo_paths import REPO

STEPS = 60
KINDS = ("sigterm", "kill9", "worker", "disk_full", "read_only")


def soak_command(mount, scratch) -> list[str]:
    overrides = [f"--override=--config.{key}={value}" for key, value in SMALL.items() if key != "num_steps"]
    return [
        sys.executable,
        os.path.join(REPO, "benchmarks", "soak.py"),
        f"--steps={STEPS}",
        "--seed=1",
        f"--workdir={mount}",
        f"--scratch={scratch}",
        "--config=configs/tiny.py",
        *overrides,
        "--mean-interval=3",
        f"--max-faults={len(KINDS)}",
        "--quiet-steps=4",
        "--read-only-s=5",
        "--fs-size-mb=256",
        "--exit-timeout=120",
        "--timeout=2700",
    ]


def processes_naming(text: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry}: {cmdline}")
    return found


@pytest.mark.slow
def test_short_soak_every_fault_kind_rows_once_checkpoints_verified_nothing_left(tmp_path):
    mount, scratch = tmp_path / "mnt", tmp_path / "scratch"
    result = subprocess.run(
        soak_command(mount, scratch),
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=3000,
    )
    summary_file = scratch / "summary.json"
    assert summary_file.exists(), result.stdout[-4000:] + result.stderr[-4000:]
    summary = json.loads(summary_file.read_text())
    if summary["filesystem"] == "none":
        pytest.skip(f"cannot mount the workdir's filesystem here: {summary['unavailable']['disk_full']}")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]

    expected = [kind for kind in KINDS if kind not in summary["unavailable"]]
    counts = collections.Counter(fault["kind"] for fault in summary["faults"])
    assert all(counts[kind] >= 1 for kind in expected), (counts, result.stdout[-4000:])

    with open(scratch / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    training = collections.Counter(row["step"] for row in rows if any(k.startswith("train/") for k in row))
    assert training == collections.Counter(range(1, STEPS + 1))
    evaluations = collections.Counter(row["step"] for row in rows if "eval/pass_rate" in row)
    assert evaluations and max(evaluations.values()) == 1

    assert summary["checkpoints"] and set(summary["checkpoints"].values()) == {"verified"}, summary["checkpoints"]
    assert not any(".orbax-checkpoint-tmp" in name for name in summary["checkpoints"])

    run_starts = summary["runs"]
    stopping = sum(counts[kind] for kind in ("sigterm", "kill9", "disk_full", "read_only"))
    assert run_starts == 1 + stopping  # every stopped run resumed, none ended unasked

    if "disk_full" in expected:
        full = [fault for fault in summary["faults"] if fault["kind"] == "disk_full"]
        for fault in full:  # the run's own last line, from its log
            assert str(mount / "run") in fault["line"] and "No space left on device" in fault["line"], fault
        logs = [(scratch / f"run{i}.log").read_text() for i in range(run_starts)]
        assert sum("No space left on device" in text and "Traceback" not in text for text in logs) >= len(full)

    assert processes_naming(str(mount)) == []
    assert not os.path.ismount(mount)
