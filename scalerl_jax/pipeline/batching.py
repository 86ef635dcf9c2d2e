"""Groups -> the padded, static-shape train batch of `scalerl_jax.train.step` (BATCH_SPEC).

For G groups of n completions, row r = g * n + j holds prompt + completion j of group g, right
padded to a length bucket T (so a run compiles once per bucket):
  tokens[r, :P+L]            = prompt (P tokens) + completion (L tokens), 0 after
  loss_mask[r, P+i]          = 1 if completion token i was sampled (not a forced phrase token)
  behavior_logp[r, P+i]      = the sampler's log-prob of token i where loss_mask is 1, else 0
  rewards[r], group_ids[r]   = reward of completion j, g
  sample_valid[r]            = the zero-variance filter's verdict ('drop'), or True ('none');
                               rows beyond the groups (when `rows` > G n) are False padding.

Masking truncated completions (`mask_truncated=True`, the recipe's
`rl.mask_truncated_completions`): a completion cut by the token limit (`cut_by_length`) keeps
its row, reward and sample_valid, but its loss_mask and behavior_logp rows are all 0, so it sends
no gradient and leaves every aggregation denominator. Its reward still counts in its group's
mean and in the batch std of the advantages (and in the zero-variance filter): it is a genuine
sample of the policy on that prompt, and dropping it would move the baseline of the group's
other completions towards the rewards of the completions that happened to finish (as TRL's
`mask_truncated_completions`, which masks after computing advantages). Completions interrupted
and then answered (a forced end of thinking, then a stop token) are not cut by length and stay.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from scalerl_jax.data import zero_variance_filter
from scalerl_jax.pipeline.group import Group

ZERO_VARIANCE_MODES = ("drop", "none")


def power_of_two_buckets(min_length: int, max_length: int) -> tuple[int, ...]:
    """min_length, 2 min_length, 4 min_length, ... below max_length, then max_length itself."""
    if not 1 <= min_length <= max_length:
        raise ValueError(f"length buckets: need 1 <= min_length={min_length} <= max_length={max_length}")
    buckets = []
    length = min_length
    while length < max_length:
        buckets.append(length)
        length *= 2
    buckets.append(max_length)
    return tuple(buckets)


def pick_bucket(length: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= length; ValueError if the sequence is longer than every bucket."""
    for bucket in sorted(buckets):
        if bucket >= length:
            return bucket
    raise ValueError(f"train batch: a sequence of {length} tokens exceeds the largest length "
                     f"bucket {max(buckets)} (max_seq_len)")


@dataclasses.dataclass(frozen=True)
class BatchInfo:
    """Counts about one built batch (host side, for metrics)."""

    num_groups: int
    num_completions: int
    zero_variance_groups: int
    sequence_length: int  # the bucket T
    longest_sequence: int
    completion_tokens: int
    sampled_tokens: int
    interrupted: int
    truncated: int
    truncated_masked: int = 0  # completions whose tokens left the loss (`mask_truncated`)


def cut_by_length(completion) -> bool:
    """True for a completion cut by the token limit (max_new_tokens or the cache length): the
    sampler marks it truncated with finish reason 'length'. An answer-budget end or a stop token
    (with or without an interruption before it) is not a cut by length."""
    return bool(completion.truncated) and completion.finish_reason == "length"


def build_train_batch(groups: Sequence[Group], *, rows: int, length_buckets: Sequence[int],
                      zero_variance: str = "drop",
                      mask_truncated: bool = False) -> tuple[dict[str, np.ndarray], BatchInfo]:
    """The train batch dict (module docstring) and its `BatchInfo`; with `mask_truncated`, the
    completions `cut_by_length` get loss_mask 0 (module docstring)."""
    if zero_variance not in ZERO_VARIANCE_MODES:
        raise ValueError(f"zero_variance={zero_variance!r}: expected one of {ZERO_VARIANCE_MODES}")
    if not groups:
        raise ValueError("build_train_batch: no groups")
    samples = [(g_index, j, group, completion) for g_index, group in enumerate(groups)
               for j, completion in enumerate(group.completions)]
    if len(samples) > rows:
        raise ValueError(f"build_train_batch: {len(samples)} completions do not fit rows={rows}")
    longest = max(len(group.prompt.tokens) + len(c.tokens) for _, _, group, c in samples)
    length = pick_bucket(longest, length_buckets)
    tokens = np.zeros((rows, length), np.int32)
    loss_mask = np.zeros((rows, length), np.float32)
    behavior_logp = np.zeros((rows, length), np.float32)
    rewards = np.zeros((rows,), np.float32)
    group_ids = np.arange(rows, dtype=np.int32)  # padding rows: their own (empty) groups
    real = np.zeros((rows,), bool)
    truncated_masked = 0
    for row, (g_index, j, group, completion) in enumerate(samples):
        prompt = group.prompt.tokens
        start, end = len(prompt), len(prompt) + len(completion.tokens)
        sampled = np.asarray(completion.sampled, bool)
        if not (len(completion.logprobs) == len(sampled) == len(completion.tokens)):
            raise ValueError(
                f"group {group.group_id} completion {j}: tokens/logprobs/sampled lengths "
                f"{len(completion.tokens)}/{len(completion.logprobs)}/{len(sampled)} differ")
        if mask_truncated and cut_by_length(completion):
            sampled = np.zeros_like(sampled)
            truncated_masked += 1
        tokens[row, :start] = prompt
        tokens[row, start:end] = completion.tokens
        loss_mask[row, start:end] = sampled
        behavior_logp[row, start:end] = np.where(sampled, completion.logprobs, 0.0)
        rewards[row] = group.rewards[j]
        group_ids[row] = g_index
        real[row] = True
    if zero_variance == "drop":
        with jax.default_device(jax.local_devices(backend="cpu")[0]):  # host math, on this process
            sample_valid, dropped = zero_variance_filter(rewards, group_ids, valid=real)
    else:
        sample_valid, dropped = real.copy(), 0
    completions = [c for _, _, _, c in samples]
    info = BatchInfo(
        num_groups=len(groups), num_completions=len(samples), zero_variance_groups=int(dropped),
        sequence_length=length, longest_sequence=longest,
        completion_tokens=sum(len(c.tokens) for c in completions),
        sampled_tokens=int(loss_mask.sum()),
        interrupted=sum(bool(c.interrupted) for c in completions),
        truncated=sum(bool(c.truncated) for c in completions), truncated_masked=truncated_masked)
    batch = {"tokens": tokens, "loss_mask": loss_mask, "behavior_logp": behavior_logp,
             "rewards": rewards, "group_ids": group_ids, "sample_valid": np.asarray(sample_valid, bool)}
    return batch, info
