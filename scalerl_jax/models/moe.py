"""Mixture-of-experts feed-forward block (dropless top-k routing over SwiGLU experts).

For a token x [D], router weights W_r [D, E] and experts e = 1..E with SwiGLU weights
(G_e, U_e [D, F], W_e [F, D]):

  logits = float32(x) @ float32(W_r)                      (router logits, float32)
  p = softmax(logits)                                     (the router's distribution)

  'softmax_topk' (Qwen3-MoE): (w, idx) = top_k(p, k), w = w / sum(w) when norm_topk_prob,
      y = sum_j w_j * expert_idx_j(x)
  'sigmoid_topk' (Llama 4): idx = top_k(logits, k), w_j = sigmoid(logits_idx_j),
      y = sum_j expert_idx_j(w_j * x) + shared(x)
  with expert_e(x) = (silu(x G_e) * (x U_e)) W_e and `shared` a SwiGLU MLP on every token (when
  `shared_expert_intermediate_size` > 0).

Every token reaches each of its k experts (no capacity limit, so nothing is dropped).

Expert parallelism (`experts_dispatched`): with the experts split over a mesh axis of size P that
also splits the tokens, each device gathers the tokens (and their routing) of its P-device group,
computes the (token, expert) pairs of its own E / P experts, and the partial outputs are summed
back to the devices that hold the tokens by a reduce-scatter: per device, P n D values in each
direction for its n tokens, as much as an all-to-all of the n k routed copies when k = P, with
static shapes and nothing dropped.

Router replay: given the experts another program chose for some tokens (the sampler's, recorded as
it generated them), `MoE.forward_with_stats` computes those tokens with the recorded experts in
place of its own top-k, each weighted by this layer's own gate for that expert (softmax_topk: p_e,
renormalized over the k when norm_topk_prob; sigmoid_topk: sigmoid(logit_e)), so the gradient
still reaches the router.

`MoE.forward_with_stats` also sums, over the tokens a mask keeps, what the router did
(`RouterStats`): per expert the token choices it received and its router probability, the router's
entropy -sum_e p_e log p_e, the choices naming no expert, and of the tokens with recorded experts
how many this layer's own top-k set differs from them (routing mismatch). From one layer's sums
with N kept tokens, transformers' load-balancing loss (Switch Transformer, as Qwen3-MoE computes it
over all layers' tokens at once) is
  aux = E * sum_e (sum_l tokens_{l,e} / (L N)) * (sum_l prob_{l,e} / (L N))   (`load_balancing_loss`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from scalerl_jax.models import sharding
from scalerl_jax.models.config import ModelConfig
from scalerl_jax.models.layers import MLP, dtype_of, make_param


class RouterStats(NamedTuple):
    """A layer's routing summed over the kept tokens (float32; a leading layer axis when stacked)."""

    expert_tokens: jax.Array  # [E] token choices routed to each expert
    expert_prob: jax.Array  # [E] sum of each expert's router probability
    entropy: jax.Array  # [] sum of the router's entropy
    tokens: jax.Array  # [] kept tokens N
    dropped: jax.Array  # [] token choices whose expert index is outside [0, E): computed by no expert
    recorded: jax.Array  # [] kept tokens with recorded experts
    mismatched: jax.Array  # [] of those, tokens whose own top-k set differs from the recorded one


def same_expert_set(a: jax.Array, b: jax.Array) -> jax.Array:
    """bool [N]: whether rows of expert indices a, b [N, k] (k distinct each) name the same set."""
    return jnp.all(jnp.sort(a, axis=-1) == jnp.sort(b, axis=-1), axis=-1)


