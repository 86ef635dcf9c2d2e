"""PipelineRL-k and PPO-off-policy-k with the real tiny sampler and the real jitted train step.

The generator (ContinuousBatcher over a tiny Llama) runs on CPU device 0; the trainer's state is
sharded over a (1, 4, 1) mesh of devices 4-7 (conftest gives 8 CPU devices), so every push is a
real `jax.device_put` across device sets. Lags, versions and accounting are checked from the
per-token versions the sampler recorded, against the bound k and the group ids produced.
"""

import time

import jax
import numpy as np
import pytest
from flax import nnx
from small_models import small_llama

from scalerl_jax.models import Transformer, make_mesh
from scalerl_jax.pipeline.config import PipelineConfig
from scalerl_jax.pipeline.group import Prompt
from scalerl_jax.pipeline.pipeline_rl import Pipeline
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig
from scalerl_jax.train import OptimizerConfig, TrainStepConfig, init_train_state, make_optimizer, make_train_step

GROUPS, SAMPLES = 2, 2
MAX_NEW, MAX_LEN = 10, 24


class Setup:
    """Model, engine and jitted step built (and compiled) once for the module."""

    reference_engine: Engine  # set by test_pipeline_evaluation's fixture

    def __init__(self):
        self.config = small_llama()
        model = Transformer(self.config, rngs=nnx.Rngs(0))
        self.graphdef, self.params = nnx.split(model)
        self.engine = Engine(self.graphdef, self.config, EngineConfig(num_slots=4, max_len=MAX_LEN, chunk_size=4))
        self.optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3, warmup_steps=0))
        self.mesh = make_mesh((1, 4, 1), devices=jax.devices()[4:8])
        _, self.shardings = init_train_state(self.copy_params(), self.optimizer, mesh=self.mesh)
        self.step = make_train_step(
            self.graphdef,
            self.optimizer,
            TrainStepConfig(logprob_chunk_size=8),
            mesh=self.mesh,
            state_shardings=self.shardings,
        )

    def copy_params(self):
        return jax.tree.map(lambda x: x.copy(), self.params)

    def fresh(self):
        """A new batcher (generator params on device 0) and a new train state on the mesh."""
        generator_params = jax.device_put(self.copy_params(), jax.devices()[0])
        batcher = ContinuousBatcher(self.engine, generator_params, seed=0)
        state, _ = init_train_state(self.copy_params(), self.optimizer, mesh=self.mesh)
        return batcher, state


@pytest.fixture(scope="module")
def setup():
    return Setup()


def prompt_source(start=0):
    """Prompt number i is a function of i alone (like a restored prompt pool)."""
    count = iter(range(start, 10**6))

    def next_prompt():
        key = next(count)
        rng = np.random.default_rng(key)
        return Prompt(key, tuple(rng.integers(3, 64, size=int(rng.integers(3, 7))).tolist()))

    return next_prompt


def parity_reward(prompt, completions):
    """+1 if the completion's token sum is even, else -1 (any deterministic function will do)."""
    return [1.0 if sum(c.tokens) % 2 == 0 else -1.0 for c in completions]


def run(
    setup, *, schedule, k, num_steps, step=None, batcher=None, gate=None, state=None, first_version=0, first_prompt=0
):
    fresh_batcher, fresh_state = setup.fresh()
    batcher = batcher or fresh_batcher
    state = fresh_state if state is None else state
    records = []
    pipeline = None
    train_step = step or setup.step

    def gated_step(state, batch):
        if gate is not None:
            gate(pipeline)
        return train_step(state, batch)

    pipeline = Pipeline(
        PipelineConfig(
            schedule=schedule,
            k=k,
            prompts_per_step=GROUPS,
            samples_per_prompt=SAMPLES,
            num_steps=num_steps,
            max_new_tokens=MAX_NEW,
            max_seq_len=MAX_LEN,
            min_length_bucket=MAX_LEN,
            temperature=1.0,
            stop_tokens=(1,),
            poll_s=0.01,
            first_version=first_version,
        ),
        batcher=batcher,
        prompt_source=prompt_source(first_prompt),
        reward_fn=parity_reward,
        train_step=gated_step,
        train_state=state,
        on_step=lambda record, sample_eval: records.append(record),
    )
    return pipeline, records


def wait_until_generator_blocked(pipeline):
    """Slowed trainer: start a step only once the idle generator is blocked on admission."""
    deadline = time.monotonic() + 60
    while pipeline.buffer.generator_blocked() is None:
        assert time.monotonic() < deadline, "generator never blocked"
        time.sleep(0.005)


def check_accounting(result, records):
    trained = [g for r in records for g in r.group_ids]
    assert len(trained) == len(set(trained))
    assert set(trained).isdisjoint(result.queued_group_ids)
    counts = result.counts
    assert counts.admitted == len(trained) + counts.queued + counts.in_flight + counts.discarded
    # ids are admission order: every id below `admitted` is trained, queued or in flight
    assert set(trained) | set(result.queued_group_ids) <= set(range(counts.admitted))
    assert [r.version for r in records] == list(range(len(records)))


