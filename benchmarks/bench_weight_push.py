"""CPU speed of the trainer -> generator weight push: two processes vs one, per params version.

Two real processes (jax.distributed, gloo), 4 CPU devices each. Process 1 trains: a small
Llama-shaped model (bf16, ~80 MB) on the mesh of its devices 0-1, FSDP over `embed` (with
--trainer_span: on devices 2-3 of process 0 and 0-1 of process 1, so slices need the collective
path). Process 0 generates: the same params on the mesh of its devices 0-1 with tensor
parallelism (a real reshard: every slice the generator needs is cut from several trainer shards).

Per version (after one warm-up version that compiles): the trainer offers (`ParamsSender.offer`),
announces the version in the KV store, the generator pulls (`ParamsReceiver.pull`) until ready.
push = generator ready - trainer offer start (same host clock). Versions run one after another.
Then, in process 1 alone, the single-process baselines onto its devices 2-3 with the
generator layout: `push_local` (device to device) and plain `jax.device_put` (which reshards
through the host for such layouts). Medians over --repeats versions; ratios against push_local.

  .venv/bin/python benchmarks/bench_weight_push.py [--repeats 5] [--trainer_span] [--vocab 16000] [--hidden 512]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

TIMEOUT_MS = 300_000


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--trainer_span",
        action="store_true",
        help="trainer mesh over both processes (devices 2-3 of process 0, 0-1 of process 1)",
    )
    parser.add_argument("--role", choices=("generator", "trainer"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def model_config(args):
    from scalerl_jax.models import get_preset

    return get_preset(
        "tiny-llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=4,
        head_dim=args.hidden // 8,
        dtype="bfloat16",
        fp32_head=False,
    )


def worker(args):
    """One process: initialize jax.distributed, build the meshes, run its side of every version."""
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process = {"generator": 0, "trainer": 1}[args.role]
    jax.distributed.initialize(f"127.0.0.1:{args.port}", 2, process)
    from flax import nnx
    from jax._src import distributed

    from scalerl_jax.distributed import weight_push
    from scalerl_jax.models import init_transformer, make_mesh, param_shardings
    from scalerl_jax.models.reshard import push_local
    from scalerl_jax.models.transformer import Transformer

    client = distributed.global_state.client
    assert client is not None, "jax.distributed.initialize did not start a client"
    config = model_config(args)
    local = [[d for d in jax.devices() if d.process_index == p] for p in (0, 1)]
    trainer_processes = (0, 1) if args.trainer_span else (1,)
    trainer_devices = local[0][2:] + local[1][:2] if args.trainer_span else local[1][:2]
    trainer_mesh = make_mesh((1, len(trainer_devices), 1), devices=trainer_devices)
    generator_mesh = make_mesh((1, 1, 2), devices=local[0][:2])
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    generator_targets = param_shardings(abstract, generator_mesh)
    server = weight_push.start_transfer_server("127.0.0.1")
    client.key_value_set(f"bench/address/{process}", server.address())
    result = {}
    if process in trainer_processes:
        params = nnx.state(init_transformer(config, mesh=trainer_mesh))
        sender = weight_push.ParamsSender(trainer_mesh, server, {0: generator_targets})
        result.update(bytes=sum(leaf.nbytes for leaf in jax.tree.leaves(params)), offer_s=[], offer_at=[])
    if process == 0:
        addresses = {p: client.blocking_key_value_get(f"bench/address/{p}", TIMEOUT_MS) for p in trainer_processes}
        receiver = weight_push.ParamsReceiver(generator_targets, abstract, server, addresses)
        result.update(pull_s=[], ready_at=[])
    for version in range(args.repeats + 1):  # version 0 is the warm-up (compiles)
        if process in trainer_processes:
            start = time.time()
            sender.offer(params, version)
            result["offer_s"].append(time.time() - start)
            result["offer_at"].append(start)
            client.key_value_set(f"bench/offered/{version}/{process}", "1")
        if process == 0:
            for p in trainer_processes:
                client.blocking_key_value_get(f"bench/offered/{version}/{p}", TIMEOUT_MS)
            start = time.time()
            jax.block_until_ready(receiver.pull(version, timeout_s=TIMEOUT_MS / 1000))  # then dropped
            result["ready_at"].append(time.time())
            result["pull_s"].append(result["ready_at"][-1] - start)
            client.key_value_set(f"bench/pulled/{version}", "1")
        else:
            client.blocking_key_value_get(f"bench/pulled/{version}", TIMEOUT_MS)
    if process == 1:  # single-process baselines: its devices 0-1 (trainer layout) -> 2-3 (generator layout)
        local_params = nnx.state(init_transformer(config, mesh=make_mesh((1, 2, 1), devices=local[1][:2])))
        local_targets = param_shardings(abstract, make_mesh((1, 1, 2), devices=local[1][2:]))
        result["local_s"] = {}
        for name, push in (
            ("push_local", push_local),
            ("jax.device_put", lambda p, t: jax.device_put(p, t, may_alias=False)),
        ):
            result["local_s"][name] = []
            for _ in range(args.repeats + 1):
                start = time.time()
                jax.block_until_ready(push(local_params, local_targets))
                result["local_s"][name].append(time.time() - start)
    print(
        json.dumps({key: value[1:] if isinstance(value, list) else value for key, value in result.items()}), flush=True
    )
    client.wait_at_barrier("bench/done", TIMEOUT_MS)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_json_line(output: str, role: str) -> dict:
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{role} process printed no result:\n{output[-3000:]}")


def main():
    args = parse_args()
    if args.role:
        return worker(args)
    port = free_port()
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    passed = [a for a in sys.argv[1:]]
    procs = {
        role: subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *passed, "--role", role, "--port", str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for role in ("generator", "trainer")
    }
    outputs = {}
    try:
        for role, proc in procs.items():
            outputs[role] = proc.communicate(timeout=TIMEOUT_MS / 1000 + 60)[0]
            if proc.returncode:
                raise RuntimeError(f"{role} process exited {proc.returncode}:\n{outputs[role][-3000:]}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    generator, trainer = (
        last_json_line(outputs["generator"], "generator"),
        last_json_line(outputs["trainer"], "trainer"),
    )
    offer_at = [min(starts) for starts in zip(*(r["offer_at"] for r in (generator, trainer) if "offer_at" in r))]
    push_s = [ready - start for ready, start in zip(generator["ready_at"], offer_at)]
    mb = trainer["bytes"] / 1e6
    local_s = trainer["local_s"]
    rows = [
        ("2 processes: offer (trainer process 1)", statistics.median(trainer["offer_s"])),
        ("2 processes: pull until ready (generator)", statistics.median(generator["pull_s"])),
        ("2 processes: push = offer start -> ready", statistics.median(push_s)),
        ("1 process: push_local (device to device)", statistics.median(local_s["push_local"])),
        ("1 process: jax.device_put reshard", statistics.median(local_s["jax.device_put"])),
    ]
    baseline = rows[3][1]
    trainer_where = "4 devices over both processes" if args.trainer_span else "2 devices of process 1"
    print(
        f"params {mb:.1f} MB bf16 ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab}); trainer FSDP "
        f"over {trainer_where} -> generator (process 0) tensor-parallel over 2 devices; "
        f"median of {args.repeats} versions after 1 warm-up"
    )
    print(f"{'path':44s} {'median s':>9s} {'MB/s':>8s} {'vs push_local':>14s}")
    for name, seconds in rows:
        print(f"{name:44s} {seconds:9.3f} {mb / seconds:8.0f} {seconds / baseline:13.2f}x")


if __name__ == "__main__":
    main()
