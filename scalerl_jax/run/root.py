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
from typing import Any

import jax
import ml_collections
from absl import logging

from scalerl_jax import data as data_lib
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.memory_fit import check_run_memory, device_memory_bytes
from scalerl_jax.config.resume import check_resume, config_json
from scalerl_jax.contracts.workdir_lock import WorkdirLockedError, hold_workdir
from scalerl_jax.distributed import coordination
from scalerl_jax.distributed.roles import assign_roles
from scalerl_jax.distributed.transport import plan_routes
from scalerl_jax.distributed.watchdog import Heartbeat
from scalerl_jax.distributed.wiring import connect_processes
from scalerl_jax.models import abstract_hf
from scalerl_jax.run.build import (
    AbstractPolicy,
    build_meshes,
    build_policy_source,
    build_transfer,
    check_moe_keys,
    code_verifier_of,
    dataset_builder,
)
from scalerl_jax.run.context import RunContext
from scalerl_jax.run.device_split import resolve_generator_fraction
from scalerl_jax.run.policy_source import run_model_overrides
from scalerl_jax.run.processes import run_follower, run_generator, run_leader
from scalerl_jax.run.signals import StopSignals, preserved_signal_handlers
from scalerl_jax.run.warm_start import build_warm_start
from scalerl_jax.telemetry.console import quiet_library_logs
from scalerl_jax.train.checkpoint import CheckpointError, RunCheckpointer

# Failures that end a run with one line naming what and where (no traceback): another run holds
# the workdir, no usable checkpoint, a checkpoint that cannot be written.
RUN_ERRORS = (WorkdirLockedError, CheckpointError)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any] | None:
    """Runs this process's part of the configured job to `num_steps` (or a stop); returns the
    leader's summary dict (None elsewhere). Restores the caller's signal handlers on the way out."""
    quiet_library_logs()
    os.makedirs(workdir, exist_ok=True)
    config = resolve_generator_fraction(config, workdir)  # 'auto': measured here, a number from now on
    roles = assign_roles(jax.devices(), config.mesh.generator_fraction, jax.process_index(), jax.process_count())
    logging.info("%s", roles.describe())
    if roles.distributed:  # host-side array math runs here, not on global device 0 (process 0's)
        jax.config.update("jax_default_device", jax.local_devices()[0])
    d = config.distributed
    # The leader's code verifier first: a machine that cannot contain a program stops the run here.
    code_verifier = code_verifier_of(config) if roles.is_leader else None
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
        check_run_memory(  # before any program compiles: recipe sizes the devices cannot hold, named
            config,
            policy.model_config,
            generator_devices=roles.generator_devices,
            trainer_devices=roles.trainer_devices,
            capacities=run_capacities(timeout_s=d.connect_timeout_s),
        )
        meshes = build_meshes(config, roles)
        transfer = build_transfer(config, roles, plan_routes(roles), policy.params, meshes.trainer)
        ctx = RunContext(config, workdir, roles, source, policy, links, meshes, transfer, code_verifier)
        if roles.is_leader:
            summary = run_leader(ctx, signals)
        elif roles.is_trainer:
            summary = run_follower(ctx)
        else:
            summary = run_generator(ctx)
        if heartbeat is not None:  # a process that fails says no goodbye: the others see it lost
            heartbeat.close()
        return summary


def run_capacities(*, timeout_s: float) -> dict[int, tuple[int, str]]:
    """Each process's device memory (`device_memory_bytes` of its first local device), gathered
    from every process so that each judges the whole run on the same numbers."""
    capacity, where = device_memory_bytes(jax.local_devices()[0])
    gathered = coordination.gather("device_memory", f"{capacity} {where}", timeout_s)
    return {process: (int(text.split(" ", 1)[0]), text.split(" ", 1)[1]) for process, text in enumerate(gathered)}


def prepare_shared_files(config: ml_collections.ConfigDict, workdir: str, stack: contextlib.ExitStack) -> None:
    """Process 0 (the leader), once for the run: holds the workdir lock (for the run's life, in
    `stack`); refuses, before any work, a workdir whose checkpoints belong to another config, a
    custom reward that does not load and mixture-of-experts keys on a dense policy; writes
    `config.json`; builds the warm-started policy and the TFDS dataset that every process reads."""
    stack.enter_context(hold_workdir(workdir))
    check_workdir_config(config, workdir)
    check_custom_reward(config)
    check_moe_keys(config)
    if "warm_start" in config:
        build_warm_start(config, workdir)
    dataset_builder(config, workdir)


def check_workdir_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    """A resumed workdir must get its own config back (`check_resume`); then `config.json` is written."""
    checkpointer = RunCheckpointer(workdir, keep=config.checkpoint.keep, processes=(0,), writes=False)
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
