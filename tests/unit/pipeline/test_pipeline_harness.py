"""Deterministic harness for the pipeline threads (pipeline/pipeline_rl.py).

The sampler is replaced by a scripted batcher that follows the `ContinuousBatcher` protocol
(one token per chunk, a scripted number of chunks per request, requests that can be held back),
and the train step by a counting step that can be gated; the orchestration under test (the
threads, the buffer, admission, selection, stopping) is the real one. Blocking is synchronised
on the buffer's observable state, not on sleeps, so the orderings asserted here are certain.
"""

import collections
import dataclasses
import logging
import os
import signal
import threading
import time
import traceback
from typing import Any

import pytest

from scalerl_jax.pipeline.config import PipelineConfig
from scalerl_jax.pipeline.generator import GeneratorStats
from scalerl_jax.pipeline.group import Prompt
from scalerl_jax.pipeline.pipeline_rl import Pipeline, quiet_progress_line
from scalerl_jax.run.signals import StopSignals, preserved_signal_handlers
from scalerl_jax.sampler import Completion


class ScriptedBatcher:
    """ContinuousBatcher protocol. Request (group, sample) runs `chunks(group, sample)` chunks and
    emits one token per chunk with the version of that chunk; while `hold(group, sample, n)` (n:
    tokens so far) is true it does not advance. `fail_at_chunk`: raise in that chunk."""

    def __init__(self, num_slots, *, chunks=lambda g, s: 1, hold=lambda g, s, n: False, fail_at_chunk=None):
        self.num_slots = num_slots
        self.chunks = chunks
        self.hold = hold
        self.fail_at_chunk = fail_at_chunk
        self.version = 0
        self.slots: list[dict[str, Any] | None] = [None] * num_slots
        self.queue = []
        self.chunk_count = 0
        self.tokens_by_version = {}
        self.counters = collections.Counter()
        self._pending: tuple[Any, int] | None = None
        self._lock = threading.Lock()

    @property
    def num_free_slots(self):
        return sum(s is None for s in self.slots)

    @property
    def num_pending(self):
        return len(self.queue)

    @property
    def idle(self):
        return not self.queue and self.num_free_slots == self.num_slots

    def add_request(self, request):
        self.queue.append(request)

    def update_params(self, params, version, *, copy=True):
        with self._lock:
            self._pending = (params, version)
        return 0.0

    def run_chunk(self):
        with self._lock:
            if self._pending is not None:
                self.version = self._pending[1]
                self._pending = None
        for i, slot in enumerate(self.slots):
            if slot is None and self.queue:
                self.slots[i] = {"request": self.queue.pop(0), "tokens": [], "versions": []}
        if self.idle:
            return []
        self.chunk_count += 1
        if self.chunk_count == self.fail_at_chunk:
            boom_in_chunk()
        time.sleep(0.001)
        finished = []
        for i, slot in enumerate(self.slots):
            if slot is None:
                continue
            group, sample = slot["request"].request_id
            if self.hold(group, sample, len(slot["tokens"])):
                continue
            slot["tokens"].append(len(slot["tokens"]) + 1)
            slot["versions"].append(self.version)
            self.tokens_by_version[self.version] = self.tokens_by_version.get(self.version, 0) + 1
            if len(slot["tokens"]) >= self.chunks(group, sample):
                n = len(slot["tokens"])
                finished.append(
                    Completion(
                        request_id=(group, sample),
                        prompt_tokens=list(slot["request"].prompt_tokens),
                        tokens=slot["tokens"],
                        logprobs=[-1.0] * n,
                        versions=slot["versions"],
                        sampled=[True] * n,
                        interrupted=False,
                        truncated=False,
                        num_think_tokens=0,
                        num_answer_tokens=n,
                        finish_reason="stop",
                        think_budget=-1,
                    )
                )
                self.slots[i] = None
        return finished


def boom_in_chunk():
    raise ValueError("injected sampler failure")


class CountingStep:
    """Train step on an int state (its version): records batches; `gate(version)` may block."""

    def __init__(self, gate=lambda version: None, fail_at=None):
        self.gate = gate
        self.fail_at = fail_at
        self.batches = []

    def __call__(self, state, batch):
        if state == self.fail_at:
            boom_in_step()
        self.gate(state)
        self.batches.append(batch)
        return state + 1, {"train/loss": 0.0}


