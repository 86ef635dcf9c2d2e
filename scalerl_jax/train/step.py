"""The RL train step as pure functions: log-probs, policy loss, microbatched gradients, AdamW update.

The loss, its aggregation and its metrics are those of `scalerl_jax.rl`; one step on a batch of B
rows (layouts in `scalerl_jax.contracts.batch_layout`) dealt into M microbatches of R = B / M rows:
  1. Over the whole batch, from the per-row arrays (`prepare_rows`):
       A = compute_advantages(rewards, group_ids, normalization, valid=sample_valid)
       s = row_scales(n, group_ids, aggregation), n_b the loss tokens of row b (0 if not valid)
     so the loss is L = sum_{b,t} m[b,t] s_b x[b,t], m = loss_mask * sample_valid, x the per-token
     policy terms. Then A, s and sample_valid are dealt into microbatches (row b to microbatch
     b mod M, so each microbatch takes rows from every batch shard).
  2. Per microbatch m (`accumulate_microbatch`): logp = sequence_logprobs(policy, tokens,
     temperature) with the model's (fp32) head, sums = policy_sums(logp, behavior_logp, A, m, s),
     and grad L_m of L_m = sums.loss, added to an fp32 accumulator; the sums of the microbatches
     combine (`combine_policy_sums`). A mixture-of-experts policy also sums its routing over the
     microbatch's real tokens (prompt and completion of valid rows, `routed_token_mask`) and, with
     `router_aux_loss_coef` = c > 0, adds c aux_m / M to L_m (aux_m its load-balancing loss,
     `moe.load_balancing_loss`; the mean over microbatches, as gradient accumulation averages
     it). With the sampler's routing in the batch (`TrainStepConfig.routing`), each MoE
     layer counts the recorded tokens whose own top-k set differs from the sampler's, and with
     `router_replay` computes them with the sampler's experts (router replay, `moe` module).
     Since A and s were fixed over the whole batch and x[b, :] depends on row b only,
     L = sum_m L_m and grad L = sum_m grad L_m exactly, for every aggregation.
  3. Metrics from the combined sums (`policy_metrics`, `train_step_metrics`), then the AdamW update
     (fp32 master weights, see optimizer.py). If the loss or the gradient norm is not finite and
     `skip_nonfinite`, the state is returned unchanged and `train/finite` is 0.

The drivers that jit these functions, place their arrays and compile them ahead of time are in
`compiled.py`: an unsorted batch runs `train_step` as one program; a length-sorted batch runs
`prepare_rows`, then `accumulate_microbatch` once per microbatch, then `train_step_metrics` and
`apply_update`, each its own program.

Precision: log-probs, losses, metrics and the gradient accumulator are fp32 whatever the body
dtype of the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from scalerl_jax.contracts.batch_layout import ROUTING_KEY, deal_microbatches, microbatch_spec
from scalerl_jax.models.logprobs import next_token_logprobs
from scalerl_jax.models.moe import RouterStats, load_balancing_loss
from scalerl_jax.rl import (
    PolicySums,
    combine_policy_sums,
    compute_advantages,
    count_sequences_and_prompts,
    effective_mask,
    policy_metrics,
    policy_sums,
    row_scales,
)
from scalerl_jax.rl.groups import safe_divide
from scalerl_jax.train.optimizer import OptimizerState, init_optimizer_state, optimizer_update
from scalerl_jax.train.step_config import TrainStepConfig


class TrainState(NamedTuple):
    """Policy params (model dtype), optimizer state (fp32, with master weights) and update count."""

    params: Any
    opt_state: OptimizerState
    step: jax.Array


def create_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    """TrainState at step 0 for `params` (an nnx.State from `nnx.split(model)`)."""
    return TrainState(params=params, opt_state=init_optimizer_state(optimizer, params), step=jnp.zeros((), jnp.int32))


class RowTerms(NamedTuple):
    """Per-row inputs of the microbatch losses, dealt [M, R] (row p of microbatch m at [m, p])."""

    advantages: jax.Array
    scales: jax.Array  # rl.row_scales over the whole batch
    valid: jax.Array  # sample_valid as float


class RowStats(NamedTuple):
    """Whole-batch counts of the per-row inputs."""

    num_prompts: jax.Array  # prompts with a loss token
    num_samples: jax.Array  # rows with a loss token
    advantage_abs_mean: jax.Array  # mean |A| over valid rows


class Accumulator(NamedTuple):
    """What the microbatches add up: the fp32 gradient, the combined `PolicySums`, the entropy sum
    sum m H, the `PolicySums` of microbatch 0, and for a mixture-of-experts policy its routing
    statistics ([MoE layers, experts]) and the sum of the microbatches' load-balancing losses
    (None for a dense one)."""

    grads: Any
    totals: PolicySums
    entropy: jax.Array
    first: PolicySums
    routing: RouterStats | None = None
    aux_loss: jax.Array | None = None


def prepare_rows(rows: dict, config: TrainStepConfig) -> tuple[RowTerms, RowStats]:
    """Step 1 (module docstring): advantages and row scales over the whole batch, dealt into
    microbatches, and the batch's counts; `rows` holds the per-row arrays of
    `batch_layout.SORTED_ROW_SPEC`."""
    valid = rows["sample_valid"].astype(jnp.float32)
    group_ids = rows["group_ids"].astype(jnp.int32)
    advantages = compute_advantages(
        rows["rewards"], group_ids, normalization=config.advantage_normalization, valid=rows["sample_valid"]
    )
    tokens_per_row = rows["loss_tokens"].astype(jnp.float32) * valid
    scales = row_scales(tokens_per_row, group_ids, aggregation=config.aggregation)
    num_samples, num_prompts = count_sequences_and_prompts(tokens_per_row, group_ids)
    deal = lambda x: deal_microbatches(x, config.num_microbatches)
    stats = RowStats(
        num_prompts=num_prompts,
        num_samples=num_samples,
        advantage_abs_mean=safe_divide(jnp.sum(jnp.abs(advantages)), jnp.sum(valid)),
    )
    return RowTerms(advantages=deal(advantages), scales=deal(scales), valid=deal(valid)), stats


def zero_accumulator(params, config: TrainStepConfig) -> Accumulator:
    """An empty `Accumulator` for `params` (and `config`'s MoE layers and experts)."""
    zero = jnp.zeros((), jnp.float32)
    routing = None
    if config.moe_layers:
        layers, experts = jnp.zeros((config.moe_layers, config.num_experts)), jnp.zeros((config.moe_layers,))
        routing = RouterStats(
            expert_tokens=layers,
            expert_prob=layers,
            entropy=experts,
            tokens=experts,
            dropped=experts,
            recorded=experts,
            mismatched=experts,
        )
    return Accumulator(
        grads=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        totals=PolicySums.zeros(),
        entropy=zero,
        first=PolicySums.zeros(),
        routing=routing,
        aux_loss=zero if config.moe_layers else None,
    )


def routed_token_mask(loss_mask: jax.Array, valid: jax.Array) -> jax.Array:
    """float32 [R, T]: 1 on the real tokens of valid rows, prompt and completion: a row is right
    padded after its completion, so those are the positions up to its last loss-mask token (none
    for a row without one)."""
    length = loss_mask.shape[1]
    has_loss = jnp.any(loss_mask > 0, axis=1)
    last = length - 1 - jnp.argmax(loss_mask[:, ::-1] > 0, axis=1)
    real = jnp.arange(length)[None, :] <= last[:, None]
    return (real & has_loss[:, None]).astype(jnp.float32) * valid[:, None].astype(jnp.float32)


def _microbatch_loss(graphdef, params, microbatch: dict, row_terms: RowTerms, config: TrainStepConfig):
    """(L_m, (its `PolicySums`, sum m H, its `RouterStats` and load-balancing loss or None)) of one
    microbatch (arrays [R, T_m]) and its rows' terms [R]."""
    model = nnx.merge(graphdef, params)
    tokens = microbatch["tokens"].astype(jnp.int32)
    routed = routed_token_mask(microbatch["loss_mask"], row_terms.valid)
    recorded = None
    if config.routing:  # [R, T, L_moe, k] -> [L_moe, R, T, k]
        recorded = jnp.moveaxis(microbatch[ROUTING_KEY], 2, 0).astype(jnp.int32)
    hidden, routing = model.hidden_with_routing(tokens, routed, recorded=recorded, replay=config.router_replay)
    logp, entropy = next_token_logprobs(
        model.head,
        hidden,
        tokens,
        temperature=config.temperature,
        chunk_size=config.logprob_chunk_size,
        with_entropy=True,
    )
    assert entropy is not None  # with_entropy
    mask = effective_mask(microbatch["loss_mask"], row_terms.valid)
    sums = policy_sums(
        logp,
        microbatch["behavior_logp"],
        row_terms.advantages,
        mask,
        row_terms.scales,
        objective=config.objective,
        eps_low=config.eps_low,
        eps_high=config.eps_high,
        eps_max=config.eps_max,
    )
    loss, aux = sums.loss, None
    if routing is not None:
        aux = load_balancing_loss(routing)
        loss = loss + config.router_aux_loss_coef * aux / config.num_microbatches
    return loss, jax.lax.stop_gradient((sums, jnp.sum(mask * entropy), routing, aux))


def accumulate_microbatch(
    graphdef,
    config: TrainStepConfig,
    accumulator: Accumulator,
    params,
    terms: RowTerms,
    index: jax.Array,
    microbatch: dict,
) -> Accumulator:
    """Step 2 (module docstring): adds grad L_m of microbatch `index` (arrays [R, T_m, ...] of
    `batch_layout.microbatch_spec`) and its sums to `accumulator`."""
    row_terms = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, axis=0, keepdims=False), terms)
    loss_of = lambda p: _microbatch_loss(graphdef, p, microbatch, row_terms, config)
    grads, (sums, entropy, routing, aux) = jax.grad(loss_of, has_aux=True)(params)
    add = lambda total, new: None if new is None else jax.tree.map(jnp.add, total, new)
    return Accumulator(
        grads=jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), accumulator.grads, grads),
        totals=combine_policy_sums(accumulator.totals, sums),
        entropy=accumulator.entropy + entropy,
        first=jax.tree.map(lambda old, new: jnp.where(index == 0, new, old), accumulator.first, sums),
        routing=add(accumulator.routing, routing),
        aux_loss=add(accumulator.aux_loss, aux),
    )


