"""Host channel between processes: authenticated, length-framed msgpack messages over TCP.

Wire format. A frame is a 4-byte big-endian unsigned length N followed by N bytes of msgpack.
The payload is a map with str keys whose values are None, bool, int, float, str, bytes, lists
(tuples arrive as lists), maps, and numpy arrays. An array travels as msgpack ExtType code 1
whose data is the msgpack list [dtype name, shape, little-endian raw bytes]; a numpy scalar
travels as a 0-d array. Nothing is pickled, so a peer can only ever make us build these types.
Arrays of object dtype (or any dtype that cannot be named, e.g. structured) are refused at
encode with an error naming the dtype.

Authentication (no pickle, no TLS). The client sends hello {protocol, process, role}; the server
answers with a fresh 32-byte nonce; the client answers HMAC-SHA256(secret, nonce); the server
compares with `hmac.compare_digest` and sends a verdict {ok, error}. A wrong secret is refused
on both sides: the server's `accept` raises ConnectionRefusedError naming the process, and the
client's `connect` raises ConnectionRefusedError with the server's reason. The secret comes from
`coordination.shared_secret()`. It authenticates peers; it does not encrypt traffic.

Waits end. Every receive takes a timeout. A peer that closed its socket or died (EOF, reset),
that stays silent past the timeout, or that stalls in the middle of a frame raises `PeerLost`,
whose message names the peer and what was awaited. Sends are bounded by the connection's
`send_timeout` (a peer that stops reading fills the socket buffers and would block forever).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, cast

import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 names with numpy for decoding)
import msgpack
import numpy as np

PROTOCOL = "scalerl-channel/1"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
DEFAULT_SEND_TIMEOUT_S = 120.0
_HANDSHAKE_MAX_MESSAGE_BYTES = 1 << 16  # bound what an unauthenticated peer can make us allocate
_FRAME_HEADER = struct.Struct(">I")
_MAX_FRAME_BYTES = (1 << 32) - 1  # what the 4-byte length can describe
_NDARRAY_EXT_CODE = 1
_MIN_SECRET_BYTES = 16


class PeerLost(RuntimeError):
    """The peer closed the connection, died, or did not answer in time.

    `peer` is the peer's human name (e.g. "process 1 (generator)"), `waiting_for` what this
    process was waiting for or doing when the loss was seen.
    """

    def __init__(self, message: str, *, peer: str, waiting_for: str):
        super().__init__(message)
        self.peer = peer
        self.waiting_for = waiting_for


class MessageTooLarge(ValueError):
    """A message is larger than the configured maximum (on the sending or the receiving side)."""


# ----------------------------------------------------------------------------- encoding


def _encode_ndarray(array: np.ndarray) -> msgpack.ExtType:
    """An ndarray as ExtType(1, msgpack([dtype name, shape, little-endian bytes]))."""
    dtype = array.dtype
    if dtype.hasobject:
        raise TypeError(
            f"cannot send a numpy array of dtype {dtype} (shape {array.shape}): object arrays "
            "would need pickle; convert it to a numeric array or to a list"
        )
    try:
        named = np.dtype(dtype.name)
    except TypeError:
        named = None
    if named is None or named != dtype.newbyteorder("="):
        raise TypeError(
            f"cannot send a numpy array of dtype {dtype!r} (shape {array.shape}): only dtypes "
            "that numpy can rebuild from their name (numeric, bool, ml_dtypes) travel"
        )
    little = np.ascontiguousarray(array, dtype=dtype.newbyteorder("<"))
    raw = little.reshape(-1).view(np.uint8).data  # a memoryview of the bytes: no copy, any dtype
    data = msgpack.packb([dtype.name, list(array.shape), raw])
    return msgpack.ExtType(_NDARRAY_EXT_CODE, data)


def _encode_default(value: Any) -> msgpack.ExtType:
    """msgpack's hook for types it does not know: numpy arrays and scalars; refuse the rest."""
    if isinstance(value, (np.ndarray, np.generic)):
        return _encode_ndarray(np.asarray(value))
    raise TypeError(
        f"cannot send a value of type {type(value).__module__}.{type(value).__qualname__}: "
        "messages carry None, bool, int, float, str, bytes, lists, dicts and numpy arrays"
    )


