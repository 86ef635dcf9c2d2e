"""The three kinds of process of a run (`distributed/roles.py`): the leader, a follower trainer
and a generator.

The leader makes every host-side decision and writes every output; it runs the pipeline
(`pipeline/`) with its own generator batcher if it has generator devices, the trainer group, and
the step reporter. A follower repeats the leader's collective operations in its order. A
generator process decodes with its own engine on its local devices, fed prompts and params by the
leader. A process with both trainer and generator devices runs its generator in a thread beside
its trainer work.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from absl import logging

from scalerl_jax import data as data_lib
from scalerl_jax.config.adapters import reward_config_of
from scalerl_jax.config.resume import config_json, flat_config
from scalerl_jax.contracts.threads import FirstError
from scalerl_jax.data.rewards import RewardTallies
from scalerl_jax.distributed.remote_generator import (
    GeneratorPush,
    LinkService,
    ParamsInbox,
    RemoteLink,
    first_version,
)
from scalerl_jax.distributed.trainer_group import TrainerGroup, TrainerOps, follow, report_restored
from scalerl_jax.distributed.transport import TRAIN, LeaderTransport, plan_routes
from scalerl_jax.distributed.wiring import ProcessLinks
from scalerl_jax.models import param_shardings
from scalerl_jax.models.reshard import push_local
from scalerl_jax.pipeline.generator import RETAINED_EVAL_VERSIONS, GeneratorCounters, GeneratorLoop
from scalerl_jax.pipeline.group import Prompt
from scalerl_jax.pipeline.pipeline_rl import Pipeline, PipelineResult
from scalerl_jax.pipeline.queue import PipelineStopped
from scalerl_jax.run.build import (
    TaskData,
    Trainer,
    build_batcher,
    build_engine,
    build_trainer,
    generator_sampling,
    load_task,
    make_reward_fn,
    pipeline_config,
    prompt_pool,
)
from scalerl_jax.run.context import RunContext
from scalerl_jax.run.evaluation import SAMPLES_FILE, Evaluator
from scalerl_jax.run.reporting import MetricsSink, RunState, StepReporter, restore, resume_run_state
from scalerl_jax.run.signals import StopSignals
from scalerl_jax.sampler import ContinuousBatcher
from scalerl_jax.scaling import ComputeMeter
from scalerl_jax.scaling.report import FitInputError, FitOptions
from scalerl_jax.scaling.report import report as fit_report
from scalerl_jax.scaling.runs import PASS_RATE_KEY
from scalerl_jax.telemetry.metrics import MetricsWriter
from scalerl_jax.train.checkpoint import RunCheckpointer


def _links(ctx: RunContext) -> ProcessLinks:
    """The connections of a process of a multi-process run (followers and generators have them)."""
    if ctx.links is None:
        raise RuntimeError(f"process {ctx.roles.process} is not the leader but has no connections to it")
    return ctx.links


def _checkpointer(ctx: RunContext) -> RunCheckpointer:
    return RunCheckpointer(ctx.workdir, keep=ctx.config.checkpoint.keep, processes=ctx.roles.trainer_processes)


# ---------------------------------------------------------------------------------------------
# Leader
# ---------------------------------------------------------------------------------------------


def run_leader(ctx: RunContext, signals: StopSignals) -> dict[str, Any]:
    """The leader: the run's decisions and outputs; returns the run's summary. Its collective
    steps (checkpointer, trainer, restore) come in the same order as a follower's. `signals`: the
    run's SIGTERM / SIGINT handling, which stops the pipeline after its current step."""
    run_start = time.time()
    checkpointer = _checkpointer(ctx)
    try:
        result = _lead(ctx, checkpointer, signals)
    finally:
        checkpointer.close()
    summary = {
        "steps": result.version,
        "stop_reason": result.stop_reason,
        "queued_groups_at_stop": len(result.queued_group_ids),
        "minutes": (time.time() - run_start) / 60,
    }
    write_fit(ctx)
    return summary


