"""Per-device memory plan of a training configuration and of a decode (generator) device, from shapes only.

    python -m scalerl_jax.cli.plan_memory --preset llama3.1-8b --mesh 1,8,1 --microbatch 8 --seq_len 16384
    python -m scalerl_jax.cli.plan_memory --report decode --preset llama3.1-8b --max_len 16384 --page_size 16

Parameters come from `nnx.eval_shape` of the model and their shardings from the logical-axis rules,
so a shard is exact: prod(ceil(dim / mesh axes)) elements. Optimizer state is AdamW's two float32
moments sharded like the parameters; gradients are a float32 accumulator over microbatches plus one
microbatch's gradient in the parameter dtype. Activations are an estimate (stated per term in
`activation_terms`): what `jax.checkpoint` keeps per layer under the remat policy, one layer's full
working set during its backward pass, and the chunked log-prob head. The plan is for a device
`platform` ('gpu' by default: the H100 / H200 it is checked against; 'tpu' for a TPU slice), which
decides what `attention_impl='auto'` means (`layers.resolve_attention_impl`). Device memory comes
from `hardware.facts` (`--device h100 | h200 | v4 | v5e | v5p | v6e` on the command line).

The decode report (`plan_decode`) is for one generator device holding the whole model: how many
decode slots fit next to the weights, (a) without paging, each slot owning max_len tokens of KV, and
(b) with a paged KV pool sized for the expected live tokens of the recipe's length distribution.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from scalerl_jax.hardware.facts import DeviceFacts, facts_for_target
from scalerl_jax.models import sharding
from scalerl_jax.models.config import ModelConfig
from scalerl_jax.models.layers import FLASH_IMPLS, resolve_attention_impl
from scalerl_jax.models.moe import resolve_moe_impl
from scalerl_jax.models.transformer import Transformer

GIB = 1024**3
# Platforms a plan is for, as `jax.default_backend()` / `Device.platform` name them ('cuda' is a GPU).
PLATFORMS = ("gpu", "cuda", "tpu", "cpu")
# The training plan is checked against the 8B run's GPUs unless a device is named; decode plans for an H200.
DEFAULT_FIT_TARGETS = ("h100", "h200")
DEFAULT_DECODE_TARGET = "h200"


def memory_gb(facts: DeviceFacts) -> float:
    """Memory of one device in GB (1e9 bytes), the unit of `MemoryPlan.fits` and `plan_decode`."""
    return facts.memory_bytes / 1e9


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one training configuration."""

    params: int
    optimizer: int
    gradients: int
    activations: int
    activation_terms: Mapping[str, int]
    kv_cache: int

    @property
    def total(self) -> int:
        """Trainer total: params + optimizer + gradients + activations (the KV cache is the sampler's)."""
        return self.params + self.optimizer + self.gradients + self.activations

    def fits(self, device_gb: float, usable_fraction: float = 0.9) -> bool:
        """Whether `total` fits in `usable_fraction` of a device of `device_gb` GB (1e9 bytes)."""
        return self.total <= usable_fraction * device_gb * 1e9


def _mesh_sizes(mesh_shape: Sequence[int] | Mapping[str, int]) -> dict[str, int]:
    if isinstance(mesh_shape, Mapping):
        return {name: int(size) for name, size in mesh_shape.items()}
    if len(mesh_shape) != len(sharding.MESH_AXES):
        raise ValueError(f"mesh shape {tuple(mesh_shape)} must have one entry per axis {sharding.MESH_AXES}")
    return dict(zip(sharding.MESH_AXES, (int(s) for s in mesh_shape)))


