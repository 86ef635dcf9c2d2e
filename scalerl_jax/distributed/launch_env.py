"""How one process of a multi-process run finds its peers: `jax.distributed.initialize` arguments from the environment.

A run is N processes (JAX multi-controller): locally N CPU processes (`launch/local.sh N ...`), on
SLURM one process per node holding every GPU of that node (`launch/slurm.sbatch`). Each process
needs the coordinator's `host:port` (process 0 serves the coordination service there), the process
count and its own id. They come from, in this order:

1. explicit variables, all three or none: `SCALERL_COORDINATOR` (host:port),
   `SCALERL_NUM_PROCESSES`, `SCALERL_PROCESS_ID` (what `launch/local.sh N` sets);
2. SLURM (`SLURM_JOB_ID` present): the coordinator is the first host of `SLURM_STEP_NODELIST`
   (the nodes of this `srun` step; `SLURM_JOB_NODELIST` outside a step) on port
   `SCALERL_COORDINATOR_PORT`, or by default a port derived from the job id as JAX derives it
   (`61440 + SLURM_JOB_ID mod 4096`, so every task computes the same one); the count is
   `SLURM_NTASKS` and the id `SLURM_PROCID`;
3. `SCALERL_DISTRIBUTED=auto` (TPU VM slices, `launch/tpu.sh`): none; JAX's own cluster detection
   reads them from the TPU metadata, one process per TPU VM holding all of its chips.

Why not let `jax.distributed.initialize()` detect SLURM itself: JAX then sets
`local_device_ids=[SLURM_LOCALID]` (jax/_src/clusters/cluster.py), which becomes the CUDA plugin's
`visible_devices` option, i.e. one GPU per process, and 10 nodes x 8 GPUs give 10 devices, not 80.
So the arguments here are all explicit and `cluster_detection_method="deactivate"` switches JAX's
detection off (otherwise any argument left None, `local_device_ids` included, is filled in from
SLURM again). `local_device_ids=None` then leaves `jax_cuda_visible_devices` at "all": the process
uses every GPU that `CUDA_VISIBLE_DEVICES` (set by SLURM for the allocation) shows it. Passing the
ids from `SLURM_STEP_GPUS` or `CUDA_VISIBLE_DEVICES` instead would be wrong whenever the node's
allocation is not GPUs 0..n-1: the plugin reads the ids as CUDA ordinals, which are renumbered
from 0 after `CUDA_VISIBLE_DEVICES`. With several tasks on one node, bind GPUs per task
(`--gpus-per-task`) or set `JAX_LOCAL_DEVICE_IDS`, which JAX still honours.

Timeouts (measured on CPU with jax 0.10.2, 2 processes):
- `initialization_timeout` (`SCALERL_INIT_TIMEOUT_S`, default 300 s): how long a process waits
  for all peers to connect, since nodes start at different times.
- `heartbeat_timeout_seconds` (`SCALERL_HEARTBEAT_TIMEOUT_S`, default 90 s): how long a silent
  process counts as alive. When it passes, the coordination service declares the process dead and
  every other process aborts (status 134) with a stack dump. It is the backstop: the run's own
  watchdog (`distributed.heartbeat_timeout_s`, 30 s) stops every process with one line naming the
  lost one, at once for a crashed peer (its socket closes) and after its timeout for a frozen one.
  JAX counts the silence from the frozen peer's last beat, which its clients send only every
  part of the timeout, so it can declare the peer dead well before a full timeout after the freeze
  (docs/results/steady_suite.md); at 3x the watchdog's timeout it stays behind the watchdog.
- `shutdown_timeout_seconds` (`SCALERL_SHUTDOWN_TIMEOUT_S`, default 60 s): how long an exiting
  process waits at JAX's shutdown barrier (run at interpreter exit) for the others. A process that
  fails with an exception does not die: it waits there while its peers wait for it inside a
  collective, and with JAX's default (300 s) it exited only when the peers gave up (110 s later
  in the measurement). With a bound, the barrier times out and every process aborts (15 s: all
  gone after 18 s). 60 s leaves process 0 time for end-of-run side effects the others do not wait
  for at a barrier of their own.
"""

