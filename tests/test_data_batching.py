"""Zero-variance filtering and the batch assembler's drop / refill / none modes."""

import numpy as np
import pytest

from scalerl_jax.data.batching import BatchAssembler, Group, zero_variance_filter


def _reference_keep(rewards, group_ids, valid):
    """Plain-python reference: a row is kept iff its prompt's valid rewards are not all equal."""
    keep = []
    for b in range(len(rewards)):
        values = {rewards[i] for i in range(len(rewards)) if group_ids[i] == group_ids[b] and valid[i]}
        keep.append(bool(valid[b]) and len(values) > 1)
    return keep


def test_zero_variance_filter_against_reference():
    rewards = np.array([1, 1, -1, -1, 1, -1, 1, 1, -1, 1], np.float32)
    group_ids = np.array([0, 0, 1, 1, 2, 2, 3, 3, 4, 4], np.int32)
    valid = np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 0], bool)
    keep, dropped = zero_variance_filter(rewards, group_ids, valid)
    assert keep.tolist() == _reference_keep(rewards.tolist(), group_ids.tolist(), valid.tolist())
    # By hand: prompts 0 (all +1), 1 (all -1), 3 (all +1) and 4 (one valid row) have no variance.
    assert keep.tolist() == [False] * 4 + [True, True] + [False] * 4
    assert dropped == 4
    keep_all_valid, dropped_all_valid = zero_variance_filter(rewards, group_ids)
    assert dropped_all_valid == 3 and keep_all_valid[8:].tolist() == [True, True]


def _group(prompt, rewards):
    return Group(prompt_index=prompt, rewards=np.array(rewards, np.float32), payload=f"p{prompt}")


def test_drop_mode_keeps_zero_variance_groups_invalid():
    assembler = BatchAssembler(3, filter_mode="drop")
    assembler.add(_group(7, [1, -1]))
    assembler.add(_group(8, [1, 1]))
    assert not assembler.is_full()
    with pytest.raises(ValueError, match="2 of 3"):
        assembler.pop_batch()
    assembler.add(_group(9, [-1, -1, 1]))
    assembler.add(_group(10, [1, -1]))  # beyond the batch: stays for the next one
    batch = assembler.pop_batch()
    assert [g.prompt_index for g in batch.groups] == [7, 8, 9]
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 2]
    assert batch.sample_valid.tolist() == [True, True, False, False, True, True, True]
    assert batch.num_zero_variance_dropped == 1 and batch.num_groups_consumed == 3
    assert batch.metrics()["data/zero_variance_dropped"] == 1.0
    assert assembler.num_groups == 1


def test_refill_mode_discards_and_keeps_sampling():
    assembler = BatchAssembler(2, filter_mode="refill")
    for prompt, rewards in [(0, [1, 1]), (1, [1, -1]), (2, [-1, -1]), (3, [-1, -1]), (4, [-1, 1])]:
        assembler.add(_group(prompt, rewards))
    batch = assembler.pop_batch()
    assert [g.prompt_index for g in batch.groups] == [1, 4]
    assert batch.sample_valid.all()
    assert batch.num_zero_variance_dropped == 3 and batch.num_groups_consumed == 5
    assembler.add(_group(5, [1, -1]))
    assembler.add(_group(6, [-1, 1]))
    assert assembler.pop_batch().num_zero_variance_dropped == 0


def test_none_mode_keeps_everything():
    assembler = BatchAssembler(2, filter_mode="none")
    assembler.add(_group(0, [1, 1]))
    assembler.add(_group(1, [1, -1]))
    batch = assembler.pop_batch()
    assert batch.sample_valid.all() and batch.num_zero_variance_dropped == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="filter_mode"):
        BatchAssembler(2, filter_mode="resample")
    with pytest.raises(ValueError, match="prompts_per_batch"):
        BatchAssembler(0)
    with pytest.raises(ValueError, match="prompt 3 has no completions"):
        BatchAssembler(1).add(_group(3, []))
