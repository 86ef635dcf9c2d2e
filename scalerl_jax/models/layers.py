"""Decoder building blocks: RMSNorm, RoPE (with Llama 3.1 scaling), GQA attention (full or chunked
local, with or without RoPE, Llama 4's QK norm and attention temperature), SwiGLU MLP.

Parameters carry logical axis names as NNX metadata (`out_sharding`). A block built with
`stack=L` holds L layers' parameters stacked on a leading `'layers'` axis (used by the scanned
decoder); its forward must then be applied to one slice at a time (see transformer.py).
Linear weights are stored input-major (`x @ W`), attention weights split per head:
q `[embed, heads, head_dim]`, k/v `[embed, kv_heads, head_dim]`, o `[heads, head_dim, embed]`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from scalerl_jax.models import paged_attention, sharding
from scalerl_jax.models.config import ModelConfig

KVCache = dict[str, jax.Array]


def dtype_of(name: str) -> jnp.dtype:
    """jnp dtype from its config name ('float32', 'bfloat16', 'float16')."""
    return jnp.dtype(name)


def make_param(
    rngs: nnx.Rngs | None,
    shape: Sequence[int],
    logical_axes: Sequence[str | None],
    *,
    dtype: jnp.dtype,
    init: str = "normal",
    stddev: float = 0.02,
    stack: int | None = None,
) -> nnx.Param:
    """An `nnx.Param` of `shape` (prefixed by `stack` layers) with logical axes as sharding metadata.

    init: 'normal' draws N(0, stddev^2) (the Hugging Face Llama/Qwen initializer), 'zeros', 'ones'.
    Sharding is metadata only (`eager_sharding=False`): `sharding.param_shardings` maps it to a mesh.
    """
    shape = tuple(int(s) for s in shape)
    axes = tuple(logical_axes)
    if stack is not None:
        shape, axes = (int(stack),) + shape, ("layers",) + axes
    if init == "normal":
        if rngs is None:
            raise ValueError("init='normal' needs rngs")
        value = stddev * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        raise ValueError(f"make_param: unknown init {init!r} (expected 'normal', 'zeros' or 'ones')")
    return nnx.Param(value.astype(dtype), out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, the statistics in float32, the result in x's dtype."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, stack: int | None = None):
        self.eps = eps
        self.scale = make_param(None, (dim,), ("norm",), dtype=dtype, init="ones", stack=stack)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return normed.astype(x.dtype) * self.scale[...].astype(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, float] | None = None) -> np.ndarray:
    """inv_freq[i] = theta^(-2i/head_dim), i < head_dim/2, with optional Llama 3.1 scaling.

    Llama 3.1 scaling (factor s, low/high frequency factors l/h, original context C): with
    wavelength w = 2 pi / inv_freq, frequencies with w > C/l are divided by s, those with
    w < C/h are kept, and in between they are interpolated with
    smooth = (C/w - l) / (h - l): (1 - smooth) inv_freq / s + smooth inv_freq.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq.astype(np.float32)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2.0 * np.pi / inv_freq
    with np.errstate(divide="ignore", invalid="ignore"):  # l = h (Llama 4): no band is interpolated
        smooth = (original / wavelength - low) / (high - low)
        interpolated = (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = np.where(
        wavelength > original / low, inv_freq / factor, np.where(wavelength < original / high, inv_freq, interpolated)
    )
    return scaled.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate halves of x[..., T, N, D]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), angle = pos * inv_freq.

    This is the "rotate_half" layout of Hugging Face Llama/Qwen checkpoints.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def weightless_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32, returned in x's dtype (no scale)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)).astype(x.dtype)


def attention_temperature(positions: jax.Array, floor_scale: float, scale: float) -> jax.Array:
    """Llama 4's query scale at absolute positions p (float32, p's shape):
    1 + scale * log(1 + floor((p + 1) / floor_scale))."""
    steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / floor_scale)
    return 1.0 + scale * jnp.log1p(steps)


