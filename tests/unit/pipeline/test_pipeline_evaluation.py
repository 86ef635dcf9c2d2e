"""Evaluation on the generator's own batcher, and reward scoring off the generator thread.

The pipeline runs the real tiny sampler and train step of `test_pipeline_real.py`; each
evaluation is checked against an independent reference: a fresh `ContinuousBatcher` (its own
engine, nothing else in its batch) run on the trainer's params of that version with the same
request seeds. Thread checks name the thread that ran each call.
"""

import threading

import jax
import numpy as np
import pytest
from test_pipeline_harness import CountingStep, ScriptedBatcher, make_pipeline
from test_pipeline_real import GROUPS, MAX_NEW, SAMPLES, Setup, parity_reward, prompt_source

from scalerl_jax.distributed.channel import Connection
from scalerl_jax.distributed.messages import eval_item_from_message, eval_item_to_message
from scalerl_jax.distributed.remote_generator import LinkService
from scalerl_jax.pipeline.config import PipelineConfig
from scalerl_jax.pipeline.generator import EvalItem, GeneratorCounters, LocalLink, evaluation_seed
from scalerl_jax.pipeline.lag import make_schedule
from scalerl_jax.pipeline.pipeline_rl import Pipeline
from scalerl_jax.pipeline.queue import GroupBuffer, PipelineStopped
from scalerl_jax.sampler import Completion, ContinuousBatcher, Engine, Request

EVAL_PROMPTS = [[5, 9, 13], [7, 3, 3, 40, 2], [60, 61], [11, 12, 13, 14]]
STOP = (1,)
RUN_SEED = 12


@pytest.fixture(scope="module")
def setup():
    setup = Setup()
    setup.reference_engine = Engine(setup.graphdef, setup.config, setup.engine.config)  # compiled once
    return setup