def train_step_metrics(config: TrainStepConfig, accumulator: Accumulator, row_stats: RowStats) -> dict:
    """The step's metrics (float32 scalars; "loss tokens" are loss_mask * sample_valid > 0):
    train/loss              the full-batch aggregated loss sum w x
    train/grad_norm         global L2 norm of the accumulated gradient
    train/entropy           mean entropy of the tempered policy over loss tokens
    train/ratio_mean        mean importance ratio r (gspo: sequence ratio) over loss tokens
    train/ratio_max         its max over loss tokens
    train/clip_frac         fraction of loss tokens truncated (cispo: r > eps_max) or clipped
    train/clip_frac_low     dapo/grpo/gspo: fraction of loss tokens with the lower clip active,
                            A < 0 and r < 1 - eps_low (gspo: r the row's sequence ratio)
    train/clip_frac_high    dapo/grpo/gspo: fraction with the upper clip active, A > 0 and
                            r > 1 + eps_high (low + high = clip_frac)
    train/cispo_truncated_frac   cispo: fraction of loss tokens with r > eps_max, the IS weight
                            truncated (= clip_frac)
    train/logp_mismatch     mean |logp_train - logp_behavior| over loss tokens (whole batch)
    train/logp_mismatch_max max of |logp_train - logp_behavior| over the loss tokens of the
                            whole batch (all microbatches; 0 without loss tokens)
    train/logp_mismatch_first_mb   the mean over the first microbatch only (sorted layout: the
                            longest rows)
    train/num_loss_tokens, train/num_prompts, train/num_samples   what entered the loss
    train/advantage_abs_mean       mean |A| over valid rows
    train/finite            1 when loss and grad norm are finite, else 0
    and for a mixture-of-experts policy, over the real tokens of the batch (`routed_token_mask`):
    moe/tokens_per_expert_min, moe/tokens_per_expert_max   the fewest and most token choices an
                            expert received, over every (MoE layer, expert)
    moe/router_entropy      mean router entropy -sum_e p_e log p_e per token and MoE layer
    moe/dropped_tokens      token choices no expert computed (dropless routing: 0)
    moe/aux_loss            the load-balancing loss, mean over microbatches (in the loss when
                            router_aux_loss_coef > 0)
    train/routing_mismatch_frac   with the sampler's routing in the batch: of the (token, MoE
                            layer) pairs with recorded experts, the share whose trainer top-k set
                            differs from the sampler's, replayed or not (with replay a layer sees
                            the sampler's routing before it, so each layer's own disagreement
                            counts; without, one layer's flips also move the later layers' inputs)
    moe/recorded_pairs      the (token, MoE layer) pairs of real tokens with the sampler's experts
    """
    totals, first = accumulator.totals, accumulator.first
    policy = policy_metrics(totals, row_stats.num_samples, row_stats.num_prompts)
    grad_norm = optax.tree.norm(accumulator.grads)
    metrics = {
        "train/loss": totals.loss,
        "train/grad_norm": grad_norm,
        "train/entropy": safe_divide(accumulator.entropy, totals.num_tokens),
        "train/ratio_mean": policy["ratio_mean"],
        "train/ratio_max": policy["ratio_max"],
        "train/clip_frac": policy["clip_frac"],
        "train/logp_mismatch": policy["abs_log_ratio_mean"],
        "train/logp_mismatch_max": policy["abs_log_ratio_max"],
        "train/logp_mismatch_first_mb": safe_divide(first.abs_log_ratio, first.num_tokens),
        "train/num_loss_tokens": policy["num_tokens"],
        "train/num_prompts": policy["num_prompts"].astype(jnp.float32),
        "train/num_samples": policy["num_sequences"].astype(jnp.float32),
        "train/advantage_abs_mean": row_stats.advantage_abs_mean,
        "train/finite": (jnp.isfinite(totals.loss) & jnp.isfinite(grad_norm)).astype(jnp.float32),
    }
    if accumulator.routing is not None and accumulator.aux_loss is not None:
        routing = accumulator.routing
        metrics.update(
            {
                "moe/tokens_per_expert_min": jnp.min(routing.expert_tokens),
                "moe/tokens_per_expert_max": jnp.max(routing.expert_tokens),
                "moe/router_entropy": safe_divide(jnp.sum(routing.entropy), jnp.sum(routing.tokens)),
                "moe/dropped_tokens": jnp.sum(routing.dropped),
                "moe/aux_loss": accumulator.aux_loss / config.num_microbatches,
            }
        )
        if config.routing:
            metrics["train/routing_mismatch_frac"] = safe_divide(jnp.sum(routing.mismatched), jnp.sum(routing.recorded))
            metrics["moe/recorded_pairs"] = jnp.sum(routing.recorded)
    if config.objective == "cispo":
        metrics["train/cispo_truncated_frac"] = policy["clip_frac_high"]
    else:
        metrics["train/clip_frac_low"] = policy["clip_frac_low"]
        metrics["train/clip_frac_high"] = policy["clip_frac_high"]
    return metrics


