"""Discrete-event cluster simulator (pipeline/sim.py) against hand-computed timelines."""

import dataclasses

import numpy as np
import pytest

from scalerl_jax.pipeline.sim import ClusterSpec, EvalSpec, chunk_cost, full_chunk_costs, pick_split, simulate


def step_by_step_cost(spec, remaining, context, steps):
    """Reference: run the decode steps one by one with the per-step cost model."""
    remaining, context = remaining.copy(), context.copy()
    seconds = 0.0
    for _ in range(steps):
        active = remaining > 0
        if not active.any():
            break
        seconds += (
            spec.decode_step_s + spec.decode_slot_s * active.sum() + spec.decode_kv_token_s * context[active].sum()
        )
        remaining[active] -= 1
        context[active] += 1
    return seconds


def test_chunk_costs_match_step_by_step_reference():
    spec = ClusterSpec(chunk_steps=8, decode_step_s=1e-3, decode_slot_s=3e-5, decode_kv_token_s=2e-7)
    rng = np.random.default_rng(0)
    remaining = rng.integers(1, 20, size=6)
    context = rng.integers(10, 500, size=6)
    steps, advance, seconds = chunk_cost(spec, remaining, context)
    assert steps == 8
    np.testing.assert_array_equal(advance, np.minimum(remaining, 8))
    assert seconds == pytest.approx(step_by_step_cost(spec, remaining, context, 8), rel=1e-12)
    # three full chunks of 4 slots that all keep running
    big = np.full(4, 100)
    costs = full_chunk_costs(spec, 3, 4, int(context[:4].sum()))
    for i in range(3):
        start = context[:4] + 8 * i
        assert costs[i] == pytest.approx(step_by_step_cost(spec, big, start, 8), rel=1e-12)


# One generator with 2 slots, groups of 2 completions of exactly 64 tokens (2 chunks of 32) at
# 0.01 s per decode step: a group takes 0.64 s. A train step on 2 x (16 + 64) = 160 tokens
# takes 160 * train_token_s. No prefill, push or load costs.
TINY = ClusterSpec(
    num_generators=1,
    num_trainers=1,
    slots_per_generator=2,
    chunk_steps=32,
    prompts_per_step=1,
    samples_per_prompt=2,
    prompt_tokens=16,
    length_median=64.0,
    group_sigma=0.0,
    sample_sigma=0.0,
    min_completion_tokens=1,
    max_completion_tokens=64,
    decode_step_s=0.01,
    decode_slot_s=0.0,
    decode_kv_token_s=0.0,
    prefill_token_s=0.0,
    train_token_s=0.005,
    train_step_overhead_s=0.0,
    weight_push_s=0.0,
    weight_load_s=0.0,
)


def test_ppo_off_policy_1_is_generate_then_train():
    # step = 0.64 (generate) + 0.8 (train), nothing overlaps.
    r = simulate(TINY, schedule="ppo_off_policy", k=1, num_steps=12)
    assert r.step_time_s == pytest.approx(1.44)
    assert r.trainer_busy_frac == pytest.approx(0.8 / 1.44)
    assert r.generator_busy_frac == pytest.approx(0.64 / 1.44)
    assert r.generator_slot_util == pytest.approx(0.64 / 1.44)
    assert r.samples_per_s == pytest.approx(2 / 1.44)
    assert (r.lag_mean, r.lag_max, r.versions_spanned_max) == (0.0, 0, 1)


def test_ppo_off_policy_2_two_groups_then_two_updates():
    # Phase: 2 groups one after the other (0.64 s each, 2 slots), then 2 updates of 0.8 s:
    # 2.88 s per 2 steps; lags 0 and 1.
    r = simulate(TINY, schedule="ppo_off_policy", k=2, num_steps=14, warmup_steps=2)
    assert r.step_time_s == pytest.approx(1.44)
    assert r.lag_mean == pytest.approx(0.5) and r.lag_max == 1


def test_pipeline_1_trainer_bound():
    # Generation (0.64 s) overlaps training (0.8 s): one step every 0.8 s, every group trained
    # one version after the one it was generated with, the generator idle 0.16 s per step.
    r = simulate(TINY, schedule="pipeline", k=1, num_steps=12)
    assert r.step_time_s == pytest.approx(0.8)
    assert r.trainer_busy_frac == pytest.approx(1.0)
    assert r.generator_busy_frac == pytest.approx(0.8)
    assert (r.lag_mean, r.lag_max) == (1.0, 1)
    assert r.versions_spanned_max == 1


