"""One process of a 2-process weight-push run (started by tests/unit/distributed/test_distributed_push.py).

usage: distributed_push_worker.py SCENARIO PORT PROCESS_ID OUT_DIR

Scenarios (CPU, gloo):
  rows_to_cols  2 devices per process; trainer mesh = process 1's devices (rows sharded); generator
                process 0 with other layouts (columns, replicated). Versions 1 and 2 are offered
                back to back (the trainer's arrays deleted after each offer, as a donating train step
                would), then pulled in reverse order.
  spanning      3 devices per process; trainer mesh = device 0 of each process; both processes are
                also generators on their devices 1 and 2, with different layouts. Version 7.
Each generator writes OUT_DIR/p{process}_v{version}.npz (leaves as float32, keys 'a/b') and
OUT_DIR/p{process}_v{version}.json (per leaf: spec, dtype, device ids per distinct shard; the
receiver's plan; and the senders' plans on trainer processes, written as plan_p{process}.json).
The source values are `source_leaf(name, shape, version)` below; the test recomputes them.
"""

import json
import os
import sys

SCENARIO, PORT, PROCESS, OUT_DIR = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
DEVICES_PER_PROCESS = {"rows_to_cols": 2, "spanning": 3}[SCENARIO]

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{PORT}", 2, PROCESS)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import distributed  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from scalerl_jax.distributed import weight_push  # noqa: E402

TIMEOUT_MS = 60_000
SHAPES = {
    "layer/w": ((8, 6), jnp.float32),
    "layer/b": ((6,), jnp.bfloat16),
    "embed": ((4, 4), jnp.bfloat16),
    "scale": ((), jnp.float32),
}


def source_leaf(name, shape, version):
    """Distinct small integers per leaf and version (exact in bf16)."""
    offset = sorted(SHAPES).index(name) * 40
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + offset + version


def tree_of(fn):
    """{'layer': {'w', 'b'}, 'embed', 'scale'} with fn(name) at each leaf."""
    return {"layer": {"w": fn("layer/w"), "b": fn("layer/b")}, "embed": fn("embed"), "scale": fn("scale")}


def devices_of(process):
    return [d for d in jax.devices() if d.process_index == process]


def trainer_params(mesh, specs, version):
    def make(name):
        shape, dtype = SHAPES[name]
        source = source_leaf(name, shape, version).astype(dtype)
        return jax.make_array_from_callback(shape, NamedSharding(mesh, specs[name]), lambda index: source[index])

    return tree_of(make)


def abstract_params():
    return tree_of(lambda name: jax.ShapeDtypeStruct(*SHAPES[name]))


def shardings_on(mesh, specs):
    return tree_of(lambda name: NamedSharding(mesh, specs[name]))


