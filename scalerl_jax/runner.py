"""Builds a run from a validated config and drives it: policy, data, sampler, train step,
pipeline, evaluation, metrics, checkpoints, and the final scaling fit.

Threads: the pipeline's generator and trainer threads; `on_step` (metrics, evaluation,
checkpoints) runs in the trainer thread between steps, while the train state is not donated.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from scalerl_jax import data as data_lib
from scalerl_jax import fit as fit_cli
from scalerl_jax.metrics import MetricsWriter, format_progress
from scalerl_jax.models import (load_chat_template, load_hf, load_tokenizer, make_mesh, param_shardings,
                                split_devices)
from scalerl_jax.pipeline.group import Prompt
from scalerl_jax.pipeline.pipeline_rl import Pipeline, PipelineConfig, StepRecord
from scalerl_jax.rl import length_penalty
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig, Request
from scalerl_jax.sampler.engine import interruption_from_tokenizer
from scalerl_jax.scaling import ComputeMeter
from scalerl_jax.train import (OptimizerConfig, TrainStepConfig, init_train_state, make_optimizer,
                               make_train_step)
from scalerl_jax.train.checkpoint import RunCheckpointer
from scalerl_jax.warm_start import build_warm_start, synthetic_task


@dataclasses.dataclass
class TaskData:
    """Encoded train and held-out prompts with their gold answers."""

    train_prompts: list[list[int]]
    train_golds: list[str]
    heldout_prompts: list[list[int]]
    heldout_golds: list[str]
    heldout_labels: list[str]
    num_too_long: int


def load_task(config: ml_collections.ConfigDict, workdir: str, encoder: data_lib.PromptEncoder) -> TaskData:
    """Builds the configured TFDS dataset and encodes its train / held-out splits."""
    data_dir = config.data.data_dir or os.path.join(workdir, "tfds")
    if config.data.dataset == "synthetic":
        builder = data_lib.build_synthetic(data_dir, synthetic_task(config))
        train_split, heldout_split, label = "train", "heldout", "level"
    elif config.data.dataset == "polaris_53k":
        builder = data_lib.build_polaris(data_dir, os.path.dirname(os.path.abspath(config.data.path)),
                                         heldout_size=config.data.heldout_size, seed=config.data.heldout_seed)
        train_split, heldout_split, label = "train", "heldout", "difficulty"
    else:
        builder = data_lib.build_local_file(
            data_dir, config.data.path, problem_field=config.data.problem_field,
            answer_field=config.data.answer_field, heldout_size=config.data.heldout_size,
            seed=config.data.heldout_seed)
        train_split, heldout_split, label = "train", "heldout", "difficulty"
    train_rows = data_lib.read_split(builder, train_split)
    heldout_rows = data_lib.read_split(builder, heldout_split)[: config.eval.num_prompts]
    train = encoder.encode([r["problem"] for r in train_rows])
    heldout = encoder.encode([r["problem"] for r in heldout_rows])
    return TaskData(
        train_prompts=train.tokens, train_golds=[train_rows[i]["answer"] for i in train.source_indices],
        heldout_prompts=heldout.tokens, heldout_golds=[heldout_rows[i]["answer"] for i in heldout.source_indices],
        heldout_labels=[str(heldout_rows[i].get(label, "")) for i in heldout.source_indices],
        num_too_long=train.num_too_long + heldout.num_too_long)


def make_reward_fn(config, tokenizer, reward_config, verify_pool, pool, golds):
    """`(prompt, completions) -> rewards`: verify the answers, shape lengths, update the pool history."""
    length_shaping = config.rl.length_control == "length_penalty"

    def reward_fn(prompt: Prompt, completions) -> list[float]:
        texts = [tokenizer.decode(list(c.tokens)) for c in completions]
        scored = data_lib.score_completions(texts, [golds[prompt.key]] * len(texts), reward_config, pool=verify_pool)
        rewards = np.asarray(scored.rewards, np.float32)
        if length_shaping:
            lengths = np.asarray([len(c.tokens) for c in completions], np.float32)
            penalty = np.asarray(length_penalty(lengths, l_max=config.rl.length_penalty_max,
                                                l_cache=config.rl.length_penalty_cache))
            rewards = rewards + np.where(scored.correct, penalty, 0.0)
        pool.record(prompt.key, int(scored.correct.sum()), len(completions))
        return rewards.tolist()

    return reward_fn


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Runs the configured job to `num_steps` (or a stop); returns a summary dict."""
    run_start = time.time()
    checkpoint_dir = build_warm_start(config, workdir) if "warm_start" in config else config.model.checkpoint
    tokenizer = load_tokenizer(checkpoint_dir)
    ids = data_lib.special_token_ids(tokenizer)
    encoder = data_lib.PromptEncoder(tokenizer, data_lib.PromptFormat(
        template=config.data.prompt_template, max_prompt_tokens=config.data.max_prompt_tokens,
        chat_template=load_chat_template(checkpoint_dir) if config.data.use_chat_template else None))
    task = load_task(config, workdir, encoder)

    generator_devices, trainer_devices = split_devices(jax.devices(), config.mesh.generator_fraction)
    trainer_mesh = make_mesh(config.mesh.trainer_shape, devices=trainer_devices)
    generator_mesh = make_mesh(config.mesh.generator_shape, devices=generator_devices)
    model = load_hf(checkpoint_dir, dtype=config.model.dtype, fp32_head=config.model.fp32_head,
                    mesh=trainer_mesh, scan_layers=config.model.scan_layers,
                    remat_policy=config.model.remat_policy)
    graphdef, params = nnx.split(model)
    model_config = model.config
    optimizer = make_optimizer(OptimizerConfig(
        learning_rate=config.optimizer.lr, warmup_steps=config.optimizer.warmup_steps, b1=config.optimizer.b1,
        b2=config.optimizer.b2, eps=config.optimizer.eps, weight_decay=config.optimizer.weight_decay,
        max_grad_norm=config.optimizer.max_grad_norm or None))
    train_state, state_shardings = init_train_state(params, optimizer, mesh=trainer_mesh)
    del params, model
    step_fn = make_train_step(graphdef, optimizer, TrainStepConfig(
        objective=config.rl.objective, aggregation=config.rl.aggregation,
        advantage_normalization=config.rl.advantage_normalization, eps_low=config.rl.eps_low,
        eps_high=config.rl.eps_high, eps_max=config.rl.eps_max, num_microbatches=config.batch.microbatches,
        temperature=config.sampler.temperature, logprob_chunk_size=config.model.logprob_chunk,
        skip_nonfinite=config.nan_policy == "skip"), mesh=trainer_mesh, state_shardings=state_shardings)

    # Resume from the newest complete checkpoint, if any.
    checkpointer = RunCheckpointer(workdir, keep=config.checkpoint.keep)
    pool = data_lib.PromptPool(len(task.train_prompts), seed=config.seed,
                               npr_threshold=config.rl.positive_pass_rate if config.rl.no_positive_resampling else None)
    meter = ComputeMeter()
    counters = {"nonfinite_steps": 0}
    start_step, metrics_offset = 0, None
    latest = checkpointer.latest_step()
    if latest is not None:
        train_state, run_state = checkpointer.restore(latest, train_state)
        start_step, metrics_offset = int(run_state["version"]), int(run_state["metrics_offset"])
        pool.load_state_dict(run_state["pool"])
        meter.load_state_dict(run_state["meter"])
        counters["nonfinite_steps"] = int(run_state["nonfinite_steps"])
        logging.info("resumed from checkpoint step %d", latest)
    writer = MetricsWriter(workdir, resume_offset=metrics_offset)

    max_len = config.data.max_prompt_tokens + config.sampler.max_new_tokens
    interruption = None
    if config.rl.length_control == "interruption":
        interruption = interruption_from_tokenizer(
            tokenizer, phrase=config.sampler.interruption_phrase, end_think=config.sampler.think_end,
            think_budget_min=config.sampler.think_budget_min, think_budget_max=config.sampler.think_budget_max,
            answer_budget=config.sampler.answer_budget)
    engine_config = EngineConfig(num_slots=config.sampler.num_slots, max_len=max_len,
                                 chunk_size=config.sampler.chunk_steps, top_k=config.sampler.top_k,
                                 top_p=config.sampler.top_p, max_stop_tokens=1, interruption=interruption)
    engine = Engine(graphdef, model_config, engine_config, mesh=generator_mesh)
    generator_shardings = param_shardings(train_state.params, generator_mesh)

    def on_generator(params):
        return jax.device_put(params, generator_shardings, may_alias=False)

    batcher = ContinuousBatcher(engine, on_generator(train_state.params), version=start_step, seed=config.seed)
    eval_batcher = ContinuousBatcher(engine, on_generator(train_state.params), version=start_step,
                                     seed=config.seed + 1)

    reward_config = data_lib.RewardConfig(
        kind="exact" if config.data.dataset == "synthetic" else "math",
        correct_reward=config.data.reward_correct, incorrect_reward=config.data.reward_incorrect)
    verify_pool = data_lib.VerifyPool(config.data.verify_workers, time_limit_s=config.data.verify_timeout_s)
    reward_fn = make_reward_fn(config, tokenizer, reward_config, verify_pool, pool, task.train_golds)

    def prompt_source() -> Prompt:
        index = pool.next_prompts(1)[0]
        return Prompt(index, tuple(task.train_prompts[index]))

    def evaluate(params, version: int) -> dict[str, float]:
        eval_batcher.update_params(params, version)

        def sample(prompts):
            for i, p in enumerate(prompts):
                eval_batcher.add_request(eval_request(i, p, config, ids["eos"], version))
            done = {c.request_id: c for c in eval_batcher.drain()}
            return [done[i] for i in range(len(prompts))]

        result = data_lib.evaluate(
            sample, task.heldout_prompts, task.heldout_golds, num_samples=config.eval.samples_per_prompt,
            decode=lambda t: tokenizer.decode(t),
            reward_fn=lambda texts, golds: data_lib.score_completions(texts, golds, reward_config, pool=verify_pool),
            difficulties=task.heldout_labels)
        return result.metrics

    latest_state = {"state": train_state}  # the newest trained state, pushed to the sampler or not

    step_times: list[float] = []
    last_eval: list[tuple[int, float]] = []  # (step, held-out pass rate) of the latest evaluation
    meter.start(len(set(generator_devices) | set(trainer_devices)))
    if start_step == 0:
        initial = evaluate(train_state.params, 0)
        writer.write(0, {**initial, **meter.metrics(), "compute/unit": "device_hours"})
        last_eval.append((0, initial["eval/pass_rate"]))
        logging.info("step 0: held-out pass rate %.3f", initial["eval/pass_rate"])

    def checkpoint(version: int) -> None:
        checkpointer.save(version, latest_state["state"], {
            "version": version, "pool": pool.state_dict(), "meter": meter.state_dict(),
            "metrics_offset": writer.offset(), "nonfinite_steps": counters["nonfinite_steps"]})

    def on_step(record: StepRecord) -> None:
        version = record.version + 1
        latest_state["state"] = record.train_state
        metrics = dict(record.metrics)
        finite = bool(metrics.get("train/finite", 1.0))
        counters["nonfinite_steps"] += int(not finite)
        rewards = np.concatenate([g.rewards for g in record.groups])
        tokens = sum(g.num_generated_tokens for g in record.groups)
        meter.add_tokens(generated=tokens, trained=int(metrics.get("train/num_loss_tokens", 0)))
        metrics.update({"train/reward_mean": float(rewards.mean()),
                        "train/pass_rate": float((rewards > 0).mean()),
                        "train/nonfinite_steps": counters["nonfinite_steps"],
                        "data/prompts_too_long": task.num_too_long, **pool.metrics(), **meter.metrics(),
                        "compute/unit": "device_hours"})
        if not finite:
            if config.nan_policy == "stop":
                writer.write(version, metrics)  # the failing step's row stays on record
                raise FloatingPointError(f"non-finite loss or gradient at step {version}; the last "
                                         "checkpoint is intact; set nan_policy='skip' to skip such steps")
            logging.warning("step %d: non-finite loss or gradient, update skipped (%d so far)", version,
                            counters["nonfinite_steps"])
        if version % config.eval.every == 0 or version == config.num_steps:
            metrics.update(evaluate(latest_state["state"].params, version))
            metrics.update(meter.metrics())
            last_eval[:] = [(version, metrics["eval/pass_rate"])]
        writer.write(version, metrics)
        step_times.append(time.time())
        eta = None
        if len(step_times) > 1:
            eta = (step_times[-1] - step_times[0]) / (len(step_times) - 1) * (config.num_steps - version)
        logging.info(format_progress(version, config.num_steps, metrics, eta, *last_eval))
        aligned = config.schedule.kind != "ppo_off_policy" or version % config.schedule.k == 0
        if version % config.checkpoint.every == 0 and aligned:
            checkpoint(version)

    pipeline = Pipeline(
        PipelineConfig(
            max_new_tokens=config.sampler.max_new_tokens, max_seq_len=max_len, schedule=config.schedule.kind,
            k=config.schedule.k, prompts_per_step=config.batch.prompts_per_step,
            samples_per_prompt=config.batch.generations_per_prompt,
            num_steps=max(0, config.num_steps - start_step),
            capacity=config.schedule.queue_groups or None,
            zero_variance=("refill" if config.rl.refill_zero_variance
                           else "drop" if config.rl.zero_variance_filter else "none"),
            temperature=config.sampler.temperature, stop_tokens=(ids["eos"],),
            interrupt=interruption is not None, min_length_bucket=min(32, max_len),
            seed=config.seed, first_version=start_step),
        batcher=batcher, prompt_source=prompt_source, reward_fn=reward_fn, train_step=step_fn,
        train_state=train_state, on_step=on_step)
    try:
        result = pipeline.run()
    finally:
        meter.stop()
        verify_pool.close()
    latest_state["state"] = result.train_state
    if result.version > start_step and result.version % config.checkpoint.every != 0:
        checkpoint(result.version)
    writer.close()
    checkpointer.close()
    summary = {"steps": result.version, "stop_reason": result.stop_reason,
               "queued_groups_at_stop": len(result.queued_group_ids),
               "minutes": (time.time() - run_start) / 60}
    low, high = config.eval.fit_a_range
    fit_cli.main([workdir, "--a-range", f"{low},{high}", "--plot", os.path.join(workdir, "scaling.png")])
    return summary


def eval_request(index: int, prompt, config, eos_id: int, version: int) -> Request:
    """An evaluation request: the run's sampling temperature and length control, a fresh seed per step."""
    return Request(request_id=index, prompt_tokens=list(prompt), max_new_tokens=config.sampler.max_new_tokens,
                   seed=(version << 20) + index, temperature=config.sampler.temperature, stop_tokens=(eos_id,))
