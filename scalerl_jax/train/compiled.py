"""The train step as compiled programs: state shardings, the jitted steps of both batch layouts,
and their ahead-of-time compilation.

Two layouts, two drivers of the same steps. Unsorted (`TrainStep`): one [B, T] batch, one jitted
program with a `lax.scan` over the microbatches. Length-sorted (`TrainStepConfig.sort_by_length`,
`SortedTrainStep`): the host sorts rows by length into the M microbatches and pads each to its own
length bucket T_m (`pipeline/batching.py`); three jitted programs for the steps of `step.py`:
(1) once per batch, (2) once per microbatch (one compile per (R, T_m), the accumulator donated),
(3) once. Loss, gradient and metrics equal those of the unsorted step on the same rows dealt the
same way.

Compiling ahead (`compile_ahead`): every program a run's batches can need, for the batch's rows
and every length bucket, is compiled before the first step and its executable kept; a step then
runs those executables, so no step compiles (a shape not compiled ahead still runs, through jit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scalerl_jax.contracts.batch_layout import (
    ROUTING_KEY,
    SORTED_ROW_SPEC,
    Routing,
    batch_spec,
    microbatch_spec,
    shapes_by_rank,
    split_sorted_batch,
    validate_batch,
)
from scalerl_jax.models.moe import RouterStats
from scalerl_jax.models.sharding import (
    DEFAULT_RULES,
    AotProgram,
    Rules,
    logical_to_spec,
    param_shardings,
    use_mesh_rules,
)
from scalerl_jax.rl import PolicySums
from scalerl_jax.train.optimizer import OptimizerState
from scalerl_jax.train.step import (
    Accumulator,
    RowTerms,
    TrainState,
    accumulate_microbatch,
    apply_update,
    create_train_state,
    prepare_rows,
    train_step,
    train_step_metrics,
    zero_accumulator,
)
from scalerl_jax.train.step_config import TrainStepConfig


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


_ABSTRACT_DTYPES = {"int": np.int32, "float": np.float32, "bool": np.bool_}  # what `pipeline.batching` builds


def abstract_arrays(
    spec: dict[str, tuple[int, str]],
    shape_of_rank: dict[int, tuple[int, ...]],
    sharding,
    routing: Routing | None = None,
) -> dict:
    """ShapeDtypeStructs of a batch layout's arrays (`batch_layout` spec: name -> (rank, kind)), the
    shape by rank, every array on `sharding` (None: no sharding); the sampler's routing, if in
    `spec`, in `routing`'s dtype."""
    return {
        name: jax.ShapeDtypeStruct(
            shape_of_rank[rank],
            routing.dtype if name == ROUTING_KEY and routing else _ABSTRACT_DTYPES[kind],
            sharding=sharding,
        )
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
        rows, length = validate_batch(batch, self.config.routing)
        self._check_rows(rows)
        return self._run("train/step", _step_shape(rows, length), self._jitted, state, batch)

    def lower(self, state: TrainState, batch: dict) -> jax.stages.Lowered:
        """Ahead-of-time lowering for these shapes (`.compile()` it to time compilation or to read
        `memory_analysis()`); the arrays may be jax.ShapeDtypeStruct."""
        self._check_rows(validate_batch(batch, self.config.routing)[0])
        with use_mesh_rules(self.mesh, self.rules):
            return self._jitted.lower(state, batch)

    def aot_programs(self, state: TrainState, rows: int, lengths: Sequence[int]) -> Iterator[AotProgram]:
        """The step for every batch shape a run can produce, to lower ahead of time: [rows, T] for
        each length bucket T in `lengths`; `state` may be abstract (ShapeDtypeStructs with shardings)."""
        routing = self.config.routing
        for length in lengths:
            batch = abstract_arrays(
                batch_spec(routing), shapes_by_rank(rows, length, routing), self.batch_sharding, routing
            )
            yield AotProgram("train/step", _step_shape(rows, length), functools.partial(self.lower, state, batch))


class SortedTrainStep(_JittedStep):
    """The jitted step on length-sorted batches (`batch_layout.split_sorted_batch`), as three
    programs driven by a host loop: `prepare_rows` (once per B), `accumulate_microbatch` for
    m = 0 .. M-1 (one compile per (R, T_m); the accumulator donated), then `train_step_metrics` and
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
            routing = None if not config.moe_layers else RouterStats._make([replicated] * len(RouterStats._fields))
            moe = [routing, replicated if config.moe_layers else None]
            accumulator = Accumulator._make([params, sums, replicated, sums, *moe])  # the fields in order
            prepare_kw.update(in_shardings=(batch,), out_shardings=(terms, replicated))
            zeros_kw.update(in_shardings=(params,), out_shardings=accumulator)
            accumulate_kw.update(
                in_shardings=(accumulator, params, terms, replicated, batch), out_shardings=accumulator
            )
            update_kw.update(in_shardings=(state, accumulator, replicated), out_shardings=(state, replicated))

        def update(state, accumulator, row_stats):
            metrics = train_step_metrics(config, accumulator, row_stats)
            return apply_update(optimizer, config, state, accumulator.grads, metrics, learning_rate_schedule)

        self._prepare = jax.jit(
            self._counted(lambda rows: prepare_rows(rows, config), "train_prepare_rows"), **prepare_kw
        )
        self._zeros = jax.jit(
            self._counted(lambda params: zero_accumulator(params, config), "train_zero_accumulator"), **zeros_kw
        )
        self._accumulate = jax.jit(
            self._counted(functools.partial(accumulate_microbatch, graphdef, config), "train_accumulate"),
            **accumulate_kw,
        )
        self._update = jax.jit(self._counted(update, "train_update"), **update_kw)

    def __call__(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rows, microbatches = split_sorted_batch(batch, self.config.num_microbatches, self.config.routing)
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
        routing = self.config.routing
        for length in lengths:
            microbatch = abstract_arrays(
                microbatch_spec(routing), shapes_by_rank(per_microbatch, length, routing), self.batch_sharding, routing
            )
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
