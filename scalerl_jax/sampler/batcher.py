"""Host-side continuous batching over an `Engine`, with versioned params.

`ContinuousBatcher.run_chunk()` is one turn of the loop:
1. wait for the previous chunk's small per-slot `active` vector and free the slots that finished;
2. adopt params pushed by `update_params` since the last turn (sequences in flight keep their KV
   cache and continue under the new params: PipelineRL's in-flight update);
3. admit pending requests (FIFO) into free slots: a request is admitted only while its slot's
   page group can hold its prompt and first chunk and still cover the next chunk of the sequences
   already running there. A request whose prompt a slot of the group already holds or is
   prefilling under the current params (another sample of the same prompt) is not prefilled: it
   shares that slot's prompt pages (`Engine.fork`, once that slot has started), so a group of G
   samples prefills its prompt once and holds one copy of it (`EngineConfig.share_prompts`);
   then prefill admitted prompts in pieces (`Engine.prefill`, up to `max_prefill_rows` pieces a
   call, in admission order): one call per turn while sequences are decoding, so a long prompt
   never stalls them for more than one call, as many as it takes when none is;
4. if a page group cannot cover the next chunk of its running sequences (they grew), preempt the
   youngest there until it can: the request goes back to the front of the queue and starts over
   (`sampler/preempted` counts them; never happens with the default, fully provisioned pool);
5. dispatch the next jitted multi-step `generate` chunk and start copying its outputs to the host;
6. while that chunk runs, turn the previous chunk's outputs into per-request token lists and
   return the `Completion`s that finished in it.
So results come back one chunk after the one that produced them and the host work of step 6
overlaps device compute. Each generated token records the params version of its chunk.

Retained versions. `retain_versions(keep, limit)` makes the batcher hold on to the params of
every version `v` with `keep(v)` that it is given (the newest `limit` of them), after newer
versions replace them, so that a second batcher can evaluate exactly that version while this
one decodes with newer params (`params_at`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from scalerl_jax.models.reshard import push_local
from scalerl_jax.sampler.engine import ChunkResult, Engine, PromptPiece, SlotSettings, host_settings, row_bucket


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to complete.

    `seed` selects the request's PRNG stream: key = fold_in(key(batcher seed), seed), so its
    samples do not depend on which slot or chunk it runs in. `temperature` 0 is greedy.
    `interrupt` applies the engine's forced interruption (if it has one) to this request.
    """

    request_id: Hashable
    prompt_tokens: Sequence[int]
    max_new_tokens: int
    seed: int = 0
    temperature: float = 0.0
    stop_tokens: Sequence[int] = ()
    interrupt: bool = True


@dataclasses.dataclass
class Completion:
    """A finished request; the per-token lists have one entry per generated token.

    `tokens` include any forced interruption phrase; `logprobs` are fp32 behaviour log-probs
    (0 for forced tokens), `versions` the params version that produced each token, `sampled`
    False for forced tokens. `num_think_tokens` counts sampled tokens before thinking ended (a
    natural end-think included), `num_answer_tokens` sampled tokens after it, so
    len(tokens) = num_think_tokens + num_answer_tokens + (len(phrase) if interrupted, unless
    truncated inside the phrase). `finish_reason`: 'stop' (a stop token, included in tokens),
    'answer_budget', or 'length' (max_new_tokens or the cache length). `think_budget` is the
    drawn budget (-1 without interruption). For a mixture-of-experts policy `routed_experts`
    [len(tokens), MoE layers, k] (`batch_layout.routing_dtype`) holds, for each token, the experts
    each MoE layer routed the input that produced it to (the last prompt token for the first, then
    each token for the next); None for a dense one.
    """

    request_id: Hashable
    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    sampled: list[bool]
    interrupted: bool
    truncated: bool
    num_think_tokens: int
    num_answer_tokens: int
    finish_reason: str
    think_budget: int
    routed_experts: np.ndarray | None = None


