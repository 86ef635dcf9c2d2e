"""Groups -> the padded, static-shape train batch, in a layout of `scalerl_jax.contracts.batch_layout`.

Two layouts. Unsorted (`BATCH_SPEC`): one [rows, T] batch, every row padded to the length bucket
T of the longest sequence. Sorted into M microbatches (`microbatches=M`, the step's
`sort_by_length`; layout in `batch_layout.split_sorted_batch`): rows sorted by length (longest
first), cut into M chunks of R = rows / M, each padded only to its own bucket T_m; see
`plan_sorted_microbatches`. With finer buckets (`octave_buckets`) this removes most padding of a
long-tailed length distribution while the loss and gradient stay those of the unsorted batch.

For G groups of n completions, sample s = g * n + j holds prompt + completion j of group g, right
padded to a length bucket T (so a run compiles once per bucket); in the unsorted layout sample s
is row s:
  tokens[r, :P+L]            = prompt (P tokens) + completion (L tokens), 0 after
  loss_mask[r, P+i]          = 1 if completion token i was sampled (not a forced phrase token)
  behavior_logp[r, P+i]      = the sampler's log-prob of token i where loss_mask is 1, else 0
  rewards[r], group_ids[r]   = reward of completion j, g
  sample_valid[r]            = the zero-variance filter's verdict ('drop'), or True ('none');
                               rows beyond the groups (when `rows` > G n) are False padding.
and for a mixture-of-experts policy (`routing`), the sampler's routing (`batch_layout.ROUTING_KEY`):
  routed_experts[r, P-1+i]   = the experts the completion recorded for token i (those the input
                               producing it was routed to: the last prompt token, then token i-1);
                               -1 elsewhere (earlier prompt tokens, the last token, padding).

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
from collections.abc import Sequence

import jax
import numpy as np

from scalerl_jax.contracts.batch_layout import ROUTING_KEY, Routing, sorted_batch_key
from scalerl_jax.data import zero_variance_filter
from scalerl_jax.pipeline.group import Group

ZERO_VARIANCE_MODES = ("drop", "none")
# The shortest length bucket of a train batch (or the longest sequence, if shorter).
MIN_LENGTH_BUCKET = 32


def octave_buckets(min_length: int, max_length: int, per_octave: int = 1) -> tuple[int, ...]:
    """Length buckets `per_octave` to an octave: each octave [s, 2s) with s = min_length 2^k holds
    s + i ceil(s / per_octave) for i = 0 .. per_octave - 1, every bucket below max_length is
    kept, then max_length itself. A sequence of length L > min_length is padded by less than
    ceil(s / per_octave) <= L / per_octave (+1) tokens, so under 1 / per_octave of its bucket;
    there are at most per_octave * ceil(log2(max_length / min_length)) + 1 buckets. per_octave=1:
    min_length, 2 min_length, 4 min_length, ... then max_length."""
    if not 1 <= min_length <= max_length:
        raise ValueError(f"length buckets: need 1 <= min_length={min_length} <= max_length={max_length}")
    if per_octave < 1:
        raise ValueError(f"length buckets: per_octave={per_octave} must be >= 1")
    buckets = []
    start = min_length
    while start < max_length:
        step = -(-start // per_octave)
        buckets.extend(length for length in range(start, 2 * start, step) if length < max_length)
        start *= 2
    buckets.append(max_length)
    return tuple(sorted(set(buckets)))


def power_of_two_buckets(min_length: int, max_length: int) -> tuple[int, ...]:
    """min_length, 2 min_length, 4 min_length, ... below max_length, then max_length itself."""
    return octave_buckets(min_length, max_length, 1)


def pick_bucket(length: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= length; ValueError if the sequence is longer than every bucket."""
    for bucket in sorted(buckets):
        if bucket >= length:
            return bucket
    raise ValueError(
        f"train batch: a sequence of {length} tokens exceeds the largest length bucket {max(buckets)} (max_seq_len)"
    )


