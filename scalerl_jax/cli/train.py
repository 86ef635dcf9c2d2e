"""The RL job: `python -m scalerl_jax.main --config=configs/scalerl_8b.py --workdir=DIR` (or
`scalerl train ...`).

Builds everything from one ml_collections config (validated first), then runs the PipelineRL-k
or PPO-off-policy-k loop: data -> sampler -> pipeline queue -> train step -> new params ->
sampler. Writes `DIR/config.json`, `DIR/metrics.jsonl`, `DIR/samples.jsonl`, TensorBoard events
in `DIR/tb`, orbax checkpoints in `DIR/checkpoints` (resumed from automatically), and at the end
a sigmoid fit of the run's own pass-rate curve (`DIR/scaling.png`).

Start-up order matters: the config is checked before JAX starts, so that on the CPU backend the
host can be split into `mesh.cpu_devices` devices (which must happen before the backend exists),
and a recipe meant for accelerators stops at once when only the CPU is there. A config problem
prints one message listing every problem and exits with status 2, without a traceback; the run's
own refusals (a workdir locked by another run, no usable checkpoint, a checkpoint that cannot be
written, a file or directory that cannot be read or written) print one line naming what and where
and exit with status 1 (`--verbosity=1` logs the traceback too). A bad command line (an unknown
flag or `--config.KEY`, a config file that is missing or not Python) and a data file or checkpoint
file that cannot be used (a malformed row, a truncated tokenizer.json) print one line naming the
file and row, line or key and exit with status 2 (`scalerl_jax.cli.errors`; `SCALERL_DEBUG=1`
prints the traceback too).

Signals (`run.signals.StopSignals`): SIGTERM (what SLURM sends before it preempts or at the time
limit) or a first Ctrl-C finishes the current step, writes its metrics row and a checkpoint of
the state after it, and exits 0 with the stop reason in the summary; the same command resumes
there. A second Ctrl-C exits at once with status 130 and one line; the next run resumes from the
last complete checkpoint. In a multi-process run the leader chooses the step where all stop.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from scalerl_jax.cli.errors import debug_enabled, report_error
from scalerl_jax.config.argv import CONFIG_ARGV_ERRORS, config_argv_problem, touch_config
from scalerl_jax.config.devices import check_backend, check_devices
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.validation import validate
from scalerl_jax.distributed.launch_env import LaunchEnvError, configure_cpu_collectives, distributed_init_kwargs

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an ml_collections config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, checkpoints and artifacts.")
flags.mark_flags_as_required(["config", "workdir"])

EXIT_CONFIG_ERROR = 2
EXIT_RUN_ERROR = 1
FORCED_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (`app.run`'s `flags_parser`), with a bad command line ended by one line
    and status 2: an unknown or missing flag, a config file that is missing or not Python (or
    whose get_config() raises a KeyError, ValueError, ...: named with its line), an unknown
    `--config.KEY` (with the nearest key), a value that does not parse, a `--workdir` that is a file."""
    try:
        rest = flags.FLAGS(argv)
        touch_config(_CONFIG.value)  # ml_collections keeps an unreadable file's error until then
    except CONFIG_ARGV_ERRORS as e:
        problem = config_argv_problem(argv, e)
        kind = "config error" if problem.startswith("--config") else "usage error"
        hint = "" if kind == "config error" else " (--helpshort lists the flags)"
        sys.exit(report_error(f"{kind}: {problem}{hint}", EXIT_CONFIG_ERROR))  # before JAX starts: no `stop`
    workdir = _WORKDIR.value
    if workdir is not None and os.path.exists(workdir) and not os.path.isdir(workdir):
        sys.exit(report_error(f"usage error: --workdir={workdir} is a file; expected a directory", EXIT_CONFIG_ERROR))
    return rest


def split_host_devices(cpu_devices: int) -> None:
    """On the CPU backend, present the host as `cpu_devices` devices (generator and trainer sets).

    Must run before JAX initializes its backends. An explicit `--xla_force_host_platform_device_count`
    in XLA_FLAGS wins (tests and users who set it keep their choice); 0 leaves JAX's default.
    """
    if cpu_devices and FORCED_DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", cpu_devices)