def _lead(ctx: RunContext, checkpointer: RunCheckpointer, signals: StopSignals) -> PipelineResult:
    config, workdir, source = ctx.config, ctx.workdir, ctx.source
    task = load_task(config, workdir, source.encoder, source.code_encoder)
    assert ctx.meshes.trainer is not None  # the leader is a trainer process
    trainer = build_trainer(config, source.checkpoint_dir, ctx.meshes.trainer)
    try:
        return _lead_with(ctx, checkpointer, signals, task, trainer)
    finally:  # a stop before the first step: the programs still queued to compile ahead are dropped
        trainer.step_fn.close()


def _lead_with(
    ctx: RunContext,
    checkpointer: RunCheckpointer,
    signals: StopSignals,
    task: TaskData,
    trainer: Trainer,
) -> PipelineResult:
    config, workdir, source, code_verifier = ctx.config, ctx.workdir, ctx.source, ctx.code_verifier
    run_state = RunState(
        pool=prompt_pool(config, task),
        meter=ComputeMeter(),
        rewards=RewardTallies(report_code=bool(task.train_code)),
    )
    saved = restore(checkpointer, trainer)
    resumed = resume_run_state(saved, run_state)
    start_step = resumed.version

    links = ctx.links
    timeout_s = config.distributed.reply_timeout_s
    group = TrainerGroup(
        list(links.of_role("trainer").values()) if links else [],
        process=ctx.roles.process,
        step_fn=trainer.step_fn,
        batch_sharding=trainer.step_fn.batch_sharding,
    )
    group.check_restored(None if saved is None else saved["step"], timeout_s=timeout_s)
    remote_params = list(links.of_role("params").values()) if links else []
    remote = GeneratorPush(remote_params, timeout_s=timeout_s) if remote_params else None
    routes = plan_routes(ctx.roles)
    batcher = _leader_batcher(ctx, trainer, group, start_step)
    transport = LeaderTransport(
        routes,
        group=group,
        offer=ctx.transfer.offer,
        local_batcher=batcher,
        local_pull=ctx.transfer.pull,
        remote=remote,
    )
    if remote is not None:
        remote.announce(start_step)  # the offer was made with the local one

    reward_config = reward_config_of(config)
    verify_pool = data_lib.VerifyPool(
        config.data.verify_workers, time_limit_s=config.data.verify_timeout_s, reward_fn=reward_config.reward_fn
    )
    reporter = StepReporter(
        config,
        task,
        run_state,
        MetricsWriter(workdir, resume_offset=resumed.metrics_offset),
        _extra_sinks(ctx),
        Evaluator(
            config,
            task,
            source,
            reward_config,
            verify_pool,
            os.path.join(workdir, SAMPLES_FILE),
            run_state.rewards,
            code_verifier,
        ),
        checkpointer,
        group,
        trainer.state,
        flat_config(config),
        start_version=start_step,
    )

    def prompt_source() -> Prompt:
        index = run_state.pool.next_prompts(1)[0]
        return Prompt(index, tuple(task.train_prompts[index]))

    pipeline = Pipeline(
        pipeline_config(config, source.tokens, trainer, ctx.roles, start_step),
        batcher=batcher,
        prompt_source=prompt_source,
        reward_fn=make_reward_fn(
            config, source.tokens, reward_config, verify_pool, run_state.pool, task, run_state.rewards, code_verifier
        ),
        train_step=group.train_step,
        train_state=trainer.state,
        push_params=transport.push,
        remote_generators=[
            (f"link-{process}", LinkService(conn, timeout_s=timeout_s).serve)
            for process, conn in (links.of_role("control").items() if links else [])
        ],
        on_start=reporter.on_start if start_step == 0 or resumed.evaluation_owed else None,
        on_step=reporter.on_step,
        on_end=reporter.on_end,
        eval_batcher=evaluation_batcher(ctx, batcher, start_step) if batcher is not None else None,
        concurrent_evaluation=config.eval.concurrent,
    )
    signals.on_stop(pipeline.request_stop)
    run_state.meter.start(ctx.meshes.num_devices)
    try:
        result = pipeline.run()
        reporter.state = result.train_state
        if result.version > start_step and reporter.checkpointed != result.version:  # a stop between checkpoints
            reporter.checkpoint(result.version)
        if result.stop_reason != "num_steps":
            logging.warning(
                "stopped (%s) at step %d, %s; the same command resumes from there",
                result.stop_reason,
                result.version,
                "its state checkpointed" if result.version > start_step else "before its first train step",
            )
    finally:
        run_state.meter.stop()
        verify_pool.close()
        reporter.close()
    group.stop()
    if remote is not None:
        remote.stop()
    return result