class RecordingBatcher(ContinuousBatcher):
    """A ContinuousBatcher that notes, for each evaluation request it queues, how many training
    requests were queued or decoding beside it, and which threads run its chunks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.training_beside_eval = []
        self.chunk_threads = set()
        self._training = set()  # training requests queued or decoding

    def add_request(self, request):
        request_id = request.request_id
        assert isinstance(request_id, tuple)  # (EVAL_TAG, job, index) or (group, sample)
        if request_id[0] == "eval":
            self.training_beside_eval.append(len(self._training))
        else:
            self._training.add(request.request_id)
        super().add_request(request)

    def run_chunk(self):
        self.chunk_threads.add(threading.current_thread().name)
        completions = super().run_chunk()
        self._training -= {c.request_id for c in completions}
        return completions


def evaluation_config(schedule: str, k: int, num_steps: int) -> PipelineConfig:
    """The pipeline of these tests: GROUPS x SAMPLES per step, sampling at temperature 1."""
    return PipelineConfig(
        schedule=schedule,
        k=k,
        prompts_per_step=GROUPS,
        samples_per_prompt=SAMPLES,
        num_steps=num_steps,
        max_new_tokens=MAX_NEW,
        max_seq_len=24,
        min_length_bucket=24,
        temperature=1.0,
        stop_tokens=STOP,
        poll_s=0.01,
    )


def evaluating_pipeline(setup, *, schedule, k, num_steps, evaluate_at, before_step_report=None):
    """A pipeline whose on_start / on_step evaluate EVAL_PROMPTS at the versions in `evaluate_at`,
    keeping each version's params (a copy on the generator's device) and completions;
    `before_step_report(pipeline)` runs first in each on_step."""
    batcher_params = jax.device_put(setup.copy_params(), jax.devices()[0])
    batcher = RecordingBatcher(setup.engine, batcher_params, seed=0)
    _, state = setup.fresh()
    evaluations, records, scorer_threads = {}, [], []
    pipeline = None

    def evaluate(version, state, sample_eval):
        params = jax.device_put(jax.tree.map(lambda x: x.copy(), state.params), jax.devices()[0])
        evaluations[version] = (params, sample_eval(version, EVAL_PROMPTS))

    def reward(prompt, completions):
        scorer_threads.append(threading.current_thread().name)
        return parity_reward(prompt, completions)

    def on_step(record, sample_eval):
        if before_step_report is not None:
            before_step_report(pipeline)
        records.append(record)
        if record.version + 1 in evaluate_at:
            evaluate(record.version + 1, record.train_state, sample_eval)

    pipeline = Pipeline(
        evaluation_config(schedule, k, num_steps),
        batcher=batcher,
        prompt_source=prompt_source(),
        reward_fn=reward,
        train_step=setup.step,
        train_state=state,
        on_step=on_step,
        on_start=(lambda sample_eval: evaluate(0, state, sample_eval)) if 0 in evaluate_at else None,
    )
    return pipeline, batcher, evaluations, records, scorer_threads


def reference_samples(setup, params, version):
    """EVAL_PROMPTS sampled alone on a fresh batcher (own engine) with the evaluation streams of
    `version` (run seed 0)."""
    batcher = ContinuousBatcher(setup.reference_engine, params, seed=0)
    for i, prompt in enumerate(EVAL_PROMPTS):
        batcher.add_request(
            Request(
                request_id=i,
                prompt_tokens=prompt,
                max_new_tokens=MAX_NEW,
                seed=evaluation_seed(0, version, i),
                temperature=1.0,
                stop_tokens=STOP,
                interrupt=True,
            )
        )
    done = {c.request_id: c for c in batcher.drain()}
    return [done[i] for i in range(len(EVAL_PROMPTS))]


def assert_same_samples(got, expected, version):
    for g, e in zip(got, expected, strict=True):
        assert g.tokens == e.tokens
        np.testing.assert_allclose(g.logprobs, e.logprobs, rtol=0, atol=1e-6)
        assert g.finish_reason == e.finish_reason and g.versions == [version] * len(g.tokens)


def test_evaluation_shares_the_generator_batcher_and_matches_a_direct_run(setup):
    pipeline, batcher, evaluations, records, scorer_threads = evaluating_pipeline(
        setup, schedule="pipeline", k=2, num_steps=4, evaluate_at={0, 2, 3, 4}
    )
    result = pipeline.run()
    assert result.version == 4 and sorted(evaluations) == [0, 2, 3, 4]
    # Evaluations shared batches with training requests, on the generator thread's batcher.
    assert max(batcher.training_beside_eval) > 0
    assert batcher.chunk_threads == {"pipeline-generator"}
    for version, (params, completions) in evaluations.items():
        assert_same_samples(completions, reference_samples(setup, params, version), version)
    # The params did change between the evaluated versions (the comparison has teeth).
    first, last = evaluations[0][1], evaluations[4][1]
    assert [c.tokens for c in first] != [c.tokens for c in last]
    # Evaluation completions never reached the group buffer or the training counters.
    trained = [c for r in records for g in r.groups for c in g.completions]
    assert all(isinstance(c.request_id[0], int) for c in trained)
    stats = result.generator
    assert stats.completions == SAMPLES * (stats.groups_finished + stats.groups_discarded)
    assert scorer_threads and set(scorer_threads) == {"pipeline-scorer"}


def test_ppo_evaluation_of_a_version_the_schedule_does_not_push(setup):
    # k = 2: version 1 is mid-phase (never pushed for training); evaluating it pushes it first,
    # and the phases still generate on their frozen versions 0 and 2.
    pipeline, batcher, evaluations, records, _ = evaluating_pipeline(
        setup, schedule="ppo_off_policy", k=2, num_steps=4, evaluate_at={1, 2}
    )
    pipeline.run()
    for version, (params, completions) in evaluations.items():
        assert_same_samples(completions, reference_samples(setup, params, version), version)
    for record in records:
        phase_start = record.version - record.version % 2
        assert {v for g in record.groups for c in g.completions for v in c.versions} == {phase_start}
    # Admission is held while on_step runs: the evaluation at the phase start 2 had the engine alone.
    assert batcher.training_beside_eval[-len(EVAL_PROMPTS) :] == [0] * len(EVAL_PROMPTS)


def test_stop_requested_during_an_evaluation_lets_it_finish(setup):
    pipeline, _, evaluations, records, _ = evaluating_pipeline(
        setup,
        schedule="pipeline",
        k=1,
        num_steps=10,
        evaluate_at={1},
        before_step_report=lambda pipeline: pipeline.request_stop(),
    )
    result = pipeline.run()
    assert result.stop_reason == "stop_requested" and result.version == 1
    assert len(evaluations[1][1]) == len(EVAL_PROMPTS)


def test_reward_runs_on_the_scoring_thread_with_unchanged_accounting():
    calls = []

    def reward(prompt, completions):
        calls.append(threading.get_ident())
        return [float(i % 2) for i in range(len(completions))]

    batcher = ScriptedBatcher(2, chunks=lambda g, s: 1 + (g + s) % 3)
    generator_idents = set()
    run_chunk = batcher.run_chunk

    def recording_run_chunk():
        generator_idents.add(threading.get_ident())
        return run_chunk()

    batcher.run_chunk = recording_run_chunk
    pipeline, records = make_pipeline(batcher, CountingStep(), reward_fn=reward, samples_per_prompt=2, num_steps=5, k=2)
    result = pipeline.run()
    assert calls and generator_idents and not set(calls) & generator_idents
    assert len(set(calls)) == 1  # one scoring thread, groups scored one at a time
    # Every scored group is counted once and reached the buffer (the last one scored may have met
    # the closed buffer at the end of the run).
    stats, counts = result.generator, result.counts
    assert len(calls) - 1 <= stats.groups_finished + stats.groups_discarded <= len(calls)
    assert counts.admitted - counts.in_flight == stats.groups_finished + stats.groups_discarded
    assert stats.completions == 2 * (stats.groups_finished + stats.groups_discarded) and result.version == 5
    assert [r.version for r in records] == list(range(5))


def test_a_failing_reward_still_ends_the_run_with_its_error():
    batcher = ScriptedBatcher(2)
    pipeline, _ = make_pipeline(batcher, CountingStep(), reward_fn=lambda prompt, completions: {}["missing"])
    with pytest.raises(KeyError, match="missing"):
        pipeline.run()


def completion(request_id, versions):
    n = len(versions)
    return Completion(
        request_id=request_id,
        prompt_tokens=[5],
        tokens=[2] * n,
        logprobs=[-1.0] * n,
        versions=list(versions),
        sampled=[True] * n,
        interrupted=False,
        truncated=False,
        num_think_tokens=0,
        num_answer_tokens=n,
        finish_reason="stop",
        think_budget=-1,
    )


def not_called(*args):
    raise AssertionError("no prompt is admitted in these tests")


def local_link():
    buffer = GroupBuffer(make_schedule("pipeline", k=1, groups_per_step=1), capacity=2)
    return LocalLink(
        buffer,
        prompt_source=not_called,
        reward_fn=not_called,
        samples_per_prompt=1,
        zero_variance="none",
        counters=GeneratorCounters(),
        run_seed=RUN_SEED,
    )


def run_in_thread(fn, *args):
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn(*args)), daemon=True)
    thread.start()
    return thread, out


def test_link_gives_evaluation_requests_only_to_a_generator_at_their_version():
    link = local_link()
    thread, out = run_in_thread(link.evaluate, 3, [[5, 6], [7]])
    while not link._eval_queue:  # the evaluation is queued
        pass
    assert link.take_evaluations(2, limit=8) == []  # a generator still on version 2 waits
    items = link.take_evaluations(3, limit=1) + link.take_evaluations(4, limit=8)
    seeds = [evaluation_seed(RUN_SEED, 3, 0), evaluation_seed(RUN_SEED, 3, 1)]
    assert items == [EvalItem(0, 0, (5, 6), seeds[0], 3), EvalItem(0, 1, (7,), seeds[1], 3)]
    assert [eval_item_from_message(eval_item_to_message(item)) for item in items] == items
    link.finish_evaluations([completion(items[1].request_id, [3, 3])])
    assert thread.is_alive()  # half the job is back
    link.finish_evaluations([completion(items[0].request_id, [3])])
    thread.join(5)
    assert [c.versions for c in out["value"]] == [[3], [3, 3]]


def test_a_newer_version_inside_an_evaluation_is_an_error():
    link = local_link()
    run_in_thread(link.evaluate, 3, [[5]])
    while not link._eval_queue:
        pass
    (item,) = link.take_evaluations(3, limit=1)
    with pytest.raises(RuntimeError, match=r"evaluation of params version 3 .* versions \[4\]"):
        link.finish_evaluations([completion(item.request_id, [3, 4])])


def test_closing_the_link_wakes_a_waiting_evaluation():
    link = local_link()
    errors = []

    def evaluate():
        try:
            link.evaluate(0, [[5]])
        except PipelineStopped as error:
            errors.append(error)

    thread = threading.Thread(target=evaluate, daemon=True)
    thread.start()
    link.close()
    thread.join(5)
    assert not thread.is_alive() and errors


class FakeConnection(Connection):
    """All `LinkService._answer` uses of its connection: the peer's name."""

    def __init__(self):
        self.peer = "process 1 (generator)"