def boom_in_step():
    raise RuntimeError("injected train-step failure")


def make_pipeline(batcher, step, reward_fn=None, on_step=None, **overrides):
    """A pipeline over `batcher` and `step`; its steps' records are appended to the list returned
    beside it, then passed to `on_step(record)` if given."""
    counter = iter(range(10**6))
    records = []

    def record_step(record, sample_eval):
        records.append(record)
        if on_step is not None:
            on_step(record)

    settings: dict[str, Any] = dict(
        max_new_tokens=8,
        max_seq_len=32,
        min_length_bucket=8,
        prompts_per_step=1,
        samples_per_prompt=1,
        num_steps=3,
        k=1,
        admission_slack=0,
        poll_s=0.01,
    )
    settings.update(overrides)
    pipeline = Pipeline(
        PipelineConfig(**settings),
        batcher=batcher,
        prompt_source=lambda: Prompt(next(counter), (1, 2, 3)),
        reward_fn=reward_fn or (lambda prompt, completions: [float(i % 2) for i in range(len(completions))]),
        train_step=step,
        train_state=0,
        push_params=lambda state, version: batcher.update_params(state, version),
        on_step=record_step,
    )
    return pipeline, records


def assert_accounting(result, records):
    trained = [g for r in records for g in r.group_ids]
    assert len(trained) == len(set(trained))  # none trained twice
    assert set(trained).isdisjoint(result.queued_group_ids)  # queued is never reported trained
    assert list(result.trained_group_ids) == trained
    counts = result.counts
    assert counts.admitted == len(trained) + counts.discarded + counts.queued + counts.in_flight
    assert [r.version for r in records] == list(range(len(records)))  # strictly increasing


def no_pipeline_threads_left():
    return not [t for t in threading.enumerate() if t.name.startswith("pipeline-")]


def test_trainer_waits_for_the_group_whose_deadline_has_come():
    # k=1, G=1, n=1. Group 0 (2 tokens) is held after its first token (made by v0); group 1
    # trains at v0. At v1 group 2 (admitted at v1) is ready, but group 0 must be consumed at v1
    # at the latest: the trainer waits for it although another group is queued, and group 2
    # follows at v2.
    pipeline: Pipeline | None = None

    def hold(group, sample, num_tokens):
        if group != 0 or num_tokens != 1:
            return False
        assert pipeline is not None
        return not (pipeline.buffer.trainer_waiting_for() == 1 and pipeline.buffer.counts().queued >= 1)

    batcher = ScriptedBatcher(2, chunks=lambda g, s: 2 if g == 0 else 1, hold=hold)
    step = CountingStep()
    pipeline, records = make_pipeline(batcher, step, k=1, num_steps=3)
    result = pipeline.run()
    assert [r.group_ids for r in records] == [(1,), (0,), (2,)]
    assert [r.lags for r in records] == [(0,), (1,), (1,)]
    assert records[1].first_versions == (0,) and records[1].last_versions == (1,)
    assert records[2].first_versions == (1,)
    m = records[1].metrics  # step on version 1 -> version 2; group 0 spans versions 0 and 1
    assert (m["pipeline/version"], m["pipeline/lag_max"], m["pipeline/versions_spanned_max"]) == (2, 1, 2)
    assert m["pipeline/groups_trained"] == 2 and m["pipeline/queue_depth"] == 1  # group 2 waits
    assert result.waits.trainer_waits >= 1
    assert_accounting(result, records)
    assert no_pipeline_threads_left()


@pytest.mark.parametrize("k,capacity,reason", [(8, 2, "full"), (1, None, "lag")])
def test_generator_blocks_while_trainer_is_slow(k, capacity, reason):
    # G=1, n=1, one-chunk requests. The first train step does not finish until the idle
    # generator is blocked on admission, for the expected reason.
    pipeline: Pipeline | None = None
    seen = {}

    def gate(version):
        if version == 0:
            assert pipeline is not None
            deadline = time.monotonic() + 10
            while pipeline.buffer.generator_blocked() != reason:
                assert time.monotonic() < deadline, "generator never blocked"
                time.sleep(0.002)
            seen["counts"] = pipeline.buffer.counts()

    batcher = ScriptedBatcher(4)
    pipeline, records = make_pipeline(batcher, CountingStep(gate), k=k, capacity=capacity, num_steps=2)
    result = pipeline.run()
    # admitted before the block: `capacity` groups (full) or (k+1)*G = 2 (lag), then one more
    # once batch 0 was taken; it stays there while step 0 runs.
    assert seen["counts"].admitted == 3 if reason == "full" else seen["counts"].admitted == 2
    waits = result.waits  # (booked under the reason in force when each wait began)
    assert waits.generator_full_waits + waits.generator_lag_waits >= 1
    assert waits.generator_blocked_full + waits.generator_blocked_lag > 0
    assert all(lag <= k for r in records for lag in r.lags)
    assert_accounting(result, records)


