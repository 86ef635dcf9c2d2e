"""The jitted RL train step: log-probs, policy loss, microbatched gradients, AdamW update.

One step on a train batch (see `BATCH_SPEC`) with B rows:
  1. A = compute_advantages(rewards, group_ids, normalization, valid=sample_valid)  (whole batch)
     w = aggregation_weights(loss_mask, group_ids, aggregation, valid=sample_valid)  (whole batch)
     so the loss is L = sum_{b,t} w[b,t] x[b,t] with x the per-token policy terms.
  2. The rows are dealt into M microbatches, row b to microbatch b mod M (each microbatch then
     takes rows from every batch shard, so all devices work on every microbatch). Since w and A
     were fixed over the whole batch and x[b,:] depends on row b only, L = sum_m L_m with
     L_m = sum_{b in m} w[b] . x[b], and grad L = sum_m grad L_m exactly, for every aggregation.
  3. `lax.scan` over microbatches: logp = sequence_logprobs(policy, tokens, temperature) with the
     model's (fp32) head, x = per_token_policy_terms(logp, behavior_logp, A, mask), grad of L_m
     accumulated in fp32.
  4. AdamW update (fp32 master weights, see optimizer.py). If the loss or the gradient norm is
     not finite and `skip_nonfinite`, the state is returned unchanged and `train/finite` is 0.

Length-sorted microbatches (`TrainStepConfig.sort_by_length`, `SortedTrainStep`): the host sorts
rows by length into the M microbatches and pads each to its own length bucket T_m
(`pipeline/batching.py`), so the batch comes as M blocks [R, T_m] (`split_sorted_batch`). The
same sum L = sum_m L_m is then taken by three jitted programs: (1) A and the per-row aggregation
scale s (w[b, t] = mask[b, t] s[b], `row_loss_scales`) over the whole batch, from per-row token
counts; (2) per microbatch, grad L_m added to a donated fp32 accumulator (one compile per
(R, T_m)); (3) the AdamW update and metrics of step 4. Loss, gradient and metrics equal those of
the unsorted step on the same rows dealt the same way (row p M + m of the per-row arrays is row
p of microbatch m).

Precision: log-probs, losses, metrics and the gradient accumulator are fp32 whatever the body
dtype of the model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scalerl_jax.models import sequence_logprobs
from scalerl_jax.models.sharding import DEFAULT_RULES, Rules, logical_to_spec, param_shardings, use_mesh_rules
from scalerl_jax.rl import (
    AGGREGATIONS,
    NORMALIZATIONS,
    OBJECTIVES,
    aggregation_weights,
    compute_advantages,
    per_token_policy_terms,
)
from scalerl_jax.rl.groups import group_sum, safe_divide
from scalerl_jax.train.optimizer import OptimizerState, init_optimizer_state, optimizer_update

# name -> (rank, dtype kind) of the train batch; B rows, T tokens per row.
BATCH_SPEC: dict[str, tuple[int, str]] = {
    "tokens": (2, "int"),  # prompt + completion, right padded
    "loss_mask": (2, "float"),  # 1 on sampled completion tokens
    "behavior_logp": (2, "float"),  # sampler's log-prob of tokens[:, t]; 0 where mask is 0
    "rewards": (1, "float"),
    "group_ids": (1, "int"),  # prompt index in [0, B)
    "sample_valid": (1, "bool"),  # False: padding row or dropped (zero-variance) row
}

NAN_POLICIES = ("skip", "stop")  # `nan_policy`: keep the old state (`skip_nonfinite`), or the run loop raises


@dataclasses.dataclass(frozen=True)
class TrainStepConfig:
    """Loss and step knobs (the recipe's defaults: CISPO, prompt average, batch-std advantages)."""

    objective: str = "cispo"
    aggregation: str = "prompt"
    advantage_normalization: str = "batch"
    eps_low: float | None = None  # clip range of dapo/grpo/gspo; None: the objective's default
    eps_high: float | None = None  # (dapo 0.2/0.28, grpo symmetric, gspo 3e-4/4e-4; rl.objectives)
    eps_max: float = 4.0  # cispo's importance-weight truncation
    num_microbatches: int = 1
    temperature: float = 1.0  # the sampler's temperature: logp of logits / temperature
    logprob_chunk_size: int = 512  # sequence chunk of the log-prob computation
    skip_nonfinite: bool = True  # keep the old state when loss or grads are NaN/inf
    sort_by_length: bool = False  # batches in the sorted layout (split_sorted_batch); SortedTrainStep

    def __post_init__(self):
        for name, allowed in (
            ("objective", OBJECTIVES),
            ("aggregation", AGGREGATIONS),
            ("advantage_normalization", NORMALIZATIONS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"TrainStepConfig.{name}={getattr(self, name)!r}; expected one of {allowed}")
        if self.num_microbatches < 1:
            raise ValueError(f"TrainStepConfig.num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.temperature <= 0:
            raise ValueError(f"TrainStepConfig.temperature must be > 0, got {self.temperature}")
        if self.logprob_chunk_size < 1:
            raise ValueError(f"TrainStepConfig.logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")


class TrainState(NamedTuple):
    """Policy params (model dtype), optimizer state (fp32, with master weights) and update count."""

    params: Any
    opt_state: OptimizerState
    step: jax.Array


def create_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    """TrainState at step 0 for `params` (an nnx.State from `nnx.split(model)`)."""
    return TrainState(params=params, opt_state=init_optimizer_state(optimizer, params), step=jnp.zeros((), jnp.int32))


def train_state_shardings(
    state: TrainState, optimizer: optax.GradientTransformation, param_shardings, mesh: Mesh
) -> TrainState:
    """Shardings of every leaf of `state`: Adam moments and master weights like their params,
    scalars (counts, step) replicated. `state` may be abstract (jax.eval_shape)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    inner = optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        state.opt_state.inner,
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
    master = None if state.opt_state.master is None else param_shardings
    return TrainState(params=param_shardings, opt_state=OptimizerState(inner=inner, master=master), step=replicated)


def init_train_state(
    params, optimizer: optax.GradientTransformation, *, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES
) -> tuple[TrainState, TrainState | None]:
    """(state, its shardings) at step 0; without a mesh the shardings are None.

    With a mesh, the params are placed on their rule shardings (`param_shardings`) and the
    optimizer state is created directly on `train_state_shardings` (the params' buffers are
    donated to the new state).
    """
    if mesh is None:
        return create_train_state(params, optimizer), None
    shardings_of_params = param_shardings(params, mesh, rules)
    create = lambda p: create_train_state(p, optimizer)
    shardings = train_state_shardings(jax.eval_shape(create, params), optimizer, shardings_of_params, mesh)
    placed = jax.device_put(params, shardings_of_params)
    return jax.jit(create, out_shardings=shardings, donate_argnums=0)(placed), shardings


def validate_batch(batch: dict) -> tuple[int, int]:
    """Checks names, ranks, dtypes and shapes of a train batch; returns (B, T)."""
    missing = sorted(set(BATCH_SPEC) - set(batch))
    if missing:
        raise ValueError(f"train batch: missing key(s) {missing}; expected {sorted(BATCH_SPEC)}")
    extra = sorted(set(batch) - set(BATCH_SPEC))
    if extra:
        raise ValueError(f"train batch: unexpected key(s) {extra}; expected {sorted(BATCH_SPEC)}")
    for name in BATCH_SPEC:
        if not hasattr(batch[name], "shape") or not hasattr(batch[name], "dtype"):
            raise ValueError(f"train batch[{name!r}]: expected an array, got {type(batch[name]).__name__}")
    if len(batch["tokens"].shape) != 2:
        raise ValueError(f"train batch['tokens']: shape {tuple(batch['tokens'].shape)}, expected [B, T]")
    rows, length = batch["tokens"].shape
    for name, (rank, kind) in BATCH_SPEC.items():
        value = batch[name]
        shape = tuple(value.shape)
        want = (rows, length)[:rank]
        if shape != want:
            raise ValueError(f"train batch[{name!r}]: shape {shape}, expected {want} (B={rows}, T={length})")
        dtype = np.dtype(value.dtype)
        ok = {
            "int": np.issubdtype(dtype, np.integer),
            "float": np.issubdtype(dtype, np.floating),
            "bool": dtype == np.bool_,
        }[kind]
        if not ok:
            raise ValueError(f"train batch[{name!r}]: dtype {dtype}, expected a {kind} dtype")
    return rows, length


# The sorted layout: per-row arrays [B] (row p M + m is row p of microbatch m), and per
# microbatch m the token arrays [R, T_m] under the keys `sorted_batch_key(name, m)`.
SORTED_ROW_SPEC: dict[str, tuple[int, str]] = {
    "rewards": (1, "float"),
    "group_ids": (1, "int"),
    "sample_valid": (1, "bool"),
    "loss_tokens": (1, "float"),  # sum_t loss_mask[b, t] (sample_valid not applied)
}
MICROBATCH_SPEC: dict[str, tuple[int, str]] = {
    "tokens": (2, "int"),
    "loss_mask": (2, "float"),
    "behavior_logp": (2, "float"),
}


def sorted_batch_key(name: str, microbatch: int) -> str:
    """Key of microbatch `microbatch`'s `name` array in a sorted-layout batch."""
    return f"{name}/{microbatch}"


def _check_array(where: str, value, shape: tuple[int, ...], kind: str) -> None:
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


def split_sorted_batch(batch: dict, num_microbatches: int) -> tuple[dict, list[dict]]:
    """A sorted-layout batch -> (per-row arrays [B], [microbatch m's arrays [R, T_m] for m < M]),
    after checking keys, shapes (B = M R) and dtypes."""
    keys = set(SORTED_ROW_SPEC) | {
        sorted_batch_key(name, m) for name in MICROBATCH_SPEC for m in range(num_microbatches)
    }
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
        for name, (_, kind) in MICROBATCH_SPEC.items():
            key = sorted_batch_key(name, m)
            _check_array(f"sorted train batch[{key!r}]", batch[key], (rows // num_microbatches, length), kind)
        microbatches.append({name: batch[sorted_batch_key(name, m)] for name in MICROBATCH_SPEC})
    return {name: batch[name] for name in SORTED_ROW_SPEC}, microbatches


def deal_microbatches(x: jax.Array, num_microbatches: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...] with row b in microbatch b mod M (at position b // M)."""
    rows = x.shape[0]
    return jnp.swapaxes(x.reshape(rows // num_microbatches, num_microbatches, *x.shape[1:]), 0, 1)


class _MicrobatchSums(NamedTuple):
    """Per-microbatch sums that add up to whole-batch metrics."""

    loss: jax.Array  # sum w x
    loss_tokens: jax.Array  # sum m
    entropy: jax.Array  # sum m H
    ratio: jax.Array  # sum m r
    clipped_low: jax.Array  # sum m [lower clip active]
    clipped_high: jax.Array  # sum m [upper clip active / cispo truncation]
    abs_logp_diff: jax.Array  # sum m |logp - behavior_logp|


def _microbatch_loss(graphdef, params, microbatch: dict, config: TrainStepConfig):
    """L_m = sum w x over the microbatch, with (the per-token sums used for metrics, the max of
    |logp - behavior_logp| over the microbatch's loss tokens, 0 if it has none)."""
    model = nnx.merge(graphdef, params)
    logp, entropy = sequence_logprobs(
        model,
        microbatch["tokens"],
        temperature=config.temperature,
        chunk_size=config.logprob_chunk_size,
        return_entropy=True,
    )
    mask = microbatch["mask"]
    abs_logp_diff = jnp.where(mask > 0, jnp.abs(logp - microbatch["behavior_logp"]), 0.0)
    abs_logp_diff_max = jnp.max(abs_logp_diff)
    terms, aux = per_token_policy_terms(
        logp,
        microbatch["behavior_logp"],
        microbatch["advantages"],
        mask,
        objective=config.objective,
        eps_low=config.eps_low,
        eps_high=config.eps_high,
        eps_max=config.eps_max,
    )
    loss = jnp.sum(microbatch["weights"] * terms)
    sums = _MicrobatchSums(
        loss=loss,
        loss_tokens=jnp.sum(mask),
        entropy=jnp.sum(mask * entropy),
        ratio=jnp.sum(mask * aux["ratio"]),
        clipped_low=jnp.sum(mask * aux["clipped_low"]),
        clipped_high=jnp.sum(mask * aux["clipped_high"]),
        abs_logp_diff=jnp.sum(mask * abs_logp_diff),
    )
    return loss, jax.tree.map(jax.lax.stop_gradient, (sums, abs_logp_diff_max))


def accumulate_gradients(
    graphdef, params, batch: dict, config: TrainStepConfig, constrain: Callable[[jax.Array], jax.Array] = lambda x: x
):
    """(fp32 gradient of the full-batch loss, metrics) by a scan over microbatches.

    `constrain` is applied to each microbatch array (a sharding constraint under a mesh).
    Metrics (float32 scalars; "loss tokens" are mask * sample_valid > 0):
      train/loss              the full-batch aggregated loss sum w x
      train/grad_norm         global L2 norm of the accumulated gradient
      train/entropy           mean entropy of the tempered policy over loss tokens
      train/ratio_mean        mean importance ratio r (gspo: sequence ratio) over loss tokens
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
      train/logp_mismatch_first_mb   the same over the first microbatch only
      train/num_loss_tokens, train/num_prompts, train/num_samples   what entered the loss
      train/advantage_abs_mean       mean |A| over valid rows
      train/finite            1 when loss and grad norm are finite, else 0
    """
    rows = batch["tokens"].shape[0]
    num_microbatches = config.num_microbatches
    if rows % num_microbatches:
        raise ValueError(f"train batch: B={rows} rows do not split into num_microbatches={num_microbatches}")
    valid = batch["sample_valid"]
    group_ids = batch["group_ids"].astype(jnp.int32)
    advantages = compute_advantages(
        batch["rewards"], group_ids, normalization=config.advantage_normalization, valid=valid
    )
    mask = batch["loss_mask"].astype(jnp.float32) * valid.astype(jnp.float32)[:, None]
    weights = aggregation_weights(mask, group_ids, aggregation=config.aggregation)
    per_row = {
        "tokens": batch["tokens"].astype(jnp.int32),
        "behavior_logp": batch["behavior_logp"].astype(jnp.float32),
        "advantages": advantages,
        "mask": mask,
        "weights": weights,
    }
    microbatches = {k: deal_microbatches(v, num_microbatches) for k, v in per_row.items()}

    grad_fn = jax.grad(lambda p, mb: _microbatch_loss(graphdef, p, mb, config), has_aux=True)

    def body(grad_sum, microbatch):
        microbatch = {k: constrain(v) for k, v in microbatch.items()}
        grads, stats = grad_fn(params, microbatch)
        grad_sum = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), grad_sum, grads)
        return grad_sum, stats

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    grads, (per_microbatch, abs_logp_diff_max) = jax.lax.scan(body, zeros, microbatches)

    totals = jax.tree.map(jnp.sum, per_microbatch)
    first = jax.tree.map(lambda x: x[0], per_microbatch)
    row_stats = _row_stats(jnp.sum(mask, axis=1), group_ids, advantages, valid)
    return grads, _step_metrics(config, grads, totals, first, jnp.max(abs_logp_diff_max), row_stats)


class _RowStats(NamedTuple):
    """Whole-batch counts of the per-row inputs."""

    num_prompts: jax.Array  # prompts with a loss token
    num_samples: jax.Array  # rows with a loss token
    advantage_abs_mean: jax.Array  # mean |A| over valid rows


def _row_stats(tokens_per_row, group_ids, advantages, valid) -> _RowStats:
    rows = tokens_per_row.shape[0]
    tokens_per_group = jax.ops.segment_sum(tokens_per_row, group_ids, num_segments=rows)
    return _RowStats(
        num_prompts=jnp.sum(tokens_per_group > 0).astype(jnp.float32),
        num_samples=jnp.sum(tokens_per_row > 0).astype(jnp.float32),
        advantage_abs_mean=jnp.sum(jnp.abs(advantages)) / jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0),
    )


def _step_metrics(
    config: TrainStepConfig,
    grads,
    totals: _MicrobatchSums,
    first: _MicrobatchSums,
    abs_logp_diff_max,
    row_stats: _RowStats,
) -> dict:
    """The metrics of `accumulate_gradients` from whole-batch sums, the first microbatch's sums,
    the max |logp - behavior_logp| and the row counts."""
    tokens = totals.loss_tokens
    safe_tokens = jnp.maximum(tokens, 1.0)
    grad_norm = optax.tree.norm(grads)
    metrics = {
        "train/loss": totals.loss,
        "train/grad_norm": grad_norm,
        "train/entropy": totals.entropy / safe_tokens,
        "train/ratio_mean": totals.ratio / safe_tokens,
        "train/clip_frac": (totals.clipped_low + totals.clipped_high) / safe_tokens,
        "train/logp_mismatch": totals.abs_logp_diff / safe_tokens,
        "train/logp_mismatch_max": abs_logp_diff_max,
        "train/logp_mismatch_first_mb": first.abs_logp_diff / jnp.maximum(first.loss_tokens, 1.0),
        "train/num_loss_tokens": tokens,
        "train/num_prompts": row_stats.num_prompts,
        "train/num_samples": row_stats.num_samples,
        "train/advantage_abs_mean": row_stats.advantage_abs_mean,
        "train/finite": (jnp.isfinite(totals.loss) & jnp.isfinite(grad_norm)).astype(jnp.float32),
    }
    if config.objective == "cispo":
        metrics["train/cispo_truncated_frac"] = totals.clipped_high / safe_tokens
    else:
        metrics["train/clip_frac_low"] = totals.clipped_low / safe_tokens
        metrics["train/clip_frac_high"] = totals.clipped_high / safe_tokens
    return metrics


def _select_tree(pred, on_true, on_false):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def train_step(
    graphdef,
    optimizer: optax.GradientTransformation,
    config: TrainStepConfig,
    state: TrainState,
    batch: dict,
    constrain: Callable[[jax.Array], jax.Array] = lambda x: x,
    learning_rate_schedule: optax.Schedule | None = None,
):
    """One update (the module docstring); returns (new state, metrics). Pure; jit it.

    Metrics: those of `accumulate_gradients`, 'train/update_applied' (1 when the state advanced),
    and, given the optimizer's `learning_rate_schedule` (optimizer.learning_rate_schedule),
    'train/lr' = learning_rate_schedule(state.step): the learning rate of this update, since
    state.step counts applied updates as the optimizer's schedule count does.
    """
    grads, metrics = accumulate_gradients(graphdef, state.params, batch, config, constrain)
    return apply_update(optimizer, config, state, grads, metrics, learning_rate_schedule)


def apply_update(
    optimizer: optax.GradientTransformation,
    config: TrainStepConfig,
    state: TrainState,
    grads,
    metrics: dict,
    learning_rate_schedule: optax.Schedule | None = None,
):
    """(new state, metrics) after the AdamW update by `grads` (step 4 of the module docstring),
    with 'train/update_applied' and, given the schedule, 'train/lr' added to `metrics`."""
    metrics = dict(metrics)
    if learning_rate_schedule is not None:
        metrics["train/lr"] = jnp.asarray(learning_rate_schedule(state.step), jnp.float32)
    new_params, new_opt_state = optimizer_update(optimizer, grads, state.opt_state, state.params)
    new_state = TrainState(params=new_params, opt_state=new_opt_state, step=state.step + 1)
    if config.skip_nonfinite:
        new_state = _select_tree(metrics["train/finite"] > 0, new_state, state)
    metrics["train/update_applied"] = (new_state.step > state.step).astype(jnp.float32)
    return new_state, metrics


class TrainStep:
    """The jitted, state-donating train step; counts how often it was traced (compiled).

    With a mesh, the state keeps `state_shardings` (in and out), every batch array is sharded along
    B over the mesh axes that `rules` give the logical axis 'batch', and the model's activations
    are constrained by `rules` (`use_mesh_rules` around tracing); without a mesh, everything stays
    where jit puts it (one device).
    """

    def __init__(
        self,
        graphdef,
        optimizer: optax.GradientTransformation,
        config: TrainStepConfig,
        *,
        mesh: Mesh | None = None,
        state_shardings: TrainState | None = None,
        rules: Rules = DEFAULT_RULES,
        learning_rate_schedule: optax.Schedule | None = None,
    ):
        if (mesh is None) != (state_shardings is None):
            raise ValueError("TrainStep: pass both mesh and state_shardings, or neither")
        self.config = config
        self.mesh = mesh
        self.rules = tuple(rules)
        self.num_traces = 0
        self.batch_sharding: NamedSharding | None = None  # where to put batches ahead of time
        constrain = lambda x: x
        jit_kwargs: dict[str, Any] = {"donate_argnums": 0}
        if mesh is not None:
            batch_spec = logical_to_spec(("batch",), rules, mesh=mesh)
            batch_sharding = NamedSharding(mesh, batch_spec)
            self.batch_sharding = batch_sharding
            batch_axes = batch_spec[0] if isinstance(batch_spec[0], tuple) else (batch_spec[0],)
            self.batch_shards = int(np.prod([mesh.shape[a] for a in batch_axes if a is not None]))
            constrain = lambda x: jax.lax.with_sharding_constraint(x, batch_sharding)
            replicated = NamedSharding(mesh, PartitionSpec())
            jit_kwargs.update(
                in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, replicated)
            )
        else:
            self.batch_shards = 1

        def step(state, batch):
            self.num_traces += 1
            return train_step(graphdef, optimizer, config, state, batch, constrain, learning_rate_schedule)

        self._jitted = jax.jit(step, **jit_kwargs)

    def _check_batch(self, batch: dict) -> None:
        rows, _ = validate_batch(batch)
        per_microbatch = rows // self.config.num_microbatches
        if rows % self.config.num_microbatches or per_microbatch % self.batch_shards:
            raise ValueError(
                f"train batch: B={rows} must split into num_microbatches={self.config.num_microbatches}"
                f" microbatches whose size is a multiple of the {self.batch_shards} batch shards"
            )

    def __call__(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        self._check_batch(batch)
        with use_mesh_rules(self.mesh, self.rules):
            return self._jitted(state, batch)

    def lower(self, state: TrainState, batch: dict) -> jax.stages.Lowered:
        """Ahead-of-time lowering for these shapes (`.compile()` it to time compilation or to read
        `memory_analysis()`); the arrays may be jax.ShapeDtypeStruct."""
        self._check_batch(batch)
        with use_mesh_rules(self.mesh, self.rules):
            return self._jitted.lower(state, batch)


def row_loss_scales(tokens_per_row: jax.Array, group_ids: jax.Array, aggregation: str) -> jax.Array:
    """s[B] with `aggregation_weights(mask, group_ids)` = mask * s[:, None], from the rows' loss
    token counts n_b = sum_t mask[b, t] alone: 'token' s = 1 / sum_b n_b; 'sample' s_b =
    1 / (n_b S) with S the rows having n_b > 0; 'prompt' s_b = 1 / (N_g P) with N_g the tokens of
    row b's prompt and P the prompts having N_g > 0. 0 where the denominator is 0."""
    if aggregation == "token":
        return jnp.broadcast_to(safe_divide(1.0, jnp.sum(tokens_per_row)), tokens_per_row.shape)
    if aggregation == "sample":
        return safe_divide(1.0, tokens_per_row * jnp.sum(tokens_per_row > 0))
    if aggregation != "prompt":
        raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {aggregation!r}")
    tokens_per_group = group_sum(tokens_per_row, group_ids)
    return safe_divide(1.0, tokens_per_group[group_ids] * jnp.sum(tokens_per_group > 0))


class _RowTerms(NamedTuple):
    """Per-row inputs of the microbatch losses, dealt [M, R] (row p of microbatch m at [m, p])."""

    advantages: jax.Array
    scales: jax.Array  # row_loss_scales
    valid: jax.Array  # sample_valid as float


class _Accumulator(NamedTuple):
    """What the microbatches add up: the fp32 gradient, the metric sums, those of microbatch 0,
    and the running max of |logp - behavior_logp|."""

    grads: Any
    totals: _MicrobatchSums
    first: _MicrobatchSums
    abs_logp_diff_max: jax.Array


def prepare_rows(rows: dict, config: TrainStepConfig) -> tuple[_RowTerms, _RowStats]:
    """Step (1) of the sorted step: advantages and aggregation scales over the whole batch, from
    the per-row arrays of `split_sorted_batch`, dealt into microbatches."""
    valid = rows["sample_valid"]
    group_ids = rows["group_ids"].astype(jnp.int32)
    advantages = compute_advantages(
        rows["rewards"], group_ids, normalization=config.advantage_normalization, valid=valid
    )
    tokens_per_row = rows["loss_tokens"].astype(jnp.float32) * valid.astype(jnp.float32)
    scales = row_loss_scales(tokens_per_row, group_ids, config.aggregation)
    deal = lambda x: deal_microbatches(x, config.num_microbatches)
    terms = _RowTerms(advantages=deal(advantages), scales=deal(scales), valid=deal(valid.astype(jnp.float32)))
    return terms, _row_stats(tokens_per_row, group_ids, advantages, valid)


def zero_accumulator(params) -> _Accumulator:
    """An empty `_Accumulator` for `params`."""
    zero = jnp.zeros((), jnp.float32)
    sums = _MicrobatchSums(*([zero] * len(_MicrobatchSums._fields)))
    return _Accumulator(
        grads=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        totals=sums,
        first=sums,
        abs_logp_diff_max=zero,
    )


def accumulate_microbatch(
    graphdef,
    config: TrainStepConfig,
    accumulator: _Accumulator,
    params,
    terms: _RowTerms,
    index: jax.Array,
    microbatch: dict,
) -> _Accumulator:
    """Step (2) of the sorted step: adds grad L_m of microbatch `index` (arrays [R, T_m]) and its
    metric sums to `accumulator`; w = mask * s, mask = loss_mask * sample_valid."""
    row = lambda x: jax.lax.dynamic_index_in_dim(x, index, axis=0, keepdims=False)
    mask = microbatch["loss_mask"].astype(jnp.float32) * row(terms.valid)[:, None]
    inputs = {
        "tokens": microbatch["tokens"].astype(jnp.int32),
        "behavior_logp": microbatch["behavior_logp"].astype(jnp.float32),
        "advantages": row(terms.advantages),
        "mask": mask,
        "weights": mask * row(terms.scales)[:, None],
    }
    grads, (sums, abs_logp_diff_max) = jax.grad(lambda p: _microbatch_loss(graphdef, p, inputs, config), has_aux=True)(
        params
    )
    return _Accumulator(
        grads=jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), accumulator.grads, grads),
        totals=jax.tree.map(jnp.add, accumulator.totals, sums),
        first=jax.tree.map(lambda old, new: jnp.where(index == 0, new, old), accumulator.first, sums),
        abs_logp_diff_max=jnp.maximum(accumulator.abs_logp_diff_max, abs_logp_diff_max),
    )


class SortedTrainStep:
    """The train step on length-sorted microbatches (module docstring), as three jitted programs
    driven by a host loop: `prepare_rows` (once per B), `accumulate_microbatch` for m = 0 .. M-1
    (one compile per (R, T_m); the accumulator donated), then `apply_update` (state donated).
    Same interface as `TrainStep` (call, `batch_sharding`, `batch_shards`, `num_traces`, the
    total of traces of the three). Every process of a multi-host trainer issues the same calls in
    the same order, since the plan is the batch's keys and shapes. Metrics are those of
    `accumulate_gradients`; 'train/logp_mismatch_first_mb' is over sorted microbatch 0, which
    holds the longest rows.
    """

    def __init__(
        self,
        graphdef,
        optimizer: optax.GradientTransformation,
        config: TrainStepConfig,
        *,
        mesh: Mesh | None = None,
        state_shardings: TrainState | None = None,
        rules: Rules = DEFAULT_RULES,
        learning_rate_schedule: optax.Schedule | None = None,
    ):
        if (mesh is None) != (state_shardings is None):
            raise ValueError("SortedTrainStep: pass both mesh and state_shardings, or neither")
        self.config = config
        self.mesh = mesh
        self.rules = tuple(rules)
        self.num_traces = 0
        self.batch_sharding: NamedSharding | None = None
        self.batch_shards = 1
        prepare_kw: dict[str, Any] = {}
        zeros_kw: dict[str, Any] = {}
        accumulate_kw: dict[str, Any] = {"donate_argnums": 0}
        update_kw: dict[str, Any] = {"donate_argnums": 0}
        if mesh is not None:
            batch_spec = logical_to_spec(("batch",), rules, mesh=mesh)
            self.batch_sharding = NamedSharding(mesh, batch_spec)
            batch_axes = batch_spec[0] if isinstance(batch_spec[0], tuple) else (batch_spec[0],)
            self.batch_shards = int(np.prod([mesh.shape[a] for a in batch_axes if a is not None]))
            replicated = NamedSharding(mesh, PartitionSpec())
            dealt = NamedSharding(mesh, PartitionSpec(None, batch_spec[0]))
            terms = _RowTerms(dealt, dealt, dealt)
            accumulator = _Accumulator(
                grads=state_shardings.params, totals=replicated, first=replicated, abs_logp_diff_max=replicated
            )
            prepare_kw.update(in_shardings=(self.batch_sharding,), out_shardings=(terms, replicated))
            zeros_kw.update(in_shardings=(state_shardings.params,), out_shardings=accumulator)
            accumulate_kw.update(
                in_shardings=(accumulator, state_shardings.params, terms, replicated, self.batch_sharding),
                out_shardings=accumulator,
            )
            update_kw.update(
                in_shardings=(state_shardings, accumulator, replicated), out_shardings=(state_shardings, replicated)
            )

        def traced(fn):
            def counted(*args):
                self.num_traces += 1
                return fn(*args)

            return counted

        def update(state, accumulator, row_stats):
            metrics = _step_metrics(
                config,
                accumulator.grads,
                accumulator.totals,
                accumulator.first,
                accumulator.abs_logp_diff_max,
                row_stats,
            )
            return apply_update(optimizer, config, state, accumulator.grads, metrics, learning_rate_schedule)

        self._prepare = jax.jit(traced(lambda rows: prepare_rows(rows, config)), **prepare_kw)
        self._zeros = jax.jit(traced(zero_accumulator), **zeros_kw)
        self._accumulate = jax.jit(traced(functools.partial(accumulate_microbatch, graphdef, config)), **accumulate_kw)
        self._update = jax.jit(traced(update), **update_kw)

    def __call__(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rows, microbatches = split_sorted_batch(batch, self.config.num_microbatches)
        per_microbatch = rows["rewards"].shape[0] // self.config.num_microbatches
        if per_microbatch % self.batch_shards:
            raise ValueError(
                f"sorted train batch: {per_microbatch} rows per microbatch are not a "
                f"multiple of the {self.batch_shards} batch shards"
            )
        with use_mesh_rules(self.mesh, self.rules):
            terms, row_stats = self._prepare(rows)
            accumulator = self._zeros(state.params)
            for index, microbatch in enumerate(microbatches):
                accumulator = self._accumulate(accumulator, state.params, terms, np.int32(index), microbatch)
            return self._update(state, accumulator, row_stats)


def make_train_step(
    graphdef,
    optimizer: optax.GradientTransformation,
    config: TrainStepConfig,
    *,
    mesh: Mesh | None = None,
    state_shardings: TrainState | None = None,
    rules: Rules = DEFAULT_RULES,
    learning_rate_schedule: optax.Schedule | None = None,
) -> TrainStep | SortedTrainStep:
    """The jitted step `step(state, batch) -> (state, metrics)` (state donated): a
    `SortedTrainStep` for sorted-layout batches when `config.sort_by_length`, else a `TrainStep`;
    pass the optimizer's `learning_rate_schedule` to get 'train/lr' in the metrics (see
    `train_step`)."""
    step_class = SortedTrainStep if config.sort_by_length else TrainStep
    return step_class(
        graphdef,
        optimizer,
        config,
        mesh=mesh,
        state_shardings=state_shardings,
        rules=rules,
        learning_rate_schedule=learning_rate_schedule,
    )