def shard_elements(shape: Sequence[int], spec: jax.sharding.PartitionSpec, mesh: Mapping[str, int]) -> int:
    """Elements of the largest shard of an array of `shape` sharded by `spec` over axis sizes `mesh`."""
    total = 1
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        total *= -(-dim // math.prod(mesh[a] for a in names))
    return total


def param_shard_bytes(
    config: ModelConfig, mesh: Mapping[str, int], rules: sharding.Rules, dtype: str | None = None
) -> int:
    """Per-device bytes of all parameters (in `dtype` if given, else their own dtypes)."""
    abstract_state = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    specs = sharding.param_specs(abstract_state, rules, mesh=mesh)
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    total = 0
    for variable, spec in zip(
        jax.tree.leaves(abstract_state, is_leaf=is_variable), jax.tree.leaves(specs, is_leaf=is_variable)
    ):
        value = variable.get_value()
        itemsize = np.dtype(dtype or value.dtype).itemsize
        total += shard_elements(value.shape, spec.get_value(), mesh) * itemsize
    return total


def activation_terms(
    config: ModelConfig,
    mesh: Mapping[str, int],
    *,
    microbatch: int,
    seq_len: int,
    remat_policy: str,
    logprob_chunk: int,
    platform: str = "gpu",
) -> dict[str, int]:
    """Estimated activation bytes per device, by term.

    b = ceil(microbatch / (data * fsdp)) sequences of T tokens per device, tp = tensor size, e =
    body dtype bytes. Per token and layer (dividing heads / mlp / vocab widths by tp):
      layer inputs (scan carry, always kept): D e
      none: all intermediates ~ e (4D + 3 H hd/tp + 4 K hd/tp + 3F/tp) + attention probs
      dots_with_no_batch_dims: e (H hd/tp + 2 K hd/tp + 2D + 2F/tp) (weight-matmul outputs)
      dots: that + attention scores and output; save_qkv_attn: e (2 H hd/tp + 2 K hd/tp); full: 0
      attention scores/probs, when `config.attention_impl` resolves to 'xla' on `platform`:
      H/tp * T * (4 + e); cudnn / splash (flash) keep a float32 softmax statistic and the output instead:
      H/tp * (4 + hd e)
    Working set of one layer during its backward: the `none` amount for one layer. Head: the
    float32 hidden states (b T D 4) and ~4 float32 [b, chunk, V/tp] buffers per log-prob chunk.
    A mixture-of-experts layer (E experts of width F, r per token) counts F r (ragged: each token's
    r expert rows) or F E (dense: every expert on every token) as its F, plus its float32 router
    logits and probabilities (8 E) and the expert outputs before they combine (ragged: r D (e + 4),
    the gathered rows and their float32 sum; dense: E D (e + 4)), the impl being what
    `config.moe_impl` resolves to on `platform`.
    """
    d, f, h, k, hd = (
        config.hidden_size,
        config.intermediate_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
    )
    e = np.dtype(config.dtype).itemsize
    tp = mesh.get("tensor", 1)
    b = -(-microbatch // (mesh.get("data", 1) * mesh.get("fsdp", 1)))
    tokens = b * seq_len
    if platform not in PLATFORMS:
        raise ValueError(f"activation_terms: unknown platform {platform!r}; expected one of {PLATFORMS}")
    flash = resolve_attention_impl(config, platform, seq_len) in FLASH_IMPLS
    scores = (h / tp) * (4 + hd * e) if flash else (h / tp) * seq_len * (4 + e)

    def per_token(width: float, extra: float) -> dict[str, float]:
        """Bytes per token of one layer whose MLP is `width` wide, by remat policy (`extra`: the
        MoE router and expert outputs, kept whole whenever the MLP's outputs are)."""
        everything = e * (4 * d + 3 * h * hd / tp + 4 * k * hd / tp + 3 * width / tp) + scores + extra
        weight_dots = e * (h * hd / tp + 2 * k * hd / tp + 2 * d + 2 * width / tp) + extra
        return {
            "none": everything,
            "full": 0.0,
            "dots_with_no_batch_dims": weight_dots,
            "dots": weight_dots + scores + e * h * hd / tp,
            "save_qkv_attn": e * (2 * h * hd / tp + 2 * k * hd / tp),
        }

    dense = per_token(f, 0.0)
    if remat_policy not in dense:
        raise ValueError(f"activation_terms: unknown remat_policy {remat_policy!r}; expected one of {sorted(dense)}")
    experts, chosen, width = config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size
    rows = experts if resolve_moe_impl(config.moe_impl, platform) == "dense" else chosen
    shared = config.shared_expert_intermediate_size
    moe = per_token(width * rows + shared, 8 * experts + rows * d * (e + 4)) if experts else dense
    layers = [moe if config.is_moe_layer(i) else dense for i in range(config.num_layers)]
    return {
        "layer_inputs": int(config.num_layers * tokens * d * e),
        "saved_by_remat_policy": int(tokens * sum(layer[remat_policy] for layer in layers)),
        "one_layer_working_set": int(tokens * max(layer["none"] for layer in layers)) if remat_policy != "none" else 0,
        "head_hidden_fp32": int(tokens * d * 4),
        "logprob_chunk": int(4 * b * min(logprob_chunk, seq_len) * -(-config.vocab_size // tp) * 4),
    }


def kv_cache_bytes(
    config: ModelConfig,
    mesh: Mapping[str, int],
    *,
    slots: int,
    max_len: int,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
) -> int:
    """Per-device bytes of the sampler's KV cache ({'k', 'v'} [L, slots, max_len, K, hd])."""
    shape = (config.num_layers, slots, max_len, config.num_kv_heads, config.head_dim)
    spec = sharding.logical_to_spec(sharding.KV_CACHE_AXES, rules, mesh=mesh, shape=shape, name="kv_cache")
    return 2 * shard_elements(shape, spec, mesh) * np.dtype(config.dtype).itemsize


def kv_bytes_per_token(config: ModelConfig) -> int:
    """K and V of one token over all layers: 2 * layers * kv_heads * head_dim * body dtype bytes."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * np.dtype(config.dtype).itemsize


def generator_weight_bytes(config: ModelConfig, rules: sharding.Rules = sharding.DEFAULT_RULES) -> int:
    """Bytes of every parameter on one unsharded device, in its own dtype (body dtype; float32 head
    when `fp32_head`, as the generator holds it)."""
    return param_shard_bytes(config, {"data": 1, "fsdp": 1, "tensor": 1}, rules)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Decode slots of one generator device (bytes; 1 GB = 1e9 bytes).

    KV budget = device - reserve - weights, reserve = (1 - usable_fraction) * device (memory XLA
    does not take) + workspace (decode and prefill scratch). Without paging a slot owns max_len
    tokens: slots = floor(budget / (max_len * kv_per_token)). With paging a slot holds the pages
    of its live tokens. A slot's live length grows by one token per decode step from the prompt to
    prompt + completion, so with slots at staggered points of their completions (steady state of
    continuous batching) a slot holds on average prompt + completion / 2 tokens: the pool is sized
    for ceil(that / page_size) pages per slot. If all slots started together (synchronized, e.g.
    a cold start) they would reach prompt + completion at once: `pages_per_slot_synchronized`. A pool
    sized for the mean runs short when the slots' live tokens rise above it; the engine then preempts
    its youngest sequence (sampler.engine), so the mean sizing trades slots for occasional preemption.
    """

    device_bytes: int
    usable_fraction: float
    workspace: int
    weights: int
    kv_per_token: int
    max_len: int
    page_size: int
    mean_prompt: float
    mean_completion: float

    @property
    def reserve(self) -> int:
        return round(self.device_bytes * (1 - self.usable_fraction)) + self.workspace

    @property
    def kv_budget(self) -> int:
        return max(0, self.device_bytes - self.reserve - self.weights)

    @property
    def slots_unpaged(self) -> int:
        return self.kv_budget // (self.max_len * self.kv_per_token)

    @property
    def live_tokens_per_slot(self) -> float:
        """Mean live tokens of a slot in steady state: prompt + completion / 2 (capped at max_len)."""
        return min(float(self.max_len), self.mean_prompt + self.mean_completion / 2)

    @property
    def pages_per_slot(self) -> int:
        return math.ceil(self.live_tokens_per_slot / self.page_size)

    @property
    def slots_paged(self) -> int:
        return self.kv_budget // (self.pages_per_slot * self.page_size * self.kv_per_token)

    @property
    def num_pages(self) -> int:
        """Pool size (EngineConfig.num_pages) for `slots_paged` slots."""
        return self.slots_paged * self.pages_per_slot

    @property
    def pages_per_slot_synchronized(self) -> int:
        return math.ceil(min(float(self.max_len), self.mean_prompt + self.mean_completion) / self.page_size)

    @property
    def slots_paged_synchronized(self) -> int:
        return self.kv_budget // (self.pages_per_slot_synchronized * self.page_size * self.kv_per_token)


def plan_decode(
    config: ModelConfig,
    *,
    max_len: int,
    page_size: int,
    mean_prompt: float,
    mean_completion: float,
    device_gb: float = memory_gb(facts_for_target(DEFAULT_DECODE_TARGET)),
    usable_fraction: float = 0.9,
    workspace_gb: float = 4.0,
) -> DecodePlan:
    """DecodePlan of `config` (its dtypes as the generator holds them) on one device of `device_gb` GB."""
    if page_size < 1 or max_len < 1:
        raise ValueError(f"plan_decode: page_size={page_size} and max_len={max_len} must be >= 1")
    if not 0 < usable_fraction <= 1:
        raise ValueError(f"plan_decode: usable_fraction={usable_fraction} must be in (0, 1]")
    return DecodePlan(
        device_bytes=int(device_gb * 1e9),
        usable_fraction=usable_fraction,
        workspace=int(workspace_gb * 1e9),
        weights=generator_weight_bytes(config),
        kv_per_token=kv_bytes_per_token(config),
        max_len=max_len,
        page_size=page_size,
        mean_prompt=float(mean_prompt),
        mean_completion=float(mean_completion),
    )


def format_decode_plan(plan: DecodePlan, title: str) -> str:
    """Human-readable decode report in GB (1e9 bytes), with its assumptions."""
    gb = lambda n: f"{n / 1e9:10.2f} GB"  # noqa: E731
    per_slot_paged = plan.pages_per_slot * plan.page_size * plan.kv_per_token
    return "\n".join(
        [
            title,
            f"  {'device':<34}{gb(plan.device_bytes)}",
            f"  {'generator weights':<34}{gb(plan.weights)}",
            f"  {'reserve':<34}{gb(plan.reserve)} ({1 - plan.usable_fraction:.0%} of the device not "
            f"taken by XLA + {plan.workspace / 1e9:.1f} GB decode/prefill workspace)",
            f"  {'KV budget':<34}{gb(plan.kv_budget)}",
            f"  {'KV per token':<34}{plan.kv_per_token:10,d} B (2 x layers x kv_heads x head_dim x dtype bytes)",
            f"  (a) no paging: {plan.max_len} tokens per slot = {plan.max_len * plan.kv_per_token / 1e9:.3f} GB "
            f"-> {plan.slots_unpaged} slots",
            f"  (b) paging, page_size {plan.page_size}: assumed mean prompt {plan.mean_prompt:,.0f} + mean "
            f"completion {plan.mean_completion:,.0f} tokens; slots at staggered points of their completions "
            f"hold prompt + completion / 2 = {plan.live_tokens_per_slot:,.0f} live tokens on average -> "
            f"{plan.pages_per_slot} pages = {per_slot_paged / 1e9:.3f} GB per slot -> {plan.slots_paged} slots "
            f"(EngineConfig(num_slots={plan.slots_paged}, page_size={plan.page_size}, "
            f"num_pages={plan.num_pages}))",
            f"      live tokens above the mean make the engine preempt its youngest sequence; if all slots "
            f"were at prompt + completion at once (synchronized start): "
            f"{plan.pages_per_slot_synchronized} pages per slot -> {plan.slots_paged_synchronized} slots",
        ]
    )


def plan_memory(
    config: ModelConfig,
    mesh_shape: Sequence[int] | Mapping[str, int],
    *,
    microbatch: int,
    seq_len: int,
    remat_policy: str | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    logprob_chunk: int = 512,
    kv_slots: int = 0,
    platform: str = "gpu",
) -> MemoryPlan:
    """MemoryPlan for training `config` on a mesh (data, fsdp, tensor) of `platform` devices at
    `microbatch` sequences of `seq_len` tokens per microbatch (global), plus a sampler KV cache of
    `kv_slots` slots."""
    mesh = _mesh_sizes(mesh_shape)
    params = param_shard_bytes(config, mesh, rules)
    params_fp32 = param_shard_bytes(config, mesh, rules, dtype="float32")
    terms = activation_terms(
        config,
        mesh,
        microbatch=microbatch,
        seq_len=seq_len,
        remat_policy=remat_policy or config.remat_policy,
        logprob_chunk=logprob_chunk,
        platform=platform,
    )
    return MemoryPlan(
        params=params,
        # AdamW's fp32 mu and nu, and the optimizer's fp32 master copy of every param whenever some
        # param is not fp32 (`train.optimizer`: a bf16 body).
        optimizer=(2 if params == params_fp32 else 3) * params_fp32,
        gradients=params_fp32 + params,
        activations=sum(terms.values()),
        activation_terms=terms,
        kv_cache=kv_cache_bytes(config, mesh, slots=kv_slots, max_len=seq_len, rules=rules) if kv_slots else 0,
    )


def format_plan(
    plan: MemoryPlan,
    title: str,
    usable_fraction: float = 0.9,
    devices: Sequence[DeviceFacts] = tuple(facts_for_target(t) for t in DEFAULT_FIT_TARGETS),
) -> str:
    """Human-readable table of a MemoryPlan in GiB, with whether it fits each of `devices`."""
    lines = [
        title,
        f"  {'params':<28}{plan.params / GIB:10.2f} GiB",
        f"  {'optimizer (mu, nu, master)':<28}{plan.optimizer / GIB:10.2f} GiB",
        f"  {'gradients (fp32 acc + 1 mb)':<28}{plan.gradients / GIB:10.2f} GiB",
        f"  {'activations (estimate)':<28}{plan.activations / GIB:10.2f} GiB",
    ]
    lines += [f"    {name:<26}{value / GIB:10.2f} GiB" for name, value in plan.activation_terms.items()]
    lines.append(f"  {'total per device':<28}{plan.total / GIB:10.2f} GiB")
    if plan.kv_cache:
        lines.append(f"  {'sampler KV cache':<28}{plan.kv_cache / GIB:10.2f} GiB (generator devices)")
    for facts in devices:
        gb = memory_gb(facts)
        verdict = "fits" if plan.fits(gb, usable_fraction) else "does NOT fit"
        lines.append(f"  {facts.name}: {verdict} ({plan.total / 1e9:.1f} GB of {usable_fraction:.0%} x {gb:g} GB)")
    return "\n".join(lines)