def _extra_sinks(ctx: RunContext) -> list[MetricsSink]:
    """Weights & Biases beside metrics.jsonl and TensorBoard, when configured."""
    config = ctx.config
    if not config.logging.wandb_project:
        return []
    from scalerl_jax.telemetry.wandb_sink import WandbSink  # an optional extra

    return [
        WandbSink(
            project=config.logging.wandb_project,
            mode=config.logging.wandb_mode,
            workdir=ctx.workdir,
            config=config_json(config),
        )
    ]


def _leader_batcher(
    ctx: RunContext, trainer: Trainer, group: TrainerGroup, start_step: int
) -> ContinuousBatcher | None:
    """Offers version `start_step` to the generators fed by transfer; then the leader's own
    generator batcher holding it (None without generator devices here). It also evaluates."""
    transfer = ctx.transfer
    if plan_routes(ctx.roles).transfer_generators:
        assert transfer.offer is not None  # trainer processes offer when any generator pulls
        offer = transfer.offer
        group.offer(start_step, TRAIN, lambda: offer(TRAIN, start_step, trainer.state.params))
    if ctx.meshes.generator is None:
        return None
    engine = build_engine(ctx.config, ctx.policy, ctx.source.tokens, ctx.meshes.generator)
    if transfer.pull is not None:
        params = transfer.pull(start_step)
    else:
        params = push_local(trainer.state.params, param_shardings(trainer.state.params, ctx.meshes.generator))
    return build_batcher(ctx.config, engine, params, start_step)


