"""Zero-variance filtering on the host (data/zero_variance.py) against a plain-python reference."""

import numpy as np

from scalerl_jax.data.zero_variance import zero_variance_filter


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
