"""Process start-up of multi-process runs as real processes: 2-process starts under explicit and
fake SLURM variables, `launch/local.sh N` and `launch/tpu.sh` (the environment parsing itself:
tests/unit/distributed/test_launch.py).

The real-process tests run `tests/support/launch_probe.py` (main.start, then one PROBE line per process).
On the CPU backend JAX ignores `local_device_ids`; what it would restrict on GPUs is the
`visible_devices` option JAX hands the CUDA plugin, so the tests assert on that option.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from repo_paths import REPO, SUPPORT

LOCAL_SH = os.path.join(REPO, "launch", "local.sh")
PROCESS_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra) -> dict:
    """The test's environment without its forced device count or any launch variables, CPU only."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "XLA_FLAGS" and not k.startswith(("SLURM_", "SCALERL_", "JAX_COORDINATOR", "PROBE_"))
    }
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [SUPPORT, env.get("PYTHONPATH")])),
    )
    env.update(extra)
    return env


PROBE_COMMAND = [sys.executable, "-u", "-m", "launch_probe", "--config=configs/tiny.py"]


def run_probes(envs: list[dict], workdir) -> list[tuple[int, str]]:
    """Starts one probe per environment, waits (bounded) for all; (exit status, stdout + stderr) each."""
    processes = [
        subprocess.Popen(
            [*PROBE_COMMAND, f"--workdir={workdir}"],
            cwd=REPO,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for env in envs
    ]
    results = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=PROCESS_TIMEOUT_S)
            results.append((process.returncode, output))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def probe_report(output: str, prefix: str = "") -> dict:
    """The probe's one JSON report among the lines of one process (`prefix`). Gloo writes to the
    same stream without line buffering, so the report may follow its text on the same line."""
    reports = [
        match.group(1)
        for line in output.splitlines()
        if line.startswith(prefix)
        for match in [re.search(r"PROBE (\{.*\})", line)]
        if match
    ]
    assert len(reports) == 1, output[-3000:]
    return json.loads(reports[0])


def fake_slurm_env(process_id: int, port: int, **extra) -> dict:
    """One task per node as SLURM describes it, on a 'node' named localhost with 2 GPUs."""
    return child_env(
        SCALERL_DISTRIBUTED="1",
        SLURM_JOB_ID="4242",
        SLURM_STEP_NODELIST="localhost",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NTASKS="2",
        SLURM_PROCID=str(process_id),
        SLURM_LOCALID="0",
        SLURM_GPUS_ON_NODE="2",
        CUDA_VISIBLE_DEVICES="0,1",
        SCALERL_COORDINATOR_PORT=str(port),
        JAX_COORDINATOR_PORT=str(port),
        **extra,
    )


def test_fake_slurm_processes_keep_all_local_devices(tmp_path):
    port = free_port()
    results = run_probes([fake_slurm_env(i, port) for i in range(2)], tmp_path)
    for process_id, (status, output) in enumerate(results):
        assert status == 0, output[-3000:]
        report = probe_report(output)
        assert report["process_index"] == process_id and report["process_count"] == 2
        assert (report["local_devices"], report["global_devices"]) == (2, 4)
        assert report["gathered"] == [10, 11]  # a real cross-process collective (gloo)
        assert "visible_devices" not in report["cuda_options"]  # a GPU process would keep every GPU
        assert re.search(rf"process {process_id} of 2, local devices \[\d+, \d+\], global device count 4", output)


@pytest.mark.slow  # JAX's own start-up path: once seen to hang past 120 s under a loaded suite
def test_jax_default_slurm_detection_restricts_gpus_to_one(tmp_path):
    """The reproduction: JAX's own SLURM path hands the CUDA plugin one GPU per process (the CPU ignores it)."""
    port = free_port()
    results = run_probes([fake_slurm_env(i, port, PROBE_INIT="jax_default") for i in range(2)], tmp_path)
    for status, output in results:
        assert status == 0, output[-3000:]
        report = probe_report(output)
        assert report["cuda_options"]["visible_devices"] == [0]  # SLURM_LOCALID: 1 of the node's GPUs
        assert report["local_devices"] == 2  # on CPU the restriction does not apply


