"""The jitted RL train step: log-probs, policy loss, microbatched gradients, AdamW update.

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
     combine (`combine_policy_sums`). Since A and s were fixed over the whole batch and x[b, :]
     depends on row b only, L = sum_m L_m and grad L = sum_m grad L_m exactly, for every
     aggregation.
  3. Metrics from the combined sums (`policy_metrics`, `step_metrics`), then the AdamW update
     (fp32 master weights, see optimizer.py). If the loss or the gradient norm is not finite and
     `skip_nonfinite`, the state is returned unchanged and `train/finite` is 0.

Two layouts, two drivers of the same steps. Unsorted (`TrainStep`): one [B, T] batch, one jitted
program with a `lax.scan` over the microbatches. Length-sorted (`TrainStepConfig.sort_by_length`,
`SortedTrainStep`): the host sorts rows by length into the M microbatches and pads each to its own
length bucket T_m (`pipeline/batching.py`); three jitted programs, (1) once per batch, (2) once
per microbatch (one compile per (R, T_m), the accumulator donated), (3) once. Loss, gradient and
metrics equal those of the unsorted step on the same rows dealt the same way.

Compiling ahead (`compile_ahead`): every program a run's batches can need, for the batch's rows
and every length bucket, is compiled before the first step and its executable kept; a step then
runs those executables, so no step compiles (a shape not compiled ahead still runs, through jit).

Precision: log-probs, losses, metrics and the gradient accumulator are fp32 whatever the body
dtype of the model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scalerl_jax.contracts.batch_layout import (
    BATCH_SPEC,
    MICROBATCH_SPEC,
    SORTED_ROW_SPEC,
    deal_microbatches,
    split_sorted_batch,
    validate_batch,
)
from scalerl_jax.models import sequence_logprobs
from scalerl_jax.models.sharding import (
    DEFAULT_RULES,
    AotProgram,
    Rules,
    logical_to_spec,
    param_shardings,
    use_mesh_rules,
)
from scalerl_jax.rl import (
    AGGREGATIONS,
    NORMALIZATIONS,
    OBJECTIVES,
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

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> TrainStepConfig:
        """The step's knobs from a run config (`scalerl_jax.config.recipes`): `rl.{objective, aggregation,
        advantage_normalization, eps_low, eps_high, eps_max}`, `batch.{microbatches,
        sort_by_length}`, `sampler.temperature`, `model.logprob_chunk`, and `nan_policy` ('skip':
        a non-finite step keeps the old state)."""
        rl = config.rl
        return cls(
            objective=rl.objective,
            aggregation=rl.aggregation,
            advantage_normalization=rl.advantage_normalization,
            eps_low=rl.eps_low,
            eps_high=rl.eps_high,
            eps_max=rl.eps_max,
            num_microbatches=config.batch.microbatches,
            temperature=config.sampler.temperature,
            logprob_chunk_size=config.model.logprob_chunk,
            skip_nonfinite=config.nan_policy == "skip",
            sort_by_length=config.batch.sort_by_length,
        )


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
    # `_make`: the fields hold shardings here, where the annotations say arrays.
    return TrainState._make([param_shardings, OptimizerState(inner=inner, master=master), replicated])


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
    sum m H, and the `PolicySums` of microbatch 0."""

    grads: Any
    totals: PolicySums
    entropy: jax.Array
    first: PolicySums


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


def zero_accumulator(params) -> Accumulator:
    """An empty `Accumulator` for `params`."""
    return Accumulator(
        grads=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        totals=PolicySums.zeros(),
        entropy=jnp.zeros((), jnp.float32),
        first=PolicySums.zeros(),
    )


def _microbatch_loss(graphdef, params, microbatch: dict, row_terms: RowTerms, config: TrainStepConfig):
    """(L_m, (its `PolicySums`, sum m H)) of one microbatch (arrays [R, T_m]) and its rows' terms [R]."""
    model = nnx.merge(graphdef, params)
    logp, entropy = sequence_logprobs(
        model,
        microbatch["tokens"].astype(jnp.int32),
        temperature=config.temperature,
        chunk_size=config.logprob_chunk_size,
        return_entropy=True,
    )
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
    return sums.loss, jax.lax.stop_gradient((sums, jnp.sum(mask * entropy)))


def accumulate_microbatch(
    graphdef,
    config: TrainStepConfig,
    accumulator: Accumulator,
    params,
    terms: RowTerms,
    index: jax.Array,
    microbatch: dict,
) -> Accumulator:
    """Step 2 (module docstring): adds grad L_m of microbatch `index` (arrays [R, T_m] of
    `batch_layout.MICROBATCH_SPEC`) and its sums to `accumulator`."""
    row_terms = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, axis=0, keepdims=False), terms)
    loss_of = lambda p: _microbatch_loss(graphdef, p, microbatch, row_terms, config)
    grads, (sums, entropy) = jax.grad(loss_of, has_aux=True)(params)
    return Accumulator(
        grads=jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), accumulator.grads, grads),
        totals=combine_policy_sums(accumulator.totals, sums),
        entropy=accumulator.entropy + entropy,
        first=jax.tree.map(lambda old, new: jnp.where(index == 0, new, old), accumulator.first, sums),
    )


def step_metrics(config: TrainStepConfig, accumulator: Accumulator, row_stats: RowStats) -> dict:
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
    if config.objective == "cispo":
        metrics["train/cispo_truncated_frac"] = policy["clip_frac_high"]
    else:
        metrics["train/clip_frac_low"] = policy["clip_frac_low"]
        metrics["train/clip_frac_high"] = policy["clip_frac_high"]
    return metrics


def accumulate_gradients(
    graphdef, params, batch: dict, config: TrainStepConfig, constrain: Callable[[jax.Array], jax.Array] = lambda x: x
):
    """(fp32 gradient of the full-batch loss, `step_metrics`) of an unsorted batch: steps 1 and 2
    with a `lax.scan` over the microbatches. `constrain` is applied to each microbatch array (a
    sharding constraint under a mesh)."""
    rows = batch["tokens"].shape[0]
    num_microbatches = config.num_microbatches
    if rows % num_microbatches:
        raise ValueError(f"train batch: B={rows} rows do not split into num_microbatches={num_microbatches}")
    per_row = {name: batch[name] for name in ("rewards", "group_ids", "sample_valid")}
    per_row["loss_tokens"] = jnp.sum(batch["loss_mask"].astype(jnp.float32), axis=1)
    terms, row_stats = prepare_rows(per_row, config)
    microbatches = {name: deal_microbatches(batch[name], num_microbatches) for name in MICROBATCH_SPEC}

    def body(accumulator, indexed):
        index, microbatch = indexed
        microbatch = {name: constrain(x) for name, x in microbatch.items()}
        return accumulate_microbatch(graphdef, config, accumulator, params, terms, index, microbatch), None

    indices = jnp.arange(num_microbatches, dtype=jnp.int32)
    accumulator, _ = jax.lax.scan(body, zero_accumulator(params), (indices, microbatches))
    return accumulator.grads, step_metrics(config, accumulator, row_stats)


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
    of `step_metrics` and `apply_update`. Pure; jit it."""
    grads, metrics = accumulate_gradients(graphdef, state.params, batch, config, constrain)
    return apply_update(optimizer, config, state, grads, metrics, learning_rate_schedule)


_ABSTRACT_DTYPES = {"int": np.int32, "float": np.float32, "bool": np.bool_}  # what `pipeline.batching` builds


def abstract_arrays(spec: dict[str, tuple[int, str]], shape_of_rank: dict[int, tuple[int, ...]], sharding) -> dict:
    """ShapeDtypeStructs of a batch layout's arrays (`batch_layout` spec: name -> (rank, kind)), the
    shape by rank, every array on `sharding` (None: no sharding)."""
    return {
        name: jax.ShapeDtypeStruct(shape_of_rank[rank], _ABSTRACT_DTYPES[kind], sharding=sharding)
        for name, (rank, kind) in spec.items()
    }


def abstract_state(state: TrainState) -> TrainState:
    """ShapeDtypeStructs of `state`'s arrays on their shardings: what `compile_ahead` needs of a
    live state, without holding its buffers."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type), state
    )


def _step_shape(rows: int, length: int) -> str:
    return f"B={rows} T={length}"


def _microbatch_shape(rows: int, length: int) -> str:
    return f"R={rows} T={length}"


class _StepShardings(NamedTuple):
    """Where a step's inputs and outputs live on its mesh."""

    state: TrainState  # the train state's shardings (`train_state_shardings`)
    batch: NamedSharding  # every batch array, split along B
    replicated: NamedSharding  # scalars and metrics


class _JittedStep:
    """What both layouts' steps share: construction, trace counting and the batch checks.

    With a mesh, the state keeps `state_shardings` (in and out), every batch array is sharded along
    B over the mesh axes that `rules` give the logical axis 'batch' (`batch_sharding`, over
    `batch_shards` shards), and the model's activations are constrained by `rules`
    (`use_mesh_rules` around tracing); without a mesh, everything stays where jit puts it (one
    device). `num_traces` counts the traces of the step's jitted programs (lowering ahead of time
    included). Programs compiled by `compile_ahead` run as those executables.
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
            raise ValueError(f"{type(self).__name__}: pass both mesh and state_shardings, or neither")
        self.config = config
        self.mesh = mesh
        self.rules = tuple(rules)
        self.num_traces = 0
        # (AotProgram.name, AotProgram.shape) -> its executable, compiled ahead (`compile_ahead`).
        self._compiled: dict[tuple[str, str], jax.stages.Compiled] = {}
        self.batch_sharding: NamedSharding | None = None  # where to put batches ahead of time
        self.batch_shards = 1
        shardings = None
        if mesh is not None and state_shardings is not None:
            batch_spec = logical_to_spec(("batch",), rules, mesh=mesh)
            self.batch_sharding = NamedSharding(mesh, batch_spec)
            batch_axes = batch_spec[0] if isinstance(batch_spec[0], tuple) else (batch_spec[0],)
            self.batch_shards = int(np.prod([mesh.shape[a] for a in batch_axes if a is not None]))
            shardings = _StepShardings(state_shardings, self.batch_sharding, NamedSharding(mesh, PartitionSpec()))
        self._build(graphdef, optimizer, shardings, learning_rate_schedule)

    def _build(self, graphdef, optimizer, shardings: _StepShardings | None, learning_rate_schedule) -> None:
        """Creates the layout's jitted programs (counted by `self._counted`); `shardings` None: no mesh."""
        raise NotImplementedError

    def _counted(self, fn, name: str):
        """`fn` adding 1 to `num_traces` each time jit traces it, named `name` (the program's name
        in JAX's compile logs and events)."""

        def counted(*args):
            self.num_traces += 1
            return fn(*args)

        counted.__name__ = counted.__qualname__ = name
        return counted

    def aot_programs(self, state: TrainState, rows: int, lengths: Sequence[int]) -> Iterator[AotProgram]:
        raise NotImplementedError

    def compile_ahead(
        self,
        state: TrainState,
        rows: int,
        lengths: Sequence[int],
        *,
        compile_map: Callable[[Callable[[Any], Any], list], Iterable[Any]] = map,
    ) -> int:
        """Compiles every program of `aot_programs(state, rows, lengths)` not compiled yet and keeps
        the executables, which later calls on those shapes run (a shape not compiled ahead goes
        through jit as before, compiling on first use); returns how many it compiled. `state` may be
        abstract (`abstract_state`). The executables take the same shardings and donate the same
        arguments as the jitted calls. The programs are lowered here, one after the other, then
        compiled by `compile_map(compile, lowered)` (e.g. a thread pool's `map`, to compile several
        at once)."""
        keys, lowered = [], []
        for aot in self.aot_programs(state, rows, lengths):
            key = (aot.name, aot.shape)
            if key not in self._compiled and key not in keys:
                keys.append(key)
                lowered.append(aot.lower())
        for key, executable in zip(keys, compile_map(lambda program: program.compile(), lowered), strict=True):
            self._compiled[key] = executable
        return len(keys)

    def _run(self, name: str, shape: str, jitted, *args):
        """Program `name` for `shape` (the names and shapes of `aot_programs`) on `args`: its
        ahead-of-time executable if there is one, else the jitted function (under the mesh rules).
        Arguments the executable refuses (types or shardings other than those it was compiled for;
        checked before it runs, so nothing is donated) go to the jitted function, with a warning."""
        executable = self._compiled.get((name, shape))
        if executable is not None:
            try:
                return executable(*args)
            except (TypeError, ValueError) as error:
                logging.warning("%s %s: not run as compiled ahead (%s); through jit from now on", name, shape, error)
                del self._compiled[(name, shape)]
        with use_mesh_rules(self.mesh, self.rules):
            return jitted(*args)

    def _check_rows(self, rows: int) -> None:
        per_microbatch, remainder = divmod(rows, self.config.num_microbatches)
        if remainder or per_microbatch % self.batch_shards:
            raise ValueError(
                f"train batch: B={rows} must split into num_microbatches={self.config.num_microbatches}"
                f" microbatches whose size is a multiple of the {self.batch_shards} batch shards"
            )


class TrainStep(_JittedStep):
    """The jitted, state-donating step on unsorted batches (`batch_layout.BATCH_SPEC`): one program
    (`train_step`)."""

    def _build(self, graphdef, optimizer, shardings: _StepShardings | None, learning_rate_schedule) -> None:
        config = self.config
        constrain = lambda x: x
        jit_kwargs: dict[str, Any] = {"donate_argnums": 0}
        if shardings is not None:
            batch_sharding = shardings.batch
            constrain = lambda x: jax.lax.with_sharding_constraint(x, batch_sharding)
            jit_kwargs.update(
                in_shardings=(shardings.state, batch_sharding), out_shardings=(shardings.state, shardings.replicated)
            )
        step = lambda state, batch: train_step(
            graphdef, optimizer, config, state, batch, constrain, learning_rate_schedule
        )
        self._jitted = jax.jit(self._counted(step, "train_step"), **jit_kwargs)

    def __call__(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rows, length = validate_batch(batch)
        self._check_rows(rows)
        return self._run("train/step", _step_shape(rows, length), self._jitted, state, batch)

    def lower(self, state: TrainState, batch: dict) -> jax.stages.Lowered:
        """Ahead-of-time lowering for these shapes (`.compile()` it to time compilation or to read
        `memory_analysis()`); the arrays may be jax.ShapeDtypeStruct."""
        self._check_rows(validate_batch(batch)[0])
        with use_mesh_rules(self.mesh, self.rules):
            return self._jitted.lower(state, batch)

    def aot_programs(self, state: TrainState, rows: int, lengths: Sequence[int]) -> Iterator[AotProgram]:
        """The step for every batch shape a run can produce, to lower ahead of time: [rows, T] for
        each length bucket T in `lengths`; `state` may be abstract (ShapeDtypeStructs with shardings)."""
        for length in lengths:
            batch = abstract_arrays(BATCH_SPEC, {1: (rows,), 2: (rows, length)}, self.batch_sharding)
            yield AotProgram("train/step", _step_shape(rows, length), functools.partial(self.lower, state, batch))


class SortedTrainStep(_JittedStep):
    """The jitted step on length-sorted batches (`batch_layout.split_sorted_batch`), as three
    programs driven by a host loop: `prepare_rows` (once per B), `accumulate_microbatch` for
    m = 0 .. M-1 (one compile per (R, T_m); the accumulator donated), then `step_metrics` and
    `apply_update` (state donated). Every process of a multi-host trainer issues the same calls in
    the same order, since the plan is the batch's keys and shapes.
    """

    def _build(self, graphdef, optimizer, shardings: _StepShardings | None, learning_rate_schedule) -> None:
        config = self.config
        prepare_kw: dict[str, Any] = {}
        zeros_kw: dict[str, Any] = {}
        accumulate_kw: dict[str, Any] = {"donate_argnums": 0}
        update_kw: dict[str, Any] = {"donate_argnums": 0}
        if shardings is not None:
            state, batch, replicated = shardings
            params = state.params
            # `_make`: these tuples hold shardings, where their annotations say arrays.
            dealt = NamedSharding(batch.mesh, PartitionSpec(None, *batch.spec))  # [M, R]: R split like B
            terms = RowTerms._make([dealt] * len(RowTerms._fields))
            sums = PolicySums._make([replicated] * len(PolicySums._fields))
            accumulator = Accumulator._make([params, sums, replicated, sums])  # grads, totals, entropy, first
            prepare_kw.update(in_shardings=(batch,), out_shardings=(terms, replicated))
            zeros_kw.update(in_shardings=(params,), out_shardings=accumulator)
            accumulate_kw.update(
                in_shardings=(accumulator, params, terms, replicated, batch), out_shardings=accumulator
            )
            update_kw.update(in_shardings=(state, accumulator, replicated), out_shardings=(state, replicated))

        def update(state, accumulator, row_stats):
            metrics = step_metrics(config, accumulator, row_stats)
            return apply_update(optimizer, config, state, accumulator.grads, metrics, learning_rate_schedule)

        self._prepare = jax.jit(
            self._counted(lambda rows: prepare_rows(rows, config), "train_prepare_rows"), **prepare_kw
        )
        self._zeros = jax.jit(self._counted(zero_accumulator, "train_zero_accumulator"), **zeros_kw)
        self._accumulate = jax.jit(
            self._counted(functools.partial(accumulate_microbatch, graphdef, config), "train_accumulate"),
            **accumulate_kw,
        )
        self._update = jax.jit(self._counted(update, "train_update"), **update_kw)

    def __call__(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rows, microbatches = split_sorted_batch(batch, self.config.num_microbatches)
        num_rows = rows["rewards"].shape[0]
        self._check_rows(num_rows)
        terms, row_stats = self._run("train/prepare_rows", f"B={num_rows}", self._prepare, rows)
        accumulator = self._run("train/zero_accumulator", "params", self._zeros, state.params)
        for index, microbatch in enumerate(microbatches):
            per_microbatch, length = microbatch["tokens"].shape
            if length == 0:  # no row of it in the loss (`plan_sorted_microbatches`): it would add zeros
                continue
            accumulator = self._run(
                "train/accumulate",
                _microbatch_shape(per_microbatch, length),
                self._accumulate,
                accumulator,
                state.params,
                terms,
                np.int32(index),
                microbatch,
            )
        return self._run("train/update", "params", self._update, state, accumulator, row_stats)

    def aot_programs(self, state: TrainState, rows: int, lengths: Sequence[int]) -> Iterator[AotProgram]:
        """Every program a step on `rows` rows can run, to lower ahead of time: `prepare_rows` and
        the accumulator's zeros (lowered here: the later programs take their output shapes),
        `accumulate_microbatch` for [R, T] with R = rows / M and each length bucket T in
        `lengths`, and the update. `state` may be abstract (ShapeDtypeStructs with shardings)."""
        self._check_rows(rows)
        per_microbatch = rows // self.config.num_microbatches
        prepare = self._lower(self._prepare, abstract_arrays(SORTED_ROW_SPEC, {1: (rows,)}, self.batch_sharding))
        yield AotProgram("train/prepare_rows", f"B={rows}", lambda: prepare)
        zeros = self._lower(self._zeros, state.params)
        yield AotProgram("train/zero_accumulator", "params", lambda: zeros)
        (terms, row_stats), accumulator = prepare.out_info, zeros.out_info
        index = jax.ShapeDtypeStruct((), np.int32)
        for length in lengths:
            microbatch = abstract_arrays(MICROBATCH_SPEC, {2: (per_microbatch, length)}, self.batch_sharding)
            lower = functools.partial(
                self._lower, self._accumulate, accumulator, state.params, terms, index, microbatch
            )
            yield AotProgram("train/accumulate", _microbatch_shape(per_microbatch, length), lower)
        yield AotProgram(
            "train/update", "params", functools.partial(self._lower, self._update, state, accumulator, row_stats)
        )

    def _lower(self, jitted, *args) -> jax.stages.Lowered:
        with use_mesh_rules(self.mesh, self.rules):
            return jitted.lower(*args)


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
    `apply_update`)."""
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
