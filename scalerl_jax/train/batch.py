"""A synthetic train batch with the real layout, for benchmarks and smoke runs."""

from __future__ import annotations

import numpy as np


def synthetic_train_batch(
    *, batch_size: int, seq_len: int, prompt_len: int, vocab_size: int, group_size: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random tokens; loss mask on [prompt_len, seq_len); rewards +1/-1 alternating inside each group
    of `group_size` consecutive rows (so no group is zero-variance when group_size > 1); behaviour
    log-probs drawn from N(-2, 0.5^2) on loss tokens, 0 elsewhere; all rows valid."""
    if not 0 <= prompt_len < seq_len:
        raise ValueError(f"synthetic_train_batch: prompt_len={prompt_len} must be in [0, {seq_len})")
    if group_size < 1 or batch_size % group_size:
        raise ValueError(
            f"synthetic_train_batch: batch_size={batch_size} must be a multiple of group_size={group_size}"
        )
    rng = np.random.default_rng(seed)
    mask = np.zeros((batch_size, seq_len), np.float32)
    mask[:, prompt_len:] = 1.0
    rows = np.arange(batch_size)
    return {
        "tokens": rng.integers(0, vocab_size, (batch_size, seq_len)).astype(np.int32),
        "loss_mask": mask,
        "behavior_logp": (mask * rng.normal(-2.0, 0.5, (batch_size, seq_len))).astype(np.float32),
        "rewards": np.where(rows % 2 == 0, 1.0, -1.0).astype(np.float32),
        "group_ids": (rows // group_size).astype(np.int32),
        "sample_valid": np.ones(batch_size, bool),
    }