def chunk_start(positions: jax.Array, chunk: int) -> jax.Array:
    """The first position of each position's attention chunk: floor(p / chunk) * chunk."""
    return (positions // chunk) * chunk


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(d) masked) v with grouped KV heads.

    q [B, T, H, D], k/v [B, S, K, D] with H = K * G (query head h uses KV head h // G), mask
    bool [B, T, S] (True = attend). Scores and softmax in float32; a fully masked row gives a
    uniform average instead of NaN. Returns [B, T, H, D] in q's dtype.
    """
    batch, length, heads, dim = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(batch, length, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / np.sqrt(dim))
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(batch, length, heads, dim)


CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128  # cuDNN flash attention: head_dim <= 128 before Hopper (256 from Hopper on)
TPU_PLATFORMS = ("tpu",)
FLASH_IMPLS = ("cudnn", "splash")  # attention impls without a T x T buffer
SPLASH_DTYPES = ("bfloat16", "float32")
SPLASH_LANES = 128  # TPU vector lanes: splash's head_dim and sequence tiles are multiples of this
SPLASH_MAX_BLOCK = 512  # largest query / key tile tried (multiples of SPLASH_LANES dividing the padded T)


def resolve_attention_impl(config: ModelConfig, platform: str, seq_len: int | None = None) -> str:
    """'xla', 'cudnn' or 'splash': the non-cached attention `config.attention_impl` means on `platform`.

    'xla', 'cudnn' and 'splash' are taken as given. 'auto' is:
    - 'cudnn' (flash attention, no T x T buffer) when the platform is a CUDA GPU ('gpu' or 'cuda')
      and cuDNN's flash kernel accepts the shapes: body dtype in `CUDNN_DTYPES` and head_dim a
      multiple of 8 that is <= `CUDNN_MAX_HEAD_DIM`;
    - 'splash' (`splash_attention`: the Pallas TPU flash kernel, no T x T buffer) when the platform
      is 'tpu', the body dtype is in `SPLASH_DTYPES` (TPUs have no float16 kernel), head_dim is a
      multiple of `SPLASH_LANES` (128: the kernel's tiles keep head_dim on the TPU's 128 lanes;
      Llama 3 / Qwen2.5-7B / Qwen3 have 128) and the call's `seq_len` (None: not known, e.g. for
      the memory planner's per-config answer) is at least `SPLASH_LANES`. Any longer length is
      padded up to the kernel's tile (exact under the causal mask, see `splash_attention`), so
      shorter calls (a 16-token prefill) stay on 'xla', whose T x T scores are then small;
    - 'xla' otherwise (CPU, a float32 model on GPU, head_dim 64 on TPU, ...).
    """
    if config.attention_impl != "auto":
        return config.attention_impl
    if platform in ("gpu", "cuda"):
        cudnn_fits = config.head_dim % 8 == 0 and config.head_dim <= CUDNN_MAX_HEAD_DIM
        return "cudnn" if config.dtype in CUDNN_DTYPES and cudnn_fits else "xla"
    if platform in TPU_PLATFORMS:
        long_enough = seq_len is None or seq_len >= SPLASH_LANES
        splash_fits = config.dtype in SPLASH_DTYPES and config.head_dim % SPLASH_LANES == 0
        return "splash" if splash_fits and long_enough else "xla"
    return "xla"


def splash_block(length: int) -> int:
    """The query / key tile of `splash_attention` for a sequence of `length`: with T' = `length`
    rounded up to a multiple of `SPLASH_LANES`, the largest of SPLASH_MAX_BLOCK, ..., 256, 128
    (multiples of 128) that divides T'."""
    padded = -(-length // SPLASH_LANES) * SPLASH_LANES
    block = SPLASH_MAX_BLOCK
    while padded % block:
        block -= SPLASH_LANES
    return block


def _splash_local(q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool) -> jax.Array:
    """Causal GQA attention of one device's q [B, T, H, D], k/v [B, T, K, D] by the splash kernel."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # TPU Pallas: imported on use

    batch, length, heads, dim = q.shape
    block = splash_block(length)
    padded = -(-length // block) * block
    pad = ((0, 0), (0, padded - length), (0, 0), (0, 0))
    # The kernel takes head-major [H, T, D] per example and does not scale the scores.
    q = jnp.pad(q * jnp.asarray(1.0 / np.sqrt(dim), q.dtype), pad).transpose(0, 2, 1, 3)
    k, v = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (k, v))
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = splash.MultiHeadMask([splash.CausalMask((padded, padded)) for _ in range(heads)])
    # Grouped heads natively: query head h reads KV head h // (H / K), no repeated K/V.
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    out = jax.vmap(kernel)(q, k, v)  # [B, H, T', D] (no residuals: save_residuals is off)
    assert isinstance(out, jax.Array)
    return out.transpose(0, 2, 1, 3)[:, :length]


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal `grouped_attention` (query t attends to keys s <= t) by the Pallas TPU splash kernel.

    q [B, T, H, D], k/v [B, T, K, D] with H = K * G; out = softmax(q k^T / sqrt(D) + causal mask) v,
    computed by tiles with an online softmax in float32, so no [T, T] buffer exists, forward or
    backward (the kernel's own custom VJP). T is padded with zeros up to a multiple of the tile
    (`splash_block`): a padded key sits at s >= T > t for every real query t, so the causal mask
    hides it, and padded query rows are cut off, which makes the padding exact.

    Under an active mesh (`sharding.use_mesh_rules`) the kernel runs per device in `jax.shard_map`
    on the local batch rows (the rules' 'batch' axes) and local heads (the 'activation_heads' /
    'activation_kv_heads' axes when both H and K divide by them, else heads are replicated so each
    query head still meets its KV head); the sequence is never split. The kernel is compiled for
    TPU when `sharding.trace_platform()` is 'tpu' and runs in Pallas interpret mode elsewhere
    (CPU tests only: slow).
    """
    interpret = sharding.trace_platform() not in TPU_PLATFORMS
    mesh = sharding.active_mesh()
    q_spec = sharding.activation_spec(q.shape, ("batch", None, "activation_heads", None))
    kv_spec = sharding.activation_spec(k.shape, ("batch", None, "activation_kv_heads", None))
    if mesh is None or q_spec is None or kv_spec is None:
        return _splash_local(q, k, v, interpret=interpret)
    q_entries, kv_entries = list(q_spec) + [None] * 4, list(kv_spec) + [None] * 4
    batch_axes = q_entries[0] if q_entries[0] == kv_entries[0] else None
    head_axes = q_entries[2] if q_entries[2] == kv_entries[2] else None
    q_spec = jax.sharding.PartitionSpec(batch_axes, None, head_axes, None)
    kv_spec = jax.sharding.PartitionSpec(batch_axes, None, head_axes, None)
    local = jax.shard_map(
        lambda q_, k_, v_: _splash_local(q_, k_, v_, interpret=interpret),
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec),
        out_specs=q_spec,
        check_vma=False,
    )
    return local(q, k, v)


def attend_in_chunks(
    attend: Callable[[jax.Array, jax.Array, jax.Array], jax.Array], q: jax.Array, k: jax.Array, v: jax.Array, chunk: int
) -> jax.Array:
    """Chunked causal attention (query t sees keys s <= t with floor(s / chunk) = floor(t / chunk),
    positions 0..T-1) by `attend`, plain causal attention over [B', C, ...] inputs.

    q [B, T, H, D], k/v [B, T, K, D]: T is padded with zeros to n * chunk (a padded key comes after
    every real query of its chunk, so the causal mask hides it; padded queries are cut off), the n
    chunks are folded into the batch as [B n, chunk, ...], attended, and unfolded. T <= chunk is one
    chunk: `attend` directly.
    """
    batch, length = q.shape[:2]
    if length <= chunk:
        return attend(q, k, v)
    num_chunks = -(-length // chunk)

    def fold(x: jax.Array) -> jax.Array:
        padded = jnp.pad(x, ((0, 0), (0, num_chunks * chunk - length)) + ((0, 0),) * (x.ndim - 2))
        return padded.reshape(batch * num_chunks, chunk, *x.shape[2:])

    out = attend(fold(q), fold(k), fold(v))
    return out.reshape(batch, num_chunks * chunk, *out.shape[2:])[:, :length]


def decode_attention(
    q: jax.Array,
    stacked_k: jax.Array,
    stacked_v: jax.Array,
    layer: jax.Array | int,
    positions: jax.Array,
    *,
    window: int,
    block: int,
    first_key: jax.Array | None = None,
) -> jax.Array:
    """`grouped_attention` of q [B, T, H, D] over keys s < `window` of cache layer `layer`, s <= positions[b, t]
    (and s >= first_key[b, t] when given: a chunked layer's chunk start).

    stacked_k/v [L, B, S, K, D] are read in place, `block` keys at a time (online softmax: with
    running max m, normalizer l and accumulator a, a block of scores x gives m' = max(m, max x),
    l' = l e^(m - m') + sum e^(x - m'), a' = a e^(m - m') + sum e^(x - m') v; the output is a' / l'),
    so scratch memory is one block, never a cache layer. Scores and softmax in float32, written as
    multiply-and-sum rather than `dot_general` (a dot would first copy the block into a
    (batch, kv head)-major layout). A row with no valid key gives zeros. Returns [B, T, H, D] in q's dtype.
    """
    batch, length, heads, dim = q.shape
    kv_heads = stacked_k.shape[3]
    block = min(block, window)
    num_blocks = -(-window // block)
    qg = q.reshape(batch, length, 1, kv_heads, heads // kv_heads, dim).astype(jnp.float32) / np.sqrt(dim)
    layer = jnp.asarray(layer, jnp.int32)
    lowest = jnp.zeros_like(positions) if first_key is None else first_key

    def read(stacked: jax.Array, start: jax.Array) -> jax.Array:  # [B, 1, block, K, 1, D] float32
        zero = jnp.int32(0)
        piece = jax.lax.dynamic_slice(stacked, (layer, zero, start, zero, zero), (1, batch, block, kv_heads, dim))[0]
        return piece[:, None, :, :, None, :].astype(jnp.float32)

    def step(carry: tuple[jax.Array, jax.Array, jax.Array], index: jax.Array):
        running_max, normalizer, acc = carry
        first = index * block
        start = jnp.minimum(first, window - block)  # the last block may overlap the previous one
        key_index = start + jnp.arange(block)
        valid = (
            (key_index >= first)[None, None, :]
            & (key_index < window)[None, None, :]
            & (key_index[None, None, :] <= positions[:, :, None])
            & (key_index[None, None, :] >= lowest[:, :, None])
        )[..., None, None]  # [B, T, block, 1, 1]
        scores = jnp.where(valid, jnp.sum(qg * read(stacked_k, start), axis=-1), -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=2))  # [B, T, K, G]
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        weights = jnp.where(valid, jnp.exp(scores - safe_max[:, :, None]), 0.0)
        rescale = jnp.exp(jnp.where(jnp.isfinite(running_max), running_max - safe_max, -jnp.inf))
        normalizer = normalizer * rescale + jnp.sum(weights, axis=2)
        acc = acc * rescale[..., None] + jnp.sum(weights[..., None] * read(stacked_v, start), axis=2)
        return (new_max, normalizer, acc), None

    stats = (batch, length, kv_heads, heads // kv_heads)
    init = (
        jnp.full(stats, -jnp.inf, jnp.float32),
        jnp.zeros(stats, jnp.float32),
        jnp.zeros(stats + (dim,), jnp.float32),
    )
    (_, normalizer, acc), _ = jax.lax.scan(step, init, jnp.arange(num_blocks, dtype=jnp.int32))
    out = acc / jnp.where(normalizer > 0, normalizer, 1.0)[..., None]
    return out.reshape(batch, length, heads, dim).astype(q.dtype)


def paged_decode_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    layer: jax.Array | int,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    window: int,
    pages_per_block: int,
    first_key: jax.Array | None = None,
) -> jax.Array:
    """Attention of one query per slot, q [S, H, D], over its keys s < lengths[slot] kept in pages
    (and s >= first_key[slot] when given: a chunked layer's chunk start).

    k/v_pages [L, N, P, K, D] is one pool of N pages of P tokens (read in place, layer `layer`);
    slot b's key at position s is k_pages[layer, page_table[b, s // P], s % P]. Only the pages
    below `window` (static; every length must be <= window) are read, `pages_per_block` pages at
    a time (one gather each), with the online softmax of `decode_attention` in float32, so scratch
    memory is one block. Page ids outside [0, N) read zeros and are always masked (their keys are
    at or past the slot's length). A slot of length 0 gives zeros. Returns [S, H, D] in q's dtype.
    """
    slots, heads, dim = q.shape
    _, num_pages, page_size, kv_heads, _ = k_pages.shape
    window_pages = -(-window // page_size)
    block_pages = min(pages_per_block, window_pages)
    num_blocks = -(-window_pages // block_pages)
    block = block_pages * page_size
    qg = q.reshape(slots, kv_heads, heads // kv_heads, dim).astype(jnp.float32) / np.sqrt(dim)
    layer = jnp.asarray(layer, jnp.int32)
    lowest = jnp.zeros_like(lengths) if first_key is None else first_key

    def read(pool: jax.Array, pages: jax.Array) -> jax.Array:  # [S, block, K, D] float32
        piece = pool.at[layer, pages].get(mode="fill", fill_value=0)  # [S, block_pages, P, K, D]
        return piece.reshape(slots, block, kv_heads, dim).astype(jnp.float32)

    def step(carry: tuple[jax.Array, jax.Array, jax.Array], index: jax.Array):
        running_max, normalizer, acc = carry
        first_page = index * block_pages
        start_page = jnp.minimum(first_page, window_pages - block_pages)  # last block may overlap
        pages = jax.lax.dynamic_slice_in_dim(page_table, start_page, block_pages, axis=1)
        key_index = start_page * page_size + jnp.arange(block)
        valid = (
            (key_index >= first_page * page_size)[None, :]
            & (key_index[None, :] < lengths[:, None])
            & (key_index[None, :] >= lowest[:, None])
        )[..., None, None]  # [S, block, 1, 1]
        # Contractions as dots (not multiply-and-sum): XLA CPU runs a broadcast product as an
        # elementwise loop, half of a decode step's time on SmolLM2 at 64 slots.
        scores = jnp.where(valid, jnp.einsum("skgd,sbkd->sbkg", qg, read(k_pages, pages)), -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1))  # [S, K, G]
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        weights = jnp.where(valid, jnp.exp(scores - safe_max[:, None]), 0.0)
        rescale = jnp.exp(jnp.where(jnp.isfinite(running_max), running_max - safe_max, -jnp.inf))
        normalizer = normalizer * rescale + jnp.sum(weights, axis=1)
        acc = acc * rescale[..., None] + jnp.einsum("sbkg,sbkd->skgd", weights, read(v_pages, pages))
        return (new_max, normalizer, acc), None

    stats = (slots, kv_heads, heads // kv_heads)
    init = (
        jnp.full(stats, -jnp.inf, jnp.float32),
        jnp.zeros(stats, jnp.float32),
        jnp.zeros(stats + (dim,), jnp.float32),
    )
    (_, normalizer, acc), _ = jax.lax.scan(step, init, jnp.arange(num_blocks, dtype=jnp.int32))
    out = acc / jnp.where(normalizer > 0, normalizer, 1.0)[..., None]
    return out.reshape(slots, heads, dim).astype(q.dtype)


DECODE_KERNELS = ("auto", "xla", "pallas")


def resolve_decode_kernel(name: str, platform: str) -> str:
    """'xla' or 'pallas': the paged decode attention `name` means on `platform`.

    'auto' is 'xla' (`paged_decode_attention_xla`: blockwise online softmax over only the live
    pages below the decode window, one block of scratch) on every platform: on TPU it is the
    decode kernel, and on GPU it stays so until the Pallas kernel has been measured there
    (benchmarks/gpu_check.sh). 'pallas' is the Triton (GPU) kernel of `paged_attention`: on
    'tpu' it is a ValueError (Triton does not target TPU); on CPU it runs interpreted (tests).
    """
    if name not in DECODE_KERNELS:
        raise ValueError(f"decode kernel {name!r}: expected one of {DECODE_KERNELS}")
    if name == "pallas" and platform in TPU_PLATFORMS:
        raise ValueError(
            "decode kernel 'pallas' is the Triton (GPU) paged attention kernel and cannot run on TPU; "
            "use 'xla' or 'auto' (the blockwise XLA kernel over the live pages)"
        )
    return "xla" if name == "auto" else name


def grouped_paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    window: int,
    pages_per_block: int,
    kernel: str,
    first_key: jax.Array | None = None,
) -> jax.Array:
    """`paged_decode_attention_xla` (kernel 'xla') or the Pallas kernel ('pallas') per page group.

    k/v_pool [L, G, N, P, K, D]: G groups of N pages; slots are split into G equal consecutive
    groups (slot b in group b // (S / G)) and a slot's page ids index its own group's pages. The
    groups are mapped with `jax.vmap` (a batch dimension of every gather), so a pool sharded over
    G with the slots sharded alike is read without moving pages between devices. The Pallas kernel
    ignores `window` (it reads each slot's own length); off GPU it runs in interpret mode (tests only).
    It reads every key from 0, so with `first_key` (a chunked layer's chunk starts [S]) the 'xla'
    kernel runs whatever `kernel` says.
    """
    groups = k_pool.shape[1]
    slots = q.shape[0]
    lowest = jnp.zeros_like(lengths) if first_key is None else first_key

    def per_group(x: jax.Array) -> jax.Array:
        return x.reshape(groups, slots // groups, *x.shape[1:])

    if kernel == "pallas" and first_key is None:
        interpret = sharding.trace_platform() not in paged_attention.GPU_PLATFORMS  # CPU: tests only, slow
        layer_index = jnp.asarray(layer, jnp.int32)  # the kernel takes it as an int32 scalar array

        def attend(q_g, k_g, v_g, table_g, lengths_g, lowest_g):
            del lowest_g  # zeros: only a chunked layer has a later first key, and it takes the XLA kernel
            return paged_attention.paged_decode_attention(
                q_g, k_g, v_g, layer_index, table_g, lengths_g, pages_per_block=pages_per_block, interpret=interpret
            )
    else:

        def attend(q_g, k_g, v_g, table_g, lengths_g, lowest_g):
            return paged_decode_attention_xla(
                q_g,
                k_g,
                v_g,
                layer,
                table_g,
                lengths_g,
                window=window,
                pages_per_block=pages_per_block,
                first_key=lowest_g,
            )

    out = jax.vmap(attend, in_axes=(0, 1, 1, 0, 0, 0))(
        per_group(q), k_pool, v_pool, per_group(page_table), per_group(lengths), per_group(lowest)
    )
    return out.reshape(q.shape)


def paged_prefill_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    groups: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    *,
    window: int,
    first_key: jax.Array | None = None,
) -> jax.Array:
    """Attention of several queries per row, q [R, T, H, D] at `positions` [R, T], over the keys
    s <= position (and s >= first_key [R, T] when given: a chunked layer's chunk start) that row
    r's pages hold: key s is k_pool[layer, groups[r], page_table[r, s // P], s % P].

    The row's pages below `window` (static; it must exceed the position of every query whose
    output is used) are gathered into [R, window, K, D] (page ids outside [0, N) read zeros,
    always masked: they lie past the positions) and attended with `grouped_attention`. A prompt's pieces can be rows of one call:
    every row's K/V are written before any row reads, so a later piece reads the earlier ones.
    Returns [R, T, H, D] in q's dtype.
    """
    rows = q.shape[0]
    _, _, _, page_size, kv_heads, dim = k_pool.shape
    window_pages = -(-window // page_size)
    pages = page_table[:, :window_pages]
    layer_index = jnp.asarray(layer, jnp.int32)

    def read(pool: jax.Array) -> jax.Array:  # [R, window_pages * P, K, D]
        piece = pool.at[layer_index, groups[:, None], pages].get(mode="fill", fill_value=0)
        return piece.reshape(rows, window_pages * page_size, kv_heads, dim).astype(q.dtype)

    key_index = jnp.arange(window_pages * page_size)[None, None, :]
    mask = key_index <= positions[:, :, None]
    if first_key is not None:
        mask &= key_index >= first_key[:, :, None]
    return grouped_attention(q, read(k_pool), read(v_pool), mask)


def write_kv_pages(
    pool: jax.Array, layer: jax.Array | int, groups: jax.Array, pages: jax.Array, offsets: jax.Array, rows: jax.Array
) -> jax.Array:
    """pool[layer, groups[i], pages[i], offsets[i]] = rows[i] for every index i (one scatter, in place
    when donated). pool [L, G, N, P, K, D]; groups/pages/offsets int [...]; rows [..., K, D]. Entries
    with a page id outside [0, N) are dropped."""
    layer_index = jnp.full(pages.shape, layer, jnp.int32)
    return pool.at[layer_index, groups, pages, offsets].set(rows.astype(pool.dtype), mode="drop")


class Attention(nnx.Module):
    """GQA self-attention of decoder layer `layer` (a stack: of its first layer, all being alike):
    optional q/k/v bias, o bias, per-head q/k RMSNorm (Qwen3); RoPE unless the layer is a NoPE
    layer, then Llama 4's QK norm on RoPE layers and its query temperature on NoPE layers; full or
    chunked causal attention (see `ModelConfig`)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, stack: int | None = None, layer: int = 0):
        d, h, k, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        dtype, std = dtype_of(config.dtype), config.initializer_range
        self.config = config
        self.uses_rope = config.uses_rope(layer)
        self.chunk = config.attention_chunk_size if config.is_chunked_layer(layer) else 0
        self.q_proj = make_param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), dtype=dtype, stddev=std, stack=stack)
        self.k_proj = make_param(
            rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), dtype=dtype, stddev=std, stack=stack
        )
        self.v_proj = make_param(
            rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), dtype=dtype, stddev=std, stack=stack
        )
        self.o_proj = make_param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), dtype=dtype, stddev=std, stack=stack)
        if config.qkv_bias:
            self.q_bias = make_param(None, (h, hd), ("heads", "head_dim"), dtype=dtype, init="zeros", stack=stack)
            self.k_bias = make_param(None, (k, hd), ("kv_heads", "head_dim"), dtype=dtype, init="zeros", stack=stack)
            self.v_bias = make_param(None, (k, hd), ("kv_heads", "head_dim"), dtype=dtype, init="zeros", stack=stack)
        if config.o_bias:
            self.o_bias = make_param(None, (d,), ("embed",), dtype=dtype, init="zeros", stack=stack)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, eps=config.rms_norm_eps, dtype=dtype, stack=stack)
            self.k_norm = RMSNorm(hd, eps=config.rms_norm_eps, dtype=dtype, stack=stack)

    def _project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B,T,H,D], k/v [B,T,K,D] after bias, q/k norm, RoPE and what follows it (Llama 4: the
        weightless QK norm on a RoPE layer, the query temperature on a NoPE layer)."""
        cfg = self.config
        q = jnp.einsum("btd,dnh->btnh", x, self.q_proj[...])
        k = jnp.einsum("btd,dnh->btnh", x, self.k_proj[...])
        v = jnp.einsum("btd,dnh->btnh", x, self.v_proj[...])
        if cfg.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.uses_rope:
            inv_freq = rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
            if cfg.qk_l2_norm:
                q, k = weightless_rms_norm(q, cfg.rms_norm_eps), weightless_rms_norm(k, cfg.rms_norm_eps)
        elif cfg.attn_temperature_tuning:
            scale = attention_temperature(positions, cfg.attn_floor_scale, cfg.attn_scale)
            q = (q.astype(jnp.float32) * scale[..., None, None]).astype(q.dtype)
        q = sharding.constrain(checkpoint_name(q, "query_proj"), sharding.QUERY_AXES)
        k = sharding.constrain(checkpoint_name(k, "key_proj"), sharding.KV_AXES)
        v = sharding.constrain(checkpoint_name(v, "value_proj"), sharding.KV_AXES)
        return q, k, v

    def _output(self, attended: jax.Array) -> jax.Array:
        attended = checkpoint_name(attended, "attention_out")
        out = jnp.einsum("btnh,nhd->btd", attended, self.o_proj[...])
        return out + self.o_bias[...] if self.config.o_bias else out

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Causal self-attention within x [B, T, D] (query t attends to keys s <= t; in a chunked
        layer only those in t's chunk of `positions`), by
        `resolve_attention_impl(config, sharding.trace_platform(), T)`: cuDNN flash attention and
        the splash kernel never build the T x T scores (a chunked layer runs them on its chunks
        folded into the batch, `attend_in_chunks`, which takes `positions` to be 0..T-1, as in
        training and the engine's prefill); 'xla' (`grouped_attention`) builds them in float32."""
        q, k, v = self._project(x, positions)
        return self._output(self._causal_attention(q, k, v, positions))

    def _causal_attention(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
        """Query t attends to keys s <= t of the same call (see `__call__`)."""
        batch, length = q.shape[:2]
        impl = resolve_attention_impl(self.config, sharding.trace_platform(), min(length, self.chunk or length))
        if impl == "cudnn":
            flash = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
        elif impl == "splash":
            flash = splash_attention
        else:
            causal = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), dtype=bool)), (batch, length, length))
            if self.chunk:
                causal &= positions[:, None, :] >= chunk_start(positions, self.chunk)[:, :, None]
            return grouped_attention(q, k, v, causal)
        return attend_in_chunks(flash, q, k, v, self.chunk) if self.chunk else flash(q, k, v)

    def forward_cached(
        self, x: jax.Array, positions: jax.Array, cache: KVCache, layer: jax.Array | int, window: int, block: int
    ) -> tuple[jax.Array, KVCache]:
        """Write this call's k/v into cache[layer, b, positions[b, t]], then attend to entries s <= positions[b, t].

        cache: the stacked {'k', 'v'}, each [L, B, S, K, D], updated in place (one scatter of this
        call's rows); positions outside [0, S) are not written. Attention reads only the first
        `window` positions of layer `layer` (every query position must be < window): one query
        row (decode) streams them `block` at a time from the cache (`decode_attention`), several
        rows (prefill) copy the window out and use `grouped_attention`, or, where the attention
        impl resolves to 'cudnn' or 'splash' (for this call's T), attend causally within the call's
        own k/v by flash attention (no T x T scores), which is the same only for a prefill at
        positions 0..T-1 of a fresh sequence (the engine's only multi-row use). A chunked layer also
        drops the keys before each query's chunk start.
        """
        q, k, v = self._project(x, positions)
        cache = {
            "k": write_kv_rows(cache["k"], layer, positions, k),
            "v": write_kv_rows(cache["v"], layer, positions, v),
        }
        first_key = chunk_start(positions, self.chunk) if self.chunk else None
        flash = resolve_attention_impl(self.config, sharding.trace_platform(), x.shape[1]) in FLASH_IMPLS
        if x.shape[1] == 1:
            attended = decode_attention(
                q, cache["k"], cache["v"], layer, positions, window=window, block=block, first_key=first_key
            )
        elif flash:
            attended = self._causal_attention(q, k, v, positions)  # a prefill: positions 0..T-1, nothing before
        else:
            keys, values = (read_kv_window(cache[name], layer, window).astype(q.dtype) for name in ("k", "v"))
            key_index = jnp.arange(window)[None, None, :]
            mask = key_index <= positions[:, :, None]
            if first_key is not None:
                mask &= key_index >= first_key[:, :, None]
            attended = grouped_attention(q, keys, values, mask)
        return self._output(attended), cache

    def forward_paged(
        self, x: jax.Array, positions: jax.Array, cache: KVCache, layer: jax.Array | int, pages: PagedView
    ) -> tuple[jax.Array, KVCache]:
        """x [S, T, D] against the paged cache {'k', 'v'} [L, G, N, P, K, D]: a decode step (T = 1,
        one token per slot) or prompt pieces (T > 1, one piece per row).

        Writes token t's k/v at page `pages.write_page[b, t]`, row `pages.write_offset[b, t]` of
        row b's group (a dropped write where the page id is out of range), then attends: a decode
        step to the slot's keys s < pages.lengths[b] (`grouped_paged_attention`), a piece's token
        to its row's keys s <= its position (`paged_prefill_attention`); in a chunked layer only
        those from the query's chunk start on.
        """
        q, k, v = self._project(x, positions)
        groups = jnp.broadcast_to(pages.write_group[:, None], pages.write_page.shape)
        cache = {
            name: write_kv_pages(cache[name], layer, groups, pages.write_page, pages.write_offset, rows)
            for name, rows in (("k", k), ("v", v))
        }
        first_key = chunk_start(positions, self.chunk) if self.chunk else None
        if x.shape[1] > 1:
            attended = paged_prefill_attention(
                q,
                cache["k"],
                cache["v"],
                layer,
                pages.write_group,
                pages.table,
                positions,
                window=pages.window,
                first_key=first_key,
            )
            return self._output(attended), cache
        attended = grouped_paged_attention(
            q[:, 0],
            cache["k"],
            cache["v"],
            layer,
            pages.table,
            pages.lengths,
            window=pages.window,
            pages_per_block=pages.pages_per_block,
            kernel=pages.kernel,
            first_key=None if first_key is None else first_key[:, 0],
        )
        return self._output(attended[:, None]), cache


class PagedView(NamedTuple):
    """Where a call writes and reads in the paged KV cache (per row, leading axis S: a decode
    step's slots or a prefill's prompt pieces).

    table int32 [S, M]: the row's page ids (in its group); lengths int32 [S]: a decode step reads
    keys s < lengths; write_group int32 [S]: the row's page group; write_page / write_offset int32
    [S, T]: where each token's k/v go. Static: window (every key read is below it),
    pages_per_block, kernel ('xla' / 'pallas': a decode step's kernel).
    """

    table: jax.Array
    lengths: jax.Array
    write_group: jax.Array
    write_page: jax.Array
    write_offset: jax.Array
    window: int
    pages_per_block: int
    kernel: str


def write_kv_rows(stacked: jax.Array, layer: jax.Array | int, positions: jax.Array, rows: jax.Array) -> jax.Array:
    """stacked[layer, b, positions[b, t]] = rows[b, t] for every b, t (one scatter, in place when donated).

    stacked [L, B, S, K, D], positions int [B, T], rows [B, T, K, D]. Positions outside [0, S) are dropped
    (negative ones too, which plain indexing would wrap).
    """
    batch, max_len = stacked.shape[1], stacked.shape[2]
    slot = jnp.broadcast_to(jnp.arange(batch)[:, None], positions.shape)
    at = jnp.where(positions < 0, max_len, positions)
    layer_index = jnp.full(positions.shape, layer, jnp.int32)
    return stacked.at[layer_index, slot, at].set(rows.astype(stacked.dtype), mode="drop")


def read_kv_window(stacked: jax.Array, layer: jax.Array | int, window: int) -> jax.Array:
    """stacked[layer, :, :window] as [B, window, K, D] (a dynamic slice; `window` static)."""
    _, batch, _, kv_heads, head_dim = stacked.shape
    start = (jnp.asarray(layer, jnp.int32),) + (jnp.int32(0),) * 4
    return jax.lax.dynamic_slice(stacked, start, (1, batch, window, kv_heads, head_dim))[0]


class MLP(nnx.Module):
    """SwiGLU: down(silu(x W_gate) * (x W_up)), of width `width` (default `config.intermediate_size`)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, stack: int | None = None, width: int | None = None):
        d, f = config.hidden_size, width or config.intermediate_size
        dtype, std = dtype_of(config.dtype), config.initializer_range
        self.gate_proj = make_param(rngs, (d, f), ("embed", "mlp"), dtype=dtype, stddev=std, stack=stack)
        self.up_proj = make_param(rngs, (d, f), ("embed", "mlp"), dtype=dtype, stddev=std, stack=stack)
        self.down_proj = make_param(rngs, (f, d), ("mlp", "embed"), dtype=dtype, stddev=std, stack=stack)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = x @ self.gate_proj[...]
        up = x @ self.up_proj[...]
        hidden = sharding.constrain(jax.nn.silu(gate) * up, sharding.MLP_AXES)
        return hidden @ self.down_proj[...]
