"""Process start-up of multi-process runs: jax.distributed arguments from the environment (explicit
and SLURM variables, host lists, the platform), on hand-written environments. The real 2-process
starts and `launch/local.sh N`: tests/e2e/test_launch_processes.py.
"""

import os
from unittest import mock

import pytest

from scalerl_jax.distributed.launch_env import (
    LaunchEnvError,
    distributed_init_kwargs,
    expand_hostlist,
    platform_will_be_cpu,
    slurm_default_port,
)


def expected_kwargs(coordinator, num_processes, process_id, init=300, heartbeat=90, shutdown=60):
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
