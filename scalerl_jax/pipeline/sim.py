"""Discrete-event simulator of an RL cluster: generator GPUs, trainer GPUs, and a schedule.

A planning tool: given per-token costs (measured by the sampler and train-step benchmarks, or
derived from hardware numbers) and a long-tailed completion length distribution, it predicts
GPU utilization, idle fractions, throughput and lag of PipelineRL-k and PPO-off-policy-k. The
schedules are the very objects the threaded pipeline uses (`lag.py`), so the simulated
admission and batch selection are the real ones.

Model.
* Each of `num_generators` GPUs runs continuous batching over `slots_per_generator` decode
  slots in chunks of up to `chunk_steps` decode steps (JetStream style: finished slots are
  retired and new requests inserted only at chunk boundaries, where new params are also
  adopted). One decode step with active slots j costs
      decode_step_s + decode_slot_s * #active + decode_kv_token_s * sum_j context_j
  (weights read once per step, per-slot compute, KV cache read). A chunk whose slot j runs
  a_j = min(remaining_j, steps) steps from context c_j costs, summed in closed form,
      steps * decode_step_s + decode_slot_s * sum_j a_j
        + decode_kv_token_s * sum_j (a_j c_j + a_j (a_j - 1) / 2).
  Inserting a request costs `prefill_token_s` per prompt token; adopting new params stalls the
  generator `weight_load_s`.
* Requests wait in one pending list that generators pull from at their chunk boundaries, each
  an even share of what is pending over the generators with free slots (load balancing). A
  prompt (a group of `samples_per_prompt` requests) is admitted when the pending requests do not
  cover all free slots and the schedule allows it; its admission version is the *oldest* params
  version held by any generator (so whichever generator runs it, its first token is no older).
* Completion lengths: log L = log(length_median) + group_sigma z_prompt + sample_sigma z, clipped
  to [min_completion_tokens, max_completion_tokens] (prompts differ in difficulty; samples vary).
* The trainer (all `num_trainers` GPUs, data parallel) takes a batch as soon as the schedule
  selects one; a step costs train_step_overhead_s + train_token_s * tokens / num_trainers
  (tokens = prompt + completion of every sample; `train_token_s` is one GPU's time per token,
  forward + backward). A push then occupies the trainer `weight_push_s`, after which the
  generators see the new version at their next chunk boundary.

* Evaluation (optional, `EvalSpec`): after every `every`-th trainer step s, `prompts x samples`
  evaluation requests (lengths drawn as above, or from their own median / cap) are queued once
  the generators can hold version s (at the push's arrival when step s pushes, else at once).
  Generators take them before any training request at their chunk boundaries (slots are not
  preempted: in-flight training completions finish; with `priority=False`, only in the slots
  that training requests leave free, and admission ignores them). `mode='blocking'` (the leader waits for
  the evaluation): the trainer takes no batch until every evaluation completion is done, so
  that wait is trainer idle time. `mode='async'`: the trainer goes on taking batches as the
  schedule allows; generators busy with evaluation produce fewer training samples, so the
  trainer may still wait for data (honest idle).

Events. A busy generator has one pending event: the end of the chunk in which its first slot
can finish (the full chunks before it are summed in closed form). A push, or a chance to admit
or pull work while it has free slots, brings that event forward to the end of the chunk then
running, so every boundary that matters is simulated exactly and no others are.

Metrics are taken over the window between the end of step `warmup_steps` and the last step.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from collections.abc import Sequence

import numpy as np

from scalerl_jax.pipeline.lag import Schedule, Ticket, default_capacity, make_schedule

EVAL_MODES = ("blocking", "async")


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Cluster shape, batch, length distribution and per-token costs (seconds)."""

    num_generators: int = 64
    num_trainers: int = 16
    slots_per_generator: int = 64
    chunk_steps: int = 32
    prompts_per_step: int = 48
    samples_per_prompt: int = 16
    prompt_tokens: int = 1024
    length_median: float = 4000.0
    group_sigma: float = 0.5
    sample_sigma: float = 0.6
    min_completion_tokens: int = 64
    max_completion_tokens: int = 15360  # 16,384 total - 1,024 prompt
    decode_step_s: float = 6.0e-3
    decode_slot_s: float = 2.0e-5
    decode_kv_token_s: float = 4.9e-8
    prefill_token_s: float = 3.2e-5
    train_token_s: float = 1.0e-4
    train_step_overhead_s: float = 1.0
    weight_push_s: float = 1.0
    weight_load_s: float = 0.5

    def __post_init__(self) -> None:
        for name in (
            "num_generators",
            "num_trainers",
            "slots_per_generator",
            "chunk_steps",
            "prompts_per_step",
            "samples_per_prompt",
            "prompt_tokens",
            "min_completion_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ClusterSpec.{name}={getattr(self, name)} must be >= 1")
        if self.max_completion_tokens < self.min_completion_tokens:
            raise ValueError("ClusterSpec.max_completion_tokens must be >= min_completion_tokens")
        for name in ("length_median", "decode_step_s", "train_token_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ClusterSpec.{name}={getattr(self, name)} must be > 0")
        for name in (
            "group_sigma",
            "sample_sigma",
            "decode_slot_s",
            "decode_kv_token_s",
            "prefill_token_s",
            "train_step_overhead_s",
            "weight_push_s",
            "weight_load_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"ClusterSpec.{name}={getattr(self, name)} must be >= 0")


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Evaluation every `every` trainer steps: `prompts` x `samples` completions on the generators.

    `mode` is one of `EVAL_MODES` (module docstring). Lengths follow the cluster's distribution
    unless `length_median` / `max_completion_tokens` are given (None: the cluster's).
    """

    every: int
    prompts: int
    samples: int
    mode: str = "blocking"
    priority: bool = True  # evaluation requests before training ones (False: in slots training leaves free)
    length_median: float | None = None
    max_completion_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("every", "prompts", "samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"EvalSpec.{name}={getattr(self, name)} must be >= 1")
        if self.mode not in EVAL_MODES:
            raise ValueError(f"EvalSpec.mode={self.mode!r}; expected one of {EVAL_MODES}")
        if self.length_median is not None and not self.length_median > 0:
            raise ValueError(f"EvalSpec.length_median={self.length_median} must be > 0")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise ValueError(f"EvalSpec.max_completion_tokens={self.max_completion_tokens} must be >= 1")


def draw_lengths(
    rng: np.random.Generator, spec: ClusterSpec, samples: int, median: float, max_tokens: int
) -> np.ndarray:
    """Completion lengths of one prompt's `samples` completions (module docstring: lognormal with
    a prompt-level and a sample-level term, clipped to [min_completion_tokens, max_tokens])."""
    z_prompt = rng.standard_normal()
    z_samples = rng.standard_normal(samples)
    lengths = np.exp(math.log(median) + spec.group_sigma * z_prompt + spec.sample_sigma * z_samples)
    low = min(spec.min_completion_tokens, max_tokens)
    return np.clip(np.rint(lengths), low, max_tokens).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Steady-state metrics of one simulated run (fractions in [0, 1])."""

    schedule: str
    k: int
    window_s: float
    steps: int
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float  # trained tokens (prompt + completion) per second
    gpu_utilization: float  # busy GPU-seconds / all GPU-seconds (generators and trainers)
    generator_busy_frac: float
    generator_slot_util: float  # active slot-seconds / all slot-seconds
    trainer_busy_frac: float
    generator_idle_frac: float
    trainer_idle_frac: float
    lag_mean: float
    lag_max: int
    versions_spanned_mean: float  # last-token version - first-token version + 1
    versions_spanned_max: int
    # Evaluation (zero without an EvalSpec), over the window: evaluations finished, their mean
    # duration (queued -> last completion done), and the share of the window the trainer spent
    # waiting for an evaluation (blocking mode; counted in trainer_idle_frac).
    evals: int = 0
    eval_s_mean: float = 0.0
    trainer_eval_wait_frac: float = 0.0


def chunk_cost(spec: ClusterSpec, remaining: np.ndarray, context: np.ndarray) -> tuple[int, np.ndarray, float]:
    """(steps, per-slot steps a_j, seconds) of one chunk over the active slots (module docstring)."""
    steps = int(min(spec.chunk_steps, remaining.max()))
    advance = np.minimum(remaining, steps)
    kv_reads = float(np.sum(advance * context + advance * (advance - 1) / 2))
    seconds = steps * spec.decode_step_s + spec.decode_slot_s * float(advance.sum()) + spec.decode_kv_token_s * kv_reads
    return steps, advance, seconds


def full_chunk_costs(spec: ClusterSpec, num_chunks: int, active: int, context_sum: int) -> np.ndarray:
    """Seconds of `num_chunks` consecutive chunks in which all `active` slots run every step.

    Chunk i starts with context sum K_i = K_0 + A C i, so it costs
    C decode_step_s + decode_slot_s A C + decode_kv_token_s (C K_i + A C (C - 1) / 2).
    """
    c = spec.chunk_steps
    start_context = context_sum + active * c * np.arange(num_chunks, dtype=np.float64)
    return (
        c * spec.decode_step_s
        + spec.decode_slot_s * active * c
        + spec.decode_kv_token_s * (c * start_context + active * c * (c - 1) / 2)
    )


@dataclasses.dataclass
class _Plan:
    """What a busy generator will do until its next event: decoding from `decode_start` through
    full chunks ending at `full_ends` (every active slot running), then one last chunk that
    retires at least one slot, ending at `end`."""

    end: float
    decode_start: float
    full_ends: np.ndarray
    active: int
    advance: np.ndarray  # per slot, steps done if the plan runs to `end`
    slot_s: float  # active slot-seconds credited for the plan


class _Generator:
    """One generator GPU: per-slot remaining tokens, context, request; version; plan."""

    def __init__(self, index: int, slots: int):
        self.index = index
        self.remaining = np.zeros(slots, np.int64)
        self.context = np.zeros(slots, np.int64)
        self.occupied = np.zeros(slots, bool)
        self.group = np.zeros(slots, np.int64)
        self.first_version = np.zeros(slots, np.int64)
        self.is_eval = np.zeros(slots, bool)  # the slot holds an evaluation request (group = its eval id)
        self.version = 0
        self.pending_version = 0
        self.free = slots
        self.token = 0  # id of the generator's live event; older events are stale
        self.scheduled = False
        self.plan: _Plan | None = None


class _Simulation:
    """Event loop state. Use `simulate()`."""

    def __init__(
        self,
        spec: ClusterSpec,
        schedule: Schedule,
        num_steps: int,
        warmup_steps: int,
        seed: int,
        evaluation: EvalSpec | None = None,
    ):
        self.spec = spec
        self.evaluation = evaluation
        self.eval_rng = np.random.default_rng([seed, 1])  # its own stream: training draws stay the same
        self.eval_pending: collections.deque = collections.deque()  # (eval id, length)
        self.evals: dict[int, dict] = {}  # eval id -> {"remaining", "start"}
        self.next_eval_id = 0
        self.trainer_waits_for_eval: int | None = None  # blocking mode: the eval id the trainer waits on
        self.schedule = schedule
        self.capacity = default_capacity(schedule)
        self.num_steps = num_steps
        self.warmup_steps = warmup_steps
        self.rng = np.random.default_rng(seed)
        self.events: list = []
        self.sequence = 0
        self.generators = [_Generator(g, spec.slots_per_generator) for g in range(spec.num_generators)]
        self.pending: collections.deque = collections.deque()
        self.free_slots = spec.num_generators * spec.slots_per_generator
        self.generators_with_free = spec.num_generators
        self.tickets: dict[int, Ticket] = {}
        self.groups: dict[int, dict] = {}
        self.next_group_id = 0
        self.next_batch_version = 0
        self.trainer_version = 0
        self.trainer_free = True
        # Seconds (floats) and counts (whole numbers) by name; 0 until first added to.
        self.counters: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.window_start: tuple[float, dict[str, float]] | None = None
        self.window_lags: list[int] = []
        self.window_spans: list[int] = []
        self.done_time: float | None = None

    # ---------------------------------------------------------------- event loop
    def push_event(self, time: float, kind: str, payload=None) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (time, self.sequence, kind, payload))

    def schedule_generator(self, gen: _Generator, time: float) -> None:
        gen.token += 1
        gen.scheduled = True
        self.push_event(time, "gen", (gen.index, gen.token))

    def run(self) -> None:
        for gen in self.generators:
            self.schedule_generator(gen, 0.0)
        while self.events and self.done_time is None:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "gen":
                index, token = payload
                gen = self.generators[index]
                if token == gen.token:
                    self.generator_boundary(gen, now)
            elif kind == "train_done":
                self.train_done(now)
            elif kind == "push_arrival":
                version, evaluate = payload
                for gen in self.generators:
                    gen.pending_version = max(gen.pending_version, version)
                    self.act_at_next_chunk(gen, now)
                self.after_step(now, evaluate)
        if self.done_time is None:
            raise RuntimeError("simulation stalled: no events left before the last step")

    def act_at_next_chunk(self, gen: _Generator, now: float) -> None:
        """Bring the generator's next boundary forward to its next chunk end (idle: now)."""
        if not gen.scheduled:
            self.schedule_generator(gen, now)
            return
        plan = gen.plan
        if plan is None:
            return
        j = int(np.searchsorted(plan.full_ends, now, side="left"))
        if j >= len(plan.full_ends):
            return  # already in the last chunk: its end is the next boundary
        new_end = float(plan.full_ends[j])
        steps = (j + 1) * self.spec.chunk_steps
        slot_s = plan.active * (new_end - plan.decode_start)
        self.counters["generator_busy_s"] -= plan.end - new_end
        self.counters["generator_slot_s"] -= plan.slot_s - slot_s
        plan.advance = np.where(gen.occupied, steps, 0)
        plan.end, plan.full_ends, plan.slot_s = new_end, plan.full_ends[: j + 1], slot_s
        self.schedule_generator(gen, new_end)

    def nudge_generators(self, now: float) -> None:
        """After admission may have opened or requests are waiting: generators with free slots
        act at their next chunk boundary."""
        work = bool(self.pending) or bool(self.eval_pending) or self.admission_allowed()
        if not work:
            return
        for gen in self.generators:
            if gen.free > 0:
                self.act_at_next_chunk(gen, now)

    # ---------------------------------------------------------------- generators
    def min_generator_version(self) -> int:
        return min(gen.version for gen in self.generators)

    def admission_allowed(self) -> bool:
        if len(self.tickets) + 1 > self.capacity:
            return False
        return self.schedule.admission_allowed(
            num_unconsumed=len(self.tickets),
            generator_version=self.min_generator_version(),
            next_batch_version=self.next_batch_version,
        )

    def admit_group(self) -> None:
        spec = self.spec
        group_id = self.next_group_id
        self.next_group_id += 1
        self.tickets[group_id] = Ticket(group_id, self.min_generator_version(), finished=False)
        lengths = draw_lengths(self.rng, spec, spec.samples_per_prompt, spec.length_median, spec.max_completion_tokens)
        self.groups[group_id] = {"remaining": spec.samples_per_prompt, "lengths": lengths, "first": [], "last": []}
        for length in lengths:
            self.pending.append((group_id, int(length)))

    def set_free(self, gen: _Generator, free: int) -> None:
        """Keep the totals of free slots and of generators with a free slot up to date."""
        self.free_slots += free - gen.free
        self.generators_with_free += int(free > 0) - int(gen.free > 0)
        gen.free = free

    def generator_boundary(self, gen: _Generator, now: float) -> None:
        spec = self.spec
        gen.scheduled = False
        if gen.plan is not None:  # the planned decoding just ended
            gen.remaining -= gen.plan.advance
            gen.context += gen.plan.advance
            gen.plan = None
            for slot in np.flatnonzero(gen.occupied & (gen.remaining == 0)):
                self.finish_request(gen, int(slot), now)
        stall = 0.0
        if gen.pending_version > gen.version:
            gen.version = gen.pending_version
            stall = spec.weight_load_s
        admitted = False
        eval_first = self.evaluation is None or self.evaluation.priority
        queued = len(self.pending) + (len(self.eval_pending) if eval_first else 0)
        while queued < self.free_slots and self.admission_allowed():
            self.admit_group()
            queued += self.spec.samples_per_prompt
            admitted = True
        # Balanced pull: an even share of the pending requests over generators with free slots,
        # evaluation requests first when they have priority, else training requests first.
        with_free = max(self.generators_with_free, 1)
        free = np.flatnonzero(~gen.occupied)
        first, second = (self.eval_pending, self.pending) if eval_first else (self.pending, self.eval_pending)
        first_slots = free[: min(len(free), -(-len(first) // with_free))]
        rest = free[len(first_slots) :]
        second_slots = rest[: min(len(rest), -(-len(second) // with_free))]
        eval_slots, train_slots = (first_slots, second_slots) if eval_first else (second_slots, first_slots)
        for slots, queue, is_eval in ((eval_slots, self.eval_pending, True), (train_slots, self.pending, False)):
            for slot in slots:
                group_id, length = queue.popleft()
                gen.occupied[slot] = True
                gen.is_eval[slot] = is_eval
                gen.group[slot] = group_id
                gen.first_version[slot] = gen.version
                gen.remaining[slot] = length
                gen.context[slot] = spec.prompt_tokens
        pulled = len(eval_slots) + len(train_slots)
        self.set_free(gen, len(free) - pulled)
        decode_start = now + stall + spec.prefill_token_s * spec.prompt_tokens * pulled
        if gen.occupied.any():
            self.plan_decoding(gen, now, decode_start)
        elif decode_start > now:  # stalled (adopting params) with nothing to decode
            self.counters["generator_busy_s"] += decode_start - now
            self.schedule_generator(gen, decode_start)
        if admitted and self.pending:
            self.nudge_generators(now)

    def plan_decoding(self, gen: _Generator, now: float, decode_start: float) -> None:
        """Plan full chunks until the first slot can finish, then that chunk; schedule its end."""
        spec = self.spec
        active = gen.occupied
        count = int(active.sum())
        first_finish = int(gen.remaining[active].min())
        num_full = (first_finish - 1) // spec.chunk_steps
        costs = full_chunk_costs(spec, num_full, count, int(gen.context[active].sum()))
        full_ends = decode_start + np.cumsum(costs)
        done = num_full * spec.chunk_steps
        _, last_advance, last_s = chunk_cost(spec, gen.remaining[active] - done, gen.context[active] + done)
        advance = np.zeros_like(gen.remaining)
        advance[active] = done + last_advance
        full_s = float(costs.sum())
        slot_s = count * full_s + float(last_advance.sum()) * last_s / max(int(last_advance.max()), 1)
        end = decode_start + full_s + last_s
        gen.plan = _Plan(
            end=end, decode_start=decode_start, full_ends=full_ends, active=count, advance=advance, slot_s=slot_s
        )
        self.counters["generator_busy_s"] += end - now
        self.counters["generator_slot_s"] += slot_s
        self.schedule_generator(gen, end)

    def finish_request(self, gen: _Generator, slot: int, now: float) -> None:
        group_id = int(gen.group[slot])
        gen.occupied[slot] = False
        self.set_free(gen, gen.free + 1)
        if gen.is_eval[slot]:
            gen.is_eval[slot] = False
            self.finish_eval_request(group_id, now)
            return
        group = self.groups[group_id]
        group["first"].append(int(gen.first_version[slot]))
        group["last"].append(gen.version)
        group["remaining"] -= 1
        if group["remaining"] == 0:
            self.tickets[group_id] = dataclasses.replace(self.tickets[group_id], finished=True)
            self.try_train(now)

    # ---------------------------------------------------------------- evaluation
    def issue_eval(self, now: float) -> int:
        """Queue one evaluation's requests (priority at the generators); returns its id."""
        ev = self.evaluation
        assert ev is not None
        spec = self.spec
        eval_id = self.next_eval_id
        self.next_eval_id += 1
        median = spec.length_median if ev.length_median is None else ev.length_median
        cap = spec.max_completion_tokens if ev.max_completion_tokens is None else ev.max_completion_tokens
        for _ in range(ev.prompts):
            for length in draw_lengths(self.eval_rng, spec, ev.samples, median, cap):
                self.eval_pending.append((eval_id, int(length)))
        self.evals[eval_id] = {"remaining": ev.prompts * ev.samples, "start": now}
        for gen in self.generators:
            if gen.free > 0:
                self.act_at_next_chunk(gen, now)
        return eval_id

    def finish_eval_request(self, eval_id: int, now: float) -> None:
        record = self.evals[eval_id]
        record["remaining"] -= 1
        if record["remaining"]:
            return
        del self.evals[eval_id]
        self.counters["evals"] += 1
        self.counters["eval_s"] += now - record["start"]
        if self.trainer_waits_for_eval == eval_id:
            self.counters["trainer_eval_wait_s"] += now - record["start"]
            self.trainer_waits_for_eval = None
            self.trainer_free = True
            self.try_train(now)

    def after_step(self, now: float, evaluate: bool) -> None:
        """The trainer's step (and its push, if any) is done: evaluate if due, then go on unless
        a blocking evaluation holds the trainer."""
        if evaluate:
            eval_id = self.issue_eval(now)
            assert self.evaluation is not None
            if self.evaluation.mode == "blocking":
                self.trainer_waits_for_eval = eval_id
                return
        self.trainer_free = True
        self.try_train(now)

    # ---------------------------------------------------------------- trainer
    def try_train(self, now: float) -> None:
        if not self.trainer_free:
            return
        chosen = self.schedule.select_batch(list(self.tickets.values()), self.next_batch_version)
        if chosen is None:
            return
        spec = self.spec
        version = self.next_batch_version
        in_window = self.window_start is not None
        tokens = 0
        for group_id in chosen:
            del self.tickets[group_id]
            group = self.groups.pop(group_id)
            tokens += int(group["lengths"].sum()) + spec.prompt_tokens * spec.samples_per_prompt
            for first, last in zip(group["first"], group["last"]):
                lag = version - first
                if lag > self.schedule.max_lag:
                    raise RuntimeError(f"simulated lag {lag} > k={self.schedule.max_lag}")
                if in_window:
                    self.window_lags.append(lag)
                    self.window_spans.append(last - first + 1)
        self.next_batch_version += 1
        self.trainer_free = False
        train_s = spec.train_step_overhead_s + spec.train_token_s * tokens / spec.num_trainers
        self.counters["trainer_busy_s"] += train_s
        if in_window:
            self.counters["samples"] += len(chosen) * spec.samples_per_prompt
            self.counters["tokens"] += tokens
        self.push_event(now + train_s, "train_done")
        self.nudge_generators(now)  # admission may have opened up

    def train_done(self, now: float) -> None:
        self.trainer_version += 1
        if self.trainer_version == self.warmup_steps:
            self.window_start = (now, dict(self.counters))
        if self.trainer_version == self.num_steps:
            self.done_time = now
            return
        ev = self.evaluation
        evaluate = ev is not None and self.trainer_version % ev.every == 0
        if self.schedule.should_push(self.trainer_version):
            self.counters["trainer_busy_s"] += self.spec.weight_push_s
            self.push_event(now + self.spec.weight_push_s, "push_arrival", (self.trainer_version, evaluate))
        else:  # nothing to push: an evaluation runs on the params the generators hold
            self.after_step(now, evaluate)

    # ---------------------------------------------------------------- result
    def result(self, kind: str) -> SimResult:
        spec = self.spec
        assert self.window_start is not None and self.done_time is not None, "result() after run()"
        start_time, start = self.window_start
        window = self.done_time - start_time
        delta = {key: self.counters[key] - start.get(key, 0.0) for key in self.counters}
        steps = self.num_steps - self.warmup_steps
        gen_busy = min(delta.get("generator_busy_s", 0.0) / (spec.num_generators * window), 1.0)
        slot_util = min(
            delta.get("generator_slot_s", 0.0) / (spec.num_generators * spec.slots_per_generator * window), 1.0
        )
        trainer_busy = min(delta.get("trainer_busy_s", 0.0) / window, 1.0)
        gpus = spec.num_generators + spec.num_trainers
        return SimResult(
            schedule=kind,
            k=self.schedule.max_lag,
            window_s=window,
            steps=steps,
            step_time_s=window / steps,
            samples_per_s=delta.get("samples", 0) / window,
            tokens_per_s=delta.get("tokens", 0) / window,
            gpu_utilization=(spec.num_generators * gen_busy + spec.num_trainers * trainer_busy) / gpus,
            generator_busy_frac=gen_busy,
            generator_slot_util=slot_util,
            trainer_busy_frac=trainer_busy,
            generator_idle_frac=1.0 - gen_busy,
            trainer_idle_frac=1.0 - trainer_busy,
            lag_mean=float(np.mean(self.window_lags)) if self.window_lags else 0.0,
            lag_max=int(max(self.window_lags, default=0)),
            versions_spanned_mean=float(np.mean(self.window_spans)) if self.window_spans else 0.0,
            versions_spanned_max=int(max(self.window_spans, default=0)),
            evals=int(delta.get("evals", 0)),
            eval_s_mean=delta.get("eval_s", 0.0) / max(delta.get("evals", 0), 1),
            trainer_eval_wait_frac=delta.get("trainer_eval_wait_s", 0.0) / window,
        )


def simulate(
    spec: ClusterSpec,
    *,
    schedule: str,
    k: int,
    num_steps: int = 40,
    warmup_steps: int | None = None,
    seed: int = 0,
    evaluation: EvalSpec | None = None,
) -> SimResult:
    """Simulate `num_steps` trainer steps of `schedule` ('pipeline' | 'ppo_off_policy') with k,
    evaluating as `evaluation` says (None: never).

    `warmup_steps` (default: k + 2) are excluded from the metrics window. An evaluation due at
    the last step is not run (the window ends there): for a window holding whole evaluation
    periods, take num_steps = warmup_steps + n x every.
    """
    if warmup_steps is None:
        warmup_steps = k + 2
    if not 1 <= warmup_steps < num_steps:
        raise ValueError(f"simulate: need 1 <= warmup_steps={warmup_steps} < num_steps={num_steps}")
    schedule_obj = make_schedule(schedule, k=k, groups_per_step=spec.prompts_per_step)
    sim = _Simulation(spec, schedule_obj, num_steps, warmup_steps, seed, evaluation)
    sim.run()
    return sim.result(schedule)


@dataclasses.dataclass(frozen=True)
class SplitChoice:
    """`pick_split`'s answer: the chosen generator count, every candidate's simulated result, and
    the reasoning as lines a person reads."""

    num_generators: int
    num_trainers: int
    candidates: tuple[tuple[int, SimResult], ...]
    reasoning: str


def pick_split(
    spec: ClusterSpec,
    total_devices: int,
    generator_counts: Sequence[int],
    *,
    schedule: str,
    k: int,
    num_steps: int = 40,
    seed: int = 0,
    evaluation: EvalSpec | None = None,
    tie_tolerance: float = 0.005,
) -> SplitChoice:
    """Simulates `spec` with each of `generator_counts` generators (the rest of `total_devices`
    training) and picks the split of highest simulated samples/s (every split costs the same
    device-hours, so throughput is the cost that counts); splits within `tie_tolerance` of the
    best go to the one with the smaller max(generator idle, trainer idle)."""
    counts = sorted(set(int(g) for g in generator_counts))
    if not counts or not all(1 <= g < total_devices for g in counts):
        raise ValueError(f"pick_split: generator counts {counts} must lie in [1, {total_devices - 1}]")
    rows = []
    for g in counts:
        trial = dataclasses.replace(spec, num_generators=g, num_trainers=total_devices - g)
        rows.append((g, simulate(trial, schedule=schedule, k=k, num_steps=num_steps, seed=seed, evaluation=evaluation)))
    best_rate = max(r.samples_per_s for _, r in rows)
    close = [(g, r) for g, r in rows if r.samples_per_s >= (1 - tie_tolerance) * best_rate]
    g, chosen = min(close, key=lambda row: (max(row[1].generator_idle_frac, row[1].trainer_idle_frac), -row[0]))
    lines = [
        f"simulated {schedule}-{k} over {total_devices} devices, {num_steps} steps each"
        + (f", eval every {evaluation.every} ({evaluation.mode})" if evaluation else ""),
        *(
            f"  {gg} generators / {total_devices - gg} trainers: {r.samples_per_s:.2f} samples/s, "
            f"step {r.step_time_s:.1f} s, generator idle {r.generator_idle_frac:.2f}, "
            f"trainer idle {r.trainer_idle_frac:.2f}"
            for gg, r in rows
        ),
        f"picked {g} / {total_devices - g}: highest samples/s"
        + (
            f" (ties within {tie_tolerance:.1%} broken by the smaller max idle, "
            f"{max(chosen.generator_idle_frac, chosen.trainer_idle_frac):.2f})"
            if len(close) > 1
            else ""
        ),
    ]
    return SplitChoice(g, total_devices - g, tuple(rows), "\n".join(lines))