def router_stats(
    probs: jax.Array,
    experts: jax.Array,
    mask: jax.Array,
    own: jax.Array | None = None,
    recorded: jax.Array | None = None,
) -> RouterStats:
    """`RouterStats` of router probabilities [N, E] and computed experts [N, k] over tokens with
    mask [N] = 1; with `recorded` [N, k] (a row of -1: none recorded), also how many recorded rows
    differ as a set from this router's own top-k `own` [N, k]."""
    num_experts = probs.shape[-1]
    mask = mask.astype(jnp.float32)
    named = (experts >= 0) & (experts < num_experts)
    choice_mask = jnp.broadcast_to(mask[:, None], experts.shape)
    # A scatter-add, not a one-hot [N, k, E]: at 16k tokens x 128 experts that would be gigabytes.
    expert_tokens = (
        jnp.zeros((num_experts,), jnp.float32).at[jnp.where(named, experts, num_experts)].add(choice_mask, mode="drop")
    )
    entropy = -jnp.sum(jnp.where(probs > 0, probs * jnp.log(probs), 0.0), axis=-1)
    zero = jnp.zeros((), jnp.float32)
    has_record = zero if recorded is None else mask * (recorded[:, 0] >= 0)
    differs = zero if recorded is None or own is None else has_record * ~same_expert_set(own, recorded)
    return RouterStats(
        expert_tokens=expert_tokens,
        expert_prob=jnp.einsum("ne,n->e", probs, mask),
        entropy=jnp.sum(entropy * mask),
        tokens=jnp.sum(mask),
        dropped=jnp.sum(jnp.where(named, 0.0, choice_mask)),
        recorded=jnp.sum(has_record),
        mismatched=jnp.sum(differs),
    )


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """The module docstring's `aux` from stacked per-layer stats ([L, E], [L]); 0 without tokens."""
    num_experts = stats.expert_tokens.shape[-1]
    total = jnp.maximum(jnp.sum(stats.tokens), 1.0)
    fraction = jnp.sum(stats.expert_tokens, axis=0) / total
    prob = jnp.sum(stats.expert_prob, axis=0) / total
    return num_experts * jnp.sum(fraction * prob)


def route_softmax_topk(probs: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights float32 [N, k], experts int32 [N, k]) of router probabilities [N, E]: the k largest
    (largest first) and their experts, divided by their sum when `normalize`."""
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def route_sigmoid_topk(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(weights float32 [N, k], experts int32 [N, k]) of router logits [N, E]: the k largest logits
    (largest first), each weighted sigmoid(logit) (not renormalized)."""
    top, experts = jax.lax.top_k(logits, k)
    return jax.nn.sigmoid(top), experts.astype(jnp.int32)


def gate_weights(
    logits: jax.Array, probs: jax.Array, experts: jax.Array, *, routing: str, normalize: bool
) -> jax.Array:
    """float32 [N, k]: the gate of each given expert [N, k] under this router (module docstring):
    the weights its own top-k would give those experts."""
    if routing == "sigmoid_topk":
        return jax.nn.sigmoid(jnp.take_along_axis(logits, experts, axis=-1))
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    return weights / jnp.sum(weights, axis=-1, keepdims=True) if normalize else weights


def experts_dense(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    scale_input: bool = False,
) -> jax.Array:
    """y [N, D] = sum_j weights[:, j] * expert_{experts[:, j]}(x) (with `scale_input`:
    sum_j expert_{experts[:, j]}(weights[:, j] * x)), computed by running all E experts on every
    token with a [N, E] combine matrix that is zero off the chosen experts (an expert given a zero
    input returns zero: SwiGLU has no bias). An expert index E names no expert: the pair adds 0."""
    num_experts = gate.shape[0]
    combine = jnp.zeros((x.shape[0], num_experts), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], experts].add(weights, mode="drop")
    if scale_input:
        rows = (x.astype(jnp.float32)[:, None, :] * combine[:, :, None]).astype(x.dtype)  # [N, E, D]
        hidden = jax.nn.silu(jnp.einsum("ned,edf->nef", rows, gate)) * jnp.einsum("ned,edf->nef", rows, up)
        return jnp.einsum("nef,efd->nd", hidden, down)
    hidden = jax.nn.silu(jnp.einsum("nd,edf->nef", x, gate)) * jnp.einsum("nd,edf->nef", x, up)
    out = jnp.einsum("nef,efd->ned", hidden, down)
    return jnp.einsum("ned,ne->nd", out.astype(jnp.float32), combine).astype(x.dtype)