def test_pipeline_1_generator_bound_with_in_flight_update():
    # Train step 160 * 0.001 = 0.16 s. A group takes 0.64 s; the push of the step that trained
    # the previous group arrives during its first chunk, so its second chunk runs on the next
    # version: every completion spans 2 versions and is trained with lag 1.
    spec = dataclasses.replace(TINY, train_token_s=0.001)
    r = simulate(spec, schedule="pipeline", k=1, num_steps=12)
    assert r.step_time_s == pytest.approx(0.64)
    assert r.trainer_busy_frac == pytest.approx(0.16 / 0.64)
    assert r.generator_busy_frac == pytest.approx(1.0)
    assert (r.lag_mean, r.lag_max) == (1.0, 1)
    assert r.versions_spanned_mean == 2.0
    ppo = simulate(spec, schedule="ppo_off_policy", k=1, num_steps=12)
    assert ppo.step_time_s == pytest.approx(0.8)


SMALL = ClusterSpec(
    num_generators=4,
    num_trainers=2,
    slots_per_generator=8,
    chunk_steps=16,
    prompts_per_step=4,
    samples_per_prompt=4,
    prompt_tokens=64,
    length_median=300.0,
    max_completion_tokens=2000,
    train_token_s=2e-4,
)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_lag_bounds_on_a_long_tailed_cluster(k):
    pipe = simulate(SMALL, schedule="pipeline", k=k, num_steps=5 * k + 6, seed=k)
    assert 0 <= pipe.lag_mean <= pipe.lag_max <= k
    # PPO-off-policy-k: whole phases in the window, lags 0..k-1 equally often.
    ppo = simulate(SMALL, schedule="ppo_off_policy", k=k, num_steps=5 * k, warmup_steps=k, seed=k)
    assert ppo.lag_mean == pytest.approx((k - 1) / 2)
    assert ppo.lag_max == k - 1 and ppo.versions_spanned_max == 1
    for r in (pipe, ppo):
        assert 0.0 <= r.generator_slot_util <= r.generator_busy_frac <= 1.0
        assert 0.0 <= r.trainer_busy_frac <= 1.0