class Batcher(Protocol):
    """What the pipeline's generator loop, its params pushes and a generator process's params
    inbox call on a sampler driver; `ContinuousBatcher` is the one the runs use.

    The loop keeps `num_pending` below `num_free_slots` plus a slack, queues requests with
    `add_request`, and calls `run_chunk` (one loop turn: adopt pushed params, decode one chunk,
    return the completions that finished) until `idle`. `update_params` may be called from
    another thread; `version` is the params version the latest chunk decoded with; `counters`
    are running counts of its work (`ContinuousBatcher.stats` names them).
    """

    counters: collections.Counter[str]

    @property
    def version(self) -> int: ...

    @property
    def num_free_slots(self) -> int: ...

    @property
    def num_pending(self) -> int: ...

    @property
    def idle(self) -> bool: ...

    def add_request(self, request: Request) -> None: ...

    def run_chunk(self) -> list[Completion]: ...

    def update_params(self, params: Any, version: int, *, copy: bool = True, wait: bool = True) -> float: ...


@dataclasses.dataclass
class _SlotRecord:
    """Host-side accumulation for the request occupying one slot."""

    request: Request
    admitted: int  # admission order (larger = younger; the youngest is preempted first)
    pieces: list[PromptPiece]  # of its prompt, still to prefill
    source: int | None  # the slot whose prompt pages it shares (`Engine.fork`); None: prefilled
    started: bool = False  # decoding on the device
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    sampled: list[bool] = dataclasses.field(default_factory=list)
    experts: list[np.ndarray] = dataclasses.field(default_factory=list)  # per chunk [tokens, MoE layers, k]


@dataclasses.dataclass
class _Chunk:
    """A dispatched chunk: its device outputs, the params version and the slot occupants."""

    result: ChunkResult
    version: int
    records: list[_SlotRecord | None]  # the started ones


