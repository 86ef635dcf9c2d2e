"""Weight push trainer -> generator: slice plan, uuids, local reshard, real 2-process transfers.

In-process tests use the conftest's 8 CPU devices; the 2-process runs start
tests/support/distributed_push_worker.py twice (gloo collectives) and check what the generator wrote
against numpy values recomputed here.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from repo_paths import REPO, SUPPORT

from scalerl_jax.distributed import weight_push
from scalerl_jax.distributed.weight_push import plan, transfer_uuid, unique_slices
from scalerl_jax.models.reshard import push_local

REPO_ROOT = REPO
WORKER = os.path.join(SUPPORT, "distributed_push_worker.py")


def mesh_2x4():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))


def S(*bounds):
    """Index tuple from (start, stop) pairs."""
    return tuple(slice(start, stop) for start, stop in bounds)


# --- unique_slices -----------------------------------------------------------------------------


def test_unique_slices_rows_on_a_2x4_mesh_has_two_slices():
    sharding = NamedSharding(mesh_2x4(), P("a", None))
    assert unique_slices(sharding, (4, 6)) == [S((0, 2), (0, 6)), S((2, 4), (0, 6))]


def test_unique_slices_columns():
    sharding = NamedSharding(mesh_2x4(), P(None, "b"))
    assert unique_slices(sharding, (4, 8)) == [
        S((0, 4), (0, 2)),
        S((0, 4), (2, 4)),
        S((0, 4), (4, 6)),
        S((0, 4), (6, 8)),
    ]


def test_unique_slices_two_axes_on_one_dimension():
    sharding = NamedSharding(mesh_2x4(), P(("a", "b")))
    assert unique_slices(sharding, (16,)) == [S((2 * i, 2 * i + 2)) for i in range(8)]


def test_unique_slices_grid_is_sorted_by_rows_then_columns():
    sharding = NamedSharding(mesh_2x4(), P("b", "a"))
    expected = [S((r, r + 2), (c, c + 2)) for r in (0, 2, 4, 6) for c in (0, 2)]
    assert unique_slices(sharding, (8, 4)) == expected


def test_unique_slices_replicated_and_scalar():
    replicated = NamedSharding(mesh_2x4(), P())
    assert unique_slices(replicated, (3, 5)) == [S((0, 3), (0, 5))]
    assert unique_slices(replicated, ()) == [()]


# --- plan ---------------------------------------------------------------------------------------


def plan_leaves():
    """A f32 (4,4) two row slices (32 B each), B f32 (4,) replicated (16 B), C bf16 (8,) two slices (8 B each)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("y",))
    shardings = [NamedSharding(mesh, P("y", None)), NamedSharding(mesh, P()), NamedSharding(mesh, P("y"))]
    return shardings, [(4, 4), (4,), (8,)], [jnp.float32, jnp.float32, jnp.bfloat16]


def owners(transfers):
    return [(t.leaf, t.index, t.owner) for t in transfers]


def test_plan_generator_0_starts_at_the_lowest_trainer_and_balances_bytes():
    # bytes so far {1, 3}: A0->1 (32,0) A1->3 (32,32) B->1 tie (48,32) C0->3 (48,40) C1->3 (48,48)
    transfers = plan(*plan_leaves(), generator=0, trainer_processes=[3, 1])
    assert owners(transfers) == [
        (0, S((0, 2), (0, 4)), 1),
        (0, S((2, 4), (0, 4)), 3),
        (1, S((0, 4)), 1),
        (2, S((0, 4)), 3),
        (2, S((4, 8)), 3),
    ]


def test_plan_generator_1_starts_the_rotation_at_the_next_trainer():
    # rotation [3, 1]: A0->3 A1->1 B->3 (tie) C0->1 C1->1
    transfers = plan(*plan_leaves(), generator=1, trainer_processes=[1, 3])
    assert [t.owner for t in transfers] == [3, 1, 3, 1, 1]