def test_link_service_serves_evaluation_requests_with_the_leader_prompts():
    link = local_link()
    service = LinkService(FakeConnection(), timeout_s=1.0)
    thread, out = run_in_thread(link.evaluate, 0, [[5, 6]])
    while not link._eval_queue:
        pass
    reply = service._answer(link, {"op": "take_evaluations", "version": 0, "limit": 4})
    (item,) = [eval_item_from_message(m) for m in reply["items"]]
    assert item == EvalItem(0, 0, (5, 6), evaluation_seed(RUN_SEED, 0, 0), 0)
    sent = {
        "request_id": list(item.request_id),
        "tokens": np.asarray([2], np.int32),
        "logprobs": np.asarray([-1.0], np.float32),
        "versions": np.asarray([0]),
        "sampled": np.asarray([True]),
        "interrupted": False,
        "truncated": False,
        "num_think_tokens": 0,
        "num_answer_tokens": 1,
        "finish_reason": "stop",
        "think_budget": -1,
    }
    service._answer(link, {"op": "finish_evaluations", "completions": [sent]})
    thread.join(5)
    assert out["value"][0].prompt_tokens == [5, 6] and out["value"][0].request_id == ("eval", 0, 0)


def test_concurrent_evaluation_samples_a_retained_version_while_the_trainer_moves_on(setup):
    # Each evaluation of version v starts only once the trainer has pushed v + 1, so the
    # generator's batcher no longer decodes with v: the evaluation batcher must get the params of v
    # that it retained, and its samples must equal a direct run on the trainer's params of v.
    batcher = ContinuousBatcher(setup.engine, jax.device_put(setup.copy_params(), jax.devices()[0]), seed=0)
    evaluate_at = {2, 3}
    batcher.retain_versions(lambda version: version in evaluate_at, limit=2)
    eval_engine = Engine(setup.graphdef, setup.config, setup.engine.config)
    eval_batcher = ContinuousBatcher(eval_engine, batcher.params, seed=0)
    eval_chunks_at = []  # (version evaluated, the generator batcher's version) per evaluation chunk
    run_eval_chunk = eval_batcher.run_chunk

    def recording_chunk():
        eval_chunks_at.append((eval_batcher.version, batcher.version))
        return run_eval_chunk()

    eval_batcher.run_chunk = recording_chunk
    _, state = setup.fresh()
    params_at, evaluations, threads = {}, {}, []
    trainer_at = {"version": 0}
    moved_on = threading.Condition()

    def evaluate_later(version, sample_eval):
        with moved_on:
            moved_on.wait_for(lambda: trainer_at["version"] > version, timeout=60)
        evaluations[version] = sample_eval(version, EVAL_PROMPTS)

    def on_step(record, sample_eval):
        version = record.version + 1
        with moved_on:
            trainer_at["version"] = version
            moved_on.notify_all()
        if version in evaluate_at:
            params_at[version] = jax.device_put(jax.tree.map(lambda x: x.copy(), record.train_state.params))
            sample_eval.pin(version)
            thread = threading.Thread(target=evaluate_later, args=(version, sample_eval))
            thread.start()
            threads.append(thread)

    def on_end():
        for thread in threads:
            thread.join(timeout=120)

    pipeline = Pipeline(
        evaluation_config("pipeline", 2, 5),
        batcher=batcher,
        prompt_source=prompt_source(),
        reward_fn=parity_reward,
        train_step=setup.step,
        train_state=state,
        on_step=on_step,
        on_end=on_end,
        eval_batcher=eval_batcher,
        concurrent_evaluation=True,
    )
    result = pipeline.run()
    assert result.version == 5 and sorted(evaluations) == [2, 3]
    for version, completions in evaluations.items():
        assert_same_samples(completions, reference_samples(setup, params_at[version], version), version)
    assert [c.tokens for c in evaluations[2]] != [c.tokens for c in evaluations[3]]
    # Evaluation chunks ran on the evaluated version while the generator's batcher decoded a newer one.
    assert any(evaluated == 2 and current > 2 for evaluated, current in eval_chunks_at)


