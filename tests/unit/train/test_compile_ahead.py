"""Train-step programs compiled before the first step: no step compiles afterwards.

Compiles are counted by JAX's own backend-compile events (`scalerl_jax.telemetry.compile_events`), not by
the step's trace counter. A step compiled ahead for every length bucket must record no compile on
batches of several bucket lengths and give the same state and metrics as the jitted step; a
bucket left out of the ahead-of-time set must show up as a compile (so the count can fail).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from small_models import small_llama

from scalerl_jax.contracts.batch_layout import Routing, sorted_batch_key
from scalerl_jax.models import Transformer, get_preset, make_mesh
from scalerl_jax.pipeline.batching import build_train_batch
from scalerl_jax.pipeline.group import Group, Prompt
from scalerl_jax.run.build import RunTrainStep
from scalerl_jax.sampler import Completion
from scalerl_jax.telemetry.compile_events import compile_log, summary
from scalerl_jax.train import (
    OptimizerConfig,
    TrainStepConfig,
    create_train_state,
    init_train_state,
    make_optimizer,
    make_train_step,
)
from scalerl_jax.train.compiled import abstract_state

VOCAB = 64
ROWS, MICROBATCHES = 8, 2
BUCKETS = (8, 16, 32, 48)
OPTIMIZER = OptimizerConfig(learning_rate=1e-2, warmup_steps=0, eps=1e-3)
STEP_CONFIG = TrainStepConfig(num_microbatches=MICROBATCHES, temperature=0.8, logprob_chunk_size=16)


def _groups(lengths, seed):
    """Groups of 2 completions of the given lengths (prompts of 3 tokens), rewards +1 / -1."""
    rng = np.random.default_rng(seed)
    groups = []
    for g, pair in enumerate(lengths):
        completions = tuple(
            Completion(
                request_id=None,
                prompt_tokens=[],
                tokens=rng.integers(1, VOCAB, n).tolist(),
                logprobs=(-rng.uniform(0.5, 4.0, n)).tolist(),
                versions=[0] * n,
                sampled=[True] * n,
                interrupted=False,
                truncated=False,
                num_think_tokens=0,
                num_answer_tokens=0,
                finish_reason="stop",
                think_budget=-1,
            )
            for n in pair
        )
        prompt = Prompt(g, tuple(rng.integers(1, VOCAB, 3).tolist()))
        groups.append(Group(g, prompt, admit_version=0, completions=completions, rewards=np.asarray([1.0, -1.0])))
    return groups


# Sequence lengths = completion + 3: each batch's microbatches land in different buckets.
BATCH_LENGTHS = [
    [(40, 2), (30, 9), (5, 20), (12, 1)],  # 43 33 23 15 | 12 8 5 4 -> buckets 48, 16
    [(3, 2), (1, 4), (5, 2), (2, 1)],  # all <= 8 -> 8, 8
    [(25, 10), (20, 2), (7, 3), (9, 4)],  # 28 23 13 12 | 10 7 6 5 -> 32, 16
]


def _batches(sort: bool):
    return [
        build_train_batch(
            _groups(lengths, seed), rows=ROWS, length_buckets=BUCKETS, microbatches=MICROBATCHES if sort else None
        )[0]
        for seed, lengths in enumerate(BATCH_LENGTHS)
    ]


@pytest.fixture(scope="module")
def graphdef_params():
    return nnx.split(Transformer(small_llama(VOCAB), rngs=nnx.Rngs(0)))


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _steps(step, state, batches):
    """Runs `batches` in order; (final state, per-step metrics as floats, compiles during the steps)."""
    log = compile_log()
    compiles, metrics = [], []
    for batch in batches:
        before = log.count()
        state, m = step(state, batch)
        jax.block_until_ready(state)
        compiles += log.events(before)
        metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
    return state, metrics, compiles


def _make(graphdef, params, config, mesh=None):
    optimizer = make_optimizer(OPTIMIZER)
    if mesh is None:
        state, shardings = create_train_state(_copy(params), optimizer), None
    else:
        state, shardings = init_train_state(_copy(params), optimizer, mesh=mesh)
    return make_train_step(graphdef, optimizer, config, mesh=mesh, state_shardings=shardings), state


@pytest.mark.parametrize("sort", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["sorted", "unsorted"])
def test_no_compile_after_compiling_ahead(graphdef_params, sort):
    graphdef, params = graphdef_params
    config = TrainStepConfig(**{**STEP_CONFIG.__dict__, "sort_by_length": sort})
    batches = _batches(sort)
    if sort:  # the batches use three buckets of the four, in several microbatch positions
        used = {b[sorted_batch_key("tokens", m)].shape[1] for b in batches for m in range(MICROBATCHES)}
        assert used == {8, 16, 32, 48}
    log = compile_log()
    ahead, state = _make(graphdef, params, config)
    before = log.count()
    programs = ahead.compile_ahead(abstract_state(state), ROWS, BUCKETS)
    assert programs == (3 + len(BUCKETS) if sort else len(BUCKETS))  # prepare, zeros, update + buckets
    assert log.count() - before >= programs  # each program is one backend compile
    assert ahead.compile_ahead(abstract_state(state), ROWS, BUCKETS) == 0  # already compiled
    got_state, got, compiles = _steps(ahead, state, batches)
    assert compiles == [], summary(compiles)

    jitted, state = _make(graphdef, params, config)
    want_state, want, compiles = _steps(jitted, state, batches)
    assert compiles  # the jitted step does compile on first use, so the count above has teeth
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-6, abs=1e-7)
    for g, w in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)


def test_a_moe_step_with_the_samplers_routing_runs_what_it_compiled_ahead():
    """A mixture-of-experts policy's batches carry the sampler's routing (int8 for 8 experts):
    the programs compiled ahead take it as built, so no step compiles."""
    model_config = get_preset("tiny-qwen3-moe", vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16)
    graphdef, params = nnx.split(Transformer(model_config, rngs=nnx.Rngs(0)))
    routing = Routing(moe_layers=2, experts_per_token=2, num_experts=8)
    config = dataclasses.replace(
        STEP_CONFIG, sort_by_length=True, moe_layers=2, num_experts=8, experts_per_token=2, router_replay=True
    )
    rng = np.random.default_rng(0)

    def recorded(completion):  # random expert pairs per MoE layer, as a sampler records them
        pairs = [[rng.permutation(8)[:2] for _ in range(2)] for _ in completion.tokens]
        return dataclasses.replace(completion, routed_experts=np.asarray(pairs, np.int8))

    batches = []
    for seed, lengths in enumerate(BATCH_LENGTHS[:2]):
        groups = [
            dataclasses.replace(g, completions=tuple(recorded(c) for c in g.completions))
            for g in _groups(lengths, seed)
        ]
        batch, _ = build_train_batch(
            groups, rows=ROWS, length_buckets=BUCKETS, microbatches=MICROBATCHES, routing=routing
        )
        batches.append(batch)
    step, state = _make(graphdef, params, config)
    step.compile_ahead(abstract_state(state), ROWS, BUCKETS)
    _, metrics, compiles = _steps(step, state, batches)
    assert compiles == [], summary(compiles)
    assert all(m["train/routing_mismatch_frac"] > 0.5 for m in metrics)  # random records rarely agree


def test_a_bucket_not_compiled_ahead_compiles_on_use(graphdef_params):
    graphdef, params = graphdef_params
    config = TrainStepConfig(**{**STEP_CONFIG.__dict__, "sort_by_length": True})
    step, state = _make(graphdef, params, config)
    step.compile_ahead(abstract_state(state), ROWS, (8, 16, 32))  # without 48
    state, _, compiles = _steps(step, state, _batches(True)[1:])  # buckets 8, 16, 32
    assert compiles == [], summary(compiles)
    state, _, compiles = _steps(step, state, _batches(True)[:1])  # bucket 48
    assert len(compiles) == 1 and compiles[0].program == "jit(train_accumulate)", summary(compiles)
    # Arguments an executable refuses (float16 rewards) go through jit, which compiles for them.
    batch = _batches(True)[1]
    _, _, compiles = _steps(step, state, [dict(batch, rewards=batch["rewards"].astype(np.float16))])
    assert [c.program for c in compiles] == ["jit(train_prepare_rows)"], summary(compiles)


@pytest.mark.slow
def test_sharded_step_runs_its_executables(graphdef_params):
    """On a (data 2, fsdp 2, tensor 2) mesh: the executables take the batch sharded along B and
    the state on its rule shardings, donate the state, and compile nothing at step time."""
    graphdef, params = graphdef_params
    config = TrainStepConfig(**{**STEP_CONFIG.__dict__, "sort_by_length": True})
    step, state = _make(graphdef, params, config, mesh=make_mesh((2, 2, 2)))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step.compile_ahead(abstract_state(state), ROWS, BUCKETS)
    old = state
    batches = [{k: jax.device_put(v, step.batch_sharding) for k, v in b.items()} for b in _batches(True)]
    state, metrics, compiles = _steps(step, state, batches)
    assert compiles == [], summary(compiles)
    assert all(x.is_deleted() for x in jax.tree.leaves(old.params))  # donated, as the jitted update does
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True):
        assert got.sharding.is_equivalent_to(want, got.ndim)
    assert all(m["train/update_applied"] == 1.0 for m in metrics)


class _FakeStep:
    """A stand-in step: `compile_ahead` records its arguments (or raises `error`); a call runs
    `body(state)` and returns no metrics."""

    batch_sharding = None

    def __init__(self, body=lambda state: state, error=None):
        self.body, self.error, self.ahead = body, error, None

    def compile_ahead(self, state, rows, lengths, *, compile_map):
        if self.error is not None:
            raise self.error
        self.ahead = (state, rows, tuple(lengths), list(compile_map(lambda x: 2 * x, [1, 2])))
        return 0

    def __call__(self, state, batch):
        return self.body(state), {}


def test_run_step_waits_for_the_compiles_and_reports_later_ones():
    calls = []

    def body(state):  # the second call compiles a new program
        calls.append(None)
        if len(calls) == 2:
            jax.jit(lambda x: x * 3 + len(calls))(state).block_until_ready()
        return state

    fake = _FakeStep(body)
    step = RunTrainStep(fake, log=compile_log(), timeout_s=60)
    state = jnp.ones(3)
    step.compile_ahead_in_background(state, 8, (32, 64), threads=2)
    metrics = [step(state, {})[1] for _ in range(3)]
    assert fake.ahead is not None  # compile_ahead ran
    abstract, rows, lengths, mapped = fake.ahead
    assert isinstance(abstract, jax.ShapeDtypeStruct) and abstract.shape == (3,)  # shapes only
    assert (rows, lengths, mapped) == (8, (32, 64), [2, 4])
    assert [m["compile/in_step"] for m in metrics] == [0, 1, 0]
    assert [m["compile/after_step0"] for m in metrics] == [0, 1, 1]
    assert metrics[2]["compile/count"] == metrics[0]["compile/count"] + 1


def test_run_step_reraises_the_compile_error_at_the_first_step():
    step = RunTrainStep(_FakeStep(error=RuntimeError("out of memory while compiling")), log=compile_log(), timeout_s=60)
    step.compile_ahead_in_background(jnp.ones(3), 8, (32,), threads=1)
    with pytest.raises(RuntimeError, match="out of memory while compiling"):
        step(jnp.ones(3), {})