def test_plan_equal_slices_is_round_robin():
    mesh = Mesh(np.array(jax.devices()[:4]), ("y",))
    transfers = plan([NamedSharding(mesh, P("y"))], [(8,)], [jnp.float32], generator=2, trainer_processes=[0, 1, 2])
    assert [t.owner for t in transfers] == [2, 0, 1, 2]


def test_plan_rejects_mismatched_inputs_and_no_trainers():
    shardings, shapes, dtypes = plan_leaves()
    with pytest.raises(ValueError, match="3 shardings, 2 shapes"):
        plan(shardings, shapes[:2], dtypes, 0, [0])
    with pytest.raises(ValueError, match="no trainer processes"):
        plan(shardings, shapes, dtypes, 0, [])


def test_transfer_uuid_is_unique_and_fits_64_bits():
    triples = [(v, g, o) for v in (0, 1, 2, 2**32 - 1) for g in (0, 1, 65535) for o in (0, 1, 65535)]
    uuids = [transfer_uuid(*triple) for triple in triples]
    assert len(set(uuids)) == len(triples)
    assert all(0 <= u < 2**64 for u in uuids)
    assert transfer_uuid(3, 2, 1) == 3 * 2**32 + 2 * 2**16 + 1


@pytest.mark.parametrize(
    "triple, what", [((2**32, 0, 0), "version"), ((0, 2**16, 0), "generator"), ((0, 0, -1), "owner")]
)
def test_transfer_uuid_rejects_out_of_range(triple, what):
    with pytest.raises(ValueError, match=what):
        transfer_uuid(*triple)


# --- single process: local reshard and the transfer path over a self-connection -----------------