def write_fit(ctx: RunContext) -> None:
    """The sigmoid fit of the run's own pass-rate curve, printed and plotted to scaling.png; in a
    run with a configured mixture also each domain's (`eval/<domain>/pass_rate`, scaling_<domain>.png)."""
    low, high = ctx.config.eval.fit_a_range
    curves = {"": PASS_RATE_KEY} | {f"_{d}": f"eval/{d}/pass_rate" for d in ctx.config.data.mixture}
    for suffix, metric in curves.items():
        plot = os.path.join(ctx.workdir, f"scaling{suffix}.png")
        try:
            fit_report([ctx.workdir], FitOptions(a_range=(low, high), plot=plot, metric=metric))
        except FitInputError as error:  # the run's own metrics: reported, the run's outcome stands
            print(f"error: {error}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Follower
# ---------------------------------------------------------------------------------------------


def run_follower(ctx: RunContext) -> None:
    """A trainer process other than the leader: the same state, the leader's operations; with
    generator devices too, its generator runs in a thread beside them."""
    errors = FirstError()
    generator = None
    if ctx.roles.is_generator:
        generator = threading.Thread(
            target=errors.guarded("generator", lambda: run_generator(ctx)), name="generator", daemon=True
        )
        generator.start()
    _follow(ctx)
    if generator is not None:
        generator.join(timeout=ctx.config.distributed.reply_timeout_s)
    errors.raise_first()


def _follow(ctx: RunContext) -> None:
    config, leader = ctx.config, _links(ctx).leader["trainer"]
    checkpointer = _checkpointer(ctx)
    trainer: Trainer | None = None
    try:
        assert ctx.meshes.trainer is not None  # a follower is a trainer process
        trainer = build_trainer(config, ctx.source.checkpoint_dir, ctx.meshes.trainer)
        saved = restore(checkpointer, trainer)
        report_restored(leader, None if saved is None else saved["step"])
        fingerprint = flat_config(config)
        offer = ctx.transfer.offer

        def train(batch) -> None:
            trainer.state, _ = trainer.step_fn(trainer.state, batch)

        def offer_params(ident: int, purpose: str) -> None:
            assert offer is not None  # the leader asks for offers only when a generator pulls
            offer(purpose, ident, trainer.state.params)

        ops = TrainerOps(
            train=train,
            offer=offer_params,
            checkpoint=lambda step: checkpointer.save(step, trainer.state, {}, config=fingerprint),
        )
        steps = follow(
            leader, batch_sharding=trainer.step_fn.batch_sharding, ops=ops, timeout_s=config.distributed.reply_timeout_s
        )
        logging.info("follower trainer: %d steps, stopped by the leader", steps)
    finally:
        if trainer is not None:  # stopped before the first step: drop the queued compiles
            trainer.step_fn.close()
        checkpointer.close()


# ---------------------------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------------------------


def evaluation_batcher(ctx: RunContext, batcher: ContinuousBatcher, start_version: int) -> ContinuousBatcher | None:
    """With `eval.concurrent`: a second batcher on the generator's devices, for evaluation requests,
    and `batcher` made to retain the params of every version the run evaluates (the start, every
    `eval.every` steps, the last), which the evaluation batcher decodes with (`pipeline/generator.py`).
    None without."""
    config = ctx.config
    if not config.eval.concurrent:
        return None
    every, last = config.eval.every, config.num_steps
    batcher.retain_versions(
        lambda version: version % every == 0 or version in (start_version, last), RETAINED_EVAL_VERSIONS
    )
    assert ctx.meshes.generator is not None  # the batcher's devices
    engine = build_engine(config, ctx.policy, ctx.source.tokens, ctx.meshes.generator)
    return build_batcher(config, engine, batcher.params, start_version)


def run_generator(ctx: RunContext) -> None:
    """A generator process: its own engine on its local devices, fed by the leader (module doc of
    `distributed/remote_generator.py`); the first announced version starts it."""
    config, links = ctx.config, _links(ctx)
    timeout_s = config.distributed.reply_timeout_s
    assert ctx.meshes.generator is not None  # a generator process has generator devices
    engine = build_engine(config, ctx.policy, ctx.source.tokens, ctx.meshes.generator)
    params_connection = links.leader["params"]
    pull = ctx.transfer.pull
    if pull is None:
        raise RuntimeError(f"generator process {ctx.roles.process} has no weight-transfer route from the trainers")
    params, version = first_version(params_connection, pull=pull, timeout_s=timeout_s)
    batcher = build_batcher(config, engine, params, version)
    eval_batcher = evaluation_batcher(ctx, batcher, version)
    stop = threading.Event()
    inbox = ParamsInbox(params_connection, pull=pull, batcher=batcher, timeout_s=timeout_s)
    errors = FirstError()
    thread = threading.Thread(
        target=errors.guarded("params-inbox", lambda: inbox.run(stop), on_exit=stop.set),
        name="params-inbox",
        daemon=True,
    )
    thread.start()
    counters = GeneratorCounters()
    link = RemoteLink(links.leader["control"], timeout_s=timeout_s, counters=counters)
    loop = GeneratorLoop(
        batcher, link, generator_sampling(config, ctx.source.tokens), counters, eval_batcher=eval_batcher
    )
    try:
        loop.run(stop)
    except PipelineStopped:
        pass
    thread.join(timeout=config.distributed.heartbeat_timeout_s)
    errors.raise_first()
    stats = counters.snapshot()
    logging.info("generator: %d chunks, %.1f s decoding", stats.chunks, stats.busy_s)