def experts_ragged(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    scale_input: bool = False,
) -> jax.Array:
    """As `experts_dense`, with each (token, expert) pair computed once: the N*k pairs are sorted by
    expert, each projection is one grouped matmul over the sorted rows (`jax.lax.ragged_dot`, group
    sizes = tokens per expert), and the rows, weighted (on the way in with `scale_input`, else on
    the way out), are added back to their tokens. Pairs naming expert E sort last, outside every
    group: the grouped matmul leaves their rows 0."""
    num_tokens, k = experts.shape
    num_experts = gate.shape[0]
    flat_experts = experts.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat_experts, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    pair_weights = weights.reshape(-1)[order][:, None]
    rows = x[token_of]
    if scale_input:
        rows = (rows.astype(jnp.float32) * pair_weights).astype(x.dtype)
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, group_sizes)) * jax.lax.ragged_dot(rows, up, group_sizes)
    out = jax.lax.ragged_dot(hidden, down, group_sizes).astype(jnp.float32)
    if not scale_input:
        out = out * pair_weights
    return jnp.zeros((num_tokens, x.shape[-1]), jnp.float32).at[token_of].add(out).astype(x.dtype)


# Tokens one device gathers from its expert group per dispatch block (`experts_dispatched`): bounds
# the [tokens, expert width] buffers of the grouped matmuls, forward and backward.
DISPATCH_GATHERED_TOKENS = 32_768