from __future__ import annotations

import importlib.util
import itertools
import pkgutil
import re
from collections.abc import Collection, Mapping

DEFAULT_INIT_TIMEOUT_S = 300
DEFAULT_HEARTBEAT_TIMEOUT_S = 90
DEFAULT_SHUTDOWN_TIMEOUT_S = 60
EXPLICIT_VARS = ("SCALERL_COORDINATOR", "SCALERL_NUM_PROCESSES", "SCALERL_PROCESS_ID")
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")
SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
# JAX's SLURM default: a port in the top 4096 of the ephemeral range, chosen by the job id.
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 65536 - 4096, 4096


class LaunchEnvError(ValueError):
    """An environment variable that cannot start a distributed run; the message names the variable."""


def distributed_init_kwargs(environ: Mapping[str, str]) -> dict | None:
    """Keyword arguments for `jax.distributed.initialize`, or None when the run is a single process.

    None unless `SCALERL_DISTRIBUTED` is "1" or "auto" ("" or "0" mean single process). With
    "auto" only the three timeouts: `jax.distributed.initialize` finds the peers itself (on TPU VM
    slices, from the TPU metadata; `launch/tpu.sh`). Raises
    `LaunchEnvError` naming the variable for a partial explicit set, missing SLURM variables or a
    malformed value. The result always has `coordinator_address`, `num_processes`, `process_id`,
    `local_device_ids=None` (every device the process can see), `cluster_detection_method="deactivate"`,
    `initialization_timeout`, `heartbeat_timeout_seconds` and `shutdown_timeout_seconds`.
    """
    switch = environ.get("SCALERL_DISTRIBUTED", "")
    if switch not in ("", "0", "1", "auto"):
        raise LaunchEnvError(
            f"SCALERL_DISTRIBUTED={switch!r}: expected 1 (distributed, peers from the variables or SLURM), "
            "auto (distributed, peers found by JAX: TPU VM slices) or 0 (single process)"
        )
    if switch not in ("1", "auto"):
        return None
    timeouts = {
        "initialization_timeout": _positive_int(environ, "SCALERL_INIT_TIMEOUT_S", DEFAULT_INIT_TIMEOUT_S),
        "heartbeat_timeout_seconds": _positive_int(environ, "SCALERL_HEARTBEAT_TIMEOUT_S", DEFAULT_HEARTBEAT_TIMEOUT_S),
        "shutdown_timeout_seconds": _positive_int(environ, "SCALERL_SHUTDOWN_TIMEOUT_S", DEFAULT_SHUTDOWN_TIMEOUT_S),
    }
    if switch == "auto":
        # On a TPU VM slice every worker runs the same command and JAX reads the coordinator, the
        # process count and this worker's id from the TPU metadata itself; every device of the
        # worker is local to it, so there is nothing to override.
        return timeouts
    explicit = [name for name in EXPLICIT_VARS if name in environ]
    if explicit:
        coordinator, num_processes, process_id = _explicit_peers(environ, explicit)
    elif "SLURM_JOB_ID" in environ:
        coordinator, num_processes, process_id = _slurm_peers(environ)
    else:
        raise LaunchEnvError(
            "SCALERL_DISTRIBUTED=1 but no peers are described: set SCALERL_COORDINATOR (host:port), "
            "SCALERL_NUM_PROCESSES and SCALERL_PROCESS_ID, or run under SLURM (srun sets SLURM_JOB_ID, "
            "SLURM_NTASKS, SLURM_PROCID, SLURM_STEP_NODELIST)"
        )
    return {
        "coordinator_address": coordinator,
        "num_processes": num_processes,
        "process_id": process_id,
        "local_device_ids": None,
        "cluster_detection_method": "deactivate",
        **timeouts,
    }