@dataclasses.dataclass(frozen=True)
class MicrobatchPlan:
    """Rows sorted into microbatches: row p of microbatch m is sample `order[m, p]` (an index into
    the batch's samples, padding rows included), padded to `lengths[m]` tokens."""

    order: np.ndarray  # int [M, R]
    lengths: tuple[int, ...]  # T_m, one bucket per microbatch

    @property
    def padded_tokens(self) -> int:
        """Token positions the step computes: sum over microbatches of R T_m."""
        return int(self.order.shape[1] * sum(self.lengths))


def plan_sorted_microbatches(
    lengths: Sequence[int] | np.ndarray,
    num_microbatches: int,
    length_buckets: Sequence[int],
    contributes: Sequence[bool] | np.ndarray | None = None,
) -> MicrobatchPlan:
    """Samples sorted by length, longest first (ties by index), cut into `num_microbatches`
    chunks of R = B / M consecutive samples; chunk m is padded to the smallest bucket >= its
    longest sample. Sorting makes the rows of a chunk nearly equal in length, so the padding is
    mostly the bucket's rounding.

    `contributes[s]` False (default: all True) marks a sample that adds nothing to the loss, its
    gradient or any of the step's sums (a zero-variance group's, a padding row, a row without
    loss tokens): such samples go last, in index order, as length 0, so a chunk's bucket is
    that of its longest contributing sample and a chunk of none has length 0 (the step skips it).
    """
    sizes = np.asarray(lengths, np.int64)
    rows = len(sizes)
    if num_microbatches < 1 or rows % num_microbatches:
        raise ValueError(f"sorted microbatches: B={rows} rows do not split into num_microbatches={num_microbatches}")
    counted = np.ones(rows, bool) if contributes is None else np.asarray(contributes, bool)
    sizes = np.where(counted, sizes, 0)
    # np.lexsort's last key is the primary one: contributing first, then longest, then by index
    order = np.lexsort((np.arange(rows), -sizes, ~counted)).reshape(num_microbatches, rows // num_microbatches)
    return MicrobatchPlan(
        order=order,
        lengths=tuple(
            pick_bucket(int(max(sizes[chunk].max(), 1)), length_buckets) if counted[chunk].any() else 0
            for chunk in order
        ),
    )


def padding_fraction(lengths: Sequence[int] | np.ndarray, padded_tokens: int) -> float:
    """1 - (sum of the sequence lengths) / (token positions computed): the share of padding."""
    return 1.0 - float(np.sum(lengths)) / padded_tokens


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
    # (rows, T) of every padded block: ((B, T),) unsorted, ((R, T_m), ...) sorted (T_m 0: skipped)
    padded_shapes: tuple[tuple[int, int], ...] = ()
    sequence_tokens: int = 0  # prompt + completion tokens of the samples the step computes (no padding)

    @property
    def skipped_microbatches(self) -> int:
        """Microbatches of the sorted layout with no contributing row: length 0, not computed."""
        return sum(1 for _, length in self.padded_shapes if length == 0)

    @property
    def padding_frac(self) -> float:
        """Share of the computed token positions that are padding (0 when nothing is computed)."""
        computed = sum(r * t for r, t in self.padded_shapes)
        return padding_fraction([self.sequence_tokens], computed) if computed else 0.0


def cut_by_length(completion) -> bool:
    """True for a completion cut by the token limit (max_new_tokens or the cache length): the
    sampler marks it truncated with finish reason 'length'. An answer-budget end or a stop token
    (with or without an interruption before it) is not a cut by length."""
    return bool(completion.truncated) and completion.finish_reason == "length"


@dataclasses.dataclass(frozen=True)
class _Sample:
    """One completion as a token row: prompt + completion, its loss mask and behaviour log-probs,
    and (MoE) the sampler's routing [tokens, MoE layers, k], -1 where none was recorded."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    behavior_logp: np.ndarray
    routed_experts: np.ndarray | None = None


def routing_row(completion, prompt_length: int, routing: Routing, where: str) -> np.ndarray:
    """[P + n, MoE layers, k] in `routing.dtype`: the completion's recorded experts of its n tokens
    at positions P-1 .. P+n-2 (module docstring), -1 elsewhere; ValueError naming `where` when the
    completion's record has another shape."""
    length = prompt_length + len(completion.tokens)
    row = np.full((length, routing.moe_layers, routing.experts_per_token), -1, routing.dtype)
    recorded = completion.routed_experts
    want = (len(completion.tokens), routing.moe_layers, routing.experts_per_token)
    if recorded is None or tuple(recorded.shape) != want:
        got = None if recorded is None else tuple(recorded.shape)
        raise ValueError(f"{where}: routed_experts of shape {got}, expected {want} (tokens, MoE layers, k)")
    row[prompt_length - 1 : length - 1] = recorded
    return row


def _pad_rows(samples: Sequence[_Sample | None], length: int, routing: Routing | None) -> dict[str, np.ndarray]:
    """tokens / loss_mask / behavior_logp [len(samples), length] (and with `routing`,
    routed_experts [len(samples), length, MoE layers, k]), right padded (None: all 0, routing -1)."""
    arrays = {
        "tokens": np.zeros((len(samples), length), np.int32),
        "loss_mask": np.zeros((len(samples), length), np.float32),
        "behavior_logp": np.zeros((len(samples), length), np.float32),
    }
    if routing is not None:
        shape = (len(samples), length, routing.moe_layers, routing.experts_per_token)
        arrays[ROUTING_KEY] = np.full(shape, -1, routing.dtype)
    for row, sample in enumerate(samples):
        if sample is not None:
            for name, array in arrays.items():
                values = getattr(sample, name)
                array[row, : len(values)] = values
    return arrays


def build_train_batch(
    groups: Sequence[Group],
    *,
    rows: int,
    length_buckets: Sequence[int],
    zero_variance: str = "drop",
    mask_truncated: bool = False,
    microbatches: int | None = None,
    routing: Routing | None = None,
) -> tuple[dict[str, np.ndarray], BatchInfo]:
    """The train batch dict (module docstring) and its `BatchInfo`; with `mask_truncated`, the
    completions `cut_by_length` get loss_mask 0 (module docstring); with `routing`, the sampler's
    routing, which every completion must carry.

    `microbatches` None: the unsorted layout (`batch_layout.BATCH_SPEC`), [rows, T] with T the
    bucket of the longest sequence. `microbatches` M: the sorted layout of
    `batch_layout.split_sorted_batch`, laid out by `plan_sorted_microbatches`: row p of microbatch m
    is sample order[m, p], and the per-row arrays (rewards, group_ids, sample_valid, loss_tokens)
    hold it at row p M + m, so that each microbatch takes rows from every batch shard as the
    unsorted step's deal (row b in microbatch b mod M) does.
    """
    if zero_variance not in ZERO_VARIANCE_MODES:
        raise ValueError(f"zero_variance={zero_variance!r}: expected one of {ZERO_VARIANCE_MODES}")
    if not groups:
        raise ValueError("build_train_batch: no groups")
    samples = [
        (g_index, j, group, completion)
        for g_index, group in enumerate(groups)
        for j, completion in enumerate(group.completions)
    ]
    if len(samples) > rows:
        raise ValueError(f"build_train_batch: {len(samples)} completions do not fit rows={rows}")
    sequences: list[_Sample | None] = [None] * rows
    lengths = np.zeros((rows,), np.int64)
    rewards = np.zeros((rows,), np.float32)
    group_ids = np.arange(rows, dtype=np.int32)  # padding rows: their own (empty) groups
    real = np.zeros((rows,), bool)
    truncated_masked = 0
    for index, (g_index, j, group, completion) in enumerate(samples):
        sampled = np.asarray(completion.sampled, bool)
        if not (len(completion.logprobs) == len(sampled) == len(completion.tokens)):
            raise ValueError(
                f"group {group.group_id} completion {j}: tokens/logprobs/sampled lengths "
                f"{len(completion.tokens)}/{len(completion.logprobs)}/{len(sampled)} differ"
            )
        if mask_truncated and cut_by_length(completion):
            sampled = np.zeros_like(sampled)
            truncated_masked += 1
        prompt = np.asarray(group.prompt.tokens, np.int32)
        no_loss = np.zeros(len(prompt), np.float32)
        where = f"group {group.group_id} completion {j}"
        sequences[index] = _Sample(
            tokens=np.concatenate([prompt, np.asarray(completion.tokens, np.int32)]),
            loss_mask=np.concatenate([no_loss, sampled.astype(np.float32)]),
            behavior_logp=np.concatenate([no_loss, np.where(sampled, completion.logprobs, 0.0)]),
            routed_experts=None if routing is None else routing_row(completion, len(prompt), routing, where),
        )
        lengths[index] = len(prompt) + len(completion.tokens)
        rewards[index] = group.rewards[j]
        group_ids[index] = g_index
        real[index] = True
    if zero_variance == "drop":
        with jax.default_device(jax.local_devices(backend="cpu")[0]):  # host math, on this process
            sample_valid, dropped = zero_variance_filter(rewards, group_ids, valid=real)
    else:
        sample_valid, dropped = real.copy(), 0
    sample_valid = np.asarray(sample_valid, bool)
    if microbatches is None:
        length = pick_bucket(int(lengths.max()), length_buckets)
        batch = {
            **_pad_rows(sequences, length, routing),
            "rewards": rewards,
            "group_ids": group_ids,
            "sample_valid": sample_valid,
        }
        padded_shapes = ((rows, length),)
        sampled_tokens = int(batch["loss_mask"].sum())
        sequence_tokens = int(lengths.sum())
    else:
        batch, padded_shapes, sequence_tokens = _sorted_layout(
            sequences,
            lengths,
            microbatches,
            length_buckets,
            {"rewards": rewards, "group_ids": group_ids, "sample_valid": sample_valid},
            routing,
        )
        sampled_tokens = int(batch["loss_tokens"].sum())
    completions = [c for _, _, _, c in samples]
    info = BatchInfo(
        num_groups=len(groups),
        num_completions=len(samples),
        zero_variance_groups=int(dropped),
        sequence_length=max(t for _, t in padded_shapes),
        longest_sequence=int(lengths.max()),
        completion_tokens=sum(len(c.tokens) for c in completions),
        sampled_tokens=sampled_tokens,
        interrupted=sum(bool(c.interrupted) for c in completions),
        truncated=sum(bool(c.truncated) for c in completions),
        truncated_masked=truncated_masked,
        padded_shapes=padded_shapes,
        sequence_tokens=sequence_tokens,
    )
    return batch, info


def _sorted_layout(
    sequences: Sequence[_Sample | None],
    lengths: np.ndarray,
    microbatches: int,
    length_buckets: Sequence[int],
    per_row: dict[str, np.ndarray],
    routing: Routing | None,
) -> tuple[dict[str, np.ndarray], tuple[tuple[int, int], ...], int]:
    """The sorted layout (`build_train_batch`), its padded (R, T_m) shapes and the tokens of the
    samples it computes. A sample that contributes nothing (not `sample_valid`, or no loss
    token) keeps its per-row entries, but its microbatch row is left empty (all 0, as a padding
    row), and a microbatch of such rows only has length 0 (`plan_sorted_microbatches`)."""
    loss_tokens = np.asarray([0.0 if s is None else float(s.loss_mask.sum()) for s in sequences], np.float32)
    contributes = per_row["sample_valid"] & (loss_tokens > 0)
    plan = plan_sorted_microbatches(lengths, microbatches, length_buckets, contributes)
    dealt = plan.order.T.reshape(-1)  # row p M + m <- sample order[m, p]: batch_layout's deal
    batch = {name: array[dealt] for name, array in {**per_row, "loss_tokens": loss_tokens}.items()}
    for m, (chunk, length) in enumerate(zip(plan.order, plan.lengths)):
        computed = [sequences[i] if contributes[i] else None for i in chunk]
        for name, array in _pad_rows(computed, length, routing).items():
            batch[sorted_batch_key(name, m)] = array
    shapes = tuple((len(chunk), length) for chunk, length in zip(plan.order, plan.lengths))
    return batch, shapes, int(lengths[contributes].sum())
