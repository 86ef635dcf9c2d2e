"""CPU speed of the trainer -> generator weight push: two processes vs one, per params version.

Two real processes (jax.distributed, gloo), 4 CPU devices each. Process 1 trains: a small
Llama-shaped model (bf16, ~80 MB) on the mesh of its devices 0-1, FSDP over `embed`. Process 0
generates: the same params on the mesh of its devices 0-1 with tensor parallelism (a real
reshard: every slice the generator needs is cut from several trainer shards).

Per version (after one warm-up version that compiles): the trainer offers (`ParamsSender.offer`),
announces the version in the KV store, the generator pulls (`ParamsReceiver.pull`) until ready.
push = generator ready - trainer offer start (same host clock). Versions run one after another.
Then, in the trainer process alone, the single-process baselines onto its devices 2-3 with the
generator layout: `push_local` (device to device) and plain `jax.device_put` (which reshards
through the host for such layouts). Medians over --repeats versions; ratios against push_local.

  .venv/bin/python benchmarks/bench_weight_push.py [--repeats 5] [--vocab 16000] [--hidden 512]
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--role", choices=("generator", "trainer"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def model_config(args):
    from scalerl_jax.models import get_preset
    return get_preset("tiny-llama", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_layers=args.layers, num_heads=8,
                      num_kv_heads=4, head_dim=args.hidden // 8, dtype="bfloat16", fp32_head=False)


def worker(args):
    """One process: initialize jax.distributed, build both meshes, run its side of every version."""
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process = {"generator": 0, "trainer": 1}[args.role]
    jax.distributed.initialize(f"127.0.0.1:{args.port}", 2, process)
    from flax import nnx
    from jax._src import distributed

    from scalerl_jax.distributed import weight_push
    from scalerl_jax.models import init_transformer, make_mesh, param_shardings
    from scalerl_jax.models.transformer import Transformer

    client = distributed.global_state.client
    config = model_config(args)
    local = [[d for d in jax.devices() if d.process_index == p] for p in (0, 1)]
    trainer_mesh = make_mesh((1, 2, 1), devices=local[1][:2])
    generator_mesh = make_mesh((1, 1, 2), devices=local[0][:2])
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    generator_targets = param_shardings(abstract, generator_mesh)
    server = weight_push.start_transfer_server("127.0.0.1")
    client.key_value_set(f"bench/address/{process}", server.address())
    versions = range(args.repeats + 1)  # version 0 is the warm-up (compiles)
    if args.role == "generator":
        receiver = weight_push.ParamsReceiver(generator_targets, abstract, server,
                                              {1: client.blocking_key_value_get("bench/address/1", TIMEOUT_MS)})
        pull_s, ready_at = [], []
        for version in versions:
            client.blocking_key_value_get(f"bench/offered/{version}", TIMEOUT_MS)
            start = time.time()
            params = receiver.pull(version, timeout_s=TIMEOUT_MS / 1000)
            jax.block_until_ready(params)
            ready_at.append(time.time())
            pull_s.append(ready_at[-1] - start)
            del params
            client.key_value_set(f"bench/pulled/{version}", "1")
        print(json.dumps({"pull_s": pull_s[1:], "ready_at": ready_at[1:]}), flush=True)
    else:
        params = nnx.state(init_transformer(config, mesh=trainer_mesh))
        nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
        sender = weight_push.ParamsSender(trainer_mesh, server, {0: generator_targets})
        offer_s, offer_at = [], []
        for version in versions:
            start = time.time()
            offered = sender.offer(params, version)
            offer_s.append(time.time() - start)
            offer_at.append(start)
            client.key_value_set(f"bench/offered/{version}", "1")
            client.blocking_key_value_get(f"bench/pulled/{version}", TIMEOUT_MS)
        local_targets = param_shardings(abstract, make_mesh((1, 1, 2), devices=local[1][2:]))
        local_s = {"push_local": [], "jax.device_put": []}
        for name, push in (("push_local", weight_push.push_local),
                           ("jax.device_put", lambda p, t: jax.device_put(p, t, may_alias=False))):
            for _ in versions:
                start = time.time()
                jax.block_until_ready(push(params, local_targets))
                local_s[name].append(time.time() - start)
        print(json.dumps({"offer_s": offer_s[1:], "offer_at": offer_at[1:], "bytes": nbytes,
                          "offered_bytes": offered, "local_s": {k: v[1:] for k, v in local_s.items()}}),
              flush=True)
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
    procs = {role: subprocess.Popen([sys.executable, os.path.abspath(__file__), *passed, "--role", role,
                                     "--port", str(port)], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for role in ("generator", "trainer")}
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
    generator, trainer = last_json_line(outputs["generator"], "generator"), last_json_line(outputs["trainer"], "trainer")
    push_s = [ready - start for ready, start in zip(generator["ready_at"], trainer["offer_at"])]
    mb = trainer["bytes"] / 1e6
    rows = [("2 processes: offer (trainer)", statistics.median(trainer["offer_s"])),
            ("2 processes: pull until ready (generator)", statistics.median(generator["pull_s"])),
            ("2 processes: push = offer start -> ready", statistics.median(push_s)),
            ("1 process: push_local (device to device)", statistics.median(trainer["local_s"]["push_local"])),
            ("1 process: jax.device_put reshard", statistics.median(trainer["local_s"]["jax.device_put"]))]
    baseline = rows[3][1]
    print(f"params {mb:.1f} MB bf16 ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab}); "
          f"trainer FSDP over 2 devices -> generator tensor-parallel over 2 devices; "
          f"offered {trainer['offered_bytes'] / 1e6:.1f} MB; median of {args.repeats} versions after 1 warm-up")
    print(f"{'path':44s} {'median s':>9s} {'MB/s':>8s} {'vs push_local':>14s}")
    for name, seconds in rows:
        print(f"{name:44s} {seconds:9.3f} {mb / seconds:8.0f} {seconds / baseline:13.2f}x")


if __name__ == "__main__":
    main()
