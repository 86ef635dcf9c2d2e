"""One of two jax processes for tests/unit/distributed/test_distributed_channel.py's coordination scenarios.

usage: coordination_peer.py PORT PROCESS_ID SHARED_DIR
Runs every scenario in order and prints one line "RESULT <json>" per scenario with what this
process observed; the test asserts on both processes' lines.
"""

import json
import pathlib
import sys
import time

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 1)


def report(scenario: str, **observed) -> None:
    print("RESULT " + json.dumps({"scenario": scenario, **observed}), flush=True)


def main(port: str, process_id: str, shared_dir: str) -> None:
    me = int(process_id)
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, me, initialization_timeout=60)
    from scalerl_jax.distributed import coordination

    report("client", is_set=coordination.distributed_client() is not None)

    coordination.barrier("start", 60.0)
    coordination.barrier("start", 60.0)  # the same name again gets a fresh barrier id
    report("barrier", passed=True)

    coordination.publish(f"greeting/{me}", f"hello from {me}")
    report("lookup", value=coordination.lookup(f"greeting/{1 - me}", 60.0))

    made = pathlib.Path(shared_dir) / "made.txt"
    calls = []

    def build():
        calls.append(me)
        time.sleep(0.5)  # process 1 must really wait for this
        made.write_text("built by process 0")

    coordination.run_once("build", build, timeout_s=60.0)
    report("run_once_ok", calls=calls, content=made.read_text())

    def explode():
        raise ValueError("tfds build exploded\nsecond line of the error")

    started = time.monotonic()
    try:
        coordination.run_once("explode", explode, timeout_s=60.0)
        report("run_once_error", raised=None)
    except Exception as err:  # noqa: BLE001 - reported to the test, which asserts on it
        report("run_once_error", raised=type(err).__name__, message=str(err), seconds=time.monotonic() - started)

    secret = coordination.shared_secret(60.0)
    report("secret", hex=secret.hex())

    if me == 0:  # process 1 skips this barrier
        started = time.monotonic()
        try:
            coordination.barrier("late", 1.0)
            report("barrier_timeout", raised=None)
        except coordination.CoordinationTimeout as err:
            report(
                "barrier_timeout", raised="CoordinationTimeout", message=str(err), seconds=time.monotonic() - started
            )
        try:
            coordination.lookup("never published", 0.5)
            report("lookup_timeout", raised=None)
        except coordination.CoordinationTimeout as err:
            report("lookup_timeout", raised="CoordinationTimeout", message=str(err))
    coordination.barrier("end", 60.0)  # the service still works after a timed-out barrier
    report("end", passed=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
