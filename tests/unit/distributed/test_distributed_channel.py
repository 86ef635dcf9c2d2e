"""Host channel (framing, msgpack without pickle, HMAC handshake, lost peers) and coordination
through jax.distributed, with real processes: peers are started with subprocess and killed or
silenced to check that every wait ends with an error naming the peer."""

import json
import os
import pathlib
import select
import socket
import subprocess
import sys
import threading
import time

import ml_dtypes
import msgpack
import numpy as np
import pytest
import repo_paths

from scalerl_jax.distributed import channel, coordination

REPO = pathlib.Path(repo_paths.REPO)
PEER = pathlib.Path(repo_paths.SUPPORT, "channel_peer.py")
COORDINATION_PEER = pathlib.Path(repo_paths.SUPPORT, "coordination_peer.py")
SECRET = bytes(range(32))
GENERATOR = "process 1 (generator)"


def _packb(value) -> bytes:
    """msgpack.packb, whose pure-Python fallback is typed as returning bytes | None."""
    payload = msgpack.packb(value)
    assert isinstance(payload, bytes)
    return payload


def peer_env() -> dict:
    """The worktree's package first on the path (the venv may hold another checkout)."""
    return {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}


def spawn_peer(mode: str, address: str, *, process: int = 1, role: str = "generator", secret: bytes = SECRET):
    return subprocess.Popen(
        [sys.executable, str(PEER), mode, address, secret.hex(), str(process), role],
        cwd=REPO,
        env=peer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(process: subprocess.Popen) -> str:
    """The peer's output once it exits (killed if still running after 300 s: a bound for a hung
    peer, far above what a loaded 2-core machine needs to import jax and run every scenario)."""
    try:
        output, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate(timeout=30)
    return output


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def local_server(**kwargs) -> channel.Server:
    return channel.Server(SECRET, host="127.0.0.1", advertise_host="127.0.0.1", **kwargs)


# ----------------------------------------------------------------------------- encoding


def test_round_trip_keeps_values_dtypes_and_shapes():
    message = {
        "kind": "group",
        "none": None,
        "flag": True,
        "count": -7,
        "ratio": 0.25,
        "blob": b"\x00\xff",
        "tokens": np.arange(12, dtype=np.int32).reshape(3, 4),
        "logprobs": np.array([-0.5, -1.25, 0.0], dtype=np.float32),
        "mask": np.array([[True, False], [False, True]]),
        "bf16": np.array([1.5, -2.0, 3.0], dtype=ml_dtypes.bfloat16),
        "empty": np.zeros((0, 3), dtype=np.int64),
        "scalar": np.float32(2.5),
        "big_endian": np.array([1, 256], dtype=">i4"),
        "nested": {"lists": [1, [2.5, "three"], {"deep": np.array([7], dtype=np.uint8)}], "t": (1, 2)},
    }
    decoded = channel.decode(channel.encode(message))

    assert decoded["kind"] == "group" and decoded["none"] is None and decoded["flag"] is True
    assert decoded["count"] == -7 and decoded["ratio"] == 0.25 and decoded["blob"] == b"\x00\xff"
    for key, dtype in [
        ("tokens", np.int32),
        ("logprobs", np.float32),
        ("mask", np.bool_),
        ("bf16", ml_dtypes.bfloat16),
        ("empty", np.int64),
    ]:
        assert decoded[key].dtype == np.dtype(dtype), key
        assert decoded[key].shape == message[key].shape, key
        np.testing.assert_array_equal(decoded[key], message[key])
    assert decoded["bf16"].astype(np.float32).tolist() == [1.5, -2.0, 3.0]
    assert decoded["scalar"].shape == () and decoded["scalar"].dtype == np.float32 and decoded["scalar"] == 2.5
    assert decoded["big_endian"].tolist() == [1, 256]
    assert decoded["nested"]["lists"][:2] == [1, [2.5, "three"]]
    assert decoded["nested"]["lists"][2]["deep"].tolist() == [7]
    assert decoded["nested"]["t"] == [1, 2]  # msgpack has no tuples
    decoded["tokens"][0, 0] = 99  # arrays are writable and do not alias the message
    assert message["tokens"][0, 0] == 0


def test_object_arrays_and_unknown_types_are_refused():
    with pytest.raises(TypeError, match="dtype object"):
        channel.encode({"x": np.array([{"a": 1}, None], dtype=object)})
    with pytest.raises(TypeError, match="dtype"):
        channel.encode({"x": np.zeros(2, dtype=[("a", np.int32)])})
    with pytest.raises(TypeError, match="builtins.set"):
        channel.encode({"x": {1, 2}})
    with pytest.raises(TypeError, match="keys must be str"):
        channel.encode({1: "x"})


def test_size_limits_and_malformed_payloads():
    message = {"x": np.zeros(1000, dtype=np.float32)}
    with pytest.raises(channel.MessageTooLarge, match="over the limit of 1000 bytes"):
        channel.encode(message, max_bytes=1000)
    payload = channel.encode(message)
    with pytest.raises(channel.MessageTooLarge):
        channel.decode(payload, max_bytes=1000)
    with pytest.raises(ValueError, match="malformed"):
        channel.decode(b"\xc1")  # a byte msgpack never uses
    with pytest.raises(ValueError, match="map with str keys"):
        channel.decode(_packb([1, 2]))  # a list, not a map
    with pytest.raises(ValueError, match="map with str keys"):
        channel.decode(_packb({1: 2}))


# ----------------------------------------------------------------------------- processes


def test_request_reply_with_a_real_process_that_connects_before_the_server_listens():
    port = free_port()
    peer = spawn_peer("echo", f"127.0.0.1:{port}")  # retries until the server below listens
    time.sleep(0.3)
    server = local_server(port=port)
    try:
        (connection,) = server.accept(timeout=60.0, expect=[1])
        assert connection.peer == GENERATOR and connection.peer_process == 1
        replies = {}

        def ask(value: int):
            x = np.full((2, 3), value, dtype=np.int32)
            replies[value] = connection.request({"x": x, "tag": f"t{value}"}, timeout=30.0, waiting_for="echo")

        threads = [threading.Thread(target=ask, args=(value,)) for value in (1, 2, 3, 4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        for value in (1, 2, 3, 4):  # each thread got the reply to its own request
            reply = replies[value]
            assert reply["from"] == 1 and reply["echo"]["tag"] == f"t{value}"
            np.testing.assert_array_equal(reply["doubled"], np.full((2, 3), 2 * value, dtype=np.int32))
            assert reply["doubled"].dtype == np.int32
        connection.send({"stop": True})
    finally:
        server.close()
        output = finish(peer)
    assert peer.returncode == 0, output


def test_wrong_secret_is_refused_on_both_sides():
    server = local_server()
    peer = spawn_peer("refused", server.address, secret=bytes(32))
    try:
        with pytest.raises(ConnectionRefusedError, match=r"refused process 1 \(generator\).*wrong secret"):
            server.accept(timeout=60.0, expect=1)
    finally:
        server.close()
        output = finish(peer)
    assert peer.returncode == 3, output
    assert "REFUSED process 0 (leader) at" in output and "wrong secret" in output, output


def test_peer_killed_mid_wait_raises_peer_lost_naming_it():
    server = local_server()
    peer = spawn_peer("die", server.address)
    try:
        (connection,) = server.accept(timeout=60.0, expect=1)
        started = time.monotonic()
        with pytest.raises(channel.PeerLost) as caught:
            connection.recv(timeout=60.0, waiting_for="finished")
        elapsed = time.monotonic() - started
    finally:
        server.close()
        finish(peer)
    assert peer.returncode == -9
    assert elapsed < 10.0
    assert str(caught.value).startswith(f"{GENERATOR} closed the connection while waiting for 'finished'")
    assert caught.value.peer == GENERATOR
    with pytest.raises(channel.PeerLost, match="closed by this process"):
        connection.send({"after": "loss"})


def test_silent_peer_times_out_naming_it_and_what_was_awaited():
    server = local_server()
    peer = spawn_peer("silent", server.address)
    try:
        (connection,) = server.accept(timeout=60.0, expect=1)
        with pytest.raises(channel.PeerLost) as caught:
            connection.recv(timeout=0.5, waiting_for="admit reply")
        assert str(caught.value) == f"no message from {GENERATOR} in 0.5 s while waiting for 'admit reply'"
        with pytest.raises(channel.PeerLost, match="no message from process 1"):
            connection.request({"q": 1}, timeout=0.3, waiting_for="admit reply")
        with pytest.raises(channel.PeerLost, match="closed by this process"):  # a late reply can't be misread
            connection.recv(timeout=0.3)
    finally:
        peer.kill()
        server.close()
        finish(peer)


def test_accept_timeout_names_who_arrived_and_who_is_missing():
    server = local_server()
    peer = spawn_peer("silent", server.address, process=1)
    try:
        # The accept timeout starts once the peer is past its imports, which take seconds on a busy machine.
        assert peer.stdout is not None and select.select([peer.stdout], [], [], 120)[0], "the peer did not start"
        assert peer.stdout.readline() == "connecting\n"
        with pytest.raises(TimeoutError) as caught:
            server.accept(timeout=4.0, expect=[1, 2])
    finally:
        peer.kill()
        server.close()
        finish(peer)
    message = str(caught.value)
    assert "accepted 1 of 2 expected connections" in message
    assert "connected: process 1;" in message and "missing: process 2" in message


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of localhost TCP sockets in this process (raw bytes on one end)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        raw = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    return raw, accepted


def test_oversized_and_stalled_frames_close_the_connection_naming_the_peer():
    raw, accepted = tcp_pair()
    connection = channel.Connection(accepted, peer=GENERATOR, peer_process=1, max_message_bytes=100)
    raw.sendall((101).to_bytes(4, "big"))
    with pytest.raises(channel.MessageTooLarge, match=r"process 1 \(generator\) announced a message of 101 bytes"):
        connection.recv(timeout=5.0, waiting_for="a group")
    raw.close()

    raw, accepted = tcp_pair()
    connection = channel.Connection(accepted, peer=GENERATOR, peer_process=1)
    raw.sendall((50).to_bytes(4, "big") + b"\x80")  # 1 of 50 payload bytes, then nothing
    with pytest.raises(channel.PeerLost, match="stopped sending in the middle of a message .* 'a group'"):
        connection.recv(timeout=0.5, waiting_for="a group")
    with pytest.raises(channel.PeerLost, match="closed by this process"):
        connection.recv(timeout=0.5)
    raw.close()


def test_handshake_drops_strangers_and_refuses_unexpected_processes():
    server = local_server()
    stranger = socket.create_connection(("127.0.0.1", int(server.address.rsplit(":", 1)[1])))
    stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")  # not a channel hello: dropped, accept goes on
    outcomes = {}

    def join(process: int):
        try:
            outcomes[process] = channel.connect(
                server.address,
                secret=SECRET,
                process=process,
                role="trainer",
                peer_name="process 0 (leader)",
                timeout=20.0,
            )
        except ConnectionRefusedError as err:
            outcomes[process] = err

    try:
        unexpected = threading.Thread(target=join, args=(5,))
        unexpected.start()
        with pytest.raises(ConnectionRefusedError, match=r"process 5 is not one of the expected process 2"):
            server.accept(timeout=20.0, expect=[2])
        unexpected.join(timeout=20)
        assert isinstance(outcomes[5], ConnectionRefusedError)
        assert "refused process 5 (trainer): process 5 is not one of" in str(outcomes[5])

        expected = threading.Thread(target=join, args=(2,))
        expected.start()
        (connection,) = server.accept(timeout=20.0, expect=[2])
        expected.join(timeout=20)
        assert connection.peer == "process 2 (trainer)"
        assert outcomes[2].peer == "process 0 (leader)" and outcomes[2].peer_process == 0
        outcomes[2].send({"hi": np.arange(3)})
        assert connection.recv(5.0)["hi"].tolist() == [0, 1, 2]
    finally:
        stranger.close()
        server.close()


# ----------------------------------------------------------------------------- coordination


def test_single_process_coordination_needs_no_service():
    assert coordination.distributed_client() is None
    coordination.barrier("alone", 0.1)
    calls = []
    coordination.run_once("alone", lambda: calls.append(1), timeout_s=0.1)
    assert calls == [1]
    coordination.publish("single/key", "value")
    assert coordination.lookup("single/key", 0.1) == "value"
    with pytest.raises(coordination.CoordinationTimeout, match="'single/missing'"):
        coordination.lookup("single/missing", 0.1)
    assert len(coordination.shared_secret(0.1)) == 32


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    """Both processes' RESULT lines from one run of tests/support/coordination_peer.py on 2 processes."""
    shared = tmp_path_factory.mktemp("coordination")
    port = str(free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, str(COORDINATION_PEER), port, str(rank), str(shared)],
            cwd=REPO,
            env=peer_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [finish(process) for process in processes]
    results = []
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"process {rank} failed:\n{output[-4000:]}"
        lines = [json.loads(line[len("RESULT ") :]) for line in output.splitlines() if line.startswith("RESULT ")]
        results.append({line["scenario"]: line for line in lines})
    return results


def test_two_processes_barrier_and_lookup(two_process_results):
    zero, one = two_process_results
    assert zero["client"]["is_set"] and one["client"]["is_set"]
    assert zero["barrier"]["passed"] and one["barrier"]["passed"]
    assert zero["lookup"]["value"] == "hello from 1" and one["lookup"]["value"] == "hello from 0"
    assert zero["end"]["passed"] and one["end"]["passed"]


def test_two_processes_run_once(two_process_results):
    zero, one = two_process_results
    assert zero["run_once_ok"]["calls"] == [0] and one["run_once_ok"]["calls"] == []
    assert one["run_once_ok"]["content"] == "built by process 0"
    assert zero["run_once_error"]["raised"] == "ValueError"
    failure = one["run_once_error"]
    assert failure["raised"] == "RuntimeError"
    assert failure["message"] == "explode failed on process 0: ValueError: tfds build exploded"
    assert failure["seconds"] < 10.0  # told by process 0's status, not by the 60 s timeout


def test_two_processes_share_one_secret(two_process_results):
    zero, one = two_process_results
    assert zero["secret"]["hex"] == one["secret"]["hex"]
    assert len(bytes.fromhex(zero["secret"]["hex"])) == 32


def test_barrier_timeout_names_the_process_that_never_arrived(two_process_results):
    zero, _ = two_process_results
    timeout = zero["barrier_timeout"]
    assert timeout["raised"] == "CoordinationTimeout"
    assert timeout["message"] == (
        "barrier 'late' (call 0) of processes [0, 1] timed out after 1.0 s on process 0: processes [1] did not arrive"
    )
    assert timeout["seconds"] < 30.0
    assert zero["lookup_timeout"]["message"] == "process 0: key 'never published' was not published within 0.5 s"


def test_a_completions_recorded_experts_cross_the_channel():
    """A mixture-of-experts completion's routed experts [tokens, MoE layers, k] arrive with their
    values, narrow dtype (int8, as the engine emits for up to 128 experts) and shape; a dense
    one's None stays None."""
    import dataclasses

    from scalerl_jax.distributed.messages import completion_from_message, completion_to_message
    from scalerl_jax.sampler.batcher import Completion

    experts = np.arange(3 * 2 * 2, dtype=np.int8).reshape(3, 2, 2)
    completion = Completion(
        request_id=7,
        prompt_tokens=[5],
        tokens=[2, 3, 4],
        logprobs=[-1.0, -0.5, -0.25],
        versions=[0, 0, 1],
        sampled=[True] * 3,
        interrupted=False,
        truncated=False,
        num_think_tokens=0,
        num_answer_tokens=3,
        finish_reason="stop",
        think_budget=-1,
    )
    for routed in (experts, None):
        sent = dataclasses.replace(completion, routed_experts=routed)
        back = completion_from_message(channel.decode(channel.encode(completion_to_message(sent))), [5])
        if routed is None:
            assert back.routed_experts is None
        else:
            assert back.routed_experts is not None and back.routed_experts.dtype == np.int8
            np.testing.assert_array_equal(back.routed_experts, experts)