def _explicit_peers(environ: Mapping[str, str], present: list[str]) -> tuple[str, int, int]:
    missing = [name for name in EXPLICIT_VARS if name not in environ]
    if missing:
        raise LaunchEnvError(
            f"{', '.join(present)} set but {', '.join(missing)} missing: set all of {', '.join(EXPLICIT_VARS)} or none"
        )
    coordinator = _host_port(environ["SCALERL_COORDINATOR"], "SCALERL_COORDINATOR")
    num_processes = _int_var(environ, "SCALERL_NUM_PROCESSES", minimum=1)
    process_id = _process_id(environ, "SCALERL_PROCESS_ID", num_processes, "SCALERL_NUM_PROCESSES")
    return coordinator, num_processes, process_id


def _slurm_peers(environ: Mapping[str, str]) -> tuple[str, int, int]:
    nodelist_var = next((name for name in SLURM_NODELIST_VARS if environ.get(name)), None)
    missing = [name for name in SLURM_VARS if name not in environ]
    if nodelist_var is None:
        missing.append(" or ".join(SLURM_NODELIST_VARS))
    if missing:
        raise LaunchEnvError(
            f"SCALERL_DISTRIBUTED=1 under SLURM (SLURM_JOB_ID set) but {', '.join(missing)} "
            f"missing: start the processes with srun"
        )
    assert nodelist_var is not None  # else it is listed in missing
    job_id = _int_var(environ, "SLURM_JOB_ID", minimum=0)
    port = (
        _int_var(environ, "SCALERL_COORDINATOR_PORT", minimum=1, maximum=65535)
        if "SCALERL_COORDINATOR_PORT" in environ
        else slurm_default_port(job_id)
    )
    first_host = expand_hostlist(environ[nodelist_var], nodelist_var)[0]
    num_processes = _int_var(environ, "SLURM_NTASKS", minimum=1)
    process_id = _process_id(environ, "SLURM_PROCID", num_processes, "SLURM_NTASKS")
    return f"{first_host}:{port}", num_processes, process_id


def slurm_default_port(job_id: int) -> int:
    """The coordinator port every task of a SLURM job computes alike: 61440 + job_id mod 4096 (as JAX)."""
    return _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN


_HOSTLIST_ITEM = re.compile(r"([^\[\],]*)(\[[^\[\]]*\])?")


def expand_hostlist(hostlist: str, variable: str = "hostlist") -> list[str]:
    """Expands a SLURM hostlist: "gpu[01-03,07],login" -> gpu01, gpu02, gpu03, gpu07, login.

    Hosts are separated by commas outside brackets; a bracket holds comma-separated numbers or
    inclusive ranges lo-hi, each zero-padded to the width of its lower bound (as SLURM writes
    them: [08-10] -> 08, 09, 10); several brackets in one host name multiply
    ("r[1-2]n[1-2]" -> r1n1, r1n2, r2n1, r2n2). `variable` names the source in errors.
    """
    hosts: list[str] = []
    for item in _split_outside_brackets(hostlist, variable):
        if not item:
            raise LaunchEnvError(f"{variable}={hostlist!r}: empty host name")
        parts: list[list[str]] = []
        position = 0
        while position < len(item):
            match = _HOSTLIST_ITEM.match(item, position)
            if match is None or match.end() == position:
                raise LaunchEnvError(f"{variable}={hostlist!r}: cannot read {item[position:]!r}")
            literal, bracket = match.groups()
            parts.append([literal])
            if bracket is not None:
                parts.append(_expand_ranges(bracket[1:-1], hostlist, variable))
            position = match.end()
        hosts.extend("".join(choice) for choice in itertools.product(*parts))
    return hosts


