"""Logical-axis sharding: rules from logical names to mesh axes, meshes, device splits.

Every parameter carries its logical axis names as NNX metadata (`out_sharding`, e.g.
`('embed', 'mlp')`; stacked layers add a leading `'layers'`). A rules table maps each logical
name to mesh axes among `('data', 'fsdp', 'tensor')`; `param_shardings` turns the metadata into
`NamedSharding`s for a mesh. Activations are constrained with `constrain(x, axes)`, which is a
no-op unless a `use_mesh_rules(mesh, rules)` context is active on this thread (the generator and
the trainer threads use different meshes).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# jaxlib ships no stub for its C++ Device class, so type checkers see `jax.Device` as a variable.
Device: TypeAlias = jax.Device  # pyright: ignore[reportInvalidTypeForm]

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]

MESH_AXES = ("data", "fsdp", "tensor")

# Logical name -> mesh axes (MaxText style). Parameters: FSDP over the embedding dimension,
# tensor parallelism over heads / mlp / vocab; a mixture-of-experts layer's experts are split
# whole over fsdp (expert parallelism: its embedding dimension then stays whole). Activations:
# batch over data and fsdp.
DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("layers", None),
    ("expert", "fsdp"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("norm", None),
    ("activation_embed", None),
    ("activation_mlp", "tensor"),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_vocab", "tensor"),
)

# Logical axes of the main activations and of the KV cache (see transformer.py).
HIDDEN_AXES = ("batch", "length", "activation_embed")
MLP_AXES = ("batch", "length", "activation_mlp")
QUERY_AXES = ("batch", "length", "activation_heads", None)
KV_AXES = ("batch", "length", "activation_kv_heads", None)
LOGITS_AXES = ("batch", "length", "activation_vocab")
KV_CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")
PAGED_KV_CACHE_AXES = ("layers", "batch", "kv_pages", "length", "kv_heads", "head_dim")

_SHARDING_METADATA_KEYS = ("out_sharding", "sharding_names", "sharding")


class AotProgram(NamedTuple):
    """One jitted program for one input shape, to lower and compile ahead of time (e.g. for a mesh
    of devices that are not attached: `scalerl_jax.cli.compile_check`). `lower()` traces it."""

    name: str  # e.g. 'train/accumulate'
    shape: str  # the sizes that pick this compile, e.g. 'R=16 T=2048'
    lower: Callable[[], jax.stages.Lowered]


def _rules_dict(rules: Rules) -> dict[str, MeshAxes]:
    table: dict[str, MeshAxes] = {}
    for entry in rules:
        if len(entry) != 2:
            raise ValueError(f"sharding rule {entry!r} is not a (logical_name, mesh_axes) pair")
        name, axes = entry
        table.setdefault(name, axes)  # first match wins, as in flax / MaxText
    return table


def _build_spec(
    logical_axes: Sequence[str | None],
    rules: Rules,
    mesh_shape: Mapping[str, int] | None,
    shape: Sequence[int] | None,
    name: str,
    strict: bool,
) -> PartitionSpec:
    table = _rules_dict(rules)
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for dim, logical in enumerate(logical_axes):
        mapped = table.get(logical) if logical is not None else None
        axes = (mapped,) if isinstance(mapped, str) else tuple(mapped or ())
        axes = tuple(a for a in axes if a not in used and (mesh_shape is None or a in mesh_shape))
        if shape is not None and mesh_shape is not None and axes:
            size = math.prod(mesh_shape[a] for a in axes)
            if shape[dim] % size:
                if strict:
                    raise ValueError(
                        f"{name}: dimension {dim} ({logical!r}, size {shape[dim]}) is not divisible by "
                        f"mesh axes {axes} of total size {size}; change the mesh or the sharding rules"
                    )
                axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: Rules = DEFAULT_RULES,
    *,
    mesh: Mesh | Mapping[str, int] | None = None,
    shape: Sequence[int] | None = None,
    name: str = "array",
) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry `logical_axes`.

    Each logical name maps to mesh axes through `rules` (first matching rule; unknown names and
    None replicate). A mesh axis is used at most once per array (later dimensions lose it) and,
    when `mesh` (a Mesh or {axis: size}) is given, axes absent from it are skipped. When `shape`
    is given too, every sharded dimension must be divisible by the product of its mesh axis
    sizes (ValueError naming `name`).
    """
    mesh_shape = None if mesh is None else dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)
    return _build_spec(logical_axes, rules, mesh_shape, shape, name, strict=True)


