"""The engine's decode-path programs, lowered ahead of time (e.g. for a mesh of devices that are
not attached: `scalerl_jax.cli.compile_check`): every call of `Engine.decode_path_calls`, on an
abstract decode state placed where `Engine.init_decode_state` would place it."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from scalerl_jax.models.sharding import AotProgram
from scalerl_jax.models.transformer import kv_pages_sharding
from scalerl_jax.sampler.engine import DecodeCall, DecodeState, Engine


def abstract_decode_state(engine: Engine) -> DecodeState:
    """`engine.init_decode_state()`'s shapes and dtypes without building it, each on the sharding
    `init_decode_state` gives it (the KV pages by the rules, the rest replicated; none without a
    mesh): what `aot_programs` takes."""
    abstract = jax.eval_shape(engine.init_decode_state)
    if engine.mesh is None:
        return abstract
    replicated = NamedSharding(engine.mesh, PartitionSpec())

    def place(leaf: jax.ShapeDtypeStruct, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    fields = {
        name: jax.tree.map(lambda leaf: place(leaf, replicated), value) for name, value in abstract._asdict().items()
    }
    fields["cache"] = {
        name: place(leaf, kv_pages_sharding(leaf.shape, engine.mesh, engine.rules))
        for name, leaf in abstract.cache.items()
    }
    return DecodeState(**fields)


def aot_programs(engine: Engine, params: Any, state: DecodeState, *, max_prompt_length: int) -> Iterator[AotProgram]:
    """Every call of `engine.decode_path_calls(max_prompt_length)`, to lower ahead of time;
    `params` and `state` may be abstract (ShapeDtypeStructs with shardings: `abstract_decode_state`)."""
    for call in engine.decode_path_calls(max_prompt_length):
        shape = " ".join(f"{key}={value}" for key, value in zip(call.shape_names, call.shape))
        yield AotProgram(
            f"generator/{call.name}", shape or "state", functools.partial(_lower, engine, params, state, call)
        )


def _lower(engine: Engine, params: Any, state: DecodeState, call: DecodeCall) -> jax.stages.Lowered:
    with engine.mesh_context():
        return call.jitted.lower(*((params,) if call.takes_params else ()), state, *call.args)