def test_a_batcher_retains_the_newest_versions_it_is_asked_to_keep(setup):
    params = [jax.tree.map(lambda x, i=i: x + i, setup.copy_params()) for i in range(5)]
    batcher = ContinuousBatcher(setup.engine, params[0], seed=0)
    batcher.retain_versions(lambda version: version % 2 == 0, limit=2)
    for version in range(1, 5):
        batcher.update_params(params[version], version, copy=False)
        batcher.run_chunk()  # adopts it
    # Kept: 2 and 4 (0 dropped beyond the limit of 2); 4 is also the current version; 1 and 3 never kept.
    assert batcher.params_at(0) is None and batcher.params_at(1) is None and batcher.params_at(3) is None
    assert batcher.params_at(2) is params[2] and batcher.params_at(4) is params[4]
    with pytest.raises(ValueError, match="at least one"):
        batcher.retain_versions(lambda version: True, limit=0)


def test_a_push_not_waited_for_still_copies_the_params_a_train_step_then_donates(setup):
    batcher = ContinuousBatcher(setup.engine, jax.device_put(setup.copy_params(), jax.devices()[0]), seed=0)
    _, state = setup.fresh()
    before = jax.tree.map(np.asarray, state.params)
    batcher.update_params(state.params, 1, wait=False)  # dispatched, not waited for
    donate = jax.jit(lambda params: jax.tree.map(lambda x: x * 0 - 7, params), donate_argnums=0)
    donate(state.params)  # overwrites the pushed buffers in place once the copy has read them
    batcher.run_chunk()  # adopts version 1
    for got, expected in zip(jax.tree.leaves(batcher.params_at(1)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(got), expected)