def variable_logical_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names stored on an NNX variable (None when it has none)."""
    metadata = variable.get_metadata()
    for key in _SHARDING_METADATA_KEYS:
        if metadata.get(key):
            return tuple(metadata[key])
    return None


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _path_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)


def param_specs(model_or_state: Any, rules: Rules = DEFAULT_RULES, mesh: Mesh | Mapping[str, int] | None = None) -> Any:
    """Pytree like `nnx.state(model)` with each variable's value replaced by its PartitionSpec.

    With `mesh` (a Mesh or {axis: size}), axes absent from it are dropped and divisibility is checked.
    """
    state = model_or_state if not isinstance(model_or_state, nnx.Module) else nnx.state(model_or_state)

    def spec_of(path: tuple[Any, ...], variable: Any) -> Any:
        if not _is_variable(variable):
            return PartitionSpec()
        axes = variable_logical_axes(variable)
        value = variable.get_value() if hasattr(variable, "get_value") else variable.value
        shape = getattr(value, "shape", ())
        if axes is None:
            return variable.replace(PartitionSpec())
        if len(axes) != len(shape):
            raise ValueError(f"param {_path_name(path)}: logical axes {axes} do not match its shape {tuple(shape)}")
        return variable.replace(logical_to_spec(axes, rules, mesh=mesh, shape=shape, name=_path_name(path)))

    return jax.tree_util.tree_map_with_path(spec_of, state, is_leaf=_is_variable)


def param_shardings(model_or_state: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """Pytree like `nnx.state(model)` with `NamedSharding(mesh, spec)` for every parameter.

    Works on a concrete model, its state, or an abstract one from `nnx.eval_shape`.
    """
    specs = param_specs(model_or_state, rules, mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def make_mesh(
    shape: Sequence[int], axis_names: Sequence[str] = MESH_AXES, devices: Sequence[Device] | None = None
) -> Mesh:
    """A `Mesh` of `devices` (default: all) with the given shape; one entry may be -1 ("the rest")."""
    devices = list(jax.devices() if devices is None else devices)
    shape = [int(s) for s in shape]
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {shape} has {len(shape)} entries but axis_names {tuple(axis_names)}")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape}: at most one entry may be -1")
    if any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh shape {shape}: entries must be positive or -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if len(devices) % known:
            raise ValueError(f"mesh shape {shape}: {len(devices)} devices are not divisible by {known}")
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices, got {len(devices)}")
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), tuple(axis_names))


def split_devices(devices: Sequence[Any], generator_fraction: float) -> tuple[list[Any], list[Any]]:
    """The run's one generator / trainer split: returns disjoint (generator, trainer) lists.

    Of n devices, round(n * `generator_fraction`) generate, clipped to [1, n - 1] so each side
    keeps one; they are the *last* devices, and the first ones train, so that on several
    processes (devices ordered by process) process 0 holds a trainer device and leads
    (distributed/roles.py). With a single device both sides share it (CPU runs). Any sequence
    works: config checks that need only the counts pass `range(n)`.
    """
    devices = list(devices)
    if isinstance(generator_fraction, str):  # 'auto' is resolved to a number before any split
        raise ValueError(f"generator_fraction={generator_fraction!r}: resolve it to a number first (run.device_split)")
    if not 0.0 < generator_fraction < 1.0:
        raise ValueError(f"generator_fraction={generator_fraction} must be in (0, 1)")
    if not devices:
        raise ValueError("split_devices: empty device list")
    if len(devices) == 1:
        return devices, devices
    num_trainer = len(devices) - min(len(devices) - 1, max(1, round(len(devices) * generator_fraction)))
    return devices[num_trainer:], devices[:num_trainer]


class _MeshRules(threading.local):
    mesh: Mesh | None = None
    rules: Rules = DEFAULT_RULES


_ACTIVE = _MeshRules()


@contextlib.contextmanager
def use_mesh_rules(mesh: Mesh | None, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
    """Within this context (on this thread) `constrain` shards activations on `mesh` by `rules`.

    It must be active while a function is traced (e.g. around the first call of a jitted step).
    """
    previous = (_ACTIVE.mesh, _ACTIVE.rules)
    _ACTIVE.mesh, _ACTIVE.rules = mesh, tuple(rules)
    try:
        yield
    finally:
        _ACTIVE.mesh, _ACTIVE.rules = previous


def active_mesh() -> Mesh | None:
    """The mesh of the innermost `use_mesh_rules` context on this thread, if any."""
    return _ACTIVE.mesh


class ExpertParallel(NamedTuple):
    """Where a mixture-of-experts layer's tokens and experts live on the active mesh: tokens split
    over `token_axes`, experts over `expert_axis` (one of them), expert width over `mlp_axis`."""

    mesh: Mesh
    token_axes: tuple[str, ...]
    expert_axis: str
    mlp_axis: str | None


def expert_parallel(num_tokens: int, num_experts: int) -> ExpertParallel | None:
    """The active mesh's expert parallelism (`use_mesh_rules`) for `num_tokens` tokens [N, D] and
    `num_experts` experts: None without a mesh, when the 'expert' rule names no axis of size > 1,
    when the tokens are not split over that axis too ('batch'), or when N or the experts do not
    divide over their axes (the caller then leaves the layout to XLA's partitioner)."""
    mesh, rules = _ACTIVE.mesh, _ACTIVE.rules
    if mesh is None:
        return None
    table = _rules_dict(rules)

    def axes_of(name: str) -> tuple[str, ...]:
        axes = table.get(name)
        named = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        return tuple(a for a in named if a in mesh.shape)

    expert_axes, token_axes, mlp_axes = axes_of("expert"), axes_of("batch"), axes_of("mlp")
    if len(expert_axes) != 1 or mesh.shape[expert_axes[0]] == 1 or expert_axes[0] not in token_axes:
        return None
    expert_axis = expert_axes[0]
    mlp_axis = mlp_axes[0] if len(mlp_axes) == 1 and mlp_axes[0] not in token_axes else None
    if num_tokens % math.prod(mesh.shape[a] for a in token_axes) or num_experts % mesh.shape[expert_axis]:
        return None
    return ExpertParallel(mesh, token_axes, expert_axis, mlp_axis)


def trace_platform() -> str:
    """The platform being traced for: that of the active mesh's devices (`use_mesh_rules`), else
    `jax.default_backend()`. Kernels are chosen by it, so a program compiled on a CPU host for a
    mesh of TPU (or GPU) devices takes that accelerator's kernels."""
    mesh = _ACTIVE.mesh
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def activation_spec(shape: Sequence[int], logical_axes: Sequence[str | None]) -> PartitionSpec | None:
    """The PartitionSpec `constrain` gives an activation of `shape` under the active mesh, None without one."""
    mesh = _ACTIVE.mesh
    if mesh is None:
        return None
    return _build_spec(logical_axes, _ACTIVE.rules, dict(mesh.shape), shape, "activation", strict=False)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` of `x` to its logical axes under the active mesh; else `x`.

    Dimensions whose size the mapped mesh axes do not divide are left unconstrained (an
    activation's size, e.g. a decode batch of 1, may legitimately not divide the mesh).
    """
    mesh, spec = _ACTIVE.mesh, activation_spec(x.shape, logical_axes)
    if mesh is None or spec is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
