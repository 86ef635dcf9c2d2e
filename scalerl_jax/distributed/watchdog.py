"""Heartbeats: a lost process ends the whole run within seconds, naming the process.

A process blocked in a collective (a train step whose peer died) cannot be woken, so loss is
detected beside the work: over each heartbeat connection (every process to the leader) both ends
send a beat every `interval_s`; a receiving thread that hears nothing for `timeout_s`, or sees
the connection close, prints which process was lost and ends this process with status 1
(`os._exit`: no cleanup that could block on the dead peer; checkpoints are written atomically by
orbax, so the last complete one stays usable). A process that finishes normally says "bye"
first, so its departure is not mistaken for a loss.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence

from absl import logging

from scalerl_jax.distributed.channel import Connection, PeerLost

EXIT_PEER_LOST = 1


def exit_on_loss(message: str) -> None:
    """Reports a lost peer on stderr and ends the process at once with status 1."""
    print(f"error: {message}; stopping this process", file=sys.stderr, flush=True)
    logging.error("%s; stopping this process", message)
    os._exit(EXIT_PEER_LOST)


class Heartbeat:
    """Beats and watches over `connections` (module docstring) until `close()`."""

    def __init__(
        self,
        connections: Sequence[Connection],
        *,
        interval_s: float,
        timeout_s: float,
        on_loss: Callable[[str], None] = exit_on_loss,
    ):
        self._connections, self._interval_s, self._timeout_s = list(connections), interval_s, timeout_s
        self._on_loss = on_loss
        self._closing = threading.Event()
        self._threads = [
            threading.Thread(target=target, args=(conn,), daemon=True, name=f"heartbeat-{kind}")
            for conn in self._connections
            for kind, target in (("send", self._beat), ("watch", self._watch))
        ]
        for thread in self._threads:
            thread.start()

    def _beat(self, connection: Connection) -> None:
        while not self._closing.wait(self._interval_s):
            try:
                connection.send({"op": "beat"})
            except OSError:
                return  # the watching thread reports the loss

    def _watch(self, connection: Connection) -> None:
        while True:
            try:
                message = connection.recv(self._timeout_s, "a heartbeat")
            except PeerLost as lost:
                if not self._closing.is_set():
                    self._on_loss(f"lost {connection.peer}: {lost}")
                return
            if message.get("op") == "bye":
                return

    def close(self) -> None:
        """Normal end: say bye on every connection and stop beating."""
        self._closing.set()
        for connection in self._connections:
            try:
                connection.send({"op": "bye"})
            except OSError:
                pass
