"""Zero-variance filtering of a batch on the host.

A prompt whose completions all got the same reward has zero advantage everywhere and carries no
policy-gradient signal; ScaleRL keeps its rows in the batch with ``sample_valid = False`` (they
leave the loss) and does not refill the batch. The number of prompts filtered out is reported.
"""

from __future__ import annotations

import numpy as np

from scalerl_jax.rl import zero_variance_mask


def zero_variance_filter(
    rewards: np.ndarray, group_ids: np.ndarray, valid: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """``(keep, num_dropped_prompts)`` from ``scalerl_jax.rl.zero_variance_mask``.

    ``keep[b]`` is True where ``b``'s prompt has unequal rewards among its valid completions;
    ``num_dropped_prompts`` counts prompts with at least one valid completion and none kept.
    """
    rewards = np.asarray(rewards, np.float32)
    group_ids = np.asarray(group_ids, np.int32)
    valid_rows = np.ones(rewards.shape, bool) if valid is None else np.asarray(valid, bool)
    keep = np.asarray(zero_variance_mask(rewards, group_ids, valid=valid_rows))
    present = set(group_ids[valid_rows].tolist())
    kept = set(group_ids[keep].tolist())
    return keep, len(present - kept)
