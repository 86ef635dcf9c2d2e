"""Length-sorted microbatches: the plan and its padding by hand, and the sorted step against the
unsorted step (`train/step.py`) on the same groups.

The unsorted step is itself checked against a float64 numpy reference of the loss and gradient in
test_train_step.py; here the sorted step (rows sorted by length, each microbatch padded to its
own bucket, three jitted programs and a host loop) must give the same loss, metrics and updated
params to 1e-6. `train/logp_mismatch_first_mb` depends on which rows form microbatch 0, so it is
compared with the unsorted step run on the same rows in the sorted order (where the unsorted
deal, row b in microbatch b mod M, forms exactly the sorted microbatches).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from small_models import small_llama

from scalerl_jax.contracts.batch_layout import sorted_batch_key, split_sorted_batch
from scalerl_jax.models import Transformer, make_mesh
from scalerl_jax.pipeline.batching import build_train_batch, octave_buckets, padding_fraction, plan_sorted_microbatches
from scalerl_jax.pipeline.group import Group, Prompt
from scalerl_jax.sampler import Completion
from scalerl_jax.train import (
    OptimizerConfig,
    SortedTrainStep,
    TrainStep,
    TrainStepConfig,
    create_train_state,
    init_train_state,
    make_optimizer,
    make_train_step,
)

VOCAB = 64
TEMPERATURE = 0.8
OPTIMIZER = OptimizerConfig(learning_rate=1e-2, warmup_steps=0, eps=1e-3)


# ---------------------------------------------------------------------------------------------
# buckets and the plan, by hand
# ---------------------------------------------------------------------------------------------
def test_octave_buckets_by_hand():
    # octave [2, 4): step 1 -> 2, 3; [4, 8): step 2 -> 4, 6; [8, 16): step 4 -> 8, 12; then 16
    assert octave_buckets(2, 16, 2) == (2, 3, 4, 6, 8, 12, 16)
    assert octave_buckets(32, 100, 1) == (32, 64, 100)
    # [4, 8): step 1 -> 4..7; [8, 16): step 2 -> 8..14, cut below max_length 12
    assert octave_buckets(4, 12, 4) == (4, 5, 6, 7, 8, 10, 12)
    recipe = octave_buckets(128, 16384, 8)  # 7 octaves of 8, then 16384
    assert len(recipe) == 57 and recipe[-3:] == (14336, 15360, 16384)  # steps of 1024 in [8192, 16384)


def test_plan_and_padding_fraction_by_hand():
    lengths = [10, 3, 7, 1, 0, 5, 12, 2]
    plan = plan_sorted_microbatches(lengths, 4, octave_buckets(2, 16, 2))
    # longest first: 12 (row 6), 10 (0), 7 (2), 5 (5), 3 (1), 2 (7), 1 (3), 0 (4)
    np.testing.assert_array_equal(plan.order, [[6, 0], [2, 5], [1, 7], [3, 4]])
    # chunk maxima 12, 7, 3, 1 -> buckets 12, 8, 3, 2: 2 rows x (12 + 8 + 3 + 2) = 50 positions
    assert plan.lengths == (12, 8, 3, 2) and plan.padded_tokens == 50
    assert padding_fraction(lengths, plan.padded_tokens) == pytest.approx(1 - 40 / 50)
    # the unsorted layout: 8 rows x bucket 12
    assert padding_fraction(lengths, 8 * 12) == pytest.approx(1 - 40 / 96)


def test_plan_puts_rows_outside_the_loss_last_and_skips_a_microbatch_of_them():
    lengths = [10, 3, 7, 1, 0, 5, 12, 2]
    contributes = [True, False, True, False, False, True, False, True]
    plan = plan_sorted_microbatches(lengths, 4, octave_buckets(2, 16, 2), contributes)
    # in the loss, longest first: 10 (row 0), 7 (2), 5 (5), 2 (7); then rows 1, 3, 4, 6 by index
    np.testing.assert_array_equal(plan.order, [[0, 2], [5, 7], [1, 3], [4, 6]])
    # chunk maxima 10, 5 -> buckets 12, 6; the row of length 12 is outside the loss: not computed
    assert plan.lengths == (12, 6, 0, 0) and plan.padded_tokens == 36
    nothing = plan_sorted_microbatches(lengths, 4, (16,), [False] * 8)
    assert nothing.lengths == (0, 0, 0, 0) and nothing.padded_tokens == 0


def test_plan_rejects_rows_that_do_not_split():
    with pytest.raises(ValueError, match="num_microbatches=3"):
        plan_sorted_microbatches([1, 2, 3, 4], 3, (8,))


# ---------------------------------------------------------------------------------------------
# groups of very different lengths -> both layouts
# ---------------------------------------------------------------------------------------------
def _completion(rng, length, *, forced_at=None):
    sampled = [True] * length
    if forced_at is not None:
        sampled[forced_at] = False
    return Completion(
        request_id=None,
        prompt_tokens=[],
        tokens=rng.integers(1, VOCAB, length).tolist(),
        logprobs=(-rng.uniform(0.5, 4.0, length)).tolist(),
        versions=[0] * length,
        sampled=sampled,
        interrupted=forced_at is not None,
        truncated=False,
        num_think_tokens=0,
        num_answer_tokens=0,
        finish_reason="stop",
        think_budget=-1,
    )


def _groups(seed=0):
    """5 prompts x 3 completions (15 of 16 rows; one padding row), completion lengths from 1 to
    58 tokens, prompts of 2-6 tokens; prompt 3's rewards are all equal (zero variance, dropped).
    Behaviour log-probs are random, so some importance ratios are far from 1 (clipping)."""
    rng = np.random.default_rng(seed)
    lengths = [[58, 3, 20], [1, 40, 9], [31, 30, 2], [12, 50, 5], [7, 25, 44]]
    rewards = [[1, -1, 1], [-1, -1, 1], [1, -1, -1], [1, 1, 1], [-1, 1, 1]]
    groups = []
    for g, (lens, rew) in enumerate(zip(lengths, rewards)):
        prompt = tuple(rng.integers(1, VOCAB, 2 + g).tolist())
        completions = tuple(_completion(rng, n, forced_at=(n // 2 if n > 10 and g % 2 else None)) for n in lens)
        groups.append(
            Group(g, Prompt(g, prompt), admit_version=0, completions=completions, rewards=np.asarray(rew, np.float32))
        )
    return groups


ROWS, MICROBATCHES = 16, 4
BUCKETS = (8, 16, 40, 64)


@pytest.fixture(scope="module")
def model_parts():
    config = small_llama(VOCAB)
    return nnx.split(Transformer(config, rngs=nnx.Rngs(0)))


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _run(graphdef, params, step_config, batch, *, mesh=None):
    optimizer = make_optimizer(OPTIMIZER)
    if mesh is None:
        state, shardings = create_train_state(_copy(params), optimizer), None
    else:
        state, shardings = init_train_state(_copy(params), optimizer, mesh=mesh)
    step = make_train_step(graphdef, optimizer, step_config, mesh=mesh, state_shardings=shardings)
    new_state, metrics = step(state, batch)
    return step, new_state, {k: float(v) for k, v in jax.device_get(metrics).items()}


def _in_loss(batch):
    """Rows of an unsorted batch that the loss sees: valid, with a loss token."""
    return batch["sample_valid"] & batch["loss_mask"].any(1)


def _permuted(batch, sorted_batch):
    """The unsorted batch with its rows in the sorted batch's dealt order (row p M + m holds row p
    of sorted microbatch m), found by matching the tokens; the sorted layout's empty rows are the
    unsorted rows outside the loss (a zero-variance group's, padding), in index order."""
    rows = {tuple(np.trim_zeros(r, "b")): i for i, r in enumerate(batch["tokens"]) if r.any()}
    _, microbatches = split_sorted_batch(sorted_batch, MICROBATCHES)
    order = np.zeros(ROWS, int)
    padding = iter(np.flatnonzero(~_in_loss(batch)))
    for m, microbatch in enumerate(microbatches):
        for p, r in enumerate(microbatch["tokens"]):
            order[p * MICROBATCHES + m] = rows[tuple(np.trim_zeros(r, "b"))] if r.any() else next(padding)
    return {name: array[order] for name, array in batch.items()}


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


# Fast cases: cispo with prompt and a clipped objective with token aggregation; sample
# aggregation and the other objectives run with -m slow (each case compiles 7 programs).
CASES = [
    ("cispo", "prompt", "batch"),
    ("dapo", "token", "batch"),
    pytest.param("cispo", "sample", "prompt", marks=pytest.mark.slow),
    pytest.param("grpo", "prompt", "none", marks=pytest.mark.slow),
    pytest.param("gspo", "sample", "batch", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("objective,aggregation,normalization", CASES)
def test_sorted_step_equals_unsorted_step(model_parts, objective, aggregation, normalization):
    graphdef, params = model_parts
    groups = _groups()
    batch, info = build_train_batch(groups, rows=ROWS, length_buckets=BUCKETS)
    sorted_batch, sorted_info = build_train_batch(groups, rows=ROWS, length_buckets=BUCKETS, microbatches=MICROBATCHES)
    eps = (0.1, 0.1) if objective == "grpo" else (None, None)
    config = TrainStepConfig(
        objective=objective,
        aggregation=aggregation,
        advantage_normalization=normalization,
        eps_low=eps[0],
        eps_high=eps[1],
        num_microbatches=MICROBATCHES,
        temperature=TEMPERATURE,
        logprob_chunk_size=16,
    )
    sorted_config = dataclasses.replace(config, sort_by_length=True)
    step, want_state, want = _run(graphdef, params, config, batch)
    sorted_step, got_state, got = _run(graphdef, params, sorted_config, sorted_batch)
    assert isinstance(step, TrainStep) and isinstance(sorted_step, SortedTrainStep)
    assert set(got) == set(want)
    for name in want:
        if name != "train/logp_mismatch_first_mb":
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
    _assert_close(got_state.params, want_state.params)
    _assert_close(got_state.opt_state, want_state.opt_state)
    if objective == "cispo":  # the same rows in the sorted order: the same microbatch 0
        _, _, permuted = _run(graphdef, params, config, _permuted(batch, sorted_batch))
        np.testing.assert_allclose(
            got["train/logp_mismatch_first_mb"], permuted["train/logp_mismatch_first_mb"], rtol=1e-6
        )
        assert got["train/logp_mismatch_first_mb"] != pytest.approx(want["train/logp_mismatch_first_mb"])
    assert got["train/update_applied"] == 1.0 and want["train/num_loss_tokens"] > 0
    if objective in ("dapo", "grpo"):
        assert want["train/clip_frac"] > 0  # the clipped branch is exercised
    # sequence lengths in the loss, sorted: 60 50 43 35 | 34 31 22 13 | 12 6 5 4; prompt 3's
    # rows (55 17 10, zero variance) and the padding row fill the last microbatch, not computed
    assert info.padded_shapes == ((16, 64),)
    assert sorted_info.padded_shapes == ((4, 64), (4, 40), (4, 16), (4, 0))
    assert sorted_info.skipped_microbatches == 1
    assert sorted_info.padding_frac < info.padding_frac
    assert sorted_info.sampled_tokens == info.sampled_tokens


def test_a_batch_without_rows_in_the_loss_computes_no_microbatch(model_parts):
    """Every group zero-variance: the sorted step runs no microbatch, and its metrics and update
    (Adam on a zero gradient: weight decay only) are the unsorted step's, which computes them all."""
    graphdef, params = model_parts
    groups = [dataclasses.replace(g, rewards=np.ones_like(g.rewards)) for g in _groups()]
    batch, _ = build_train_batch(groups, rows=ROWS, length_buckets=BUCKETS)
    sorted_batch, info = build_train_batch(groups, rows=ROWS, length_buckets=BUCKETS, microbatches=MICROBATCHES)
    assert info.padded_shapes == ((4, 0),) * MICROBATCHES and info.padding_frac == 0.0
    config = TrainStepConfig(num_microbatches=MICROBATCHES, temperature=TEMPERATURE, logprob_chunk_size=16)
    _, want_state, want = _run(graphdef, params, config, batch)
    step, got_state, got = _run(graphdef, params, dataclasses.replace(config, sort_by_length=True), sorted_batch)
    assert step.num_traces == 3  # prepare, zeros, update
    assert want["train/num_loss_tokens"] == 0 and want["train/grad_norm"] == 0
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
    _assert_close(got_state.params, want_state.params)


def test_sorted_layout_deals_rows_like_the_unsorted_step():
    """Row p M + m of the per-row arrays is row p of microbatch m, its loss_tokens that row's mask
    sum, and the tokens are those of the unsorted batch."""
    groups = _groups()
    batch, _ = build_train_batch(groups, rows=ROWS, length_buckets=BUCKETS)
    sorted_batch, info = build_train_batch(groups, rows=ROWS, length_buckets=BUCKETS, microbatches=MICROBATCHES)
    # sequence lengths 60 5 22 | 4 43 12 | 35 34 6 | 17 55 10 | 13 31 50: 397 tokens, 315 of them
    # outside prompt 3 (zero variance), in 4 x (64 + 40 + 16) = 480 positions computed sorted
    assert info.sequence_tokens == 315
    assert info.padding_frac == pytest.approx(1 - 315 / 480)
    assert info.sequence_length == 64 and info.longest_sequence == 60
    permuted = _permuted(batch, sorted_batch)
    for name in ("rewards", "group_ids", "sample_valid"):
        np.testing.assert_array_equal(sorted_batch[name], permuted[name])
    np.testing.assert_array_equal(sorted_batch["loss_tokens"], permuted["loss_mask"].sum(1))
    in_loss = _in_loss(permuted)
    for m in range(MICROBATCHES):
        tokens = sorted_batch[sorted_batch_key("tokens", m)]
        rows = permuted["tokens"][m::MICROBATCHES]
        computed = in_loss[m::MICROBATCHES]
        np.testing.assert_array_equal(tokens[computed], rows[computed, : tokens.shape[1]])
        assert not rows[computed, tokens.shape[1] :].any()  # nothing cut off
        assert not tokens[~computed].any()  # rows outside the loss are left empty
    lengths = [(r > 0).sum() for r, counted in zip(batch["tokens"], _in_loss(batch)) if counted]
    first = sorted_batch[sorted_batch_key("tokens", 0)]
    assert sorted((first > 0).sum(1).tolist()) == sorted(lengths)[-4:]  # longest first


@pytest.mark.slow
def test_sharded_sorted_step_equals_unsharded(model_parts):
    """Mesh (data 2, fsdp 2, tensor 2): 4 rows per microbatch over 4 batch shards."""
    graphdef, params = model_parts
    sorted_batch, _ = build_train_batch(_groups(seed=1), rows=ROWS, length_buckets=BUCKETS, microbatches=MICROBATCHES)
    config = TrainStepConfig(num_microbatches=MICROBATCHES, temperature=TEMPERATURE, sort_by_length=True)
    _, want_state, want = _run(graphdef, params, config, sorted_batch)
    step, got_state, got = _run(graphdef, params, config, sorted_batch, mesh=make_mesh((2, 2, 2)))
    assert step.batch_shards == 4
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    for g, w in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_compiles_once_per_microbatch_shape(model_parts):
    """A second step on the same shapes traces nothing; a new bucket traces only the microbatch
    program once."""
    graphdef, params = model_parts
    optimizer = make_optimizer(OPTIMIZER)
    step = make_train_step(
        graphdef,
        optimizer,
        TrainStepConfig(num_microbatches=MICROBATCHES, temperature=TEMPERATURE, sort_by_length=True),
    )
    state = create_train_state(_copy(params), optimizer)
    batch, _ = build_train_batch(_groups(), rows=ROWS, length_buckets=BUCKETS, microbatches=MICROBATCHES)
    state, _ = step(state, batch)
    first = step.num_traces  # prepare, zeros, update, and microbatch shapes 64, 40, 8
    assert first == 3 + 3
    state, _ = step(state, batch)
    assert step.num_traces == first
    shorter, _ = build_train_batch(_groups()[1:], rows=ROWS, length_buckets=BUCKETS, microbatches=MICROBATCHES)
    lengths = {shorter[sorted_batch_key("tokens", m)].shape[1] for m in range(MICROBATCHES)}
    seen = {batch[sorted_batch_key("tokens", m)].shape[1] for m in range(MICROBATCHES)}
    step(state, shorter)
    # in the loss: 50 43 35 34 | 31 13 12 6 | 4 (prompt 3's rows, 3 padding rows and 4 more) | none
    assert lengths - seen == {8} and lengths & {0} == {0}
    assert step.num_traces == first + 1  # a length-0 microbatch is skipped, never traced


def test_bad_sorted_batch_names_the_key(model_parts):
    batch, _ = build_train_batch(_groups(), rows=ROWS, length_buckets=BUCKETS, microbatches=MICROBATCHES)
    with pytest.raises(ValueError, match="missing key"):
        split_sorted_batch(batch, MICROBATCHES + 1)
    bad = dict(batch)
    bad[sorted_batch_key("loss_mask", 2)] = bad[sorted_batch_key("loss_mask", 2)][:, :-1]
    with pytest.raises(ValueError, match=r"loss_mask/2"):
        split_sorted_batch(bad, MICROBATCHES)