def accumulate_gradients(
    graphdef, params, batch: dict, config: TrainStepConfig, constrain: Callable[[jax.Array], jax.Array] = lambda x: x
):
    """(fp32 gradient of the full-batch loss, `train_step_metrics`) of an unsorted batch: steps 1
    and 2 with a `lax.scan` over the microbatches. `constrain` is applied to each microbatch array
    (a sharding constraint under a mesh)."""
    rows = batch["tokens"].shape[0]
    num_microbatches = config.num_microbatches
    if rows % num_microbatches:
        raise ValueError(f"train batch: B={rows} rows do not split into num_microbatches={num_microbatches}")
    per_row = {name: batch[name] for name in ("rewards", "group_ids", "sample_valid")}
    per_row["loss_tokens"] = jnp.sum(batch["loss_mask"].astype(jnp.float32), axis=1)
    terms, row_stats = prepare_rows(per_row, config)
    microbatches = {name: deal_microbatches(batch[name], num_microbatches) for name in microbatch_spec(config.routing)}

    def body(accumulator, indexed):
        index, microbatch = indexed
        microbatch = {name: constrain(x) for name, x in microbatch.items()}
        return accumulate_microbatch(graphdef, config, accumulator, params, terms, index, microbatch), None

    indices = jnp.arange(num_microbatches, dtype=jnp.int32)
    accumulator, _ = jax.lax.scan(body, zero_accumulator(params, config), (indices, microbatches))
    return accumulator.grads, train_step_metrics(config, accumulator, row_stats)