def experts_dispatched(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    layout: sharding.ExpertParallel,
    compute: Callable[..., jax.Array],
    scale_input: bool = False,
    max_gathered_tokens: int = DISPATCH_GATHERED_TOKENS,
) -> jax.Array:
    """`compute(x, weights, experts, gate, up, down)` (`experts_dense` or `experts_ragged`) with the
    experts split over `layout.expert_axis` (module docstring), under `jax.shard_map`: each device
    all-gathers the tokens [n, D], weights and experts [n, k] of its expert group, computes the
    pairs naming its own experts (the others renamed to 'no expert'), and its [P n, D] partial
    output (summed over the expert width when that is split over `layout.mlp_axis`) is
    reduce-scattered back to the tokens' devices.

    The n local tokens go in c consecutive blocks (c the smallest divisor of n with P n / c <=
    `max_gathered_tokens`), one after another under `jax.checkpoint`: every token's output depends
    on that token alone, and a device's buffers then hold P n / c gathered tokens, not P n (Scout's
    16-device group at 16k tokens a device would gather 262,144)."""
    axis, mlp_axis = layout.expert_axis, layout.mlp_axis

    def block(x, weights, experts, gate, up, down):
        num_local = gate.shape[0]
        xs, ws, es = (jax.lax.all_gather(a, axis, axis=0, tiled=True) for a in (x, weights, experts))
        es = es - jax.lax.axis_index(axis) * num_local
        mine = (es >= 0) & (es < num_local)
        y = compute(
            xs, jnp.where(mine, ws, 0.0), jnp.where(mine, es, num_local), gate, up, down, scale_input=scale_input
        )
        if mlp_axis is not None:
            y = jax.lax.psum(y, mlp_axis)
        return jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)

    def local(x, weights, experts, gate, up, down):
        n = x.shape[0]
        group = layout.mesh.shape[axis]
        blocks = next(c for c in range(1, n + 1) if n % c == 0 and (group * n // c <= max_gathered_tokens or c == n))
        if blocks == 1:
            return block(x, weights, experts, gate, up, down)
        per_block = jax.checkpoint(lambda xwe: block(xwe[0], xwe[1], xwe[2], gate, up, down))
        split = tuple(a.reshape(blocks, n // blocks, *a.shape[1:]) for a in (x, weights, experts))
        return jax.lax.map(per_block, split).reshape(x.shape)

    tokens = PartitionSpec(layout.token_axes, None)
    expert_in, expert_out = PartitionSpec(axis, None, mlp_axis), PartitionSpec(axis, mlp_axis, None)
    return jax.shard_map(
        local,
        mesh=layout.mesh,
        in_specs=(tokens, tokens, tokens, expert_in, expert_in, expert_out),
        out_specs=tokens,
        check_vma=False,  # the output is the same on every `mlp_axis` shard once summed there
    )(x, weights, experts, gate, up, down)


def resolve_moe_impl(name: str, platform: str) -> str:
    """'auto' -> 'dense' on CPU (E x the FLOPs, no gather / scatter), 'ragged' elsewhere."""
    if name != "auto":
        return name
    return "dense" if platform == "cpu" else "ragged"


class MoE(nnx.Module):
    """x [..., D] -> [..., D]: the module docstring's block with `config`'s experts and routing."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        self.config = config
        d, e, f = config.hidden_size, config.num_experts, config.moe_intermediate_size
        dtype, std = dtype_of(config.dtype), config.initializer_range
        self.router = make_param(rngs, (d, e), ("embed", None), dtype=dtype, stddev=std, stack=stack)
        self.gate_proj = make_param(rngs, (e, d, f), ("expert", "embed", "mlp"), dtype=dtype, stddev=std, stack=stack)
        self.up_proj = make_param(rngs, (e, d, f), ("expert", "embed", "mlp"), dtype=dtype, stddev=std, stack=stack)
        self.down_proj = make_param(rngs, (e, f, d), ("expert", "mlp", "embed"), dtype=dtype, stddev=std, stack=stack)
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, rngs=rngs, stack=stack, width=config.shared_expert_intermediate_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.forward_with_stats(x, None)[0]

    def forward_with_stats(
        self,
        x: jax.Array,
        token_mask: jax.Array | None,
        recorded: jax.Array | None = None,
        *,
        replay: bool = True,
    ) -> tuple[jax.Array, RouterStats, jax.Array]:
        """(y [..., D], `RouterStats` over the tokens of x [..., D] where token_mask [...] is 1 (all
        tokens when it is None), this router's own top-k experts int32 [..., k]). With `recorded`
        integer [..., k] (rows of -1: none recorded), the stats count the tokens whose own top-k
        set differs from it, and with `replay` the tokens it names are computed with those experts."""
        config = self.config
        tokens = x.reshape(-1, x.shape[-1])
        logits = jnp.einsum(
            "nd,de->ne",
            tokens.astype(jnp.float32),
            self.router[...].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        probs = jax.nn.softmax(logits, axis=-1)
        if config.routing == "sigmoid_topk":
            weights, experts = route_sigmoid_topk(logits, config.num_experts_per_tok)
        else:
            weights, experts = route_softmax_topk(probs, config.num_experts_per_tok, config.norm_topk_prob)
        own = experts
        given = None if recorded is None else recorded.reshape(-1, config.num_experts_per_tok).astype(jnp.int32)
        if given is not None and replay:
            has_record = given[:, :1] >= 0
            experts = jnp.where(has_record, given, own)
            replayed = gate_weights(logits, probs, experts, routing=config.routing, normalize=config.norm_topk_prob)
            weights = jnp.where(has_record, replayed, weights)
        impl = resolve_moe_impl(config.moe_impl, sharding.trace_platform())
        compute = experts_dense if impl == "dense" else experts_ragged
        layout = sharding.expert_parallel(tokens.shape[0], config.num_experts)
        if layout is not None:
            compute = functools.partial(experts_dispatched, layout=layout, compute=compute)
        out = compute(
            tokens,
            weights,
            experts,
            self.gate_proj[...],
            self.up_proj[...],
            self.down_proj[...],
            scale_input=config.routing == "sigmoid_topk",
        )
        out = out.reshape(x.shape)
        if config.shared_expert_intermediate_size:  # on x [B, T, D]: the MLP's activation layout is per (B, T)
            out = out + self.shared_expert(x)
        mask = jnp.ones(tokens.shape[:1]) if token_mask is None else token_mask.reshape(-1)
        stats = router_stats(probs, experts, mask, own, given)
        return out, stats, own.reshape(*x.shape[:-1], -1)
