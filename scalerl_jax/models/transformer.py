"""Decoder-only transformer (Llama 3 / Qwen2.5 / Qwen3 / Qwen3-MoE / Llama 4 text) in Flax NNX, with a
KV-cached forward.

Layers are either stacked (`config.scan_layers`: one `DecoderLayer` holding [L, ...] params, or,
when the layer kinds repeat with a period p > 1 (`ModelConfig.layer_period`), a list of p such
stacks of L / p layers; applied with `jax.lax.scan` over `nnx.split` state slices, one period per
step, so compile time does not grow with depth) or a list of L separate layers (unrolled). Both
apply `jax.checkpoint` per layer with the policy named by `config.remat_policy` when gradients are
taken through `__call__`/`hidden`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from scalerl_jax.models import sharding
from scalerl_jax.models.config import ModelConfig
from scalerl_jax.models.layers import MLP, Attention, KVCache, PagedView, RMSNorm, dtype_of, make_param
from scalerl_jax.models.moe import MoE, RouterStats

_NnxList = getattr(nnx, "List", list)


def remat_policy(name: str) -> Callable[..., bool] | None:
    """The `jax.checkpoint` policy named `name` ('none' has no checkpointing and returns None).

    full: save nothing inside a layer (recompute all); dots: save every matmul output;
    dots_with_no_batch_dims: save weight matmuls only (not attention scores);
    save_qkv_attn: save the q/k/v projections and the attention output.
    """
    policies = jax.checkpoint_policies
    table: dict[str, Callable[..., bool] | None] = {
        "full": policies.nothing_saveable,
        "dots": policies.checkpoint_dots,
        "dots_with_no_batch_dims": policies.dots_with_no_batch_dims_saveable,
        "save_qkv_attn": policies.save_only_these_names("query_proj", "key_proj", "value_proj", "attention_out"),
    }
    if name == "none":
        return None
    if name not in table:
        raise ValueError(f"unknown remat_policy {name!r}; expected 'none' or one of {sorted(table)}")
    return table[name]


def _embedding_dtype(config: ModelConfig) -> jnp.dtype:
    """Tied embeddings double as the head: float32 when `fp32_head`, else the body dtype."""
    return jnp.dtype(jnp.float32) if (config.tie_word_embeddings and config.fp32_head) else dtype_of(config.dtype)


def fp32_logits(hidden: jax.Array, weight: jax.Array, head_precision: str) -> jax.Array:
    """float32(hidden) [..., D] @ float32(weight) [D, V] -> float32 [..., V] at `head_precision`.

    'bf16x3' chooses per lowering platform (`lax.platform_dependent`, so one traced program lowers
    right for each backend): on CUDA the tensor-core algorithm `DotAlgorithmPreset.BF16_BF16_F32_X3`
    (x = x_hi + x_lo in bf16; x.y ~ x_hi.y_hi + x_hi.y_lo + x_lo.y_hi, accumulated in float32); on
    TPU `Precision.HIGH`, which is that same 3-pass bf16 product on the MXU (compiled HLO:
    `operand_precision={high,high}`; the X3 preset is not used there because XLA:TPU compiled the
    forward dot of d/d(h, W) sum(logits * g) to one bf16 pass, checked deviceless on v5e);
    everywhere else `Precision.HIGHEST` (exact float32). The gradients' dots inherit the setting.
    Other names are `lax.Precision` members ('highest', 'high', 'default').
    """
    hidden, weight = hidden.astype(jnp.float32), weight.astype(jnp.float32)

    def dot_at(precision: jax.lax.Precision | jax.lax.DotAlgorithmPreset) -> Callable[..., jax.Array]:
        return lambda h, w: jnp.einsum("...d,dv->...v", h, w, precision=precision, preferred_element_type=jnp.float32)

    if head_precision == "bf16x3":
        return jax.lax.platform_dependent(
            hidden,
            weight,
            cuda=dot_at(jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3),
            tpu=dot_at(jax.lax.Precision.HIGH),
            default=dot_at(jax.lax.Precision.HIGHEST),
        )
    return dot_at(jax.lax.Precision[head_precision.upper()])(hidden, weight)


class DecoderLayer(nnx.Module):
    """Pre-norm block `layer` of the decoder (a stack: its first, all being of one kind):
    h = x + attn(norm(x)); out = h + ffn(norm(h)), where ffn is the SwiGLU `mlp` or, in a
    mixture-of-experts layer, the experts `moe`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, stack: int | None = None, layer: int = 0):
        dtype = dtype_of(config.dtype)
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, stack=stack)
        self.attn = Attention(config, rngs=rngs, stack=stack, layer=layer)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, stack=stack)
        if config.is_moe_layer(layer):
            self.moe = MoE(config, rngs=rngs, stack=stack)
        else:
            self.mlp = MLP(config, rngs=rngs, stack=stack)

    def _feed_forward(self, h: jax.Array) -> jax.Array:
        """h + ffn(norm(h)), constrained to the hidden layout."""
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return sharding.constrain(h + ffn(self.mlp_norm(h)), sharding.HIDDEN_AXES)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return self._feed_forward(x + self.attn(self.attn_norm(x), positions))

    def forward_with_routing(
        self,
        x: jax.Array,
        positions: jax.Array,
        token_mask: jax.Array,
        recorded: jax.Array | None = None,
        *,
        replay: bool = True,
    ) -> tuple[jax.Array, RouterStats | None]:
        """As `__call__`, with the experts' `RouterStats` over the tokens where token_mask [B, T]
        is 1 (None in a dense layer); `recorded` [B, T, k]: another program's experts, compared
        with this layer's and, with `replay`, used in their place (`MoE.forward_with_stats`)."""
        h = x + self.attn(self.attn_norm(x), positions)
        if not hasattr(self, "moe"):
            return self._feed_forward(h), None
        y, stats, _ = self.moe.forward_with_stats(self.mlp_norm(h), token_mask, recorded, replay=replay)
        return sharding.constrain(h + y, sharding.HIDDEN_AXES), stats

    def _feed_forward_routed(self, h: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(`_feed_forward`, the experts each token was routed to [B, T, k], None in a dense layer)."""
        if not hasattr(self, "moe"):
            return self._feed_forward(h), None
        y, _, experts = self.moe.forward_with_stats(self.mlp_norm(h), None)
        return sharding.constrain(h + y, sharding.HIDDEN_AXES), experts

    def forward_cached(
        self, x: jax.Array, positions: jax.Array, cache: KVCache, layer: jax.Array | int, window: int, block: int
    ) -> tuple[jax.Array, KVCache]:
        """As `__call__`, attending through (and updating) layer `layer` of the stacked KV cache."""
        attended, cache = self.attn.forward_cached(self.attn_norm(x), positions, cache, layer, window, block)
        return self._feed_forward(x + attended), cache

    def forward_paged(
        self, x: jax.Array, positions: jax.Array, cache: KVCache, layer: jax.Array | int, pages: PagedView
    ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """As `forward_cached`, through the paged KV cache (`Attention.forward_paged`), with the
        experts each token was routed to (`_feed_forward_routed`)."""
        attended, cache = self.attn.forward_paged(self.attn_norm(x), positions, cache, layer, pages)
        out, experts = self._feed_forward_routed(x + attended)
        return out, cache, experts


class Transformer(nnx.Module):
    """tokens [B, T] -> logits float32 [B, T, V] (causal), plus `hidden`, `head`, `forward_cached`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, v = config.hidden_size, config.vocab_size
        self.embed_tokens = make_param(
            rngs, (v, d), ("vocab", "embed"), dtype=_embedding_dtype(config), stddev=config.initializer_range
        )
        period = config.layer_period
        if config.scan_layers and period == 1:
            self.layers = DecoderLayer(config, rngs=rngs, stack=config.num_layers)
        elif config.scan_layers:  # stack j holds layers j, j + p, j + 2p, ... (all of layer j's kind)
            self.layers = _NnxList(
                [DecoderLayer(config, rngs=rngs, stack=config.num_layers // period, layer=j) for j in range(period)]
            )
        else:
            self.layers = _NnxList([DecoderLayer(config, rngs=rngs, layer=i) for i in range(config.num_layers)])
        self.final_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype_of(config.dtype))
        if not config.tie_word_embeddings:
            head_dtype = jnp.float32 if config.fp32_head else dtype_of(config.dtype)
            self.lm_head = make_param(
                rngs, (d, v), ("embed", "vocab"), dtype=head_dtype, stddev=config.initializer_range
            )

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Logits float32 [B, T, V] of causal attention over tokens [B, T]."""
        return self.head(self.hidden(tokens, positions))

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Embedding lookup in the body dtype, [B, T] -> [B, T, D]."""
        x = jnp.take(self.embed_tokens[...], tokens, axis=0).astype(dtype_of(self.config.dtype))
        return sharding.constrain(x, sharding.HIDDEN_AXES)

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Final-normed hidden states [B, T, D] (body dtype); positions default to arange(T) (RoPE only)."""
        return self.hidden_with_routing(tokens, jnp.ones(tokens.shape, jnp.float32), positions)[0]

    def hidden_with_routing(
        self,
        tokens: jax.Array,
        token_mask: jax.Array,
        positions: jax.Array | None = None,
        recorded: jax.Array | None = None,
        *,
        replay: bool = True,
    ) -> tuple[jax.Array, RouterStats | None]:
        """(`hidden`, the MoE layers' `RouterStats` over the tokens where token_mask [B, T] is 1,
        stacked in layer order: [L_moe, E] and [L_moe]; None for a dense model). `recorded`
        [L_moe, B, T, k]: another program's experts at each MoE layer (-1 rows: none), counted in
        the stats where they differ from the layer's own and, with `replay`, computed in their place."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        policy_name = self.config.remat_policy

        def apply_layer(
            layer: DecoderLayer, x: jax.Array, pos: jax.Array, given: jax.Array | None
        ) -> tuple[jax.Array, RouterStats | None]:
            return layer.forward_with_routing(x, pos, token_mask, given, replay=replay)

        if policy_name != "none":
            apply_layer = _checkpointed(apply_layer, remat_policy(policy_name), prevent_cse=not self.config.scan_layers)
        x = self.embed(tokens)
        if self.config.scan_layers:
            x, stats = _scan_stacks(
                self._stacks(),
                self.config,
                lambda layer, h, _, given: apply_layer(layer, h, positions, given),
                x,
                recorded,
            )
            return self.final_norm(x), stats
        assert not isinstance(self.layers, DecoderLayer)  # a list of layers
        per_layer = []
        for index, layer in enumerate(self.layers):
            moe_index = len(per_layer)
            given = recorded[moe_index] if recorded is not None and self.config.is_moe_layer(index) else None
            x, layer_stats = apply_layer(layer, x, positions, given)
            per_layer += [] if layer_stats is None else [layer_stats]
        stats = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer) if per_layer else None
        return self.final_norm(x), stats

    def _stacks(self) -> list[DecoderLayer]:
        """The stacked layers of a scanned model, one per position in the layer period."""
        return [self.layers] if isinstance(self.layers, DecoderLayer) else list(self.layers)

    def head(self, hidden: jax.Array) -> jax.Array:
        """Unembedding [..., D] -> float32 [..., V].

        fp32_head: W is float32 and logits = float32(h) @ W by `fp32_logits` at `config.head_precision`
        (true float32 on CPU for 'highest' and 'bf16x3'). Otherwise the matmul runs in the body dtype
        (logits rounded to it), then is cast to float32.
        """
        weight = self.embed_tokens[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        if self.config.fp32_head:
            logits = fp32_logits(hidden, weight, self.config.head_precision)
        else:
            body = dtype_of(self.config.dtype)
            logits = jnp.einsum("...d,dv->...v", hidden.astype(body), weight.astype(body)).astype(jnp.float32)
        return sharding.constrain(logits, sharding.LOGITS_AXES) if logits.ndim == 3 else logits

    def forward_cached(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        *,
        window: int | None = None,
        block: int | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Final-normed hidden [B, T, D] and the updated cache.

        For each row b and step t, K/V of tokens[b, t] are written at cache[:, b, positions[b, t]]
        (positions outside [0, max_len) are not written, so they cannot corrupt other rows); the
        query at position p then attends to all cache entries with key index <= p, which are
        assumed valid. Prefill: T = bucket length, positions = arange; decode: T = 1.

        The cache is carried whole through the layer loop and each layer scatters only its new
        rows into it, so with the cache donated nothing cache-sized is copied. `window` (static,
        default max_len) bounds the key positions attention reads: cost follows the window, not
        max_len; every position must be < window (the caller's contract). `block` (static, default
        the whole window): keys a decode step (T = 1) reads per piece, which bounds its scratch memory.
        """
        _check_cache(self.config, cache, tokens.shape[0])
        max_len = cache["k"].shape[2]
        window = max_len if window is None else int(window)
        if not 1 <= window <= max_len:
            raise ValueError(f"forward_cached: window={window} must be in [1, max_len={max_len}]")
        block = window if block is None else int(block)
        if block < 1:
            raise ValueError(f"forward_cached: block={block} must be >= 1")
        hidden, cache, _ = self._through_layers_routed(
            tokens,
            cache,
            lambda layer, h, c, index: (*layer.forward_cached(h, positions, c, index, window, block), None),
        )
        return hidden, cache

    def forward_paged(
        self, tokens: jax.Array, positions: jax.Array, cache: KVCache, pages: PagedView
    ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """Final-normed hidden [S, 1, D] of one decode step, the updated paged cache, and the experts
        each slot's token was routed to in each MoE layer, int32 [L_moe, S, 1, k] (None for a dense model).

        cache {'k', 'v'}: [L, G, N, P, K, D] page pools (`init_kv_pages`), carried whole through the
        layer loop; each layer writes this step's K/V where `pages` says and reads each slot's keys
        below `pages.lengths` (`layers.Attention.forward_paged`).
        """
        return self._through_layers_routed(
            tokens, cache, lambda layer, h, c, index: layer.forward_paged(h, positions, c, index, pages)
        )

    def _through_layers_routed(
        self,
        tokens: jax.Array,
        cache: KVCache,
        apply: Callable[[DecoderLayer, jax.Array, KVCache, Any], tuple[jax.Array, KVCache, jax.Array | None]],
    ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """Embed, fold `apply(layer, h, cache, layer_index) -> (h, cache, experts or None)` over the
        layers (a scan when stacked), final norm; the cache is carried through the loop and the MoE
        layers' experts are stacked in layer order (None when no layer returns any)."""
        x = self.embed(tokens)
        if self.config.scan_layers:

            def body(layer: DecoderLayer, carry: tuple[jax.Array, KVCache], index: jax.Array, _: None):
                h, c, experts = apply(layer, *carry, index)
                return (h, c), experts

            (x, cache), routed = _scan_stacks(self._stacks(), self.config, body, (x, cache), None)
        else:
            assert not isinstance(self.layers, DecoderLayer)  # a list of layers
            per_layer = []
            for index, layer in enumerate(self.layers):
                x, cache, experts = apply(layer, x, cache, index)
                per_layer += [] if experts is None else [experts]
            routed = jnp.stack(per_layer) if per_layer else None
        return self.final_norm(x), cache, routed


def _checkpointed(
    apply_layer: Callable[..., Any], policy: Callable[..., bool] | None, *, prevent_cse: bool
) -> Callable[..., Any]:
    """`apply_layer(layer, x, pos, given)` under `jax.checkpoint` (the layer passed functionally as
    its state).

    prevent_cse can be False inside `lax.scan`, which already keeps XLA from merging the recomputation.
    """

    def apply(layer: DecoderLayer, x: jax.Array, pos: jax.Array, given: jax.Array | None) -> Any:
        graphdef, state = nnx.split(layer)

        def pure(state: Any, x: jax.Array, pos: jax.Array, given: jax.Array | None) -> Any:
            return apply_layer(nnx.merge(graphdef, state), x, pos, given)

        return jax.checkpoint(pure, policy=policy, prevent_cse=prevent_cse)(state, x, pos, given)

    return apply


def _scan_stacks(
    stacks: list[DecoderLayer],
    config: ModelConfig,
    body: Callable[[DecoderLayer, Any, jax.Array, Any], tuple[Any, Any]],
    carry: Any,
    per_moe_layer: Any,
) -> tuple[Any, Any]:
    """Fold `body(layer_i, carry, i, per_moe_layer[m(i)] or None) -> (carry, out_i or None)` over
    layers i = 0..L-1 of a scanned model with one `lax.scan` of L / p steps, p = len(stacks): step g
    applies layer g p + j from stack j for j = 0..p-1. m(i) is layer i's rank among the MoE layers
    (`per_moe_layer`: a pytree of [L_moe, ...] arrays, or None); the outs that are not None, layer
    order, are stacked as [L_out, ...]."""
    period, steps = len(stacks), config.num_layers // len(stacks)
    moe_rank = {j: rank for rank, j in enumerate(j for j in range(period) if config.is_moe_layer(j))}
    graphdefs, states = zip(*(nnx.split(stack) for stack in stacks))
    per_step = jax.tree.map(lambda a: a.reshape(steps, len(moe_rank), *a.shape[1:]), per_moe_layer)

    def step(carry: Any, xs: tuple[Any, jax.Array, Any]) -> tuple[Any, Any]:
        layer_states, g, given = xs
        outs = []
        for j in range(period):
            layer_given = None if j not in moe_rank else jax.tree.map(lambda a, r=moe_rank[j]: a[r], given)
            carry, out = body(nnx.merge(graphdefs[j], layer_states[j]), carry, g * period + j, layer_given)
            outs += [] if out is None else [out]
        return carry, (jax.tree.map(lambda *o: jnp.stack(o), *outs) if outs else None)

    carry, outs = jax.lax.scan(step, carry, (list(states), jnp.arange(steps, dtype=jnp.int32), per_step))
    return carry, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), outs)


def _check_cache(config: ModelConfig, cache: KVCache, batch: int) -> None:
    expected = (config.num_layers, batch, config.num_kv_heads, config.head_dim)
    for name in ("k", "v"):
        if name not in cache:
            raise ValueError(f"KV cache is missing {name!r} (expected keys 'k' and 'v')")
        shape = cache[name].shape
        if len(shape) != 5 or (shape[0], shape[1], shape[3], shape[4]) != expected:
            raise ValueError(
                f"KV cache {name!r} has shape {tuple(shape)}; expected [num_layers={expected[0]}, "
                f"batch={batch}, max_len, num_kv_heads={expected[2]}, head_dim={expected[3]}]"
            )


def init_kv_cache(
    config: ModelConfig,
    batch: int,
    max_len: int,
    *,
    dtype: str | None = None,
    mesh: Mesh | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
) -> KVCache:
    """Zero KV cache {'k', 'v'}, each [num_layers, batch, max_len, num_kv_heads, head_dim].

    dtype defaults to the body dtype. With a mesh the zeros are created directly on their
    shardings (logical axes `sharding.KV_CACHE_AXES`).
    """
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    cache_dtype = dtype_of(dtype or config.dtype)

    def zeros() -> KVCache:
        return {"k": jnp.zeros(shape, cache_dtype), "v": jnp.zeros(shape, cache_dtype)}

    if mesh is None:
        return zeros()
    spec = sharding.logical_to_spec(sharding.KV_CACHE_AXES, rules, mesh=mesh, shape=shape, name="kv_cache")
    out = NamedSharding(mesh, spec)
    return jax.jit(zeros, out_shardings={"k": out, "v": out})()


def init_kv_pages(
    config: ModelConfig,
    *,
    groups: int,
    pages_per_group: int,
    page_size: int,
    dtype: str | None = None,
    mesh: Mesh | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
) -> KVCache:
    """Zero paged KV cache {'k', 'v'}, each [num_layers, groups, pages_per_group, page_size,
    num_kv_heads, head_dim] (logical axes `sharding.PAGED_KV_CACHE_AXES`: groups like the batch,
    so each device holds the pages of its own slots). dtype defaults to the body dtype."""
    shape = (config.num_layers, groups, pages_per_group, page_size, config.num_kv_heads, config.head_dim)
    cache_dtype = dtype_of(dtype or config.dtype)

    def zeros() -> KVCache:
        return {"k": jnp.zeros(shape, cache_dtype), "v": jnp.zeros(shape, cache_dtype)}

    if mesh is None:
        return zeros()
    out = kv_pages_sharding(shape, mesh, rules)
    return jax.jit(zeros, out_shardings={"k": out, "v": out})()


def kv_pages_sharding(
    shape: tuple[int, ...], mesh: Mesh, rules: sharding.Rules = sharding.DEFAULT_RULES
) -> NamedSharding:
    """Where a paged KV pool of `shape` lives on `mesh` (logical axes `sharding.PAGED_KV_CACHE_AXES`)."""
    spec = sharding.logical_to_spec(sharding.PAGED_KV_CACHE_AXES, rules, mesh=mesh, shape=shape, name="paged kv_cache")
    return NamedSharding(mesh, spec)


def init_transformer(
    config: ModelConfig, *, seed: int = 0, mesh: Mesh | None = None, rules: sharding.Rules = sharding.DEFAULT_RULES
) -> Transformer:
    """A randomly initialized `Transformer` built by one jitted program and, with a mesh, created
    directly on `param_shardings` (an 8B model never sits whole on one device). The draws are those
    of `Transformer(config, rngs=nnx.Rngs(seed))` (equal up to float rounding of the fused program)."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(seed))))
    out_shardings = None if mesh is None else sharding.param_shardings(abstract_state, mesh, rules)
    state = jax.jit(lambda: nnx.state(Transformer(config, rngs=nnx.Rngs(seed))), out_shardings=out_shardings)()
    return nnx.merge(graphdef, state)