@pytest.mark.parametrize("k", [1, 2, 8])
def test_pipeline_lag_bound_exactly_once_and_versions(setup, k):
    # The trainer is slowed until the generator saturates the bound before every step, so the
    # bound is reached: from step k on, every completion is trained exactly k versions late.
    pipeline, records = run(setup, schedule="pipeline", k=k, num_steps=k + 3, gate=wait_until_generator_blocked)
    result = pipeline.run()
    assert result.steps == k + 3 and result.stop_reason == "num_steps"
    for r in records:
        assert all(0 <= lag <= k for lag in r.lags)
        for group in r.groups:
            for c in group.completions:
                assert c.versions == sorted(c.versions) and c.versions[0] >= group.admit_version
                assert c.versions[-1] <= r.version  # nothing from the future
    assert all(set(r.lags) == {k} for r in records[k:])
    assert np.isfinite([r.metrics["train/loss"] for r in records]).all()
    assert max(r.metrics["pipeline/lag_max"] for r in records) == k
    check_accounting(result, records)
    # the trained data was generated by every version the generator received in time:
    # step t (up to k + 2) trains data of version t - k
    assert batcher_versions(records) == set(range(0, 3))


def batcher_versions(records):
    return {v for r in records for g in r.groups for c in g.completions for v in c.versions}


def test_pipeline_unslowed_run(setup):
    pipeline, records = run(setup, schedule="pipeline", k=2, num_steps=4)
    result = pipeline.run()
    assert all(lag <= 2 for r in records for lag in r.lags)
    check_accounting(result, records)
    assert result.generator.completions >= 4 * GROUPS * SAMPLES


def test_ppo_off_policy_k_updates_per_phase(setup):
    k = 2
    pipeline, records = run(setup, schedule="ppo_off_policy", k=k, num_steps=2 * k)
    result = pipeline.run()
    assert [r.version for r in records] == list(range(2 * k))
    for r in records:
        phase_start = r.version - r.version % k
        tokens_versions = {v for g in r.groups for c in g.completions for v in c.versions}
        assert tokens_versions == {phase_start}  # frozen params for the whole phase
        assert set(r.lags) == {r.version - phase_start}
    check_accounting(result, records)


def test_ppo_off_policy_resume_at_phase_boundary_is_exact(setup):
    # One run of 2 phases vs one phase, then a resume from its final state and version (with
    # the prompt source where it stopped): the second phase's losses agree.
    k = 2
    pipeline, full = run(setup, schedule="ppo_off_policy", k=k, num_steps=2 * k)
    pipeline.run()
    pipeline, _ = run(setup, schedule="ppo_off_policy", k=k, num_steps=k)
    state = pipeline.run().train_state
    batcher = ContinuousBatcher(setup.engine, jax.device_put(state.params, jax.devices()[0]), version=k, seed=0)
    pipeline, resumed = run(
        setup,
        schedule="ppo_off_policy",
        k=k,
        num_steps=k,
        batcher=batcher,
        state=state,
        first_version=k,
        first_prompt=k * GROUPS,
    )
    pipeline.run()
    assert [r.version for r in resumed] == [2, 3]
    for a, b in zip(full[k:], resumed):
        assert [g.prompt.key for g in a.groups] == [g.prompt.key for g in b.groups]
        assert [c.tokens for g in a.groups for c in g.completions] == [
            c.tokens for g in b.groups for c in g.completions
        ]
        assert a.metrics["train/loss"] == pytest.approx(b.metrics["train/loss"], abs=1e-6)


def test_generator_exception_stops_run_quickly(setup):
    batcher, _ = setup.fresh()
    calls = {"n": 0, "raised_at": None}
    original = batcher.run_chunk

    def failing_run_chunk():
        calls["n"] += 1
        if calls["n"] == 6:
            calls["raised_at"] = time.monotonic()
            raise OSError("device lost")
        return original()

    batcher.run_chunk = failing_run_chunk
    pipeline, _ = run(setup, schedule="pipeline", k=2, num_steps=1000, batcher=batcher)
    with pytest.raises(OSError, match="device lost"):
        pipeline.run()
    assert time.monotonic() - calls["raised_at"] < 10


def test_trainer_exception_stops_run_quickly(setup):
    raised = {}

    def failing_step(state, batch):
        if raised.get("armed"):
            raised["at"] = time.monotonic()
            raise FloatingPointError("NaN loss at step 1")
        raised["armed"] = True
        return setup.step(state, batch)

    pipeline, records = run(setup, schedule="pipeline", k=2, num_steps=1000, step=failing_step)
    with pytest.raises(FloatingPointError, match="NaN loss at step 1"):
        pipeline.run()
    assert time.monotonic() - raised["at"] < 10
    assert len(records) == 1
