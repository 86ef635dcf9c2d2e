"""Per-prompt (group) reductions and input checks shared by the RL loss math.

A batch holds ``B`` completions; ``group_ids[b]`` in ``[0, B)`` is the index of the prompt that
completion ``b`` answers. With at most ``B`` distinct prompts, every per-group reduction is a
segment op with the static ``num_segments=B``, so it traces once under ``jax.jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike


def check_rank(name: str, array: jax.Array, rank: int) -> None:
    """Raises ValueError naming ``name`` unless ``array`` has exactly ``rank`` dimensions."""
    if array.ndim != rank:
        raise ValueError(f"{name}: expected a rank-{rank} array, got shape {tuple(array.shape)}")


def check_same_shape(name: str, array: jax.Array, expected: tuple[int, ...], like: str) -> None:
    """Raises ValueError naming ``name`` unless ``array.shape == expected`` (the shape of ``like``)."""
    if tuple(array.shape) != tuple(expected):
        raise ValueError(f"{name}: shape {tuple(array.shape)} does not match {like} shape {tuple(expected)}")


def check_group_ids(group_ids: jax.Array, batch: int) -> None:
    """Checks ``group_ids`` is an integer vector of length ``batch`` with values in ``[0, batch)``.

    Shape and dtype are always checked. Values are checked only when the array is concrete and
    readable on this host (eager calls); under ``jax.jit`` they are traced and cannot be inspected,
    and an id outside
    ``[0, batch)`` would be dropped by the segment ops, so callers must keep the convention.
    """
    check_rank("group_ids", group_ids, 1)
    if group_ids.shape[0] != batch:
        raise ValueError(f"group_ids: length {group_ids.shape[0]} does not match batch size {batch}")
    if not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError(f"group_ids: expected an integer dtype, got {group_ids.dtype}")
    try:
        if not group_ids.is_fully_addressable:  # spread over hosts: not readable here
            return
        values = np.asarray(group_ids)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return  # traced under jit
    bad = np.flatnonzero((values < 0) | (values >= batch))
    if bad.size:
        raise ValueError(
            f"group_ids: values must lie in [0, {batch}) (prompt index inside the batch); "
            f"index {int(bad[0])} holds {int(values[bad[0]])}"
        )


def as_row_mask(name: str, valid: ArrayLike | None, batch: int) -> jax.Array:
    """Returns ``valid`` as float32[B] of 0/1 (all ones when ``valid`` is None)."""
    if valid is None:
        return jnp.ones((batch,), jnp.float32)
    valid = jnp.asarray(valid)
    check_rank(name, valid, 1)
    if valid.shape[0] != batch:
        raise ValueError(f"{name}: length {valid.shape[0]} does not match batch size {batch}")
    return (valid > 0).astype(jnp.float32)


def group_sum(values: jax.Array, group_ids: jax.Array) -> jax.Array:
    """``out[g] = sum_{b : group_ids[b] = g} values[b]`` for ``g`` in ``[0, B)``; shape [B, ...]."""
    return jax.ops.segment_sum(values, group_ids, num_segments=group_ids.shape[0])


def group_sum_per_row(values: jax.Array, group_ids: jax.Array) -> jax.Array:
    """The group sum broadcast back to rows: ``out[b] = sum_{b' in group(b)} values[b']``."""
    return group_sum(values, group_ids)[group_ids]


def safe_divide(numerator: ArrayLike, denominator: jax.Array) -> jax.Array:
    """``numerator / denominator`` where ``denominator > 0``, else 0 (no NaN, no inf, jittable).

    The denominator is replaced by 1 where it is not positive before dividing, so neither the
    value nor the gradient ever sees a division by zero.
    """
    positive = denominator > 0
    return jnp.where(positive, numerator / jnp.where(positive, denominator, 1), 0)
