"""A channel client run as a real process by tests/unit/distributed/test_distributed_channel.py.

usage: channel_peer.py MODE ADDRESS SECRET_HEX PROCESS ROLE
  echo    answer each request {"x": array, ...} with {"echo": request, "doubled": x * 2,
          "from": PROCESS}, until a request {"stop": True}
  die     connect, then SIGKILL itself after 0.5 s (the test is waiting in recv)
  silent  print "connecting" (imports done), connect, then sleep (the test times out and kills this process)
  refused connect expecting refusal; print the ConnectionRefusedError and exit 3
Errors are printed as "ERROR <type>: <message>" with exit code 2.
"""

import os
import signal
import sys
import time

from scalerl_jax.distributed import channel


def main(mode: str, address: str, secret_hex: str, process: str, role: str) -> int:
    connect = lambda: channel.connect(  # noqa: E731
        address,
        secret=bytes.fromhex(secret_hex),
        process=int(process),
        role=role,
        peer_name="process 0 (leader)",
        timeout=30.0,
    )
    if mode == "refused":
        try:
            connect()
        except ConnectionRefusedError as err:
            print(f"REFUSED {err}", flush=True)
            return 3
        return 0
    if mode == "silent":
        print("connecting", flush=True)
    connection = connect()
    if mode == "echo":
        while True:
            request = connection.recv(30.0, "a request")
            if request.get("stop"):
                return 0
            connection.send({"echo": request, "doubled": request["x"] * 2, "from": int(process)})
    if mode == "die":
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "silent":
        time.sleep(60.0)
        return 0
    raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
    try:
        sys.exit(main(*sys.argv[1:]))
    except Exception as err:  # noqa: BLE001 - report for the test, which asserts on it
        print(f"ERROR {type(err).__name__}: {err}", flush=True)
        sys.exit(2)
