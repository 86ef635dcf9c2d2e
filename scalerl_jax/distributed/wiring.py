"""Connects the processes of a run: host channels to the leader, heartbeats, transfer servers.

Every process other than the leader opens, to the leader's channel server (its address and a
shared secret are published in jax.distributed's key-value store):
- a *heartbeat* connection (all of them; `watchdog.py`),
- a *control* and a *params* connection (generator processes; `remote_generator.py`),
- a *trainer* connection (follower trainer processes; `trainer_group.py`).
Trainer processes, and generator processes that receive params by weight transfer, start a
`jax.experimental.transfer` server; trainer processes publish its address.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any

import jax

from scalerl_jax.distributed import coordination
from scalerl_jax.distributed.channel import Connection, Server, connect
from scalerl_jax.distributed.roles import Roles

LEADER_ADDRESS_KEY = "scalerl/leader_address"
TRANSFER_ADDRESS_KEY = "scalerl/transfer_address/{process}"


def process_name(roles: Roles, process: int) -> str:
    """'process 2 (generator)': how errors name a process."""
    kinds = []
    if process == roles.leader:
        kinds.append("leader")
    elif process in roles.trainer_processes:
        kinds.append("trainer")
    if process in roles.generator_processes:
        kinds.append("generator")
    return f"process {process} ({' + '.join(kinds)})"


def connection_roles(roles: Roles, process: int) -> list[str]:
    """The connections `process` (not the leader) opens to the leader, in order."""
    names = ["heartbeat"]
    if process in roles.generator_processes:
        names += ["control", "params"]
    if process in roles.followers:
        names.append("trainer")
    return names


@dataclasses.dataclass
class ProcessLinks:
    """This process's connections. On the leader: `peers[(process, role)]`; elsewhere `leader[role]`."""

    peers: dict[tuple[int, str], Connection] = dataclasses.field(default_factory=dict)
    leader: dict[str, Connection] = dataclasses.field(default_factory=dict)

    def of_role(self, role: str) -> dict[int, Connection]:
        """The leader's connections of one role, by process."""
        return {process: conn for (process, name), conn in sorted(self.peers.items()) if name == role}

    def heartbeats(self) -> list[Connection]:
        return list(self.of_role("heartbeat").values()) if self.peers else [self.leader["heartbeat"]]

    def close(self) -> None:
        for connection in [*self.peers.values(), *self.leader.values()]:
            connection.close()


def advertised_host() -> str:
    """The host name other processes reach this one at (SCALERL_ADVERTISE_HOST overrides)."""
    return os.environ.get("SCALERL_ADVERTISE_HOST") or socket.gethostname()


def connect_processes(roles: Roles, *, timeout_s: float) -> ProcessLinks:
    """Opens every connection of the module docstring (blocking, each wait bounded by `timeout_s`)."""
    secret = coordination.shared_secret(timeout_s)
    links = ProcessLinks()
    if roles.is_leader:
        server = Server(
            secret,
            port=0,
            name=process_name(roles, roles.leader),
            process=roles.leader,
            advertise_host=advertised_host(),
        )
        coordination.publish(LEADER_ADDRESS_KEY, server.address)
        expected = [
            (p, name) for p in range(roles.num_processes) if p != roles.leader for name in connection_roles(roles, p)
        ]
        try:
            for conn in server.accept(timeout_s, len(expected)):
                links.peers[(conn.peer_process, conn.role)] = conn
        finally:
            server.close()
        missing = sorted(set(expected) - set(links.peers))
        if missing:
            raise RuntimeError(f"the leader got no connection for {missing}")
        return links
    address = coordination.lookup(LEADER_ADDRESS_KEY, timeout_s)
    for name in connection_roles(roles, roles.process):
        links.leader[name] = connect(
            address,
            secret=secret,
            process=roles.process,
            role=name,
            peer_name=process_name(roles, roles.leader),
            timeout=timeout_s,
        )
    return links


def start_transfer_server(roles: Roles) -> Any:
    """A weight-transfer server on this process's devices; trainer processes publish its address."""
    from jax.experimental import transfer

    host = advertised_host()
    server = transfer.start_transfer_server(jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"])
    if roles.is_trainer:
        coordination.publish(TRANSFER_ADDRESS_KEY.format(process=roles.process), server.address())
    return server


def trainer_transfer_addresses(roles: Roles, *, timeout_s: float) -> dict[int, str]:
    """Every trainer process's transfer server address."""
    return {p: coordination.lookup(TRANSFER_ADDRESS_KEY.format(process=p), timeout_s) for p in roles.trainer_processes}
