"""Groups -> padded train batch (pipeline/batching.py), checked against arrays written out by hand."""

import dataclasses

import numpy as np
import pytest

from scalerl_jax.contracts.batch_layout import ROUTING_KEY, Routing, routing_dtype, split_sorted_batch, validate_batch
from scalerl_jax.pipeline.batching import build_train_batch, cut_by_length, pick_bucket, power_of_two_buckets
from scalerl_jax.pipeline.group import Group, Prompt, lags
from scalerl_jax.sampler import Completion


def completion(tokens, logprobs, sampled, versions, *, interrupted=False, truncated=False, finish_reason="stop"):
    return Completion(
        request_id=None,
        prompt_tokens=[],
        tokens=list(tokens),
        logprobs=list(logprobs),
        versions=list(versions),
        sampled=list(sampled),
        interrupted=interrupted,
        truncated=truncated,
        num_think_tokens=0,
        num_answer_tokens=0,
        finish_reason=finish_reason,
        think_budget=-1,
    )


def two_groups():
    # group 0: prompt [5, 6], rewards differ; completion 1 has a forced token (sampled False).
    g0 = Group(
        0,
        Prompt("a", (5, 6)),
        admit_version=3,
        rewards=np.array([1.0, -1.0], np.float32),
        completions=(
            completion([7, 8], [-0.5, -0.25], [True, True], [3, 4]),
            completion([9, 10, 11], [-1.0, 0.0, -2.0], [True, False, True], [4, 4, 5], interrupted=True),
        ),
    )
    # group 1: prompt [1], both rewards equal -> zero variance.
    g1 = Group(
        1,
        Prompt("b", (1,)),
        admit_version=4,
        rewards=np.array([-1.0, -1.0], np.float32),
        completions=(
            completion([2], [-0.125], [True], [4]),
            completion([3, 4, 5, 6], [-1.0, -1.0, -1.0, -1.0], [True] * 4, [5, 5, 5, 6], truncated=True),
        ),
    )
    return [g0, g1]


def test_batch_arrays_by_hand():
    batch, info = build_train_batch(two_groups(), rows=6, length_buckets=(4, 8, 16))
    # longest row: prompt 1 + completion 4 = 5, or 2 + 3 = 5 -> bucket 8
    np.testing.assert_array_equal(
        batch["tokens"],
        [
            [5, 6, 7, 8, 0, 0, 0, 0],
            [5, 6, 9, 10, 11, 0, 0, 0],
            [1, 2, 0, 0, 0, 0, 0, 0],
            [1, 3, 4, 5, 6, 0, 0, 0],
            [0] * 8,
            [0] * 8,
        ],
    )
    np.testing.assert_array_equal(
        batch["loss_mask"],
        [
            [0, 0, 1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 1, 0, 0, 0],
            [0, 1, 0, 0, 0, 0, 0, 0],
            [0, 1, 1, 1, 1, 0, 0, 0],
            [0] * 8,
            [0] * 8,
        ],
    )
    np.testing.assert_array_equal(
        batch["behavior_logp"],
        [
            [0, 0, -0.5, -0.25, 0, 0, 0, 0],
            [0, 0, -1.0, 0.0, -2.0, 0, 0, 0],
            [0, -0.125, 0, 0, 0, 0, 0, 0],
            [0, -1.0, -1.0, -1.0, -1.0, 0, 0, 0],
            [0] * 8,
            [0] * 8,
        ],
    )
    np.testing.assert_array_equal(batch["rewards"], [1, -1, -1, -1, 0, 0])
    np.testing.assert_array_equal(batch["group_ids"], [0, 0, 1, 1, 4, 5])
    # group 1 has zero variance, rows 4-5 are padding
    np.testing.assert_array_equal(batch["sample_valid"], [True, True, False, False, False, False])
    assert validate_batch(batch) == (6, 8)
    assert (info.num_groups, info.num_completions, info.zero_variance_groups) == (2, 4, 1)
    assert (info.sequence_length, info.longest_sequence) == (8, 5)
    assert (info.completion_tokens, info.sampled_tokens) == (10, 9)
    assert (info.interrupted, info.truncated) == (1, 1)


