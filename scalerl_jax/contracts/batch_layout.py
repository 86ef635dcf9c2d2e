"""The train batch's layouts: the contract between the batch builder (`pipeline.batching`) and the
train step (`train.step`).

Imports numpy only, so the host-side builder depends on no device code. B rows (completions), M
microbatches of R = B / M rows each; row b of the batch is dealt to microbatch b mod M, at position
b // M (`deal_microbatches`), so that every microbatch takes rows from every batch shard.

Unsorted (`BATCH_SPEC`, `validate_batch`): one block [B, T], every row padded to one length T.

Sorted (`SORTED_ROW_SPEC`, `MICROBATCH_SPEC`, `split_sorted_batch`): the per-row arrays [B], where
row p M + m is row p of microbatch m (the deal above), and per microbatch m the token arrays
[R, T_m] under the keys `sorted_batch_key(name, m)`, each microbatch padded to its own length T_m.

A mixture-of-experts policy's batches also carry the sampler's routing (`ROUTING_KEY`, both layouts
beside the token arrays, [B, T, L_moe, k] or [R, T_m, L_moe, k]): at [b, t, l] the k experts that
MoE layer l routed input token t of row b to while the sampler generated the token after it, and
-1 where nothing was recorded (prompt tokens but the last, the final token, padding). Its dtype is
the narrowest signed integer that holds every expert index (`routing_dtype`): at 16k tokens, 48
MoE layers and k = 8 a row is 6 MB in int8, 25 MB in int32.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# name -> (rank, dtype kind) of the unsorted batch; B rows, T tokens per row.
BATCH_SPEC: dict[str, tuple[int, str]] = {
    "tokens": (2, "int"),  # prompt + completion, right padded
    "loss_mask": (2, "float"),  # 1 on sampled completion tokens
    "behavior_logp": (2, "float"),  # sampler's log-prob of tokens[:, t]; 0 where mask is 0
    "rewards": (1, "float"),
    "group_ids": (1, "int"),  # prompt index in [0, B)
    "sample_valid": (1, "bool"),  # False: padding row or dropped (zero-variance) row
}
# The sorted layout's per-row arrays [B] ...
SORTED_ROW_SPEC: dict[str, tuple[int, str]] = {
    "rewards": (1, "float"),
    "group_ids": (1, "int"),
    "sample_valid": (1, "bool"),
    "loss_tokens": (1, "float"),  # sum_t loss_mask[b, t] (sample_valid not applied)
}
# ... and its per-microbatch token arrays [R, T_m].
MICROBATCH_SPEC: dict[str, tuple[int, str]] = {
    "tokens": (2, "int"),
    "loss_mask": (2, "float"),
    "behavior_logp": (2, "float"),
}


ROUTING_KEY = "routed_experts"
ROUTING_SPEC: dict[str, tuple[int, str]] = {ROUTING_KEY: (4, "int")}


def routing_dtype(num_experts: int) -> np.dtype:
    """The narrowest signed integer dtype holding expert indices 0 .. num_experts - 1 and -1."""
    for dtype in (np.int8, np.int16, np.int32):
        if num_experts - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"routing_dtype: {num_experts} experts do not fit int32 indices")


class Routing(NamedTuple):
    """The sampler's routing in a batch (`ROUTING_KEY`): [..., moe_layers, experts_per_token]
    expert indices of a policy with `num_experts` experts per MoE layer."""

    moe_layers: int
    experts_per_token: int
    num_experts: int

    @property
    def dtype(self) -> np.dtype:
        return routing_dtype(self.num_experts)


def batch_spec(routing: Routing | None) -> dict[str, tuple[int, str]]:
    """The unsorted layout's arrays: `BATCH_SPEC`, plus `ROUTING_SPEC` with `routing`."""
    return {**BATCH_SPEC, **(ROUTING_SPEC if routing else {})}


def microbatch_spec(routing: Routing | None) -> dict[str, tuple[int, str]]:
    """The sorted layout's per-microbatch arrays: `MICROBATCH_SPEC`, plus `ROUTING_SPEC` with `routing`."""
    return {**MICROBATCH_SPEC, **(ROUTING_SPEC if routing else {})}


