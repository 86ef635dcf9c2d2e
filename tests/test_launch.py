"""Process start-up of multi-process runs: jax.distributed arguments from the environment, real
2-process starts under explicit and fake SLURM variables, and `launch/local.sh N`.

The real-process tests run `tests/launch_probe.py` (main.start, then one PROBE line per process).
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
from unittest import mock

import pytest

from scalerl_jax.distributed.launch_env import (
    LaunchEnvError,
    distributed_init_kwargs,
    expand_hostlist,
    platform_will_be_cpu,
    slurm_default_port,
)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
LOCAL_SH = os.path.join(REPO, "launch", "local.sh")
PROCESS_TIMEOUT_S = 120


def expected_kwargs(coordinator, num_processes, process_id, init=300, heartbeat=30, shutdown=60):
    return {
        "coordinator_address": coordinator,
        "num_processes": num_processes,
        "process_id": process_id,
        "local_device_ids": None,
        "cluster_detection_method": "deactivate",
        "initialization_timeout": init,
        "heartbeat_timeout_seconds": heartbeat,
        "shutdown_timeout_seconds": shutdown,
    }


SLURM_10_NODES = {
    "SCALERL_DISTRIBUTED": "1",
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "gpu[007-009,012-018]",
    "SLURM_JOB_NODELIST": "gpu[007-009,012-018],login1",
    "SLURM_NTASKS": "10",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "0",
    "SLURM_GPUS_ON_NODE": "8",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
}


# --- distributed_init_kwargs on hand-written environments ---------------------------------------


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"SCALERL_DISTRIBUTED": "0"},
        {"SCALERL_DISTRIBUTED": ""},
        {"SCALERL_DISTRIBUTED": "0", "SLURM_JOB_ID": "1", "SLURM_NTASKS": "2"},
    ],
)
def test_single_process_unless_asked(environ):
    assert distributed_init_kwargs(environ) is None


def test_auto_leaves_the_peers_to_jax_with_the_run_timeouts():
    """On a TPU VM slice JAX reads coordinator, count and id from the TPU metadata: nothing of them
    is passed (a None would not be filled in), and cluster detection stays on."""
    kwargs = distributed_init_kwargs({"SCALERL_DISTRIBUTED": "auto", "SCALERL_HEARTBEAT_TIMEOUT_S": "15"})
    assert kwargs == {"initialization_timeout": 300, "heartbeat_timeout_seconds": 15, "shutdown_timeout_seconds": 60}


def test_explicit_variables():
    environ = {
        "SCALERL_DISTRIBUTED": "1",
        "SCALERL_COORDINATOR": "10.0.0.5:1234",
        "SCALERL_NUM_PROCESSES": "4",
        "SCALERL_PROCESS_ID": "3",
        "SCALERL_INIT_TIMEOUT_S": "120",
        "SCALERL_HEARTBEAT_TIMEOUT_S": "15",
        "SCALERL_SHUTDOWN_TIMEOUT_S": "20",
    }
    assert distributed_init_kwargs(environ) == expected_kwargs("10.0.0.5:1234", 4, 3, 120, 15, 20)


def test_explicit_variables_win_over_slurm():
    environ = dict(
        SLURM_10_NODES, SCALERL_COORDINATOR="127.0.0.1:5555", SCALERL_NUM_PROCESSES="2", SCALERL_PROCESS_ID="1"
    )
    assert distributed_init_kwargs(environ) == expected_kwargs("127.0.0.1:5555", 2, 1)


@pytest.mark.parametrize(
    "present", [("SCALERL_COORDINATOR",), ("SCALERL_NUM_PROCESSES", "SCALERL_PROCESS_ID"), ("SCALERL_PROCESS_ID",)]
)
def test_partial_explicit_set_names_the_missing(present):
    values = {"SCALERL_COORDINATOR": "h:1", "SCALERL_NUM_PROCESSES": "2", "SCALERL_PROCESS_ID": "0"}
    environ = {"SCALERL_DISTRIBUTED": "1", **{name: values[name] for name in present}}
    with pytest.raises(LaunchEnvError) as error:
        distributed_init_kwargs(environ)
    missing_part = str(error.value).split(" set but ")[1].split(" missing")[0]
    assert sorted(missing_part.split(", ")) == sorted(set(values) - set(present))


@pytest.mark.parametrize(
    "variable, value",
    [
        ("SCALERL_DISTRIBUTED", "yes"),
        ("SCALERL_NUM_PROCESSES", "two"),
        ("SCALERL_NUM_PROCESSES", "0"),
        ("SCALERL_PROCESS_ID", "2"),
        ("SCALERL_PROCESS_ID", "-1"),
        ("SCALERL_COORDINATOR", "nohost"),
        ("SCALERL_COORDINATOR", "host:70000"),
        ("SCALERL_COORDINATOR", ":1234"),
        ("SCALERL_INIT_TIMEOUT_S", "0"),
        ("SCALERL_HEARTBEAT_TIMEOUT_S", "abc"),
        ("SCALERL_SHUTDOWN_TIMEOUT_S", "1.5"),
    ],
)
def test_malformed_values_name_their_variable(variable, value):
    environ = {
        "SCALERL_DISTRIBUTED": "1",
        "SCALERL_COORDINATOR": "h:1",
        "SCALERL_NUM_PROCESSES": "2",
        "SCALERL_PROCESS_ID": "0",
        variable: value,
    }
    with pytest.raises(LaunchEnvError, match=f"^{variable}="):
        distributed_init_kwargs(environ)


def test_distributed_without_peers_is_an_error():
    with pytest.raises(LaunchEnvError, match="SCALERL_COORDINATOR.*SLURM_JOB_ID"):
        distributed_init_kwargs({"SCALERL_DISTRIBUTED": "1"})


def test_slurm_variables():
    # 61440 + 4242 mod 4096 = 61440 + 146; the step's first node; every GPU the task sees.
    assert distributed_init_kwargs(SLURM_10_NODES) == expected_kwargs("gpu007:61586", 10, 3)


def test_slurm_keeps_every_gpu_whatever_the_local_id():
    # JAX's own detection would pass local_device_ids=[5] here: one GPU.
    kwargs = distributed_init_kwargs(dict(SLURM_10_NODES, SLURM_LOCALID="5"))
    assert kwargs is not None
    assert kwargs["local_device_ids"] is None and kwargs["cluster_detection_method"] == "deactivate"


def test_slurm_port_override_and_job_nodelist_fallback():
    environ = {k: v for k, v in SLURM_10_NODES.items() if k != "SLURM_STEP_NODELIST"}
    environ.update(SCALERL_COORDINATOR_PORT="29500", SLURM_JOB_NODELIST="login1,gpu[1-4]", SLURM_PROCID="0")
    assert distributed_init_kwargs(environ) == expected_kwargs("login1:29500", 10, 0)


@pytest.mark.parametrize("dropped", ["SLURM_NTASKS", "SLURM_PROCID"])
def test_slurm_missing_variable_is_named(dropped):
    environ = {k: v for k, v in SLURM_10_NODES.items() if k != dropped}
    with pytest.raises(LaunchEnvError, match=dropped):
        distributed_init_kwargs(environ)


def test_slurm_without_nodelist_is_named():
    environ = {k: v for k, v in SLURM_10_NODES.items() if "NODELIST" not in k}
    with pytest.raises(LaunchEnvError, match="SLURM_STEP_NODELIST or SLURM_JOB_NODELIST"):
        distributed_init_kwargs(environ)


def test_slurm_procid_beyond_ntasks():
    with pytest.raises(LaunchEnvError, match="SLURM_PROCID=10 but SLURM_NTASKS=10"):
        distributed_init_kwargs(dict(SLURM_10_NODES, SLURM_PROCID="10"))


# --- SLURM hostlists ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node01", ["node01"]),
        ("node01,host2", ["node01", "host2"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("gpu[1-2],cpu[5],login", ["gpu1", "gpu2", "cpu5", "login"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
        ("node-a1.cluster.org", ["node-a1.cluster.org"]),
        ("localhost", ["localhost"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["node[1-", "node[3-1]", "node[a]", "node]1[", "a,,b", "n[1-2[3]]", "n[]"])
def test_expand_hostlist_rejects_malformed(hostlist):
    with pytest.raises(LaunchEnvError, match=r"^SLURM_JOB_NODELIST="):
        expand_hostlist(hostlist, "SLURM_JOB_NODELIST")


@pytest.mark.parametrize(
    "nodelist", ["node001", "node001,host2", "node[001-015],host2", "node[007,009-015],x", "a1b[2-3]"]
)
def test_first_host_and_port_agree_with_jax(nodelist):
    from jax._src.clusters.slurm_cluster import SlurmCluster

    with mock.patch.dict(os.environ, {"SLURM_JOB_ID": "987654", "SLURM_STEP_NODELIST": nodelist}):
        jax_address = SlurmCluster.get_coordinator_address(timeout_secs=None, override_coordinator_port=None)
    assert jax_address == f"{expand_hostlist(nodelist)[0]}:{slurm_default_port(987654)}"


# --- which platform gets gloo ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "platforms, plugins, cpu",
    [
        ("cpu", [], True),
        ("", [], True),
        ("cuda,cpu", [], False),
        ("", ["xla_cuda12"], False),
        ("cpu", ["xla_cuda12"], True),
        (" cpu , cuda", ["xla_cuda12"], True),
    ],
)
def test_platform_will_be_cpu(platforms, plugins, cpu):
    assert platform_will_be_cpu(platforms, plugins) is cpu


# --- real processes ----------------------------------------------------------------------------------


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
        PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(REPO, "tests"), env.get("PYTHONPATH")])),
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
def test_dead_peer_stops_the_others_within_60_s_by_default(tmp_path):
    port = free_port()
    envs = [
        child_env(
            SCALERL_DISTRIBUTED="1",
            SCALERL_COORDINATOR=f"127.0.0.1:{port}",
            SCALERL_NUM_PROCESSES="2",
            SCALERL_PROCESS_ID=str(i),
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
            "PYTHONPATH": os.path.join(REPO, "tests"),
        },
    )
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout.split("PROBE ", 1)[1])
    assert probe["kwargs"] == {
        "initialization_timeout": 300,
        "heartbeat_timeout_seconds": 30,
        "shutdown_timeout_seconds": 60,
    }
    assert probe["argv"] == ["--config=configs/tiny.py", f"--workdir={tmp_path}", "--config.num_steps=3"]