def _split_outside_brackets(hostlist: str, variable: str) -> list[str]:
    items, depth, current = [], 0, []
    for ch in hostlist:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            raise LaunchEnvError(f"{variable}={hostlist!r}: unbalanced or nested brackets")
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise LaunchEnvError(f"{variable}={hostlist!r}: unbalanced brackets")
    items.append("".join(current))
    return [item.strip() for item in items]


def _expand_ranges(ranges: str, hostlist: str, variable: str) -> list[str]:
    numbers = []
    for entry in ranges.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", entry)
        if match is None:
            raise LaunchEnvError(f"{variable}={hostlist!r}: bad range {entry!r} (expected N or LO-HI)")
        low_text, high_text = match.groups()
        low, high = int(low_text), int(high_text if high_text is not None else low_text)
        if high < low:
            raise LaunchEnvError(f"{variable}={hostlist!r}: range {entry!r} runs backwards")
        numbers.extend(str(n).zfill(len(low_text)) for n in range(low, high + 1))
    return numbers


def _host_port(value: str, variable: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise LaunchEnvError(f"{variable}={value!r}: expected host:port with a port in 1..65535")
    return value


def _int_var(environ: Mapping[str, str], variable: str, *, minimum: int, maximum: int | None = None) -> int:
    text = environ[variable]
    try:
        value = int(text)
    except ValueError:
        raise LaunchEnvError(f"{variable}={text!r}: not an integer") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"in {minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise LaunchEnvError(f"{variable}={text!r}: expected an integer {bound}")
    return value


def _process_id(environ: Mapping[str, str], variable: str, num_processes: int, count_variable: str) -> int:
    process_id = _int_var(environ, variable, minimum=0)
    if process_id >= num_processes:
        raise LaunchEnvError(
            f"{variable}={process_id} but {count_variable}={num_processes}: ids run from 0 to {num_processes - 1}"
        )
    return process_id


def _positive_int(environ: Mapping[str, str], variable: str, default: int) -> int:
    return _int_var(environ, variable, minimum=1) if variable in environ else default


def platform_will_be_cpu(jax_platforms: str, accelerator_plugins: Collection[str]) -> bool:
    """Whether JAX's default backend will be the CPU, decided before any backend starts.

    `jax_platforms` is JAX's `jax_platforms` setting (the `JAX_PLATFORMS` variable): when set, its
    first entry is the platform JAX tries first. Unset, JAX prefers any installed accelerator
    plugin (e.g. `xla_cuda12`); with none installed it runs on the CPU. (A plugin installed on a
    machine without its accelerator falls back to CPU: set JAX_PLATFORMS=cpu there.)
    """
    platforms = [p.strip() for p in jax_platforms.split(",") if p.strip()]
    if platforms:
        return platforms[0] == "cpu"
    return not accelerator_plugins


def installed_accelerator_plugins() -> list[str]:
    """Names of installed JAX PJRT plugins (modules under `jax_plugins`, or its entry points), without importing them."""
    from importlib.metadata import entry_points

    names = {entry.name for entry in entry_points(group="jax_plugins")}
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        names.update(module.name for module in pkgutil.iter_modules(spec.submodule_search_locations))
    return sorted(names)


def configure_cpu_collectives(num_processes: int | None) -> bool:
    """Selects gloo for cross-process CPU collectives when the run is multi-process on the CPU.

    JAX's CPU backend has no cross-process collectives by default: a computation over devices of
    several processes fails. gloo (over TCP, rendezvous through the jax.distributed key-value
    store) provides them. Must run before the CPU backend starts. Returns whether gloo was chosen.
    `num_processes` None (peers found by JAX, `SCALERL_DISTRIBUTED=auto`): never the CPU.
    """
    import jax

    # jax.config's options are dynamic attributes, which its type stubs do not declare.
    platforms = jax.config.jax_platforms or ""  # pyright: ignore[reportAttributeAccessIssue]
    if (
        num_processes is None
        or num_processes <= 1
        or not platform_will_be_cpu(platforms, installed_accelerator_plugins())
    ):
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    return True