def shapes_by_rank(rows: int, length: int, routing: Routing | None) -> dict[int, tuple[int, ...]]:
    """The shapes of a layout's rank-1, -2 and -4 (routing) arrays for `rows` rows of `length` tokens."""
    trailing = (routing.moe_layers, routing.experts_per_token) if routing else ()
    return {1: (rows,), 2: (rows, length), 4: (rows, length, *trailing)}


def sorted_batch_key(name: str, microbatch: int) -> str:
    """Key of microbatch `microbatch`'s `name` array in a sorted-layout batch."""
    return f"{name}/{microbatch}"


def deal_microbatches(x, num_microbatches: int):
    """[B, ...] -> [M, B/M, ...] with row b in microbatch b mod M (at position b // M).

    Takes a numpy or a jax array (only its methods are used), and returns the same kind."""
    rows = x.shape[0]
    return x.reshape(rows // num_microbatches, num_microbatches, *x.shape[1:]).swapaxes(0, 1)


def _check_array(where: str, value, shape: tuple[int, ...], kind: str) -> None:
    """Raises ValueError naming `where` unless `value` is an array of `shape` and dtype `kind`."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise ValueError(f"{where}: expected an array, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{where}: shape {tuple(value.shape)}, expected {shape}")
    dtype = np.dtype(value.dtype)
    ok = {
        "int": np.issubdtype(dtype, np.integer),
        "float": np.issubdtype(dtype, np.floating),
        "bool": dtype == np.bool_,
    }[kind]
    if not ok:
        raise ValueError(f"{where}: dtype {dtype}, expected a {kind} dtype")


def validate_batch(batch: dict, routing: Routing | None = None) -> tuple[int, int]:
    """Checks names, ranks, dtypes and shapes of an unsorted train batch (with `routing`, one
    carrying the sampler's routing); returns (B, T)."""
    spec = batch_spec(routing)
    missing = sorted(set(spec) - set(batch))
    if missing:
        raise ValueError(f"train batch: missing key(s) {missing}; expected {sorted(spec)}")
    extra = sorted(set(batch) - set(spec))
    if extra:
        raise ValueError(f"train batch: unexpected key(s) {extra}; expected {sorted(spec)}")
    tokens = batch["tokens"]
    if not hasattr(tokens, "shape") or len(tokens.shape) != 2:
        raise ValueError(f"train batch['tokens']: shape {getattr(tokens, 'shape', None)}, expected [B, T]")
    rows, length = tokens.shape
    shapes = shapes_by_rank(rows, length, routing)
    for name, (rank, kind) in spec.items():
        _check_array(f"train batch[{name!r}]", batch[name], shapes[rank], kind)
    return rows, length


def split_sorted_batch(batch: dict, num_microbatches: int, routing: Routing | None = None) -> tuple[dict, list[dict]]:
    """A sorted-layout batch -> (per-row arrays [B], [microbatch m's arrays [R, T_m] for m < M]),
    after checking keys, shapes (B = M R) and dtypes; with `routing`, one carrying the sampler's
    routing."""
    spec = microbatch_spec(routing)
    keys = set(SORTED_ROW_SPEC) | {sorted_batch_key(name, m) for name in spec for m in range(num_microbatches)}
    if set(batch) != keys:
        raise ValueError(
            f"sorted train batch for {num_microbatches} microbatches: missing key(s) "
            f"{sorted(keys - set(batch))[:6]}, unexpected key(s) {sorted(set(batch) - keys)[:6]}"
        )
    rows = batch["rewards"].shape[0] if hasattr(batch["rewards"], "shape") else -1
    if rows % num_microbatches or rows < num_microbatches:
        raise ValueError(f"sorted train batch: B={rows} rows do not split into num_microbatches={num_microbatches}")
    for name, (_, kind) in SORTED_ROW_SPEC.items():
        _check_array(f"sorted train batch[{name!r}]", batch[name], (rows,), kind)
    microbatches = []
    for m in range(num_microbatches):
        tokens = batch[sorted_batch_key("tokens", m)]
        length = tokens.shape[-1] if hasattr(tokens, "shape") else -1
        shapes = shapes_by_rank(rows // num_microbatches, length, routing)
        for name, (rank, kind) in spec.items():
            key = sorted_batch_key(name, m)
            _check_array(f"sorted train batch[{key!r}]", batch[key], shapes[rank], kind)
        microbatches.append({name: batch[sorted_batch_key(name, m)] for name in spec})
    return {name: batch[name] for name in SORTED_ROW_SPEC}, microbatches