def test_malformed_launch_variable_is_a_config_error(tmp_path):
    env = child_env(
        SCALERL_DISTRIBUTED="1", SCALERL_COORDINATOR="127.0.0.1:1", SCALERL_NUM_PROCESSES="two", SCALERL_PROCESS_ID="0"
    )
    result = subprocess.run(
        [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={tmp_path}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "config error: SCALERL_NUM_PROCESSES='two': not an integer" in result.stderr


def run_local_sh(num_processes: int, workdir, **extra) -> tuple[int, str, float]:
    env = child_env(PYTHON=sys.executable, SCALERL_MAIN_MODULE="launch_probe", **extra)
    started = time.monotonic()
    result = subprocess.run(
        [LOCAL_SH, str(num_processes), "configs/tiny.py", str(workdir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
    )
    return result.returncode, result.stdout + result.stderr, time.monotonic() - started


def test_local_sh_starts_n_processes_with_prefixed_output(tmp_path):
    status, output, _ = run_local_sh(2, tmp_path, CPU_DEVICES="2")
    assert status == 0, output[-3000:]
    for process_id in range(2):
        report = probe_report(output, prefix=f"[p{process_id}] ")
        assert report["process_index"] == process_id
        assert (report["local_devices"], report["global_devices"], report["gathered"]) == (2, 4, [10, 11])
        assert f"[p{process_id}] " in output and re.search(
            rf"^\[p{process_id}\] .*process {process_id} of 2, local devices", output, re.MULTILINE
        )


def test_local_sh_stops_hung_peers_after_a_failure(tmp_path):
    # Process 1 dies (SIGKILL) after start-up; process 0 waits for it 110 s (heartbeat 30 s), so only
    # the launcher's 5 s grace period ends it early.
    status, output, seconds = run_local_sh(2, tmp_path, PROBE_FAIL="crash", GRACE_S="5")
    assert status == 128 + signal.SIGKILL, output[-3000:]
    assert "local.sh: process 1 exited with status 137" in output
    assert "local.sh: terminating processes still running 5 s after a failure" in output
    assert seconds < 60  # generous: the peer alone would wait 30 s (heartbeat) to 110 s


def test_failing_process_does_not_hang_at_exit(tmp_path):
    # Process 1 exits with status 3; at exit JAX waits at its shutdown barrier for process 0, which
    # waits for process 1: SCALERL_SHUTDOWN_TIMEOUT_S bounds that, and both processes stop non-zero.
    status, output, seconds = run_local_sh(2, tmp_path, PROBE_FAIL="exit", GRACE_S="90", SCALERL_SHUTDOWN_TIMEOUT_S="5")
    assert status != 0, output[-3000:]
    assert re.search(r"local.sh: process 1 exited with status [1-9]", output)
    assert "terminating processes" not in output  # they ended on their own, before the grace period
    assert seconds < 60


@pytest.mark.slow
def test_dead_peer_stops_the_others_after_the_heartbeat_timeout(tmp_path):
    """JAX's backstop without the run's watchdog (a probe, not the run): SCALERL_HEARTBEAT_TIMEOUT_S
    reaches the coordination service, which stops the survivor (default 90 s; 20 s here)."""
    port = free_port()
    envs = [
        child_env(
            SCALERL_DISTRIBUTED="1",
            SCALERL_COORDINATOR=f"127.0.0.1:{port}",
            SCALERL_NUM_PROCESSES="2",
            SCALERL_PROCESS_ID=str(i),
            SCALERL_HEARTBEAT_TIMEOUT_S="20",
            PROBE_FAIL="crash",
        )
        for i in range(2)
    ]
    started = time.monotonic()
    results = run_probes(envs, tmp_path)
    seconds = time.monotonic() - started
    assert results[1][0] == -signal.SIGKILL
    assert results[0][0] != 0 and "stopped sending heartbeats" in results[0][1], results[0][1][-3000:]
    assert seconds < 60


def test_tpu_sh_runs_main_with_peers_found_by_jax(tmp_path):
    """`launch/tpu.sh` runs the main module once per TPU VM with SCALERL_DISTRIBUTED=auto, which
    leaves the peers to JAX's TPU metadata and keeps the run's timeouts."""
    result = subprocess.run(
        [os.path.join(REPO, "launch", "tpu.sh"), "configs/tiny.py", str(tmp_path), "--config.num_steps=3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PYTHON": sys.executable,
            "SCALERL_MAIN_MODULE": "launch_env_probe",
            "PYTHONPATH": SUPPORT,
        },
    )
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout.split("PROBE ", 1)[1])
    assert probe["kwargs"] == {
        "initialization_timeout": 300,
        "heartbeat_timeout_seconds": 90,
        "shutdown_timeout_seconds": 60,
    }
    assert probe["argv"] == ["--config=configs/tiny.py", f"--workdir={tmp_path}", "--config.num_steps=3"]