def test_generator_exception_ends_run_with_its_traceback():
    batcher = ScriptedBatcher(2, chunks=lambda g, s: 3, fail_at_chunk=5)
    start = time.monotonic()
    pipeline, _ = make_pipeline(batcher, CountingStep(), num_steps=100)
    with pytest.raises(ValueError, match="injected sampler failure") as info:
        pipeline.run()
    assert time.monotonic() - start < 10
    assert "boom_in_chunk" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert no_pipeline_threads_left()


def test_trainer_exception_wakes_a_blocked_generator():
    # k=0: the generator is blocked on admission (lag) while the trainer fails in step 2.
    batcher = ScriptedBatcher(2)
    start = time.monotonic()
    pipeline, records = make_pipeline(batcher, CountingStep(fail_at=2), k=0, num_steps=100)
    with pytest.raises(RuntimeError, match="injected train-step failure") as info:
        pipeline.run()
    assert time.monotonic() - start < 10
    assert "boom_in_step" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert len(records) == 2 and no_pipeline_threads_left()


def test_exception_in_reward_fn_and_in_on_step():
    batcher = ScriptedBatcher(2)
    pipeline, _ = make_pipeline(batcher, CountingStep(), reward_fn=lambda prompt, completions: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        pipeline.run()

    def on_step(record):
        raise KeyError("bad metric")

    pipeline, _ = make_pipeline(ScriptedBatcher(2), CountingStep(), on_step=on_step)
    with pytest.raises(KeyError, match="bad metric"):
        pipeline.run()
    assert no_pipeline_threads_left()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_after_the_current_step(signum):
    in_step, release = threading.Event(), threading.Event()

    def gate(version):
        if version == 1:
            in_step.set()
            assert release.wait(10)

    def send_signal():
        assert in_step.wait(10)
        os.kill(os.getpid(), signum)
        time.sleep(0.2)  # the handler runs in the main thread; the step is still going
        release.set()

    batcher = ScriptedBatcher(4)
    pipeline, records = make_pipeline(batcher, CountingStep(gate), k=2, num_steps=50)
    with preserved_signal_handlers():  # the run's signal handling, as `run.root.run` installs it
        signals = StopSignals(leader=True)
        signals.install()
        signals.on_stop(pipeline.request_stop)
        sender = threading.Thread(target=send_signal)
        sender.start()
        result = pipeline.run()
        sender.join()
    assert result.stop_reason == f"signal {signal.Signals(signum).name}"
    assert result.steps == 2 and len(records) == 2  # step 1 finished, no step 2
    assert_accounting(result, records)
    assert no_pipeline_threads_left()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_request_stop_from_on_step():
    batcher = ScriptedBatcher(4)
    pipeline: Pipeline | None = None

    def stop_at_version_4(record):
        if record.version == 4:
            assert pipeline is not None
            pipeline.request_stop()

    pipeline, records = make_pipeline(batcher, CountingStep(), k=3, num_steps=50, on_step=stop_at_version_4)
    result = pipeline.run()
    assert result.stop_reason == "stop_requested" and result.steps == 5
    assert_accounting(result, records)


def test_ppo_off_policy_k_updates_per_phase_on_one_version():
    k, groups, samples = 3, 2, 2
    batcher = ScriptedBatcher(3, chunks=lambda g, s: 1 + (g * 7 + s) % 4)
    step = CountingStep()
    pipeline, records = make_pipeline(
        batcher,
        step,
        schedule="ppo_off_policy",
        k=k,
        prompts_per_step=groups,
        samples_per_prompt=samples,
        num_steps=3 * k,
        admission_slack=2,
    )
    result = pipeline.run()
    assert [r.version for r in records] == list(range(3 * k))
    for r in records:
        phase_start = r.version - r.version % k
        assert set(r.first_versions) == set(r.last_versions) == {phase_start}
        assert set(r.lags) == {r.version - phase_start}
        assert len(r.group_ids) == groups
    # every token of a phase on that phase's version: nothing generated while training
    assert set(batcher.tokens_by_version) == {0, 3, 6}
    assert_accounting(result, records)


def test_zero_variance_refill_discards_and_counts():
    # n=2 with rewards [r, r] for even groups: they are discarded on arrival and counted.
    batcher = ScriptedBatcher(4)
    pipeline, records = make_pipeline(
        batcher,
        CountingStep(),
        samples_per_prompt=2,
        prompts_per_step=2,
        zero_variance="refill",
        k=2,
        num_steps=3,
        reward_fn=lambda prompt, completions: [1.0, 1.0 - 2 * (prompt.key % 2)],
    )
    result = pipeline.run()
    for r in records:
        assert all(g.prompt.key % 2 == 1 for g in r.groups)
    assert result.counts.discarded >= 3
    assert sum(r.metrics["data/zero_variance_dropped"] for r in records) <= result.counts.discarded
    assert_accounting(result, records)


def test_mask_truncated_and_flops_reach_the_batch_and_metrics():
    """Through the real trainer loop: sample 0 of every group is cut by length, so with
    mask_truncated its row has no loss token; model FLOP/s = train_step_flops(rows, T) / step_s."""

    class CutFirstSample(ScriptedBatcher):
        def run_chunk(self):
            return [
                dataclasses.replace(c, truncated=True, finish_reason="length") if c.request_id[1] == 0 else c
                for c in super().run_chunk()
            ]

    step = CountingStep()
    flops = lambda rows, length: 1e9 * rows * length
    pipeline, records = make_pipeline(
        CutFirstSample(4),
        step,
        samples_per_prompt=2,
        k=1,
        num_steps=2,
        mask_truncated=True,
        train_step_flops=flops,
        peak_flops_per_s=1e15,
    )
    pipeline.run()
    assert len(step.batches) == 2
    for batch, record in zip(step.batches, records):
        assert batch["loss_mask"][0].sum() == 0 and batch["loss_mask"][1].sum() == 1
        assert list(batch["sample_valid"]) == [True, True]
        metrics = record.metrics
        assert metrics["data/truncated_masked"] == 1.0
        want = 1e9 * 2 * metrics["pipeline/sequence_length"] / metrics["pipeline/step_s"]
        assert metrics["compute/model_flops_per_s"] == pytest.approx(want)
        assert metrics["compute/mfu"] == pytest.approx(want / 1e15)


def test_quiet_progress_line_names_what_each_side_does():
    stats = GeneratorStats(chunks=412, busy_s=980.4, generated_tokens=9536, groups_finished=37, groups_discarded=12)
    line = quiet_progress_line(
        quiet_s=312.0,
        next_step=3,
        num_steps=200,
        trainer="waiting for a batch",
        groups_ready=5,
        groups_per_step=8,
        generator=stats,
        evaluations=[(0, 260, 400)],
    )
    assert line == (
        "no step finished for 5.2 min (step 3/200 next) | trainer waiting for a batch, 5 of 8 groups ready | "
        "generator: 412 decode chunks (980 s), 37 groups finished (12 discarded), 9536 completion tokens | "
        "evaluation of step 0: 260/400 samples back"
    )


def test_a_long_step_is_reported_while_it_runs(caplog):
    # Step 0 does not finish until the pipeline has said, with no step done, that the trainer trains.
    caplog.set_level(logging.INFO)

    def quiet_lines():
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("no step finished")]

    def gate(version):
        deadline = time.monotonic() + 10
        while version == 0 and not any("trainer training" in line for line in quiet_lines()):
            assert time.monotonic() < deadline, "no progress line while step 0 ran"
            time.sleep(0.005)

    pipeline, records = make_pipeline(ScriptedBatcher(2), CountingStep(gate), num_steps=2, quiet_log_s=0.05)
    pipeline.run()
    assert len(records) == 2
    line = next(line for line in quiet_lines() if "trainer training" in line)
    # two slots, k=1: groups 0 and 1 finish in the first chunk; group 0 is in the step, group 1 waits
    assert "(step 1/2 next) | trainer training, 1 of 1 groups ready | generator: 1 decode chunks" in line
    assert "2 groups finished (0 discarded), 2 completion tokens" in line
