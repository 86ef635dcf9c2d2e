"""JetStream-style decode engine: `prefill`, `insert` and `generate` over a fixed pool of slots.

Layout. The decode state holds one preallocated KV cache `[layers, slots, max_len, kv_heads,
head_dim]` (the model's `init_kv_cache`) and, per slot, the token to feed next, its position, a
PRNG key, budgets, stop tokens and the length-control state machine. Every call is jitted; the
decode state is donated, so the cache is updated in place.

- `prefill(params, tokens[N, Tb], true_length[N]) -> Prefix`: runs the prompts (right padded to
  a power-of-two bucket `Tb`) through `forward_cached` into a fresh `[layers, N, Tb, ...]` cache.
  No logits are computed: the last prompt token is fed again by the first decode step, which
  rewrites its own K/V entry and samples the first completion token, so all sampling and
  length-control logic lives in one place (the decode step).
- `insert(prefix, state, slots[N], settings) -> state`: copies the prefix caches into the slots'
  rows `[:, slot, :Tb]` and resets the slots' per-slot fields. Rows whose slot index is
  `num_slots` (padding of the request batch to a power of two) are dropped.
- `generate(params, state) -> (state, ChunkResult)`: up to `chunk_size` decode steps in one
  `lax.while_loop` (it stops early once every slot is idle). Each step feeds every slot's last
  token at its position, writes its K/V into the cache in place (one row per slot per layer),
  takes the fp32 logits of the head, and emits one token per active slot: a sampled one (see
  `sampling.py`) or, while the slot is being interrupted, the next token of the forced phrase
  (logprob 0, sampled False).

Live window. Decode attention reads only cache positions < W, where W is fixed per chunk (one
compile per W): the smallest power-of-two multiple of `min_decode_window` (capped at `max_len`)
that covers every position the chunk can feed. The engine knows this without asking the device:
it keeps, on the host, an upper bound of each slot's next position + 1 (the prompt length at
insert, plus `chunk_size` per chunk since), so a step costs O(live tokens), not O(max_len). The
bound assumes one engine drives one decode state (the latest from `init_decode_state`); if it is
ever wrong, the chunk stops before any slot would feed a position >= W (checked on the device,
inside the loop's condition), so results stay exact and later chunks, with larger bounds, go on.

Length control (forced interruption) runs inside the jitted chunk as a per-slot state machine:
phase THINK counts sampled thinking tokens; if the last `len(end_think_ids)` sampled tokens equal
`end_think_ids` the thinking closed naturally and the phase becomes ANSWER; if instead the count
reaches the slot's think budget (drawn at insert from the request's key, uniform in [lo, hi]) the
phase becomes FORCING, which emits the phrase tokens one per step (teacher forced; their K/V are
written like any token's) and then becomes ANSWER. ANSWER counts sampled tokens up to the answer
budget. A stop token (only a sampled one) ends the sequence in any phase, so a stop before the
think budget means no phrase. Inside the chunk is chosen over host-side forcing so that an
interruption costs no extra host round trip or recompile.

Inactive slots still run through the step (static shapes) but change nothing; their cache row is
dead until the next insert overwrites positions [0, Tb) and decoding overwrites each later
position before it can be attended to (the model attends to key index <= query position only).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scalerl_jax.models.sharding import DEFAULT_RULES, Rules, use_mesh_rules
from scalerl_jax.models.transformer import init_kv_cache
from scalerl_jax.sampler.sampling import sample_tokens

PHASE_THINK = 0
PHASE_FORCING = 1
PHASE_ANSWER = 2

PAD_TOKEN = -1  # Entry of ChunkResult.tokens where a slot emitted nothing at that step.
CPU_DECODE_BLOCK = 256  # EngineConfig.decode_block=0 on CPU


@dataclasses.dataclass(frozen=True)
class InterruptionConfig:
    """Forced interruption of thinking (ScaleRL's length control).

    `phrase_ids`: tokens teacher-forced when the think budget is reached (typically the tokens
    of "Okay, time is up. ... </think>"). `end_think_ids`: the token sequence that closes thinking
    naturally (the tokens of "</think>"). The think budget of each request is drawn uniformly in
    [`think_budget_min`, `think_budget_max`]; after thinking closes at most `answer_budget`
    tokens are sampled.
    """

    phrase_ids: tuple[int, ...]
    end_think_ids: tuple[int, ...]
    think_budget_min: int
    think_budget_max: int
    answer_budget: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "phrase_ids", tuple(int(t) for t in self.phrase_ids))
        object.__setattr__(self, "end_think_ids", tuple(int(t) for t in self.end_think_ids))
        if not self.phrase_ids:
            raise ValueError("InterruptionConfig.phrase_ids is empty")
        if not self.end_think_ids:
            raise ValueError("InterruptionConfig.end_think_ids is empty")
        if not 1 <= self.think_budget_min <= self.think_budget_max:
            raise ValueError(
                f"InterruptionConfig think budget range [{self.think_budget_min}, "
                f"{self.think_budget_max}] must satisfy 1 <= min <= max")
        if self.answer_budget < 1:
            raise ValueError(f"InterruptionConfig.answer_budget={self.answer_budget} must be >= 1")


def interruption_from_tokenizer(
    tokenizer: Any,
    *,
    phrase: str,
    end_think: str,
    think_budget_min: int,
    think_budget_max: int,
    answer_budget: int,
) -> InterruptionConfig:
    """Build an `InterruptionConfig` by encoding `phrase` and `end_think` with a `tokenizers.Tokenizer`."""
    phrase_ids = tokenizer.encode(phrase, add_special_tokens=False).ids
    end_think_ids = tokenizer.encode(end_think, add_special_tokens=False).ids
    return InterruptionConfig(tuple(phrase_ids), tuple(end_think_ids), think_budget_min,
                              think_budget_max, answer_budget)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static shape and sampling knobs of an `Engine` (changing any of them recompiles).

    `max_len`: KV cache length per slot = the longest prompt + completion. `chunk_size`: decode
    steps per jitted `generate` call. `top_k` (0 = off) and `top_p` (1.0 = off) apply to every
    sampled slot; temperature is per slot. `max_stop_tokens`: capacity of the per-slot stop set.
    `min_prefill_bucket`: smallest prefill length bucket (buckets double up to `max_len`).
    `max_prefill_rows`: most requests prefilled by one call (row counts are powers of two up to
    it, so prefill compiles <= (log2(max_prefill_rows) + 1) x number of length buckets).
    `interruption`: None disables forced interruption for every request.
    `decode_block`: keys a decode step reads per piece of a cache layer (bounds its scratch memory
    to one piece); 0 picks by backend: `CPU_DECODE_BLOCK` on CPU (where XLA would otherwise copy the
    whole window out of the cache), the whole window elsewhere (on GPU XLA fuses the cache slice
    into the attention reductions; unmeasured here).
    `min_decode_window`: smallest decode attention window (see `Engine.generate`; windows double
    up to `max_len`, one `generate` compile each).
    """

    num_slots: int
    max_len: int
    chunk_size: int = 16
    top_k: int = 0
    top_p: float = 1.0
    max_stop_tokens: int = 4
    min_prefill_bucket: int = 16
    max_prefill_rows: int = 8
    interruption: InterruptionConfig | None = None
    decode_block: int = 0
    min_decode_window: int = 256

    def __post_init__(self) -> None:
        if self.decode_block < 0:
            raise ValueError(f"EngineConfig.decode_block={self.decode_block} must be >= 0 (0 = by backend)")
        for name in ("num_slots", "max_len", "chunk_size", "max_stop_tokens", "min_prefill_bucket",
                     "max_prefill_rows", "min_decode_window"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)} must be >= 1")
        if self.max_len < 2:
            raise ValueError(f"EngineConfig.max_len={self.max_len} must be >= 2")
        if self.top_k < 0:
            raise ValueError(f"EngineConfig.top_k={self.top_k} must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"EngineConfig.top_p={self.top_p} must be in (0, 1]")


class DecodeState(NamedTuple):
    """Per-slot decode state (leading axis = slot). Donated to every engine call."""

    cache: Any  # the model's KV cache pytree, [layers, slots, max_len, ...] leaves
    tokens: jax.Array  # int32[S] token to feed at the next step (last prompt or generated token)
    positions: jax.Array  # int32[S] position of `tokens` in its sequence
    keys: jax.Array  # PRNG key[S]; step n samples with fold_in(key, n)
    num_generated: jax.Array  # int32[S] tokens emitted so far (forced ones included)
    max_new_tokens: jax.Array  # int32[S]
    temperature: jax.Array  # float32[S]; 0 = greedy
    stop_tokens: jax.Array  # int32[S, K], -1 padded
    active: jax.Array  # bool[S] slot holds an unfinished request
    phase: jax.Array  # int32[S] PHASE_THINK / PHASE_FORCING / PHASE_ANSWER
    forced_index: jax.Array  # int32[S] next phrase token to force
    recent: jax.Array  # int32[S, E] last E sampled thinking tokens
    think_budget: jax.Array  # int32[S] (drawn at insert; -1 when interruption is off)
    answer_budget: jax.Array  # int32[S]
    num_think: jax.Array  # int32[S] sampled tokens while thinking (a natural end-think included)
    num_answer: jax.Array  # int32[S] sampled tokens after thinking closed
    interrupted: jax.Array  # bool[S]
    truncated: jax.Array  # bool[S] ended by a budget or the cache length, not a stop token
    stopped: jax.Array  # bool[S] ended by a stop token


class Prefix(NamedTuple):
    """Output of `prefill`: K/V of the padded prompts and where each prompt ends."""

    cache: Any  # [layers, N, Tb, ...] leaves
    last_token: jax.Array  # int32[N] last prompt token (fed again by the first decode step)
    true_length: jax.Array  # int32[N]


class SlotSettings(NamedTuple):
    """Per-request settings written by `insert` (leading axis = the N inserted requests)."""

    seed: jax.Array  # uint32[N] engine-level seed
    stream: jax.Array  # uint32[N] request seed; key = fold_in(key(seed), stream)
    max_new_tokens: jax.Array  # int32[N]
    temperature: jax.Array  # float32[N]
    stop_tokens: jax.Array  # int32[N, K], -1 padded
    interrupt: jax.Array  # bool[N] apply forced interruption to this request


class ChunkResult(NamedTuple):
    """What one `generate` call emitted ([S, C] per step) and each slot's state after it ([S])."""

    tokens: jax.Array  # int32[S, C], PAD_TOKEN where nothing was emitted
    logprobs: jax.Array  # float32[S, C], 0 for forced tokens and padding
    sampled: jax.Array  # bool[S, C] emitted and sampled (False for forced phrase tokens)
    emitted: jax.Array  # bool[S, C]
    active: jax.Array  # bool[S] still running after the chunk
    interrupted: jax.Array
    truncated: jax.Array
    stopped: jax.Array
    num_think: jax.Array
    num_answer: jax.Array
    think_budget: jax.Array
    steps: jax.Array  # int32[] decode steps actually run


def prefill_bucket(length: int, *, min_bucket: int, max_len: int) -> int:
    """Smallest power-of-two multiple of `min_bucket` that is >= `length`, capped at `max_len`."""
    bucket = min_bucket
    while bucket < length:
        bucket *= 2
    return min(bucket, max_len)


def row_bucket(count: int, *, max_rows: int) -> int:
    """Smallest power of two >= `count`, capped at `max_rows` (callers split larger groups)."""
    bucket = 1
    while bucket < count:
        bucket *= 2
    return min(bucket, max_rows)


class Engine:
    """Prefill / insert / generate over `config.num_slots` decode slots (see module docstring).

    `graphdef` is the model's NNX graph definition (`nnx.split(model)[0]`); params are passed to
    every call so that they can be swapped between chunks. `prefill_insert` is `prefill`
    followed by `insert` in one jitted call (what the batcher uses: one dispatch, half the
    compiles). `compile_counts` counts the distinct input shapes each jitted entry point has been
    called with (one compile each).

    With a `mesh` (the generator's devices) the KV cache is created sharded by `rules` (slots
    over the batch axes, KV heads over tensor), the other per-slot fields replicated, and every
    call is traced under `use_mesh_rules(mesh, rules)` so activations are constrained too; params
    must already be on that mesh. Without one everything lives on the default device.
    """

    def __init__(self, graphdef: Any, model_config: Any, config: EngineConfig, *,
                 mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES):
        self.graphdef = graphdef
        self.model_config = model_config
        self.config = config
        self.mesh = mesh
        self.rules = tuple(rules)
        if config.max_len > model_config.max_position_embeddings:
            logging.warning("EngineConfig.max_len=%d exceeds the model's max_position_embeddings=%d",
                            config.max_len, model_config.max_position_embeddings)
        self.compile_counts: dict[str, int] = {"prefill": 0, "insert": 0, "prefill_insert": 0,
                                               "generate": 0}
        self._signatures: set[tuple] = set()
        self._prefill_jit = jax.jit(self._prefill)
        self._insert_jit = jax.jit(self._insert, donate_argnums=(1,))
        self._prefill_insert_jit = jax.jit(self._prefill_insert, donate_argnums=(1,))
        self._generate_jit = jax.jit(self._generate, donate_argnums=(1,), static_argnums=(2,))
        self._live_bound = np.zeros((config.num_slots,), np.int64)

    # ----------------------------------------------------------------------------- public API
    def init_decode_state(self) -> DecodeState:
        """All slots idle, zero cache. Every field is its own buffer (the state is donated)."""
        cfg = self.config
        slots = cfg.num_slots
        end_len = len(cfg.interruption.end_think_ids) if cfg.interruption else 0

        def ints(value: int, *shape: int) -> jax.Array:
            return jnp.full((slots, *shape), value, jnp.int32)

        def flags() -> jax.Array:
            return jnp.zeros((slots,), bool)

        state = DecodeState(
            cache=None, tokens=ints(0), positions=ints(0),
            keys=jax.random.split(jax.random.key(0), slots),
            num_generated=ints(0), max_new_tokens=ints(0),
            temperature=jnp.zeros((slots,), jnp.float32),
            stop_tokens=ints(-1, cfg.max_stop_tokens), active=flags(),
            phase=ints(PHASE_ANSWER), forced_index=ints(0), recent=ints(-1, end_len),
            think_budget=ints(-1), answer_budget=ints(0), num_think=ints(0), num_answer=ints(0),
            interrupted=flags(), truncated=flags(), stopped=flags(),
        )
        if self.mesh is not None:
            state = jax.device_put(state, NamedSharding(self.mesh, PartitionSpec()))
        self._live_bound[:] = 0
        return state._replace(cache=init_kv_cache(self.model_config, slots, cfg.max_len,
                                                  mesh=self.mesh, rules=self.rules))

    def prefill(self, params: Any, tokens: Any, true_length: Any) -> Prefix:
        """K/V of right-padded host prompts `tokens` int32[N, Tb] (or [Tb]), lengths `true_length`."""
        tokens = np.asarray(tokens, np.int32)
        true_length = np.asarray(true_length, np.int32)
        if tokens.ndim == 1:
            tokens, true_length = tokens[None], true_length.reshape(1)
        self._count("prefill", tokens.shape)
        with self._mesh_context():
            return self._prefill_jit(params, tokens, true_length)

    def insert(self, prefix: Prefix, state: DecodeState, slots: Any,
               settings: SlotSettings) -> DecodeState:
        """Place the prefix rows into `slots` (int32[N]; `num_slots` = drop that row); donates `state`."""
        slots = np.asarray(slots, np.int32).reshape(-1)
        bucket = jax.tree.leaves(prefix.cache)[0].shape[2]
        self._count("insert", jax.tree.leaves(prefix.cache)[0].shape)
        self._note_inserted(slots, np.full(slots.shape, bucket))
        with self._mesh_context():
            return self._insert_jit(prefix, state, slots, settings)

    def prefill_insert(self, params: Any, state: DecodeState, tokens: Any, true_length: Any,
                       slots: Any, settings: SlotSettings) -> DecodeState:
        """`insert(prefill(params, tokens, true_length), state, slots, settings)` in one call."""
        tokens = np.asarray(tokens, np.int32)
        true_length, slots = np.asarray(true_length, np.int32), np.asarray(slots, np.int32)
        self._count("prefill_insert", tokens.shape)
        self._note_inserted(slots, true_length)
        with self._mesh_context():
            return self._prefill_insert_jit(params, state, tokens, true_length, slots, settings)

    def generate(self, params: Any, state: DecodeState) -> tuple[DecodeState, ChunkResult]:
        """Run up to `chunk_size` decode steps over all slots, attending over the live window; donates `state`."""
        window = self.decode_window()
        self._count("generate", (window,))
        self._live_bound = np.minimum(self._live_bound + self.config.chunk_size, self.config.max_len)
        with self._mesh_context():
            return self._generate_jit(params, state, window)

    def release_slots(self, slots: Any) -> None:
        """Slots whose request finished (inactive on the device) no longer widen the window; an
        insert sets their bound again."""
        self._live_bound[np.asarray(slots, np.int64)] = 0

    def decode_window(self) -> int:
        """W of the next chunk: covers positions up to max(live bound) + chunk_size - 2 (module doc)."""
        cfg = self.config
        needed = int(self._live_bound.max()) + cfg.chunk_size - 1
        return prefill_bucket(needed, min_bucket=cfg.min_decode_window, max_len=cfg.max_len)

    # ------------------------------------------------------------------------------ internals
    def _mesh_context(self) -> contextlib.AbstractContextManager:
        if self.mesh is None:
            return contextlib.nullcontext()
        return use_mesh_rules(self.mesh, self.rules)

    def _note_inserted(self, slots: np.ndarray, lengths: np.ndarray) -> None:
        """Host bound of the inserted slots: next position + 1 <= prompt length (padding rows dropped)."""
        kept = slots < self.config.num_slots
        self._live_bound[slots[kept]] = lengths[kept]

    def _count(self, name: str, shape: tuple) -> None:
        signature = (name, tuple(shape))
        if signature not in self._signatures:
            self._signatures.add(signature)
            self.compile_counts[name] += 1
            logging.info("sampler engine: compiling %s for shape %s (%d %s compiles)", name, shape,
                         self.compile_counts[name], name)

    def _decode_block(self) -> int | None:
        """Keys per decode attention piece (`EngineConfig.decode_block`; None = the whole window)."""
        if self.config.decode_block:
            return self.config.decode_block
        platform = (self.mesh.devices.flat[0].platform if self.mesh is not None
                    else jax.default_backend())
        return CPU_DECODE_BLOCK if platform == "cpu" else None

    def _prefill(self, params: Any, tokens: jax.Array, true_length: jax.Array) -> Prefix:
        model = nnx.merge(self.graphdef, params)
        batch, length = tokens.shape
        cache = init_kv_cache(self.model_config, batch, length)
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        _, cache = model.forward_cached(tokens, positions, cache)
        last_index = jnp.clip(true_length - 1, 0, length - 1)
        last_token = jnp.take_along_axis(tokens, last_index[:, None], axis=1)[:, 0]
        return Prefix(cache=cache, last_token=last_token, true_length=true_length)

    def _prefill_insert(self, params: Any, state: DecodeState, tokens: jax.Array,
                        true_length: jax.Array, slots: jax.Array,
                        settings: SlotSettings) -> DecodeState:
        return self._insert(self._prefill(params, tokens, true_length), state, slots, settings)

    def _insert(self, prefix: Prefix, state: DecodeState, slots: jax.Array,
                settings: SlotSettings) -> DecodeState:
        cfg = self.config
        bucket = jax.tree.leaves(prefix.cache)[0].shape[2]

        def put_cache(full: jax.Array, part: jax.Array) -> jax.Array:
            return full.at[:, slots, :bucket].set(part.astype(full.dtype), mode="drop")

        def put(field: jax.Array, value: jax.Array) -> jax.Array:
            return field.at[slots].set(jnp.asarray(value).astype(field.dtype), mode="drop")

        request_keys = jax.vmap(lambda s, r: jax.random.fold_in(jax.random.key(s), r))(
            settings.seed, settings.stream)
        split_keys = jax.vmap(jax.random.split)(request_keys)
        budget_keys, sample_keys = split_keys[:, 0], split_keys[:, 1]
        rows = settings.seed.shape[0]
        if cfg.interruption is not None:
            lo, hi = cfg.interruption.think_budget_min, cfg.interruption.think_budget_max
            drawn = jax.vmap(lambda k: jax.random.randint(k, (), lo, hi + 1))(budget_keys)
            think_budget = jnp.where(settings.interrupt, drawn, -1)
            answer_budget = jnp.where(settings.interrupt, cfg.interruption.answer_budget,
                                      settings.max_new_tokens)
        else:
            think_budget = jnp.full((rows,), -1, jnp.int32)
            answer_budget = settings.max_new_tokens
        phase = jnp.where(think_budget >= 0, PHASE_THINK, PHASE_ANSWER)
        zeros = jnp.zeros((rows,), jnp.int32)
        falses = jnp.zeros((rows,), bool)
        return state._replace(
            cache=jax.tree.map(put_cache, state.cache, prefix.cache),
            tokens=put(state.tokens, prefix.last_token),
            positions=put(state.positions, prefix.true_length - 1),
            keys=state.keys.at[slots].set(sample_keys, mode="drop"),
            num_generated=put(state.num_generated, zeros),
            max_new_tokens=put(state.max_new_tokens, settings.max_new_tokens),
            temperature=put(state.temperature, settings.temperature),
            stop_tokens=put(state.stop_tokens, settings.stop_tokens),
            active=put(state.active, jnp.ones((rows,), bool)),
            phase=put(state.phase, phase),
            forced_index=put(state.forced_index, zeros),
            recent=put(state.recent, jnp.full((rows, state.recent.shape[1]), -1, jnp.int32)),
            think_budget=put(state.think_budget, think_budget),
            answer_budget=put(state.answer_budget, answer_budget),
            num_think=put(state.num_think, zeros), num_answer=put(state.num_answer, zeros),
            interrupted=put(state.interrupted, falses), truncated=put(state.truncated, falses),
            stopped=put(state.stopped, falses),
        )

    def _decode_step(self, model: Any, state: DecodeState, window: int) -> tuple[DecodeState, tuple]:
        """One token for every active slot: (new state, (token, logprob, sampled, emitted)) per slot.

        Attention reads cache positions < `window`; the caller ensures active slots feed below it.
        """
        cfg = self.config
        feed_positions = self._feed_positions(state)
        hidden, cache = model.forward_cached(state.tokens[:, None], feed_positions[:, None],
                                             state.cache, window=window, block=self._decode_block())
        logits = model.head(hidden[:, 0]).astype(jnp.float32)
        step_keys = jax.vmap(jax.random.fold_in)(state.keys, state.num_generated)
        drawn, drawn_logprob = sample_tokens(logits, step_keys, state.temperature,
                                             top_k=cfg.top_k, top_p=cfg.top_p)
        active = state.active
        forcing = active & (state.phase == PHASE_FORCING)
        thinking = active & (state.phase == PHASE_THINK)
        answering = active & (state.phase == PHASE_ANSWER)
        if cfg.interruption is not None:
            phrase = jnp.asarray(cfg.interruption.phrase_ids, jnp.int32)
            end_think = jnp.asarray(cfg.interruption.end_think_ids, jnp.int32)
            forced = phrase[jnp.clip(state.forced_index, 0, phrase.shape[0] - 1)]
            token = jnp.where(forcing, forced, drawn)
            logprob = jnp.where(forcing, 0.0, drawn_logprob)
            shifted = jnp.concatenate([state.recent[:, 1:], token[:, None]], axis=1)
            recent = jnp.where(thinking[:, None], shifted, state.recent)
            closed = thinking & jnp.all(recent == end_think[None], axis=1)
            forced_index = state.forced_index + forcing.astype(jnp.int32)
            phrase_done = forcing & (forced_index >= phrase.shape[0])
        else:
            token, logprob, recent, forced_index = drawn, drawn_logprob, state.recent, state.forced_index
            closed = phrase_done = jnp.zeros_like(active)
        num_generated = state.num_generated + active.astype(jnp.int32)
        positions = state.positions + active.astype(jnp.int32)
        num_think = state.num_think + thinking.astype(jnp.int32)
        num_answer = state.num_answer + answering.astype(jnp.int32)
        stop = active & ~forcing & jnp.any(token[:, None] == state.stop_tokens, axis=1)
        out_of_room = active & ((num_generated >= state.max_new_tokens) |
                                (positions + 1 >= cfg.max_len))
        answer_full = answering & (num_answer >= state.answer_budget)
        finished = stop | out_of_room | answer_full
        # The phrase starts only if the sequence goes on (a stop or a full budget ends it first).
        start_forcing = thinking & ~closed & ~finished & (num_think >= state.think_budget)
        phase = jnp.where(closed | phrase_done, PHASE_ANSWER,
                          jnp.where(start_forcing, PHASE_FORCING, state.phase))
        new_state = state._replace(
            cache=cache,
            tokens=jnp.where(active, token, state.tokens),
            positions=positions, num_generated=num_generated,
            active=active & ~finished, phase=phase, forced_index=forced_index, recent=recent,
            num_think=num_think, num_answer=num_answer,
            interrupted=state.interrupted | start_forcing,
            truncated=state.truncated | (finished & ~stop),
            stopped=state.stopped | stop,
        )
        emitted_token = jnp.where(active, token, PAD_TOKEN)
        emitted_logprob = jnp.where(active, logprob, 0.0)
        return new_state, (emitted_token, emitted_logprob, active & ~forcing, active)

    def _feed_positions(self, state: DecodeState) -> jax.Array:
        """Where each slot's next token is written (its position, kept inside the cache)."""
        return jnp.minimum(state.positions, self.config.max_len - 1)

    def _generate(self, params: Any, state: DecodeState, window: int) -> tuple[DecodeState, ChunkResult]:
        model = nnx.merge(self.graphdef, params)
        slots, chunk = self.config.num_slots, self.config.chunk_size
        outputs = (jnp.full((slots, chunk), PAD_TOKEN, jnp.int32),
                   jnp.zeros((slots, chunk), jnp.float32),
                   jnp.zeros((slots, chunk), bool), jnp.zeros((slots, chunk), bool))

        def keep_going(carry):
            step, current, _ = carry
            inside = jnp.all(~current.active | (self._feed_positions(current) < window))
            return (step < chunk) & jnp.any(current.active) & inside

        def body(carry):
            step, current, outs = carry
            current, emitted = self._decode_step(model, current, window)
            outs = tuple(jax.lax.dynamic_update_index_in_dim(buf, value, step, axis=1)
                         for buf, value in zip(outs, emitted))
            return step + 1, current, outs

        steps, state, outputs = jax.lax.while_loop(keep_going, body, (jnp.int32(0), state, outputs))
        result = ChunkResult(*outputs, active=state.active, interrupted=state.interrupted,
                             truncated=state.truncated, stopped=state.stopped,
                             num_think=state.num_think, num_answer=state.num_answer,
                             think_budget=state.think_budget, steps=steps)
        # The per-slot fields are separate output buffers from the state's (which the next call
        # donates); the batcher reads them after dispatching that call (tested via the batcher).
        return state, result


def host_settings(
    *, seeds: np.ndarray, streams: np.ndarray, max_new_tokens: np.ndarray, temperature: np.ndarray,
    stop_tokens: np.ndarray, interrupt: np.ndarray,
) -> SlotSettings:
    """Pack numpy per-request arrays into a `SlotSettings` with the engine's dtypes."""
    return SlotSettings(
        seed=np.asarray(seeds, np.uint32), stream=np.asarray(streams, np.uint32),
        max_new_tokens=np.asarray(max_new_tokens, np.int32),
        temperature=np.asarray(temperature, np.float32),
        stop_tokens=np.asarray(stop_tokens, np.int32), interrupt=np.asarray(interrupt, bool))