def no_host_transfers():
    """Guards that raise on an explicit host round trip (see the test for which ones trip on CPU)."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(jax.transfer_guard_host_to_device("disallow_explicit"))
    stack.enter_context(jax.transfer_guard_device_to_host("disallow_explicit"))
    return stack


def plan_json(transfers):
    return [[t.leaf, [[s.start, s.stop] for s in t.index], t.owner] for t in transfers]


def write_pulled(params, version, receiver):
    leaves = {
        "layer/w": params["layer"]["w"],
        "layer/b": params["layer"]["b"],
        "embed": params["embed"],
        "scale": params["scale"],
    }
    np.savez(
        os.path.join(OUT_DIR, f"p{PROCESS}_v{version}.npz"),
        allow_pickle=True,  # the default, named so that the arrays unpacked below cannot bind it
        **{name: np.asarray(leaf).astype(np.float32) for name, leaf in leaves.items()},
    )
    info = {"plan": plan_json(receiver.transfers), "leaves": {}}
    for name, leaf in leaves.items():
        info["leaves"][name] = {
            "spec": str(leaf.sharding.spec),
            "dtype": str(leaf.dtype),
            "devices": sorted(d.id for d in leaf.sharding.device_set),
            "shards": sorted(
                [
                    [shard.device.id, [list(i.indices(n)[:2]) for i, n in zip(shard.index, leaf.shape)]]
                    for shard in leaf.addressable_shards
                ]
            ),
        }
    with open(os.path.join(OUT_DIR, f"p{PROCESS}_v{version}.json"), "w") as f:
        json.dump(info, f)


def publish_address(client, server):
    client.key_value_set(f"push/address/{PROCESS}", server.address())


def address_of(client, process):
    return client.blocking_key_value_get(f"push/address/{process}", TIMEOUT_MS)


def rows_to_cols(client, server):
    trainer_mesh = Mesh(np.array(devices_of(1)), ("x",))
    generator_mesh = Mesh(np.array(devices_of(0)), ("y",))
    trainer_specs = {"layer/w": P("x", None), "layer/b": P(), "embed": P("x", None), "scale": P()}
    generator_specs = {"layer/w": P(None, "y"), "layer/b": P("y"), "embed": P(), "scale": P()}
    targets = shardings_on(generator_mesh, generator_specs)
    if PROCESS == 1:
        sender = weight_push.ParamsSender(trainer_mesh, server, {0: targets})
        offered = {}
        for version in (1, 2):
            params = trainer_params(trainer_mesh, trainer_specs, version)
            with no_host_transfers():
                offered[version] = sender.offer(params, version)
            for leaf in jax.tree.leaves(params):
                leaf.delete()  # as a donating train step would: the offer must not alias these buffers
        with open(os.path.join(OUT_DIR, "plan_p1.json"), "w") as f:
            json.dump(
                {"plans": {g: plan_json(t) for g, t in sender.plans(params).items()}, "offered_bytes": offered}, f
            )
        client.key_value_set("push/offered", "1,2")
    else:
        receiver = weight_push.ParamsReceiver(targets, abstract_params(), server, {1: address_of(client, 1)})
        client.blocking_key_value_get("push/offered", TIMEOUT_MS)
        for version in (2, 1):
            with no_host_transfers():
                params = receiver.pull(version, timeout_s=60)
            write_pulled(params, version, receiver)
        try:
            receiver.pull(3, timeout_s=2)  # never offered: the wait must end, naming the trainer
        except TimeoutError as error:
            with open(os.path.join(OUT_DIR, "p0_never_offered.txt"), "w") as f:
                f.write(str(error))
    client.wait_at_barrier("push/done", TIMEOUT_MS)


def spanning(client, server):
    trainer_mesh = Mesh(np.array([devices_of(0)[0], devices_of(1)[0]]), ("x",))
    trainer_specs = {"layer/w": P("x", None), "layer/b": P(), "embed": P(None, "x"), "scale": P()}
    generator_specs = {
        0: {"layer/w": P("y", None), "layer/b": P(), "embed": P(), "scale": P()},
        1: {"layer/w": P(None, "y"), "layer/b": P("y"), "embed": P("y", None), "scale": P()},
    }
    targets = {
        g: shardings_on(Mesh(np.array(devices_of(g)[1:]), ("y",)), specs) for g, specs in generator_specs.items()
    }
    version = 7
    sender = weight_push.ParamsSender(trainer_mesh, server, targets)
    params = trainer_params(trainer_mesh, trainer_specs, version)
    with no_host_transfers():
        offered = sender.offer(params, version)
    with open(os.path.join(OUT_DIR, f"plan_p{PROCESS}.json"), "w") as f:
        json.dump(
            {"plans": {g: plan_json(t) for g, t in sender.plans(params).items()}, "offered_bytes": {version: offered}},
            f,
        )
    client.wait_at_barrier("push/offered", TIMEOUT_MS)  # the caller's announcement, in a real run
    receiver = weight_push.ParamsReceiver(
        targets[PROCESS], abstract_params(), server, {p: address_of(client, p) for p in (0, 1)}
    )
    with no_host_transfers():
        pulled = receiver.pull(version, timeout_s=60)
    write_pulled(pulled, version, receiver)
    client.wait_at_barrier("push/done", TIMEOUT_MS)


def main():
    client = distributed.global_state.client
    server = weight_push.start_transfer_server("127.0.0.1")
    publish_address(client, server)
    {"rows_to_cols": rows_to_cols, "spanning": spanning}[SCENARIO](client, server)
    print(f"process {PROCESS}: done", flush=True)
    jax.distributed.shutdown()
    os._exit(0)  # a timed-out pull leaves a blocked transfer thread behind; do not wait for it


if __name__ == "__main__":
    main()
