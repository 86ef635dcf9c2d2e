"""DAPO's overlong reward shaping (ScaleRL Eq. 9), an alternative to forced interruption.

  R_len(|y|) = clip((L_max - |y|) / L_cache - 1, -1, 0)
             = 0                                 if |y| <= L_max - L_cache
             = (L_max - L_cache - |y|) / L_cache if L_max - L_cache < |y| <= L_max
             = -1                                if |y| > L_max

The caller adds it to the reward of correct answers (ScaleRL: L_max 14k, L_cache 2k).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

LENGTH_CONTROLS = ("interruption", "length_penalty", "none")  # `rl.length_control`: forced interruption, Eq. 9, neither


def length_penalty(lengths: ArrayLike, *, l_max: float, l_cache: float) -> jax.Array:
    """float32 penalty in [-1, 0] per completion length (same shape as ``lengths``).

    Raises ValueError unless ``l_cache > 0`` and ``l_max >= l_cache``.
    """
    if not l_cache > 0:
        raise ValueError(f"l_cache: must be > 0, got {l_cache}")
    if l_max < l_cache:
        raise ValueError(f"l_max: must be >= l_cache ({l_cache}), got {l_max}")
    lengths = jnp.asarray(lengths).astype(jnp.float32)
    return jnp.clip((l_max - lengths) / l_cache - 1.0, -1.0, 0.0)