def test_no_filter_keeps_every_real_row():
    batch, info = build_train_batch(two_groups(), rows=4, length_buckets=(8,), zero_variance="none")
    np.testing.assert_array_equal(batch["sample_valid"], [True] * 4)
    assert info.zero_variance_groups == 0


def mixed_endings_group():
    """Prompt [5]; completion 0 cut by the token limit (truncated, 'length'), completion 1
    interrupted (forced token 9, sampled False) then answered with a stop token, completion 2 a
    plain stop. Rewards differ, so no row is zero-variance."""
    return Group(
        0,
        Prompt("p", (5,)),
        admit_version=0,
        rewards=np.array([0.0, 1.0, 0.5], np.float32),
        completions=(
            completion([1, 2, 3], [-0.5, -0.5, -0.5], [True] * 3, [0] * 3, truncated=True, finish_reason="length"),
            completion([4, 9, 6], [-0.25, 0.0, -0.75], [True, False, True], [0] * 3, interrupted=True),
            completion([7, 8], [-1.0, -2.0], [True, True], [0, 0]),
        ),
    )


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_mask_truncated_drops_only_completions_cut_by_length(mask_truncated):
    batch, info = build_train_batch([mixed_endings_group()], rows=4, length_buckets=(4,), mask_truncated=mask_truncated)
    truncated_row = [0, 0, 0, 0] if mask_truncated else [0, 1, 1, 1]
    np.testing.assert_array_equal(batch["loss_mask"], [truncated_row, [0, 1, 0, 1], [0, 1, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(
        batch["behavior_logp"], [np.multiply(truncated_row, -0.5), [0, -0.25, 0, -0.75], [0, -1.0, -2.0, 0], [0] * 4]
    )
    # the truncated row stays valid: its reward keeps its place in the group's baseline.
    np.testing.assert_array_equal(batch["sample_valid"], [True, True, True, False])
    np.testing.assert_array_equal(batch["tokens"][0], [5, 1, 2, 3])
    assert info.truncated_masked == (1 if mask_truncated else 0)
    assert (info.truncated, info.interrupted) == (1, 1)
    assert info.sampled_tokens == (4 if mask_truncated else 7)


def test_cut_by_length():
    assert cut_by_length(completion([1], [0.0], [True], [0], truncated=True, finish_reason="length"))
    assert not cut_by_length(completion([1], [0.0], [True], [0], interrupted=True))
    assert not cut_by_length(completion([1], [0.0], [True], [0], truncated=True, finish_reason="answer_budget"))


def test_versions_and_lags():
    g0, g1 = two_groups()
    assert g0.first_versions == [3, 4] and g0.last_versions == [4, 5]
    np.testing.assert_array_equal(lags([g0, g1], 6), [3, 2, 2, 1])


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="exceeds the largest length bucket 4"):
        build_train_batch(two_groups(), rows=4, length_buckets=(4,))
    with pytest.raises(ValueError, match="do not fit rows=3"):
        build_train_batch(two_groups(), rows=3, length_buckets=(8,))
    with pytest.raises(ValueError, match="group 9: 1 rewards for 2 completions"):
        Group(9, Prompt("c", (1,)), 0, rewards=np.array([1.0], np.float32), completions=two_groups()[0].completions)
    bad = completion([1, 2], [-1.0], [True, True], [0, 0])
    with pytest.raises(ValueError, match="group 2 completion 0: tokens/logprobs/sampled"):
        build_train_batch(
            [Group(2, Prompt("d", (1,)), 0, rewards=np.array([0.0], np.float32), completions=(bad,))],
            rows=1,
            length_buckets=(8,),
        )


# One MoE layer, k = 2 of 4 experts: int8 in the batch.
ROUTING = Routing(moe_layers=1, experts_per_token=2, num_experts=4)


def routed_groups():
    """`two_groups` with each completion's recorded experts: token i of completion c of group g
    recorded as the pair [g, 10 c + i] (not real expert ids: only their places are checked)."""
    groups = []
    for g, group in enumerate(two_groups()):
        completions = tuple(
            dataclasses.replace(
                c, routed_experts=np.asarray([[[g, 10 * j + i]] for i in range(len(c.tokens))], np.int32)
            )
            for j, c in enumerate(group.completions)
        )
        groups.append(dataclasses.replace(group, completions=completions))
    return groups


def test_routing_dtype_holds_every_expert_id_and_minus_one():
    """Expert ids 0 .. E-1 and -1: int8 up to E = 128 (ids <= 127), int16 up to 32768."""
    assert [routing_dtype(e) for e in (1, 128, 129, 32768, 32769)] == [np.int8, np.int8, np.int16, np.int16, np.int32]


def test_routing_by_hand():
    """Completion token i was produced from the input at position P-1+i: its record goes there;
    the earlier prompt tokens, the last token and padding hold -1."""
    batch, _ = build_train_batch(routed_groups(), rows=6, length_buckets=(8,), routing=ROUTING)
    validate_batch(batch, ROUTING)
    routed = batch[ROUTING_KEY]
    assert routed.dtype == np.int8 and routed.shape == (6, 8, 1, 2)
    none = [-1, -1]
    want = [
        [none, [0, 0], [0, 1], none, none, none, none, none],  # prompt [5, 6] + [7, 8]
        [none, [0, 10], [0, 11], [0, 12], none, none, none, none],  # prompt [5, 6] + [9, 10, 11]
        [[1, 0], none, none, none, none, none, none, none],  # prompt [1] + [2]
        [[1, 10], [1, 11], [1, 12], [1, 13], none, none, none, none],  # prompt [1] + [3, 4, 5, 6]
        [none] * 8,
        [none] * 8,
    ]
    np.testing.assert_array_equal(routed[:, :, 0], want)


def test_sorted_layout_carries_each_rows_routing():
    """Each microbatch row's routing is its sample's (as in the unsorted layout, cut to T_m); the
    rows that add nothing (group 1 has zero variance) are empty, routing -1 included."""
    unsorted, _ = build_train_batch(routed_groups(), rows=4, length_buckets=(4, 8), routing=ROUTING)
    batch, info = build_train_batch(routed_groups(), rows=4, length_buckets=(4, 8), microbatches=2, routing=ROUTING)
    _, microbatches = split_sorted_batch(batch, 2, ROUTING)
    seen = 0
    for microbatch, (_, length) in zip(microbatches, info.padded_shapes):
        for tokens, routed in zip(microbatch["tokens"], microbatch[ROUTING_KEY]):
            if not tokens.any():
                assert (routed == -1).all()
                continue
            (sample,) = [b for b in range(4) if (unsorted["tokens"][b, :length] == tokens).all()]
            np.testing.assert_array_equal(routed, unsorted[ROUTING_KEY][sample, :length])
            seen += 1
    assert seen == 2  # group 0's two completions


def test_routing_of_another_shape_is_refused_naming_the_completion():
    groups = routed_groups()
    with pytest.raises(
        ValueError, match=r"group 0 completion 0: routed_experts of shape \(2, 1, 2\), expected \(2, 2, 2\)"
    ):
        build_train_batch(groups, rows=4, length_buckets=(8,), routing=ROUTING._replace(moe_layers=2))
    dense = [dataclasses.replace(g, completions=two_groups()[i].completions) for i, g in enumerate(groups)]
    with pytest.raises(ValueError, match="group 0 completion 0: routed_experts of shape None"):
        build_train_batch(dense, rows=4, length_buckets=(8,), routing=ROUTING)


def test_buckets():
    assert power_of_two_buckets(128, 1000) == (128, 256, 512, 1000)
    assert power_of_two_buckets(64, 64) == (64,)
    assert pick_bucket(129, (128, 256)) == 256 and pick_bucket(128, (128, 256)) == 128