def test_bad_spec_names_the_field():
    with pytest.raises(ValueError, match="ClusterSpec.num_trainers"):
        ClusterSpec(num_trainers=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        simulate(TINY, schedule="pipeline", k=1, num_steps=3, warmup_steps=3)


# Evaluation on TINY: one prompt x 2 samples of 64 tokens = one group's work, 0.64 s on free slots.
# Windows from step 3 to step 19 hold 4 evaluations (after steps 4, 8, 12, 16).
TINY_EVAL = {mode: EvalSpec(every=4, prompts=1, samples=2, mode=mode) for mode in ("blocking", "async")}


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_eval_with_ppo_off_policy_1_is_one_more_group_per_period(mode):
    # After step 4j the push arrives, the next phase's group is admitted and the evaluation's two
    # requests take both slots first: 0.64 s of evaluation, then the group (0.64 s), then the
    # update (0.8 s). 4 steps take 4 x 1.44 + 0.64 = 6.4 s in both modes: the trainer needs that
    # group anyway, so not waiting for the evaluation gains nothing. Blocking: the trainer waits
    # 0.64 s of every 6.4 s for the evaluation itself.
    r = simulate(TINY, schedule="ppo_off_policy", k=1, num_steps=19, evaluation=TINY_EVAL[mode])
    assert r.step_time_s == pytest.approx(1.6)
    assert r.trainer_idle_frac == pytest.approx(1 - 3.2 / 6.4)
    assert r.evals == 4 and r.eval_s_mean == pytest.approx(0.64)
    assert r.trainer_eval_wait_frac == pytest.approx(0.1 if mode == "blocking" else 0.0)


def test_eval_blocking_stops_a_trainer_bound_pipeline_async_does_not():
    # 4 slots, trainer-bound PipelineRL-1 (0.8 s steps, one group of 2 in flight): the evaluation
    # fits in the 2 spare slots at no cost (decode_slot_s = 0). Blocking: every 4 steps the
    # trainer stops 0.64 s: 4 x 0.8 + 0.64 = 3.84 s, idle 0.64 / 3.84. Async: 0.8 s steps, no idle.
    spec = dataclasses.replace(TINY, slots_per_generator=4)
    blocking = simulate(spec, schedule="pipeline", k=1, num_steps=19, evaluation=TINY_EVAL["blocking"])
    assert blocking.step_time_s == pytest.approx(0.96)
    assert blocking.trainer_idle_frac == pytest.approx(0.64 / 3.84)
    assert blocking.trainer_eval_wait_frac == pytest.approx(0.64 / 3.84)
    asynchronous = simulate(spec, schedule="pipeline", k=1, num_steps=19, evaluation=TINY_EVAL["async"])
    assert asynchronous.step_time_s == pytest.approx(0.8)
    assert asynchronous.trainer_idle_frac == pytest.approx(0.0, abs=1e-12)
    assert asynchronous.evals == 4 and asynchronous.trainer_eval_wait_frac == 0.0


@pytest.mark.parametrize("k", [1, 4])
def test_eval_modes_on_a_long_tailed_cluster(k):
    # Blocking counts at least the evaluation wait as trainer idle; async never waits for it and
    # is no slower (here: the cluster has spare generator slots). Lags stay within k either way.
    evaluation = {m: EvalSpec(every=5, prompts=8, samples=4, mode=m) for m in ("blocking", "async")}
    steps = k + 2 + 15
    plain = simulate(SMALL, schedule="pipeline", k=k, num_steps=steps, seed=k)
    blocking = simulate(SMALL, schedule="pipeline", k=k, num_steps=steps, seed=k, evaluation=evaluation["blocking"])
    asynchronous = simulate(SMALL, schedule="pipeline", k=k, num_steps=steps, seed=k, evaluation=evaluation["async"])
    assert blocking.evals == 3
    assert blocking.trainer_idle_frac >= blocking.trainer_eval_wait_frac - 1e-12 > 0
    # the trainer waits from each evaluation's start to its end
    assert blocking.trainer_eval_wait_frac * blocking.window_s == pytest.approx(3 * blocking.eval_s_mean)
    assert asynchronous.trainer_eval_wait_frac == 0.0
    assert asynchronous.step_time_s <= blocking.step_time_s + 1e-9
    assert plain.step_time_s <= asynchronous.step_time_s + 1e-9
    for r in (blocking, asynchronous):
        assert r.lag_max <= k


def test_bad_eval_spec_names_the_field():
    with pytest.raises(ValueError, match="EvalSpec.mode"):
        EvalSpec(every=1, prompts=1, samples=1, mode="overlap")
    with pytest.raises(ValueError, match="EvalSpec.every"):
        EvalSpec(every=0, prompts=1, samples=1)


def test_pick_split_takes_the_faster_split():
    # TINY over 3 devices. 2 generators / 1 trainer: trainer-bound at 0.8 s a step. 1 generator
    # / 2 trainers: steps of 0.4 s of training, but a group takes the one generator 0.64 s:
    # generator-bound at 0.64 s a step. The second is faster.
    choice = pick_split(TINY, 3, [1, 2], schedule="pipeline", k=1, num_steps=12)
    assert (choice.num_generators, choice.num_trainers) == (1, 2)
    rates = {g: r.samples_per_s for g, r in choice.candidates}
    assert rates[1] == pytest.approx(2 / 0.64) and rates[2] == pytest.approx(2 / 0.8)
    assert "picked 1 / 2" in choice.reasoning
    with pytest.raises(ValueError, match="generator counts"):
        pick_split(TINY, 3, [3], schedule="pipeline", k=1)


def test_eval_without_priority_runs_in_the_slots_training_leaves():
    # PPO-off-policy-1 on TINY, evaluation after training's own group: the group (0.64 s) goes
    # first, then the evaluation runs during the update (0.64 s < 0.8 s), so async costs nothing:
    # 1.44 s a step as without evaluation. Blocking still waits: 0.64 + 0.64 + 0.8 after the push.
    spare = {m: dataclasses.replace(TINY_EVAL[m], priority=False) for m in TINY_EVAL}
    asynchronous = simulate(TINY, schedule="ppo_off_policy", k=1, num_steps=19, evaluation=spare["async"])
    assert asynchronous.step_time_s == pytest.approx(1.44)
    assert asynchronous.evals == 4 and asynchronous.eval_s_mean == pytest.approx(1.28)
    blocking = simulate(TINY, schedule="ppo_off_policy", k=1, num_steps=19, evaluation=spare["blocking"])
    assert blocking.step_time_s == pytest.approx(1.6)