class ContinuousBatcher:
    """Continuous batching driver: `add_request`, `run_chunk`, `update_params` (see module doc).

    `params` must already be on the generator's devices; their shardings are the target of every
    later `update_params` push. Not thread safe except `update_params`, which may be called from
    another thread (the swap happens under a lock at the next chunk boundary).
    """

    def __init__(self, engine: Engine, params: Any, *, version: int = 0, seed: int = 0):
        if not 0 <= seed < 2**32:
            raise ValueError(f"ContinuousBatcher seed={seed} must be in [0, 2**32)")
        self.engine = engine
        self.seed = seed
        self._params = params
        self._version = version
        self._param_shardings = jax.tree.map(lambda leaf: leaf.sharding, params)
        self._pending_params: tuple[Any, int] | None = None
        self._params_lock = threading.Lock()  # guards the params, the pending push and the retained
        self._retained: dict[int, Any] = {}
        self._keep: Callable[[int], bool] = lambda version: False
        self._retain_limit = 0
        self._state = engine.init_decode_state()
        self._slots: list[_SlotRecord | None] = [None] * engine.config.num_slots
        self._queue: collections.deque[Request] = collections.deque()
        self._live_ids: set[Hashable] = set()
        self._inflight: _Chunk | None = None
        # Live slots holding each prompt, prefilled under the current params: what a request with
        # the same prompt can share (`Engine.fork`).
        self._prompt_holders: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
        self._admissions = 0
        self.last_push_seconds = 0.0
        self.counters = collections.Counter()

    # --------------------------------------------------------------------------- properties
    @property
    def version(self) -> int:
        """Params version used by the most recently dispatched chunk."""
        return self._version

    @property
    def params(self) -> Any:
        """The params the next chunk decodes with (version `version`)."""
        return self._params

    @property
    def num_free_slots(self) -> int:
        return sum(record is None for record in self._slots)

    @property
    def num_pending(self) -> int:
        return len(self._queue)

    @property
    def num_active(self) -> int:
        """Slots holding a request (including ones that finished in the chunk now in flight)."""
        return len(self._slots) - self.num_free_slots

    @property
    def idle(self) -> bool:
        """Nothing pending, nothing in a slot, nothing in flight."""
        return not self._queue and self.num_active == 0 and self._inflight is None

    def stats(self) -> dict[str, float]:
        """Counters (chunks, tokens, completions, slot-steps) plus compile counts and last push time."""
        out = {f"sampler/{name}": float(value) for name, value in self.counters.items()}
        out.update({f"sampler/compiles_{name}": float(count) for name, count in self.engine.compile_counts.items()})
        out["sampler/param_push_seconds"] = self.last_push_seconds
        out["sampler/params_version"] = float(self._version)
        return out

    # ------------------------------------------------------------------------------ public API
    def add_request(self, request: Request) -> None:
        """Queue a request (FIFO); raises ValueError naming the request and field if it is invalid."""
        self._validate(request)
        self._live_ids.add(request.request_id)
        self._queue.append(request)

    def update_params(self, params: Any, version: int, *, copy: bool = True, wait: bool = True) -> float:
        """Copy `params` onto the generator's shardings; adopted at the next chunk boundary.

        Copies by default, device to device (`models.reshard.push_local`: never through
        the host, never aliasing the caller's buffers, which a train step may donate: the
        runtime lets a donation overwrite a buffer only once the copies reading it are done);
        `copy=False` takes over params that are already this generator's own buffers on its
        shardings (e.g. just received by weight transfer). `wait`: return once the copy is
        complete; else once it is dispatched (the first chunk on the new params waits for it).
        Returns and records the seconds taken.
        """
        start = time.perf_counter()
        placed = push_local(params, self._param_shardings) if copy else params
        if wait:
            jax.block_until_ready(placed)
        seconds = time.perf_counter() - start
        with self._params_lock:
            self._pending_params = (placed, version)
            self._retain(placed, version)
        self.last_push_seconds = seconds
        self.counters["param_pushes"] += 1
        return seconds

    def retain_versions(self, keep: Callable[[int], bool], limit: int) -> None:
        """From now on keep the params of each version `v` with `keep(v)` (this one's too), the
        newest `limit` such versions, for `params_at` (module docstring)."""
        if limit < 1:
            raise ValueError(f"retain_versions(limit={limit}) must keep at least one version")
        with self._params_lock:
            self._keep, self._retain_limit = keep, limit
            self._retain(self._params, self._version)

    def params_at(self, version: int) -> Any | None:
        """The params of `version` if this batcher holds them (decoding with them, pushed and not yet
        adopted, or retained), else None. Thread safe."""
        with self._params_lock:
            if self._pending_params is not None and self._pending_params[1] == version:
                return self._pending_params[0]
            if self._version == version:
                return self._params
            return self._retained.get(version)

    def _retain(self, params: Any, version: int) -> None:
        """Under the params lock: keeps `params` if `version` is one to keep, dropping the oldest
        beyond the limit."""
        if self._retain_limit and self._keep(version):
            self._retained[version] = params
            for old in sorted(self._retained)[: -self._retain_limit]:
                del self._retained[old]

    def warm_up(self, max_prompt_length: int) -> None:
        """Compile every engine call the decode loop can make for prompts up to `max_prompt_length`
        tokens (`Engine.warm_up`), so none compiles later; only before any request runs."""
        if not self.idle:
            raise ValueError("ContinuousBatcher.warm_up must run before any request")
        self._state = self.engine.warm_up(self._params, self._state, max_prompt_length=max_prompt_length)

    def run_chunk(self) -> list[Completion]:
        """One loop turn (module docstring); returns requests that finished in the previous chunk."""
        previous, self._inflight = self._inflight, None
        if previous is not None:
            still_active = np.asarray(previous.result.active)
            finished = [
                slot for slot, record in enumerate(previous.records) if record is not None and not still_active[slot]
            ]
            for slot in finished:
                self._vacate(slot)
            self.engine.release_slots(finished)
        self._adopt_pending_params()
        self._fill_free_slots()
        self._prefill_admitted()
        self._preempt_for_pages()
        started = [record if record is not None and record.started else None for record in self._slots]
        if any(started):
            self._state, result = self.engine.generate(self._params, self._state)
            for leaf in jax.tree.leaves(result):
                leaf.copy_to_host_async()
            self._inflight = _Chunk(result, self._version, started)
            self.counters["chunks"] += 1
        return self._absorb(previous) if previous is not None else []

    def drain(self) -> list[Completion]:
        """Run chunks until idle; returns every completion in finishing order."""
        completions: list[Completion] = []
        while not self.idle:
            completions.extend(self.run_chunk())
        return completions

    # ------------------------------------------------------------------------------ internals
    def _validate(self, request: Request) -> None:
        cfg = self.engine.config
        vocab = self.engine.model_config.vocab_size
        rid = request.request_id
        if rid in self._live_ids:
            raise ValueError(f"request_id={rid!r} is already pending or running")
        prompt = np.asarray(request.prompt_tokens)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError(f"request {rid!r}: prompt_tokens is empty or not a flat list")
        if prompt.size + 1 > cfg.max_len:
            raise ValueError(
                f"request {rid!r}: prompt length {prompt.size} leaves no room in EngineConfig.max_len={cfg.max_len}"
            )
        bad = np.flatnonzero((prompt < 0) | (prompt >= vocab))
        if bad.size:
            raise ValueError(
                f"request {rid!r}: prompt_tokens[{bad[0]}]={prompt[bad[0]]} outside the vocabulary [0, {vocab})"
            )
        if request.max_new_tokens < 1:
            raise ValueError(f"request {rid!r}: max_new_tokens={request.max_new_tokens} must be >= 1")
        if len(request.stop_tokens) > cfg.max_stop_tokens:
            raise ValueError(
                f"request {rid!r}: {len(request.stop_tokens)} stop_tokens exceed "
                f"EngineConfig.max_stop_tokens={cfg.max_stop_tokens}"
            )
        if not 0 <= request.seed < 2**32:
            raise ValueError(f"request {rid!r}: seed={request.seed} must be in [0, 2**32)")
        if request.temperature < 0:
            raise ValueError(f"request {rid!r}: temperature={request.temperature} must be >= 0")

    def _adopt_pending_params(self) -> None:
        with self._params_lock:
            pending, self._pending_params = self._pending_params, None
            if pending is not None:
                self._params, self._version = pending
        if pending is not None:
            self._prompt_holders.clear()  # their prompts' K/V came from older params
            self.counters["param_swaps"] += 1

    def _fill_free_slots(self) -> None:
        """Admit queued requests (FIFO) while a free slot's group can hold them (module doc, 3)."""
        free = [slot for slot, record in enumerate(self._slots) if record is None]
        while self._queue and free:
            request = self._queue[0]
            placed = self._place(request, free)
            if placed is None:
                break  # FIFO: later requests wait for the pages this one needs
            slot, source = placed
            self._queue.popleft()
            free.remove(slot)
            pieces = [] if source is not None else self.engine.prompt_pieces(slot, request.prompt_tokens)
            self._slots[slot] = _SlotRecord(request, admitted=self._admissions, pieces=pieces, source=source)
            self._admissions += 1
            if self.engine.config.share_prompts:
                self._prompt_holders[tuple(request.prompt_tokens)].append(slot)

    def _prefill_admitted(self) -> None:
        """Prefill the admitted prompts' pieces in admission order, a call of up to
        `max_prefill_rows` pieces at a time: one call if a sequence is decoding, else until every
        admitted prompt is written; then start the requests sharing a started slot's prompt."""
        cfg = self.engine.config
        decoding = any(record is not None and record.started for record in self._slots)
        waiting = sorted(
            ((record.admitted, slot) for slot, record in enumerate(self._slots) if record is not None and record.pieces)
        )
        calls = 0
        while waiting and not (decoding and calls):
            pieces: list[PromptPiece] = []
            requests: list[Request] = []
            while waiting and len(pieces) < cfg.max_prefill_rows:
                record = self._slots[waiting[0][1]]
                assert record is not None  # waiting lists occupied slots
                taken = record.pieces[: cfg.max_prefill_rows - len(pieces)]
                del record.pieces[: len(taken)]
                pieces += taken
                requests += [record.request] * len(taken)
                if not record.pieces:
                    record.started = True
                    waiting.pop(0)
            self._state = self.engine.prefill(
                self._params, self._state, pieces, self._settings(requests, len(requests))
            )
            calls += 1
            self.counters["prefill_calls"] += 1
            self.counters["prefill_tokens"] += sum(min(cfg.prefill_chunk, len(p.prompt) - 1 - p.start) for p in pieces)
            self.counters["prefill_computed_tokens"] += (
                row_bucket(len(pieces), max_rows=cfg.max_prefill_rows) * cfg.prefill_chunk
            )
        forks = [
            (slot, record)
            for slot, record in enumerate(self._slots)
            if record is not None
            and not record.started
            and record.source is not None
            and (source := self._slots[record.source]) is not None
            and source.started
        ]
        for start in range(0, len(forks), cfg.max_prefill_rows):
            self._fork_group(forks[start : start + cfg.max_prefill_rows])

    def _place(self, request: Request, free: list[int]) -> tuple[int, int | None] | None:
        """(free slot, live slot whose prompt pages it shares, or None to prefill) for `request`,
        its pages taken; None if no free slot's group can hold them."""
        length = len(request.prompt_tokens)
        holders = self._prompt_holders.get(tuple(request.prompt_tokens), ())
        group_of = self.engine.pages.group_of
        for source in holders:
            record = self._slots[source]
            if record is not None and record.source is not None and not record.started:
                continue  # a fork whose copy of the last prompt page is not made yet
            for slot in (slot for slot in free if group_of(slot) == group_of(source)):
                if self._kept(slot, self.engine.share_prompt(slot, source, length)):
                    return slot, source
        slot = next((slot for slot in free if self._kept(slot, self.engine.reserve(slot, length))), None)
        return None if slot is None else (slot, None)

    def _kept(self, slot: int, reserved: bool) -> bool:
        """Whether pages just `reserved` for `slot` are kept: only if its group still covers the
        next chunk of the sequences running there."""
        if not reserved:
            return False
        if self.engine.pages.group_of(slot) in self.engine.chunk_shortfall():
            self.engine.release_slots([slot])
            return False
        return True

    def _vacate(self, slot: int) -> None:
        """`slot`'s request is over (finished or preempted): it no longer offers its prompt."""
        record = self._slots[slot]
        self._slots[slot] = None
        if record is None:
            return
        key = tuple(record.request.prompt_tokens)
        holders = self._prompt_holders.get(key)
        if holders is not None and slot in holders:
            holders.remove(slot)
            if not holders:
                del self._prompt_holders[key]

    def _preempt_for_pages(self) -> None:
        """Evict the youngest running sequence of each page group short of pages for the next chunk
        until none is; their requests go back to the front of the queue."""
        while short := self.engine.chunk_shortfall():
            candidates = [
                (record.admitted, slot)
                for slot, record in enumerate(self._slots)
                if record is not None and self.engine.pages.group_of(slot) in short
            ]
            _, slot = max(candidates)
            evicted = self._slots[slot]
            assert evicted is not None  # a candidate
            self._vacate(slot)
            self._state = self.engine.evict(self._state, [slot])
            self._queue.appendleft(evicted.request)
            self.counters["preempted"] += 1

    def _fork_group(self, forks: list[tuple[int, _SlotRecord]]) -> None:
        """Start `forks` ((slot, record)) on their sources' prompt pages (`Engine.fork`), in one
        call padded to a power of two rows."""
        cfg = self.engine.config
        rows = row_bucket(len(forks), max_rows=cfg.max_prefill_rows)
        slots = np.full((rows,), cfg.num_slots, np.int32)  # out of range: padding rows are dropped
        sources = np.zeros((rows,), np.int32)
        lengths = np.ones((rows,), np.int32)
        last_tokens = np.zeros((rows,), np.int32)
        for row, (slot, record) in enumerate(forks):
            prompt = record.request.prompt_tokens
            assert record.source is not None  # a fork
            slots[row], sources[row] = slot, record.source
            lengths[row], last_tokens[row] = len(prompt), prompt[-1]
            self.counters["shared_prompt_pages"] += (len(prompt) - 1) // cfg.page_size
            record.started = True
        settings = self._settings([record.request for _, record in forks], rows)
        self._state = self.engine.fork(self._state, slots, sources, lengths, last_tokens, settings)
        self.counters["forked_requests"] += len(forks)

    def _settings(self, requests: list[Request], rows: int) -> SlotSettings:
        """The per-request settings of `requests`, padded to `rows` rows."""
        cfg = self.engine.config
        stops = np.full((rows, cfg.max_stop_tokens), -1, np.int32)
        max_new = np.ones((rows,), np.int32)
        temperature = np.zeros((rows,), np.float32)
        streams = np.zeros((rows,), np.uint32)
        interrupt = np.zeros((rows,), bool)
        for row, request in enumerate(requests):
            stops[row, : len(request.stop_tokens)] = request.stop_tokens
            max_new[row] = request.max_new_tokens
            temperature[row] = request.temperature
            streams[row] = request.seed
            interrupt[row] = request.interrupt
        return host_settings(
            seeds=np.full((rows,), self.seed, np.uint32),
            streams=streams,
            max_new_tokens=max_new,
            temperature=temperature,
            stop_tokens=stops,
            interrupt=interrupt,
        )

    def _absorb(self, chunk: _Chunk) -> list[Completion]:
        result = jax.tree.map(np.asarray, chunk.result)
        self.counters["decode_steps"] += int(result.steps)
        self.counters["slot_steps"] += int(result.steps) * len(chunk.records)
        interruption = self.engine.config.interruption
        finished: list[Completion] = []
        for slot, record in enumerate(chunk.records):
            if record is None:
                continue
            emitted = result.emitted[slot]
            count = int(emitted.sum())
            record.tokens.extend(result.tokens[slot, emitted].tolist())
            record.logprobs.extend(result.logprobs[slot, emitted].tolist())
            record.sampled.extend(result.sampled[slot, emitted].tolist())
            record.versions.extend([chunk.version] * count)
            if result.experts is not None:
                record.experts.append(result.experts[slot, emitted])
            self.counters["generated_tokens"] += count
            self.counters["forced_tokens"] += count - int(result.sampled[slot].sum())
            if result.active[slot]:
                continue
            stopped = bool(result.stopped[slot])
            think_budget = int(result.think_budget[slot])
            num_answer = int(result.num_answer[slot])
            if stopped:
                reason = "stop"
            elif interruption is not None and think_budget >= 0 and num_answer >= interruption.answer_budget:
                reason = "answer_budget"
            else:
                reason = "length"
            finished.append(
                Completion(
                    request_id=record.request.request_id,
                    prompt_tokens=list(record.request.prompt_tokens),
                    tokens=record.tokens,
                    logprobs=record.logprobs,
                    versions=record.versions,
                    sampled=record.sampled,
                    interrupted=bool(result.interrupted[slot]),
                    truncated=bool(result.truncated[slot]),
                    num_think_tokens=int(result.num_think[slot]),
                    num_answer_tokens=num_answer,
                    finish_reason=reason,
                    think_budget=think_budget,
                    routed_experts=np.concatenate(record.experts) if record.experts else None,
                )
            )
            self._live_ids.discard(record.request.request_id)
            self.counters["completions"] += 1
        return finished