def _select_tree(pred, on_true, on_false):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def apply_update(
    optimizer: optax.GradientTransformation,
    config: TrainStepConfig,
    state: TrainState,
    grads,
    metrics: dict,
    learning_rate_schedule: optax.Schedule | None = None,
):
    """(new state, metrics) after the AdamW update by `grads` (step 3 of the module docstring),
    with 'train/update_applied' (1 when the state advanced) and, given the optimizer's
    `learning_rate_schedule` (optimizer.learning_rate_schedule), 'train/lr' =
    learning_rate_schedule(state.step) added to `metrics`: the learning rate of this update, since
    state.step counts applied updates as the optimizer's schedule count does."""
    metrics = dict(metrics)
    if learning_rate_schedule is not None:
        metrics["train/lr"] = jnp.asarray(learning_rate_schedule(state.step), jnp.float32)
    new_params, new_opt_state = optimizer_update(optimizer, grads, state.opt_state, state.params)
    new_state = TrainState(params=new_params, opt_state=new_opt_state, step=state.step + 1)
    if config.skip_nonfinite:
        new_state = _select_tree(metrics["train/finite"] > 0, new_state, state)
    metrics["train/update_applied"] = (new_state.step > state.step).astype(jnp.float32)
    return new_state, metrics


def train_step(
    graphdef,
    optimizer: optax.GradientTransformation,
    config: TrainStepConfig,
    state: TrainState,
    batch: dict,
    constrain: Callable[[jax.Array], jax.Array] = lambda x: x,
    learning_rate_schedule: optax.Schedule | None = None,
):
    """One update on an unsorted batch (the module docstring); returns (new state, metrics), those
    of `train_step_metrics` and `apply_update`. Pure; jit it."""
    grads, metrics = accumulate_gradients(graphdef, state.params, batch, config, constrain)
    return apply_update(optimizer, config, state, grads, metrics, learning_rate_schedule)
