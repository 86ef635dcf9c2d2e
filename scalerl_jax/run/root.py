"""The composition root: `run(config, workdir)` builds this process's part of a run and drives it.

It works out the process's roles (`distributed/roles.py`), prepares the shared files once
(process 0: the workdir lock, the config check and `config.json`, the warm start, the TFDS
dataset), loads the policy's source, connects the processes, builds the meshes and the weight
transfer, and runs the leader, a follower trainer or a generator process (`processes.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import ml_collections
from absl import logging

from scalerl_jax import data as data_lib
from scalerl_jax.config_validation import ConfigError, check_resume, config_json
from scalerl_jax.console import quiet_library_logs
from scalerl_jax.distributed import coordination
from scalerl_jax.distributed.roles import assign_roles
from scalerl_jax.distributed.transport import plan_routes
from scalerl_jax.distributed.watchdog import Heartbeat
from scalerl_jax.distributed.wiring import connect_processes
from scalerl_jax.models import abstract_hf
from scalerl_jax.policy_source import run_model_overrides
from scalerl_jax.run.build import AbstractPolicy, build_meshes, build_policy_source, build_transfer, dataset_builder
from scalerl_jax.run.context import RunContext
from scalerl_jax.run.processes import run_follower, run_generator, run_leader
from scalerl_jax.train.checkpoint import CheckpointError, RunCheckpointer
from scalerl_jax.warm_start import build_warm_start
from scalerl_jax.workdir_lock import WorkdirLockedError, hold_workdir

# Failures that end a run with one line naming what and where (no traceback): another run holds
# the workdir, no usable checkpoint, a checkpoint that cannot be written.
RUN_ERRORS = (WorkdirLockedError, CheckpointError)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any] | None:
    """Runs this process's part of the configured job to `num_steps` (or a stop); returns the
    leader's summary dict (None elsewhere). Restores the caller's signal handlers on the way out."""
    quiet_library_logs()
    os.makedirs(workdir, exist_ok=True)
    roles = assign_roles(jax.devices(), config.mesh.generator_fraction, jax.process_index(), jax.process_count())
    logging.info("%s", roles.describe())
    if roles.distributed:  # host-side array math runs here, not on global device 0 (process 0's)
        jax.config.update("jax_default_device", jax.local_devices()[0])
    d = config.distributed
    with preserved_signal_handlers(), contextlib.ExitStack() as stack:
        signals = StopSignals(leader=roles.is_leader)
        signals.install()
        coordination.run_once(
            "prepare", lambda: prepare_shared_files(config, workdir, stack), timeout_s=d.connect_timeout_s
        )
        source = build_policy_source(config, workdir)
        links = connect_processes(roles, timeout_s=d.connect_timeout_s) if roles.distributed else None
        heartbeat = (
            Heartbeat(links.heartbeats(), interval_s=d.heartbeat_s, timeout_s=d.heartbeat_timeout_s) if links else None
        )
        policy = AbstractPolicy(*abstract_hf(source.checkpoint_dir, **run_model_overrides(config)))
        meshes = build_meshes(config, roles)
        transfer = build_transfer(config, roles, plan_routes(roles), policy.params, meshes.trainer)
        ctx = RunContext(config, workdir, roles, source, policy, links, meshes, transfer)
        if roles.is_leader:
            summary = run_leader(ctx, signals)
        elif roles.is_trainer:
            summary = run_follower(ctx)
        else:
            summary = run_generator(ctx)
        if heartbeat is not None:  # a process that fails says no goodbye: the others see it lost
            heartbeat.close()
        return summary


EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's status for a run stopped by Ctrl-C


class StopSignals:
    """SIGTERM / SIGINT for the run's life (installed from the main thread by `run`).

    The first SIGTERM or SIGINT asks for a graceful stop: on the leader, the pipeline finishes
    its current step, writes its metrics row and checkpoints the state after it (every trainer
    process saves with the leader), then the run ends normally (exit 0, the stop reason in the
    summary). Followers and generator processes only log it: the leader decides the step at which
    every process stops (SLURM signals all of them), so none stops on its own and leaves a
    collective half issued. A later SIGTERM is logged and ignored. A later SIGINT (a second
    Ctrl-C) ends the process at once: one line on stderr, logs flushed, `os._exit(130)`, without
    the interpreter's teardown (XLA's threads abort it mid-step); the next run resumes from the
    last complete checkpoint. A stop asked for before the pipeline exists is kept and passed on
    when it registers (`on_stop`)."""

    def __init__(self, *, leader: bool) -> None:
        self.leader = leader
        self.reason: str | None = None  # 'signal SIGTERM' once a stop was asked for
        self._stop: Callable[[str], None] | None = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, self.handle)

    def on_stop(self, stop: Callable[[str], None]) -> None:
        """`stop(reason)` is called on the first signal (at once if one came already)."""
        self._stop = stop  # handlers run in the main thread, between its bytecodes: no lock needed
        if self.reason is not None:
            stop(self.reason)

    def handle(self, signum: int, frame: object = None) -> None:
        name = signal.Signals(signum).name
        first = self.reason is None
        if first:
            self.reason = f"signal {name}"
        if not first:
            if signum == signal.SIGINT:
                exit_now(
                    f"stopped at once by a second {name}; the next run resumes from the last complete checkpoint",
                    EXIT_INTERRUPTED,
                )
            logging.warning("%s received again: already stopping after the current step", name)
            return
        if not self.leader:
            logging.warning("%s received: the leader (process 0) chooses the step at which every process stops", name)
            return
        logging.warning("%s received: stopping after the current step, with a checkpoint", name)
        if self._stop is not None:
            self._stop(f"signal {name}")


def exit_now(message: str, status: int) -> None:
    """Ends the process at once: `message` on stderr, logs flushed, `os._exit(status)`."""
    print(message, file=sys.stderr, flush=True)
    logging.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(status)


@contextlib.contextmanager
def preserved_signal_handlers() -> Iterator[None]:
    """Restores the SIGINT / SIGTERM handlers found on entry (the caller keeps its Ctrl-C)."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:
                signal.signal(signum, handler)


def prepare_shared_files(config: ml_collections.ConfigDict, workdir: str, stack: contextlib.ExitStack) -> None:
    """Process 0 (the leader), once for the run: holds the workdir lock (for the run's life, in
    `stack`); refuses, before any work, a workdir whose checkpoints belong to another config and a
    custom reward that does not load; writes `config.json`; builds the warm-started policy and the
    TFDS dataset that every process reads."""
    stack.enter_context(hold_workdir(workdir))
    check_workdir_config(config, workdir)
    check_custom_reward(config)
    if "warm_start" in config:
        build_warm_start(config, workdir)
    dataset_builder(config, workdir)


def check_workdir_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    """A resumed workdir must get its own config back (`check_resume`); then `config.json` is written."""
    checkpointer = RunCheckpointer(workdir, keep=config.checkpoint.keep, processes=(0,))
    try:
        saved = checkpointer.saved_config()
    finally:
        checkpointer.close()
    check_resume(config, workdir, saved_fingerprint=saved)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config_json(config), f, indent=2, sort_keys=True)


def check_custom_reward(config: ml_collections.ConfigDict) -> None:
    """Imports `data.reward_fn` and calls it once on a dummy item in a worker, before any heavy work."""
    if config.data.reward_fn:
        try:
            data_lib.check_reward_fn(config.data.reward_fn, time_limit_s=config.data.verify_timeout_s)
        except ValueError as e:
            raise ConfigError(f"config key `data.reward_fn` = {config.data.reward_fn!r}: {e}") from e
