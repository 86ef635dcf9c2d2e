"""Generators in other processes: the link they use, the leader's service for it, and the inbox
through which they receive params versions.

A generator process runs the ordinary `GeneratorLoop` on its own engine and local mesh, with a
`RemoteLink` in place of the in-process `LocalLink`: each link call is one request over its
*control* connection to the leader, where a `LinkService` thread answers it by calling the
leader's `LocalLink` (so admission, prompt draws, seed indices, scoring and evaluation jobs stay
in one place, in one order, whatever the number of generators). Evaluation requests reach a
remote generator as they reach the local one (`take_evaluations`) and run on its one batcher.
When the leader's buffer closes, every answer is `{"stopped": true}` and the remote loop ends as
the local one does (`PipelineStopped`).

Its *params* connection carries the leader's announcements "version v is offered": the
generator pulls it through the weight transfer, hands it to its batcher to adopt at the next
chunk boundary, and acknowledges. `GeneratorPush` is the leader's side: announce to every
generator, then wait for every acknowledgement.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from absl import logging

from scalerl_jax.distributed.messages import (
    admission_from_message,
    admission_to_message,
    completion_from_message,
    completion_to_message,
    eval_item_from_message,
    eval_item_to_message,
)
from scalerl_jax.pipeline.generator import Admission, EvalItem, GeneratorCounters, GeneratorStats, LocalLink
from scalerl_jax.pipeline.queue import PipelineStopped
from scalerl_jax.sampler.batcher import Batcher, Completion

if TYPE_CHECKING:
    from scalerl_jax.distributed.channel import Connection


class RemoteLink:
    """`GeneratorLink` over the control connection to the leader (module docstring). With each
    finished group it reports the chunks and busy seconds of `counters` since the last report."""

    def __init__(self, connection: Connection, *, timeout_s: float, counters: GeneratorCounters):
        self._connection, self._timeout_s, self._counters = connection, timeout_s, counters
        self._reported = GeneratorStats()

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        reply = self._connection.request(message, self._timeout_s, f"the leader's answer to {message['op']!r}")
        if reply.get("stopped"):
            raise PipelineStopped("the leader stopped the pipeline")
        if "error" in reply:
            raise RuntimeError(f"the leader could not serve {message['op']!r}: {reply['error']}")
        return reply

    def admit(self, version: int) -> Admission | None:
        reply = self._call({"op": "admit", "version": version})
        return admission_from_message(reply["admission"]) if reply.get("admission") else None

    def finish(self, admission: Admission, completions: Sequence[Completion]) -> None:
        now = self._counters.snapshot()
        self._call(
            {
                "op": "finish",
                "admission": admission_to_message(admission),
                "completions": [completion_to_message(c) for c in completions],
                "chunks": now.chunks - self._reported.chunks,
                "busy_s": now.busy_s - self._reported.busy_s,
                "prefill_tokens": now.prefill_tokens - self._reported.prefill_tokens,
                "shared_prompt_pages": now.shared_prompt_pages - self._reported.shared_prompt_pages,
            }
        )
        self._reported = now

    def take_evaluations(self, version: int, limit: int) -> list[EvalItem]:
        reply = self._call({"op": "take_evaluations", "version": version, "limit": limit})
        return [eval_item_from_message(item) for item in reply["items"]]

    def finish_evaluations(self, completions: Sequence[Completion]) -> None:
        self._call({"op": "finish_evaluations", "completions": [completion_to_message(c) for c in completions]})

    def epoch(self) -> int:
        return int(self._call({"op": "epoch"})["epoch"])

    def wait_admissible(self, version: int, *, epoch: int, timeout: float) -> bool:
        reply = self._call({"op": "wait_admissible", "version": version, "epoch": epoch, "timeout": timeout})
        return bool(reply["admissible"])


class LinkService:
    """The leader's side of one generator process's control connection.

    `serve(link, stop)` answers its `RemoteLink` requests with the leader's `LocalLink` until the
    buffer closes: then it answers `stopped` to the generator's next request (a running generator
    asks at least once per chunk) and returns, so the generator always learns that the pipeline
    ended. A request that fails on the leader raises here, which stops the pipeline, and the
    generator is told so (a reward function that raises fails on the leader's scoring thread).
    """

    def __init__(self, connection: Connection, *, timeout_s: float):
        self._connection, self._timeout_s = connection, timeout_s

    def _answer(self, link: LocalLink, message: dict[str, Any]) -> dict[str, Any]:
        op = message["op"]
        if op == "admit":
            admission = link.admit(int(message["version"]))
            return {"admission": admission_to_message(admission) if admission else None}
        if op == "finish":
            admission = admission_from_message(message["admission"])
            completions = [completion_from_message(c, list(admission.prompt.tokens)) for c in message["completions"]]
            link.finish(admission, completions)
            link.record_generator_work(
                int(message["chunks"]),
                float(message["busy_s"]),
                int(message["prefill_tokens"]),
                int(message["shared_prompt_pages"]),
            )
            return {}
        if op == "take_evaluations":
            items = link.take_evaluations(int(message["version"]), int(message["limit"]))
            return {"items": [eval_item_to_message(item) for item in items]}
        if op == "finish_evaluations":
            link.finish_evaluations(
                [
                    completion_from_message(c, link.evaluation_prompt(tuple(c["request_id"])))
                    for c in message["completions"]
                ]
            )
            return {}
        if op == "epoch":
            return {"epoch": link.epoch()}
        if op == "wait_admissible":
            return {
                "admissible": link.wait_admissible(
                    int(message["version"]), epoch=int(message["epoch"]), timeout=float(message["timeout"])
                )
            }
        raise ValueError(f"{self._connection.peer} sent an unknown request {op!r}")

    def serve(self, link: LocalLink, stop: threading.Event) -> None:
        del stop  # the buffer's close ends the service (class docstring)
        while True:
            message = self._connection.recv(self._timeout_s, "a generator request")
            try:
                reply = self._answer(link, message)
            except PipelineStopped:
                self._connection.send({"stopped": True})
                return
            except Exception as error:
                self._connection.send({"error": f"{type(error).__name__}: {error}"})
                raise
            self._connection.send(reply)


def first_version(connection: Connection, *, pull: Callable[[int], Any], timeout_s: float) -> tuple[Any, int]:
    """Waits for the leader's first announcement, pulls it and acknowledges: (params, version)."""
    message = connection.recv(timeout_s, "the first params version")
    if message.get("op") != "params":
        raise ValueError(f"expected the first params version from the leader, got {message.get('op')!r}")
    version = int(message["version"])
    params = pull(version)
    connection.send({"op": "pulled", "version": version})
    return params, version


class ParamsInbox:
    """A generator process's thread that adopts announced params versions.

    `pull(version) -> params` fetches params onto this generator's shardings (weight transfer,
    under transfer id `version`); `batcher` adopts them at its next chunk boundary.
    """

    def __init__(self, connection: Connection, *, pull: Callable[[int], Any], batcher: Batcher, timeout_s: float):
        self._connection, self._pull, self._batcher = connection, pull, batcher
        self._timeout_s = timeout_s

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            message = self._connection.recv(self._timeout_s, "a params announcement")
            op = message["op"]
            if op == "stop":
                stop.set()
                return
            if op == "params":
                version = int(message["version"])
                self._batcher.update_params(self._pull(version), version, copy=False)
                self._connection.send({"op": "pulled", "version": version})
            else:
                raise ValueError(f"unknown message {op!r} from the leader")


class GeneratorPush:
    """The leader's side of the params connections: announce a version, wait for every pull."""

    def __init__(self, connections: Sequence[Connection], *, timeout_s: float):
        self._connections, self._timeout_s = list(connections), timeout_s

    def announce(self, version: int) -> None:
        for connection in self._connections:
            connection.send({"op": "params", "version": version})
        for connection in self._connections:
            reply = connection.recv(self._timeout_s, f"the pull of params version {version}")
            if reply.get("op") != "pulled" or int(reply["version"]) != version:
                raise RuntimeError(f"{connection.peer} answered {reply} to the push of version {version}")

    def stop(self) -> None:
        for connection in self._connections:
            try:
                connection.send({"op": "stop"})
            except OSError as error:  # already gone: its own watchdog reports it
                logging.warning("could not tell %s to stop: %s", connection.peer, error)