def host_round_trip_guards():
    """Guards that trip on an explicit host round trip. On CPU the device-to-host guard never trips
    (`np.asarray` of a CPU array is not a transfer), so the host-to-device one is what catches it."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(jax.transfer_guard_host_to_device("disallow_explicit"))
    stack.enter_context(jax.transfer_guard_device_to_host("disallow_explicit"))
    return stack


def trainer_and_generator_meshes():
    devices = jax.devices()
    return Mesh(np.array(devices[:4]), ("x",)), Mesh(np.array(devices[4:8]).reshape(2, 2), ("y", "z"))


def sharded(source, sharding):
    return jax.make_array_from_callback(source.shape, sharding, lambda index: source[index])


def test_guards_catch_a_host_round_trip():
    trainer_mesh, generator_mesh = trainer_and_generator_meshes()
    x = sharded(np.arange(8, dtype=np.float32), NamedSharding(trainer_mesh, P("x")))
    with host_round_trip_guards(), pytest.raises(Exception, match="Disallowed host-to-device"):
        jax.device_put(np.asarray(x), NamedSharding(generator_mesh, P()))


def test_push_local_reshards_device_to_device_without_aliasing():
    trainer_mesh, generator_mesh = trainer_and_generator_meshes()
    w_source = np.arange(48, dtype=np.float32).reshape(8, 6)
    b_source = (np.arange(4) - 2).astype(jnp.bfloat16)
    c_source = np.arange(24, dtype=np.float32).reshape(2, 12)
    params = {
        "w": sharded(w_source, NamedSharding(trainer_mesh, P("x", None))),
        "b": sharded(b_source, NamedSharding(trainer_mesh, P())),
        "c": sharded(c_source, NamedSharding(trainer_mesh, P(None, "x"))),
        "s": sharded(np.float32(2.5), NamedSharding(trainer_mesh, P())),
    }
    targets = {
        "w": NamedSharding(generator_mesh, P("z", "y")),
        "b": NamedSharding(generator_mesh, P("y")),
        "c": NamedSharding(generator_mesh, P("y", None)),
        "s": NamedSharding(generator_mesh, P()),
    }
    with host_round_trip_guards():
        pushed = push_local(params, targets)
    for leaf in jax.tree.leaves(params):
        leaf.delete()  # the trainer's next step donates these
    assert all(pushed[name].sharding == targets[name] for name in targets)
    np.testing.assert_array_equal(np.asarray(pushed["w"]), w_source)
    np.testing.assert_array_equal(np.asarray(pushed["c"]), c_source)
    assert float(pushed["s"]) == 2.5
    assert pushed["b"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(pushed["b"]).astype(np.float32), [-2, -1, 0, 1])


def test_push_local_onto_the_same_devices_and_layout_copies():
    """Single-device CPU runs share the device: the push must still be a copy, not an alias."""
    trainer_mesh, _ = trainer_and_generator_meshes()
    source = np.arange(12, dtype=np.float32).reshape(4, 3)
    sharding = NamedSharding(trainer_mesh, P("x", None))
    params = [sharded(source, sharding)]
    with host_round_trip_guards():
        (pushed,) = push_local(params, [sharding])
    params[0].delete()
    assert pushed.sharding == sharding
    np.testing.assert_array_equal(np.asarray(pushed), source)


def test_sender_and_receiver_in_one_process_move_an_nnx_state():
    """Trainer mesh devices 0-3, generator devices 4-7, the receiver connected to its own server."""
    trainer_mesh, generator_mesh = trainer_and_generator_meshes()
    state = nnx.state(nnx.Linear(4, 6, rngs=nnx.Rngs(0)))
    kernel_source = np.arange(24, dtype=np.float32).reshape(4, 6) / 8
    bias_source = np.arange(6, dtype=np.float32) - 3
    trainer_state = jax.tree.map(lambda x: x, state)
    trainer_state["kernel"].set_value(sharded(kernel_source, NamedSharding(trainer_mesh, P("x", None))))
    trainer_state["bias"].set_value(sharded(bias_source, NamedSharding(trainer_mesh, P())))
    targets = jax.tree.map(lambda x: NamedSharding(generator_mesh, P("y", "z") if x.ndim == 2 else P("z")), state)
    server = weight_push.start_transfer_server()
    sender = weight_push.ParamsSender(trainer_mesh, server, {0: targets})
    receiver = weight_push.ParamsReceiver(targets, jax.eval_shape(lambda: state), server, {0: server.address()})
    with host_round_trip_guards():
        offered = sender.offer(trainer_state, version=5)
        pulled = receiver.pull(5, timeout_s=60)
    # distinct slices: kernel 2x2 grid of (2,3) f32 = 4 x 24 B, bias 2 halves of 3 f32 = 2 x 12 B
    assert offered == 4 * 24 + 2 * 12
    assert isinstance(pulled, nnx.State)
    kernel_var, bias_var = pulled["kernel"], pulled["bias"]
    assert isinstance(kernel_var, nnx.Variable) and isinstance(bias_var, nnx.Variable)
    kernel, bias = kernel_var.get_value(), bias_var.get_value()
    assert kernel.sharding == NamedSharding(generator_mesh, P("y", "z"))
    np.testing.assert_array_equal(np.asarray(kernel), kernel_source)
    np.testing.assert_array_equal(np.asarray(bias), bias_source)
    assert {d.id for d in bias.sharding.device_set} == {d.id for d in generator_mesh.devices.flat}


def test_sender_rejects_params_of_another_structure():
    trainer_mesh, generator_mesh = trainer_and_generator_meshes()
    targets = {"w": NamedSharding(generator_mesh, P())}
    sender = weight_push.ParamsSender(trainer_mesh, weight_push.start_transfer_server(), {1: targets})
    params = {"v": sharded(np.zeros(4, np.float32), NamedSharding(trainer_mesh, P()))}
    with pytest.raises(ValueError, match="tree structure of generator process 1"):
        sender.offer(params, 0)
    with pytest.raises(ValueError, match="generator process 2 and 1 have different tree structures"):
        weight_push.ParamsSender(
            trainer_mesh, weight_push.start_transfer_server(), {1: targets, 2: {"w": targets["w"], "x": targets["w"]}}
        )


# --- two real processes -------------------------------------------------------------------------

LEAF_SHAPES = {"layer/w": (8, 6), "layer/b": (6,), "embed": (4, 4), "scale": ()}
LEAF_ORDER = ["embed", "layer/b", "layer/w", "scale"]  # flattening order of the worker's dict tree


def source_leaf(name, version):
    """The worker's source values, recomputed independently: arange + 40 * leaf rank + version."""
    shape = LEAF_SHAPES[name]
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 40 * LEAF_ORDER.index(name) + version


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(scenario, out_dir):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)  # each worker sets its own device count
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, scenario, str(port), str(i), str(out_dir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {i} exited {proc.returncode}:\n{output[-4000:]}"


def load_pulled(out_dir, process, version):
    with open(os.path.join(out_dir, f"p{process}_v{version}.json")) as f:
        info = json.load(f)
    return dict(np.load(os.path.join(out_dir, f"p{process}_v{version}.npz"))), info


def assert_values(arrays, version):
    for name in LEAF_SHAPES:
        np.testing.assert_array_equal(arrays[name], source_leaf(name, version), err_msg=f"{name} v{version}")


def shards(info, name):
    return [(device, [tuple(b) for b in bounds]) for device, bounds in info["leaves"][name]["shards"]]


def test_two_processes_trainer_rows_to_generator_columns_two_versions(tmp_path):
    run_two_processes("rows_to_cols", tmp_path)
    for version in (1, 2):
        arrays, info = load_pulled(tmp_path, 0, version)
        assert_values(arrays, version)
        leaves = info["leaves"]
        assert leaves["layer/w"]["spec"] == "P(None, 'y')" and leaves["layer/w"]["dtype"] == "float32"
        assert leaves["layer/b"]["spec"] == "P('y',)" and leaves["layer/b"]["dtype"] == "bfloat16"
        assert leaves["embed"]["spec"] == "P()" and leaves["embed"]["dtype"] == "bfloat16"
        assert shards(info, "layer/w") == [(0, [(0, 8), (0, 3)]), (1, [(0, 8), (3, 6)])]
        assert shards(info, "embed") == [(0, [(0, 4), (0, 4)]), (1, [(0, 4), (0, 4)])]
        assert all(leaf["devices"] == [0, 1] for leaf in leaves.values())
    with open(tmp_path / "plan_p1.json") as f:
        sent = json.load(f)
    assert sent["plans"]["0"] == info["plan"]  # both sides computed the same plan
    # embed (4,4) bf16 whole 32 B + b halves 2 x 6 B + w column halves 2 x 96 B + scale 4 B
    assert sent["offered_bytes"] == {"1": 240, "2": 240}
    message = (tmp_path / "p0_never_offered.txt").read_text()
    assert "version 3" in message and "trainer process 1" in message


def test_two_processes_trainer_mesh_spanning_both_to_two_generators(tmp_path):
    run_two_processes("spanning", tmp_path)
    arrays0, info0 = load_pulled(tmp_path, 0, 7)
    arrays1, info1 = load_pulled(tmp_path, 1, 7)
    assert_values(arrays0, 7)
    assert_values(arrays1, 7)
    assert shards(info0, "layer/w") == [(1, [(0, 4), (0, 6)]), (2, [(4, 8), (0, 6)])]
    assert info1["leaves"]["embed"]["spec"] == "P('y', None)"
    assert shards(info1, "embed") == [(2049, [(0, 2), (0, 4)]), (2050, [(2, 4), (0, 4)])]
    plans = []
    for process in (0, 1):
        with open(tmp_path / f"plan_p{process}.json") as f:
            plans.append(json.load(f))
    assert plans[0]["plans"] == plans[1]["plans"]
    assert plans[0]["plans"]["0"] == info0["plan"] and plans[0]["plans"]["1"] == info1["plan"]
    # both trainer processes serve something, and together they offered every distinct slice once per generator:
    # generator 0: embed 32 + b 12 + w 2 x 96 + scale 4 = 240; generator 1: 2 x 16 + 2 x 6 + 2 x 96 + 4 = 240
    offered = [p["offered_bytes"]["7"] for p in plans]
    assert min(offered) > 0 and sum(offered) == 480
    owners_for_generator_1 = {owner for _, _, owner in info1["plan"]}
    assert owners_for_generator_1 == {0, 1}