def _decode_ext(code: int, data: bytes) -> np.ndarray:
    """Inverse of `_encode_ndarray`: a writable array of the sent dtype and shape."""
    if code != _NDARRAY_EXT_CODE:
        raise ValueError(f"unknown msgpack extension type {code} in a channel message")
    dtype_name, shape, raw = msgpack.unpackb(data, raw=False)
    dtype = np.dtype(dtype_name).newbyteorder("<")
    count = int(np.prod(shape, dtype=np.int64))
    if count * dtype.itemsize != len(raw):
        raise ValueError(
            f"array of dtype {dtype_name} and shape {shape} needs {count * dtype.itemsize} "
            f"bytes but the message carries {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def encode(message: dict, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes:
    """The msgpack payload of `message` (a dict with str keys); the frame header is added by send."""
    if not isinstance(message, dict):
        raise TypeError(f"a channel message is a dict, got {type(message).__name__}")
    bad_keys = [key for key in message if not isinstance(key, str)]
    if bad_keys:
        raise TypeError(f"channel message keys must be str, got {bad_keys!r}")
    # msgpack's pure-Python fallback types packb as bytes | None (None only when autoreset is off).
    payload = cast(bytes, msgpack.packb(message, default=_encode_default, use_bin_type=True))
    limit = min(max_bytes, _MAX_FRAME_BYTES)
    if len(payload) > limit:
        raise MessageTooLarge(
            f"message with keys {sorted(message)} encodes to {len(payload)} bytes, over the limit of {limit} bytes"
        )
    return payload


def decode(payload: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> dict:
    """The message dict encoded in `payload`; arrays come back as numpy arrays of the sent dtype."""
    if len(payload) > max_bytes:
        raise MessageTooLarge(f"payload of {len(payload)} bytes is over the limit of {max_bytes} bytes")
    try:
        message = msgpack.unpackb(payload, raw=False, ext_hook=_decode_ext, strict_map_key=False, use_list=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as err:
        raise ValueError(f"malformed channel message: {err}") from err
    if not isinstance(message, dict) or not all(isinstance(key, str) for key in message):
        raise ValueError(f"malformed channel message: expected a map with str keys, got {type(message).__name__}")
    return message


# ----------------------------------------------------------------------------- connection


def _configure(sock: socket.socket, send_timeout: float) -> None:
    """No Nagle delay (small request/reply messages), keepalive, and bounded sends."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.settimeout(send_timeout)


class Connection:
    """One end of an established channel to a named peer.

    `send` may be called from several threads. `recv` is serialized too, and a frame is always
    read whole, so two readers never interleave bytes; but which reader gets which message is
    up to the scheduler, so a connection used with `request` should have no other reader.
    After a PeerLost that leaves the byte stream in an unknown state (loss, a stall inside a
    frame, a request that timed out: its reply could arrive later and be taken for the next
    one) the connection is closed; a plain `recv` timeout before any byte arrived leaves it open.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        peer: str,
        peer_process: int,
        role: str = "",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        send_timeout: float = DEFAULT_SEND_TIMEOUT_S,
    ):
        self.peer = peer
        self.peer_process = peer_process
        self.role = role  # what the connection is for (one process may open several)
        self.max_message_bytes = max_message_bytes
        self.send_timeout = send_timeout
        self._sock = sock
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._request_lock = threading.Lock()
        self._closed = False
        _configure(sock, send_timeout)

    def _authenticated(
        self, *, peer: str, peer_process: int, role: str, max_message_bytes: int, send_timeout: float
    ) -> None:
        """After the handshake: the peer's real name, the connection's role and the limits for normal traffic."""
        self.peer = peer
        self.peer_process = peer_process
        self.role = role
        self.max_message_bytes = max_message_bytes
        self.send_timeout = send_timeout
        self._sock.settimeout(send_timeout)

    def _lost(self, message: str, waiting_for: str) -> PeerLost:
        """Close (the stream can no longer be trusted) and build the error to raise."""
        self.close()
        return PeerLost(message, peer=self.peer, waiting_for=waiting_for)

    def _closed_here(self, waiting_for: str) -> PeerLost:
        return PeerLost(
            f"the connection to {self.peer} was closed by this process while waiting for {waiting_for!r}",
            peer=self.peer,
            waiting_for=waiting_for,
        )

    def send(self, message: dict) -> None:
        """Encode and send one message; raises PeerLost if the peer is gone or stops reading."""
        payload = encode(message, max_bytes=self.max_message_bytes)
        header = _FRAME_HEADER.pack(len(payload))
        what = "sending a message"
        with self._send_lock:
            if self._closed:
                raise self._closed_here(what)
            try:
                self._sock.sendall(header)
                self._sock.sendall(payload)
            except TimeoutError as err:
                raise self._lost(
                    f"{self.peer} did not take data for {float(self.send_timeout)} s while this "
                    f"process was {what} ({len(payload)} bytes)",
                    what,
                ) from err
            except OSError as err:
                if self._closed:
                    raise self._closed_here(what) from err
                raise self._lost(
                    f"{self.peer} closed the connection while this process was {what} ({type(err).__name__}: {err})",
                    what,
                ) from err

    def _fill(self, buffer: bytearray, timeout: float, waiting_for: str, *, in_frame: bool) -> None:
        """Read exactly len(buffer) bytes; each wait for more bytes is bounded by `timeout`."""
        view = memoryview(buffer)
        received = 0
        while received < len(buffer):
            if self._closed:
                raise self._closed_here(waiting_for)
            ready = self._poller.poll(max(0.0, timeout) * 1000.0)
            if not ready:
                if in_frame or received:
                    raise self._lost(
                        f"{self.peer} stopped sending in the middle of a message (nothing for "
                        f"{float(timeout)} s) while waiting for {waiting_for!r}",
                        waiting_for,
                    )
                raise PeerLost(
                    f"no message from {self.peer} in {float(timeout)} s while waiting for {waiting_for!r}",
                    peer=self.peer,
                    waiting_for=waiting_for,
                )
            try:
                count = self._sock.recv_into(view[received:])
            except OSError as err:
                if self._closed:
                    raise self._closed_here(waiting_for) from err
                raise self._lost(
                    f"{self.peer} closed the connection while waiting for {waiting_for!r} "
                    f"({type(err).__name__}: {err})",
                    waiting_for,
                ) from err
            if count == 0:
                if self._closed:
                    raise self._closed_here(waiting_for)
                raise self._lost(
                    f"{self.peer} closed the connection while waiting for {waiting_for!r}",
                    waiting_for,
                )
            received += count

    def recv(self, timeout: float, waiting_for: str = "a message") -> dict:
        """The next message. PeerLost if none starts within `timeout` s, if the peer stalls for
        `timeout` s inside one, or if the peer closes or dies. Oversized or malformed frames close
        the connection and raise MessageTooLarge / ValueError naming the peer."""
        with self._recv_lock:
            header = bytearray(_FRAME_HEADER.size)
            self._fill(header, timeout, waiting_for, in_frame=False)
            (length,) = _FRAME_HEADER.unpack(header)
            if length > self.max_message_bytes:
                self.close()
                raise MessageTooLarge(
                    f"{self.peer} announced a message of {length} bytes, over the limit of "
                    f"{self.max_message_bytes} bytes, while this process waited for {waiting_for!r}"
                )
            payload = bytearray(length)
            self._fill(payload, timeout, waiting_for, in_frame=True)
        try:
            return decode(payload, max_bytes=self.max_message_bytes)
        except ValueError as err:
            self.close()
            raise ValueError(f"{self.peer} sent {err} while this process waited for {waiting_for!r}") from err

    def request(self, message: dict, timeout: float, waiting_for: str = "a reply") -> dict:
        """Send `message` and return the next message received (the reply). Requests from several
        threads are serialized, so each gets its own reply. On PeerLost the connection is closed."""
        with self._request_lock:
            try:
                self.send(message)
                return self.recv(timeout, waiting_for)
            except PeerLost:
                self.close()
                raise

    def close(self) -> None:
        """Close the socket (idempotent); a thread blocked in recv wakes up with PeerLost."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the peer may already have reset the connection
        self._sock.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Connection(peer={self.peer!r}, peer_process={self.peer_process}, {state})"


# ----------------------------------------------------------------------------- handshake


def _mac(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


def _check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(
            f"the channel secret must be at least {_MIN_SECRET_BYTES} bytes (use coordination.shared_secret())"
        )
    return bytes(secret)


class _NotAPeer(Exception):
    """A connection that did not complete the handshake (no hello, silence, garbage)."""


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"channel address {address!r} is not 'host:port'")
    return host.strip("[]"), int(port)


def _expected(expect: int | Sequence[int]) -> tuple[int, frozenset[int] | None]:
    """(how many, which processes or None) from `accept`'s `expect`."""
    if isinstance(expect, int):
        if expect < 0:
            raise ValueError(f"accept(expect={expect}): expected a count >= 0")
        return expect, None
    processes = frozenset(int(p) for p in expect)
    if len(processes) != len(expect):
        raise ValueError(f"accept(expect={list(expect)}): process ids repeat")
    return len(processes), processes


def _describe(processes: Iterable[int]) -> str:
    return ", ".join(f"process {p}" for p in sorted(processes)) or "none"


class Server:
    """Listening end of the channel, run by the process that others connect to (the leader).

    `address` is what peers pass to `connect`: `advertise_host` (default `socket.gethostname()`,
    a name other nodes can resolve) and the bound port. `accept` authenticates each peer.
    """

    def __init__(
        self,
        secret: bytes,
        host: str = "0.0.0.0",
        port: int = 0,
        name: str = "process 0 (leader)",
        *,
        process: int = 0,
        advertise_host: str | None = None,
        handshake_timeout: float = 10.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        send_timeout: float = DEFAULT_SEND_TIMEOUT_S,
    ):
        self.name = name
        self.process = process
        self._secret = _check_secret(secret)
        self._handshake_timeout = handshake_timeout
        self._max_message_bytes = max_message_bytes
        self._send_timeout = send_timeout
        self._advertise_host = advertise_host or socket.gethostname()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as err:
            self._listener.close()
            raise OSError(f"{name} cannot listen on {host}:{port}: {err}") from err
        self._listener.listen(128)
        self._port = self._listener.getsockname()[1]

    @property
    def address(self) -> str:
        return f"{self._advertise_host}:{self._port}"

    def _refuse(self, connection: Connection, reason: str) -> ConnectionRefusedError:
        try:
            connection.send({"ok": False, "error": reason})
        except PeerLost:
            pass  # it is refused either way
        connection.close()
        return ConnectionRefusedError(f"{self.name} refused {connection.peer}: {reason}")

    def _handshake(
        self,
        sock: socket.socket,
        origin: str,
        timeout: float,
        accepted: Sequence[tuple[int, str]],
        expected: frozenset[int] | None,
    ) -> Connection:
        """Authenticate one incoming socket. _NotAPeer for non-protocol traffic (ignored by
        accept); ConnectionRefusedError for a real peer that must not join (wrong secret,
        unexpected or repeated process id): a configuration error that accept reports at once."""
        connection = Connection(
            sock,
            peer=f"an unidentified peer at {origin}",
            peer_process=-1,
            max_message_bytes=_HANDSHAKE_MAX_MESSAGE_BYTES,
            send_timeout=min(timeout, self._send_timeout),
        )
        try:
            hello = connection.recv(timeout, "hello")
        except (PeerLost, ValueError) as err:
            connection.close()
            raise _NotAPeer(str(err)) from err
        process, role = hello.get("process"), hello.get("role")
        if hello.get("protocol") != PROTOCOL or not isinstance(process, int) or not isinstance(role, str):
            connection.close()
            raise _NotAPeer(f"{origin} sent {sorted(hello)!r}, not a {PROTOCOL} hello")
        connection.peer = f"process {process} ({role}) at {origin}"
        nonce = secrets.token_bytes(32)
        try:
            connection.send({"nonce": nonce, "process": self.process, "name": self.name})
            answer = connection.recv(timeout, "authentication")
        except (PeerLost, ValueError) as err:
            connection.close()
            raise _NotAPeer(str(err)) from err
        mac = answer.get("hmac")
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, _mac(self._secret, nonce)):
            raise self._refuse(connection, "wrong secret (the HMAC of the nonce does not match)")
        if expected is not None and process not in expected:
            raise self._refuse(connection, f"process {process} is not one of the expected {_describe(expected)}")
        if (process, role) in accepted:
            raise self._refuse(connection, f"process {process} is already connected as {role!r}")
        connection.send({"ok": True})
        connection._authenticated(
            peer=f"process {process} ({role})",
            peer_process=process,
            role=role,
            max_message_bytes=self._max_message_bytes,
            send_timeout=self._send_timeout,
        )
        return connection

    def accept(self, timeout: float, expect: int | Sequence[int]) -> list[Connection]:
        """Accept and authenticate `expect` connections within `timeout` s, sorted by (process, role).

        `expect` is a count, or the process ids that must connect, one connection each (then
        missing ones are named on timeout and others are refused). A process may open several
        connections under different roles (count them in `expect`), never two with one role. TimeoutError says how many arrived, from which
        processes, which are missing, and what non-protocol connections were dropped.
        """
        count, expected = _expected(expect)
        deadline = time.monotonic() + timeout
        connections: dict[tuple[int, str], Connection] = {}
        dropped: list[str] = []
        try:
            while len(connections) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(self._timeout_message(timeout, count, expected, connections, dropped))
                self._listener.settimeout(remaining)
                try:
                    sock, (host, port) = self._listener.accept()[:2]
                except TimeoutError:
                    continue
                handshake_timeout = min(self._handshake_timeout, max(remaining, 0.1))
                try:
                    connection = self._handshake(sock, f"{host}:{port}", handshake_timeout, list(connections), expected)
                except _NotAPeer as err:
                    dropped.append(str(err))
                    continue
                connections[(connection.peer_process, connection.role)] = connection
        except BaseException:
            for connection in connections.values():
                connection.close()
            raise
        return [connections[key] for key in sorted(connections)]

    def _timeout_message(self, timeout, count, expected, connections, dropped) -> str:
        message = (
            f"{self.name} accepted {len(connections)} of {count} expected connections in "
            f"{float(timeout)} s on {self.address}; connected: {_describe(sorted({p for p, _ in connections}))}"
        )
        if expected is not None:
            message += f"; missing: {_describe(list(expected - {p for p, _ in connections}))}"
        if dropped:
            message += f"; dropped {len(dropped)} connection(s) that did not complete the handshake: " + "; ".join(
                dropped
            )
        return message

    def close(self) -> None:
        """Stop listening (accepted connections stay open)."""
        self._listener.close()


def connect(
    address: str,
    *,
    secret: bytes,
    process: int,
    role: str,
    peer_name: str,
    timeout: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    send_timeout: float = DEFAULT_SEND_TIMEOUT_S,
) -> Connection:
    """Connect to the Server at `address` ("host:port") as `process` in `role`, and authenticate.

    Retries (backoff 0.05 s doubling to 1 s) until `timeout`, since the server may not listen
    yet. PeerLost naming `peer_name` if it cannot be reached or stops answering during the
    handshake; ConnectionRefusedError with the server's reason if it refuses us.
    """
    secret = _check_secret(secret)
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        left_s = deadline - time.monotonic()
        try:
            sock = socket.create_connection((host, port), timeout=max(min(left_s, 5.0), 0.05))
            break
        except OSError as err:
            if time.monotonic() + delay >= deadline:
                raise PeerLost(
                    f"process {process} ({role}) could not connect to {peer_name} at {address} "
                    f"within {float(timeout)} s (last error: {type(err).__name__}: {err})",
                    peer=peer_name,
                    waiting_for="connection",
                ) from err
            time.sleep(delay)
            delay = min(2 * delay, 1.0)
    connection = Connection(
        sock,
        peer=peer_name,
        peer_process=-1,
        max_message_bytes=_HANDSHAKE_MAX_MESSAGE_BYTES,
        send_timeout=send_timeout,
    )

    def remaining() -> float:
        return max(deadline - time.monotonic(), 0.05)

    connection.send({"protocol": PROTOCOL, "process": process, "role": role})
    challenge = connection.recv(remaining(), "the authentication nonce")
    nonce, server_process = challenge.get("nonce"), challenge.get("process")
    if not isinstance(nonce, bytes) or not isinstance(server_process, int):
        connection.close()
        raise ConnectionRefusedError(f"{peer_name} at {address} does not speak {PROTOCOL} (sent {sorted(challenge)!r})")
    connection.send({"hmac": _mac(secret, nonce)})
    verdict = connection.recv(remaining(), "the authentication verdict")
    if verdict.get("ok") is not True:
        connection.close()
        raise ConnectionRefusedError(
            f"{peer_name} at {address} refused process {process} ({role}): {verdict.get('error', verdict)}"
        )
    connection._authenticated(
        peer=peer_name,
        peer_process=server_process,
        role=role,
        max_message_bytes=max_message_bytes,
        send_timeout=send_timeout,
    )
    return connection