def start(config) -> None:
    """Validates the config, starts JAX (distributed when asked) and checks the backend fits.

    Order: validate -> split the CPU host into devices -> (multi-process) gloo CPU collectives and
    `jax.distributed.initialize` -> backend and device checks. The first three must precede the
    backend's start; the checks start it. `SCALERL_DISTRIBUTED=1` makes the run one of N
    processes, the peers described by `SCALERL_COORDINATOR` / `SCALERL_NUM_PROCESSES` /
    `SCALERL_PROCESS_ID` or by SLURM (`scalerl_jax.distributed.launch_env`); each process keeps
    every local device. A malformed launch variable is a config error naming the variable.
    """
    validate(config)
    split_host_devices(config.mesh.cpu_devices)
    try:
        init_kwargs = distributed_init_kwargs(os.environ)
    except LaunchEnvError as e:
        raise ConfigError(str(e)) from e
    if init_kwargs is not None:
        configure_cpu_collectives(init_kwargs.get("num_processes"))
        jax.distributed.initialize(**init_kwargs)
    check_backend(config, jax.default_backend())
    logging.info(
        "process %d of %d, local devices %s, global device count %d",
        jax.process_index(),
        jax.process_count(),
        [device.id for device in jax.local_devices()],
        jax.device_count(),
    )
    check_devices(config, len(jax.devices()))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config, workdir = _CONFIG.value, _WORKDIR.value
    assert workdir is not None  # a required flag: absl refuses the command line without it
    try:
        start(config)
    except ConfigError as e:
        sys.exit(report_error(f"config error: {e}", EXIT_CONFIG_ERROR))
    from scalerl_jax.data.rows import DataFileError
    from scalerl_jax.models.hf_tokenizer import CheckpointFileError
    from scalerl_jax.run import RUN_ERRORS, run  # heavy imports after the config is known to be good
    from scalerl_jax.run.signals import EXIT_INTERRUPTED, exit_now
    from scalerl_jax.sandbox import SandboxUnavailable

    started = time.time()
    try:
        summary = run(config, workdir)
    except ConfigError as e:  # found once the checkpoint, tokenizer or data are read
        stop(f"config error: {e}", EXIT_CONFIG_ERROR)
    except (DataFileError, CheckpointFileError, SandboxUnavailable) as e:
        # a data row or a checkpoint file that cannot be used, a machine that cannot run the code sandbox
        stop(f"error: {e}", EXIT_CONFIG_ERROR)
    except (*RUN_ERRORS, OSError) as e:  # OSError: a file or directory that cannot be read or written
        logging.debug("run stopped", exc_info=True)  # the traceback, with --verbosity=1
        stop(f"error: {e}", EXIT_RUN_ERROR)
    except KeyboardInterrupt:  # a SIGINT before the run's own handling (`run.signals.StopSignals`) is installed
        exit_now("interrupted by SIGINT while the run was starting", EXIT_INTERRUPTED)
    except BaseException:
        if jax.process_count() > 1:  # the traceback, then out at once (see `stop`)
            logging.exception("run failed")
            stop("error: the run failed (traceback above)", EXIT_RUN_ERROR)
        raise
    logging.info("run finished in %.1f min: %s", (time.time() - started) / 60, summary)


def stop(message: str, status: int) -> None:
    """Prints `message` and exits with `status`. In a multi-process run the exit is immediate
    (`os._exit`): a normal exit would wait at jax.distributed's shutdown barrier for peers that
    are still working, while they learn of this process's end only when its connections close."""
    if debug_enabled() and sys.exc_info()[0] is not None:
        traceback.print_exc()
    print(message, file=sys.stderr, flush=True)
    if jax.process_count() > 1:
        logging.flush()
        os._exit(status)
    sys.exit(status)


def cli() -> None:
    """The command: absl parses the flags (`parse_flags`), then `main` runs."""
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
