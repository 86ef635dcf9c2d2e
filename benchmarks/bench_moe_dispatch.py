"""Expert parallelism: the shard_map dispatch (`moe.experts_dispatched`) vs what XLA's SPMD
partitioner makes of the sharded grouped matmul, by the bytes of collectives in the compiled
gradient program.

One mixture-of-experts layer's gradient (router, top-k, the experts by `jax.lax.ragged_dot`, a
squared-output loss) with Qwen3-30B-A3B's shapes (D 2048, expert width 768, 128 experts, 8 per
token, bfloat16) and `--tokens` tokens per device, compiled (not run) for 8 host devices as
meshes (data, fsdp, tensor): the experts split over fsdp, their width over tensor, the tokens over
data x fsdp. For each path: the summed result bytes of each collective kind in the per-device
program (all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute), their total,
XLA's temporary bytes, and the ratio SPMD / dispatch of the totals. Before that, at small shapes,
both paths' loss and gradients against one device's (relative error).

  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_moe_dispatch.py [--tokens 4096]

The CPU compiler's partitioner is XLA's SPMD partitioner that GPU and TPU use too; their own
passes after it (collective combining, async scheduling) are not applied here.
"""

from __future__ import annotations

import argparse
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scalerl_jax.models import make_mesh
from scalerl_jax.models.moe import experts_dispatched, experts_ragged, route_softmax_topk
from scalerl_jax.models.sharding import ExpertParallel

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
COLLECTIVE = re.compile(r"=\s*(.*?)\s+(" + "|".join(KINDS) + r")(?:-start)?\(")
SHAPE = re.compile(r"(bf16|f16|f32|f64|s8|s16|s32|s64|u8|u32|pred)\[([\d,]*)\]")
ITEM_BYTES = {
    "bf16": 2,
    "f16": 2,
    "f32": 4,
    "f64": 8,
    "s8": 1,
    "s16": 2,
    "s32": 4,
    "s64": 8,
    "u8": 1,
    "u32": 4,
    "pred": 1,
}
MESHES = ((1, 8, 1), (1, 4, 2), (2, 4, 1))


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Per collective kind, the summed bytes of the results of its instructions in `hlo_text`."""
    totals: dict[str, int] = dict.fromkeys(KINDS, 0)
    for line in hlo_text.splitlines():
        match = COLLECTIVE.search(line)
        if match:
            for dtype, dims in SHAPE.findall(match.group(1)):
                totals[match.group(2)] += ITEM_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return totals


def layer_loss(mesh_shape, *, experts_per_token: int, dispatch: bool):
    """loss(params, x, router, target) of one MoE layer on `make_mesh(mesh_shape)`."""
    mesh = make_mesh(mesh_shape, devices=jax.devices()[: int(np.prod(mesh_shape))])
    layout = ExpertParallel(mesh, ("data", "fsdp"), "fsdp", "tensor" if mesh_shape[2] > 1 else None)

    def loss(params, x, router, target):
        gate, up, down = params
        probs = jax.nn.softmax(x.astype(jnp.float32) @ router)
        weights, experts = route_softmax_topk(probs, experts_per_token, True)
        if dispatch:
            y = experts_dispatched(x, weights, experts, gate, up, down, layout=layout, compute=experts_ragged)
        else:
            y = experts_ragged(x, weights, experts, gate, up, down)
        return jnp.sum((y.astype(jnp.float32) - target) ** 2)

    return mesh, loss


def shardings(mesh):
    """(gate/up, down, tokens) shardings: experts over fsdp, width over tensor, tokens over data x fsdp."""
    return (
        NamedSharding(mesh, P("fsdp", None, "tensor")),
        NamedSharding(mesh, P("fsdp", "tensor", None)),
        NamedSharding(mesh, P(("data", "fsdp"), None)),
    )


def check_small() -> None:
    rng = np.random.default_rng(0)
    n, d, f, e, k = 256, 32, 16, 16, 4
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    router = jnp.asarray(rng.normal(size=(d, e)), jnp.float32)
    params = tuple(jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d)))
    target = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    _, one_device = layer_loss((1, 1, 1), experts_per_token=k, dispatch=False)
    want_loss, want_grads = jax.jit(jax.value_and_grad(one_device))(params, x, router, target)
    for shape in MESHES:
        for dispatch in (False, True):
            mesh, loss = layer_loss(shape, experts_per_token=k, dispatch=dispatch)
            expert_in, expert_out, tokens = shardings(mesh)
            placed = (jax.device_put(params[0], expert_in), jax.device_put(params[1], expert_in))
            placed += (jax.device_put(params[2], expert_out),)
            got_loss, grads = jax.jit(jax.value_and_grad(loss))(placed, jax.device_put(x, tokens), router, target)
            error = max(float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) for g, w in zip(grads, want_grads))
            print(
                f"small {shape} {'dispatch' if dispatch else 'spmd':8s} loss rel err "
                f"{abs(float(got_loss) / float(want_loss) - 1):.1e}, grad rel err {error:.1e}"
            )


def measure(tokens_per_device: int) -> None:
    d, f, e, k = 2048, 768, 128, 8
    for shape in MESHES:
        totals = {}
        for dispatch in (False, True):
            mesh, loss = layer_loss(shape, experts_per_token=k, dispatch=dispatch)
            expert_in, expert_out, tokens = shardings(mesh)
            params = (
                jax.ShapeDtypeStruct((e, d, f), jnp.bfloat16, sharding=expert_in),
                jax.ShapeDtypeStruct((e, d, f), jnp.bfloat16, sharding=expert_in),
                jax.ShapeDtypeStruct((e, f, d), jnp.bfloat16, sharding=expert_out),
            )
            n = tokens_per_device * shape[0] * shape[1]
            x = jax.ShapeDtypeStruct((n, d), jnp.bfloat16, sharding=tokens)
            router = jax.ShapeDtypeStruct((d, e), jnp.float32, sharding=NamedSharding(mesh, P()))
            target = jax.ShapeDtypeStruct((n, d), jnp.float32, sharding=tokens)
            compiled = jax.jit(jax.grad(loss)).lower(params, x, router, target).compile()
            counts = collective_bytes(compiled.as_text() or "")
            totals[dispatch] = sum(counts.values())
            memory = compiled.memory_analysis()
            temp = f", temp {memory.temp_size_in_bytes / 2**30:.2f} GiB" if memory is not None else ""
            kinds = ", ".join(f"{kind} {size / 2**20:.0f}" for kind, size in counts.items() if size)
            print(
                f"mesh {shape} {'dispatch' if dispatch else 'spmd':8s} collectives MiB per device: {kinds}; "
                f"total {totals[dispatch] / 2**20:.0f} MiB{temp}"
            )
        print(f"mesh {shape}: spmd / dispatch collective bytes = {totals[False] / totals[True]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="MoE dispatch vs SPMD partitioner: collective bytes")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per device of the measured shapes")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.default_backend()} devices")
    check_small()
    measure(args.tokens)


if __name__ == "__main__":
    main()
