"""JetStream-style decode engine: `prefill`, `fork` and `generate` over a fixed pool of slots.

Layout. The decode state holds a paged KV cache: pools `[layers, G, N, P, kv_heads, head_dim]`
(the model's `init_kv_pages`: G page groups, one per device the slots are sharded over, of N pages
of P = `page_size` tokens) and, per slot, the token to feed next, its position, a PRNG key,
budgets, stop tokens and the length-control state machine. Which pages a slot holds is host state
(`pages.PageTable`): pages are taken as a sequence grows (before each chunk, for the positions it
can reach) and given back when it ends, so memory follows the live tokens and a pool smaller than
slots x max_len (`num_pages`) serves more slots than a contiguous cache could. The table is an
input of every call. Every call is jitted; the decode state is donated, so the cache is updated
in place.

- `prefill(params, state, pieces, settings) -> state`: writes the K/V of prompt pieces straight
  into their slots' pages. A prompt of n tokens is prefilled at positions [0, n - 1) in pieces of
  `prefill_chunk` tokens (`prompt_pieces`); one call runs up to `max_prefill_rows` pieces, one per
  row, of any prompts (the pieces of one prompt may share a call: each layer writes every row's
  K/V before any row attends, so a later piece reads the earlier ones). Prefill work follows the
  prompt tokens (padding only in a prompt's last piece and in rows up to a power of two), and the
  compiled prefills are (row counts) x (windows), whatever the prompt lengths. No logits are
  computed: a slot whose last piece is in the call starts (its per-slot fields reset from
  `settings`), and its first decode step feeds the prompt's last token, writing its K/V and
  sampling the first completion token, so all sampling and length-control logic lives in one
  place (the decode step).
- `fork(state, slots[M], sources[M], ...) -> state`: starts requests whose prompt another slot
  of the same page group already holds (the samples of one prompt): they share that slot's pages
  wholly below the prompt's last token (`share_prompt`, reference counted), get a copy of the
  page holding it (which they will write), and start decoding with their own PRNG stream. The
  prompt is prefilled once however many samples it has.
- `generate(params, state) -> (state, ChunkResult)`: up to `chunk_size` decode steps in one
  `lax.while_loop` (it stops early once every slot is idle). Each step feeds every slot's last
  token at its position, writes its K/V into its page in place (one row per slot per layer),
  takes the fp32 logits of the head, and emits one token per active slot: a sampled one (see
  `sampling.py`) or, while the slot is being interrupted, the next token of the forced phrase
  (logprob 0, sampled False). A mixture-of-experts policy also reports, per step, the experts
  each MoE layer routed the fed token to (the routing behind the emitted token's log-prob:
  what router replay reuses in the trainer).

Live window. Decode attention reads only each slot's pages below its length (the Pallas kernel)
or, portably, its pages below a window W fixed per chunk (one compile per W): the smallest power-of-two multiple of `min_decode_window` (capped at `max_len`)
that covers every position the chunk can feed. The engine knows this without asking the device:
it keeps, on the host, an upper bound of each slot's next position + 1 (the prompt length at
start, plus `chunk_size` per chunk since), so a step costs O(live tokens), not O(max_len). The
bound assumes one engine drives one decode state (the latest from `init_decode_state`); if it is
ever wrong, the chunk stops before any slot would feed a position >= W (checked on the device,
inside the loop's condition, as is every slot staying inside the pages it holds), so results stay
exact and later chunks, with larger bounds, go on.

Compiles. `warm_up` compiles every prefill shape up to a prompt length, every window and the
eviction call before decoding starts, so none happens on the decode path later
(`decode_path_calls`; `engine_programs.py` lowers the same calls ahead of time). A program is
compiled for the shardings of its inputs, so every call returns the decode state on the shardings
`init_decode_state` gives it (`_pinned`): left to XLA's propagation, a mesh of several devices gets
the state back slot-sharded from one call and replicated from another, and the next call with it
compiles again (on the decode path, after warm-up). The engine's
settings (`EngineConfig`, `InterruptionConfig`) are in `engine_config.py`.

Length control (forced interruption) runs inside the jitted chunk as a per-slot state machine:
phase THINK counts sampled thinking tokens; if the last `len(end_think_ids)` sampled tokens equal
`end_think_ids` the thinking closed naturally and the phase becomes ANSWER; if instead the count
reaches the slot's think budget (drawn at the start from the request's key, uniform in [lo, hi]) the
phase becomes FORCING, which emits the phrase tokens one per step (teacher forced; their K/V are
written like any token's) and then becomes ANSWER. ANSWER counts sampled tokens up to the answer
budget. A stop token (only a sampled one) ends the sequence in any phase, so a stop before the
think budget means no phrase. Inside the chunk is chosen over host-side forcing so that an
interruption costs no extra host round trip or recompile.

Inactive slots still run through the step (static shapes) but change nothing (their writes are
dropped). A slot's pages hold stale keys until a prefill overwrites positions [0, n - 1) and decoding
overwrites each later position before it can be attended to (attention reads keys below the
query's position + 1 only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scalerl_jax.contracts.batch_layout import routing_dtype
from scalerl_jax.models.layers import PagedView, resolve_decode_kernel
from scalerl_jax.models.paged_attention import GPU_PLATFORMS, triton_shape_problems
from scalerl_jax.models.sharding import DEFAULT_RULES, Rules, logical_to_spec, use_mesh_rules
from scalerl_jax.models.transformer import init_kv_pages, kv_pages_sharding
from scalerl_jax.sampler.engine_config import EngineConfig
from scalerl_jax.sampler.pages import PageTable, pages_for
from scalerl_jax.sampler.sampling import sample_tokens

PHASE_THINK = 0
PHASE_FORCING = 1
PHASE_ANSWER = 2

PAD_TOKEN = -1  # Entry of ChunkResult.tokens where a slot emitted nothing at that step.
CPU_DECODE_BLOCK = 256  # EngineConfig.decode_block=0 on CPU
# EngineConfig.decode_block=0 on TPU: `compile_check` of the 8B decode chunk at window 16,384 on
# v5p (64 slots per chip) needs 9.5 GiB of temporaries per chip reading the whole window at once,
# 1.9 GiB in 512-key pieces (3.0 GiB in 2,048-key ones).
TPU_DECODE_BLOCK = 512
PALLAS_PAGES_PER_BLOCK = 8  # pages the Pallas decode kernel reads per block


class DecodeState(NamedTuple):
    """Per-slot decode state (leading axis = slot). Donated to every engine call."""

    cache: Any  # the paged KV cache, [layers, groups, pages, page_size, ...] leaves
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
    think_budget: jax.Array  # int32[S] (drawn at the start; -1 when interruption is off)
    answer_budget: jax.Array  # int32[S]
    num_think: jax.Array  # int32[S] sampled tokens while thinking (a natural end-think included)
    num_answer: jax.Array  # int32[S] sampled tokens after thinking closed
    interrupted: jax.Array  # bool[S]
    truncated: jax.Array  # bool[S] ended by a budget or the cache length, not a stop token
    stopped: jax.Array  # bool[S] ended by a stop token


class PromptPiece(NamedTuple):
    """Tokens [start, start + prefill_chunk) of the prompt of the request in `slot` (fewer at the
    prompt's end, none for a one-token prompt: `Engine.prompt_pieces`)."""

    slot: int
    prompt: Sequence[int]
    start: int


class SlotSettings(NamedTuple):
    """Per-request settings written when a request starts (`prefill`, `fork`; leading axis = the
    N started requests).

    Built on the host as numpy arrays (`host_settings`); device arrays inside the calls.
    """

    seed: jax.Array | np.ndarray  # uint32[N] engine-level seed
    stream: jax.Array | np.ndarray  # uint32[N] request seed; key = fold_in(key(seed), stream)
    max_new_tokens: jax.Array | np.ndarray  # int32[N]
    temperature: jax.Array | np.ndarray  # float32[N]
    stop_tokens: jax.Array | np.ndarray  # int32[N, K], -1 padded
    interrupt: jax.Array | np.ndarray  # bool[N] apply forced interruption to this request


class DecodeCall(NamedTuple):
    """One jitted call of the decode path (`Engine.decode_path_calls`): `jitted(params, state,
    *args)` (without params when not `takes_params`), compiled once per `shape`."""

    name: str  # the `compile_counts` key
    shape: tuple[int, ...]
    shape_names: tuple[str, ...]
    jitted: Any
    takes_params: bool
    args: tuple


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
    # [S, C, MoE layers, k] (`batch_layout.routing_dtype`): the experts each MoE layer routed the
    # token fed at each step to (the input whose logits gave that step's token), -1 where nothing
    # was emitted; None when dense.
    experts: jax.Array | None = None


def doubled_bucket(length: int, *, min_bucket: int, max_len: int) -> int:
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
    """Prefill / fork / generate over `config.num_slots` decode slots (see module docstring).

    `graphdef` is the model's NNX graph definition (`nnx.split(model)[0]`); params are passed to
    every call so that they can be swapped between chunks. `compile_counts` counts the distinct input shapes each jitted entry point has been
    called with (one compile each).

    With a `mesh` (the generator's devices) the KV cache is created sharded by `rules` (slots
    over the batch axes, KV heads over tensor), the other per-slot fields replicated, and every
    call is traced under `use_mesh_rules(mesh, rules)` so activations are constrained too; params
    must already be on that mesh. Without one everything lives on the default device.
    """

    def __init__(
        self,
        graphdef: Any,
        model_config: Any,
        config: EngineConfig,
        *,
        mesh: Mesh | None = None,
        rules: Rules = DEFAULT_RULES,
    ):
        self.graphdef = graphdef
        self.model_config = model_config
        self.config = config
        self.mesh = mesh
        self.rules = tuple(rules)
        if config.max_len > model_config.max_position_embeddings:
            logging.warning(
                "EngineConfig.max_len=%d exceeds the model's max_position_embeddings=%d",
                config.max_len,
                model_config.max_position_embeddings,
            )
        self.compile_counts: dict[str, int] = {
            "prefill": 0,
            "fork": 0,
            "generate": 0,
            "evict": 0,
        }
        self._signatures: set[tuple] = set()
        self._prefill_jit = jax.jit(self._prefill, donate_argnums=(1,), static_argnums=(2,))
        self._fork_jit = jax.jit(self._fork, donate_argnums=(0,))
        self._generate_jit = jax.jit(self._generate, donate_argnums=(1,), static_argnums=(2,))
        self._evict_jit = jax.jit(
            lambda state, mask: self._pinned(state._replace(active=state.active & ~mask)), donate_argnums=(0,)
        )
        self._live_bound = np.zeros((config.num_slots,), np.int64)
        self.page_groups = _batch_shards(mesh, self.rules)
        self.pages_per_slot = pages_for(config.max_len, config.page_size)
        total_pages = config.num_pages or config.num_slots * self.pages_per_slot
        if total_pages % self.page_groups:
            raise ValueError(
                f"EngineConfig.num_pages={total_pages} must split into {self.page_groups} "
                "page groups (one per device the slots are sharded over)"
            )
        self.pages_per_group = total_pages // self.page_groups
        self.pages = self._new_page_table()
        platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        self.decode_kernel = resolve_decode_kernel(config.decode_kernel, platform)
        problems = triton_shape_problems(
            head_dim=model_config.head_dim, page_size=config.page_size, pages_per_block=PALLAS_PAGES_PER_BLOCK
        )
        if self.decode_kernel == "pallas" and platform in GPU_PLATFORMS and problems:
            raise ValueError(f"EngineConfig.decode_kernel='pallas' on {platform}: {problems}")

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
            cache=None,
            tokens=ints(0),
            positions=ints(0),
            keys=jax.random.split(jax.random.key(0), slots),
            num_generated=ints(0),
            max_new_tokens=ints(0),
            temperature=jnp.zeros((slots,), jnp.float32),
            stop_tokens=ints(-1, cfg.max_stop_tokens),
            active=flags(),
            phase=ints(PHASE_ANSWER),
            forced_index=ints(0),
            recent=ints(-1, end_len),
            think_budget=ints(-1),
            answer_budget=ints(0),
            num_think=ints(0),
            num_answer=ints(0),
            interrupted=flags(),
            truncated=flags(),
            stopped=flags(),
        )
        if self.mesh is not None:
            state = jax.device_put(state, NamedSharding(self.mesh, PartitionSpec()))
        self._live_bound[:] = 0
        self.pages = self._new_page_table()
        return state._replace(
            cache=init_kv_pages(
                self.model_config,
                groups=self.page_groups,
                pages_per_group=self.pages_per_group,
                page_size=cfg.page_size,
                mesh=self.mesh,
                rules=self.rules,
            )
        )

    def prompt_pieces(self, slot: int, prompt: Sequence[int]) -> list[PromptPiece]:
        """The pieces prefilling `prompt` in `slot`: positions [0, n - 1) in `prefill_chunk`
        tokens each (the last token is fed by the first decode step), one empty piece for n = 1."""
        chunk = self.config.prefill_chunk
        return [PromptPiece(slot, prompt, start) for start in range(0, max(len(prompt) - 1, 1), chunk)]

    def prefill(
        self, params: Any, state: DecodeState, pieces: Sequence[PromptPiece], settings: SlotSettings
    ) -> DecodeState:
        """Write the K/V of `pieces` (at most `max_prefill_rows`; one call padded to a power of two
        rows) into their slots' pages, which must hold them (`reserve`). A slot whose prompt's last
        piece is here starts, with that piece's row of `settings` (rows as `pieces`); donates
        `state`."""
        cfg = self.config
        rows = row_bucket(len(pieces), max_rows=cfg.max_prefill_rows)
        if not 0 < len(pieces) <= rows:
            raise ValueError(f"Engine.prefill: {len(pieces)} pieces; 1 to max_prefill_rows={cfg.max_prefill_rows}")
        tokens = np.zeros((rows, cfg.prefill_chunk), np.int32)
        slots = np.full((rows,), cfg.num_slots, np.int32)  # out of range: padding rows write nothing
        starts, ends = np.zeros((rows,), np.int32), np.zeros((rows,), np.int32)
        starting = np.full((rows,), cfg.num_slots, np.int32)  # slots that start: none by default
        last_tokens, lengths = np.zeros((rows,), np.int32), np.ones((rows,), np.int32)
        for row, (slot, prompt, start) in enumerate(pieces):
            end = min(start + cfg.prefill_chunk, len(prompt) - 1)
            tokens[row, : max(end - start, 0)] = prompt[start:end]
            slots[row], starts[row], ends[row] = slot, start, end
            if end >= len(prompt) - 1:
                starting[row], last_tokens[row], lengths[row] = slot, prompt[-1], len(prompt)
        positions = starts[:, None] + np.arange(cfg.prefill_chunk, dtype=np.int32)[None, :]
        table = self._table_rows(slots)
        pages = np.take_along_axis(table, np.minimum(positions // cfg.page_size, self.pages_per_slot - 1), axis=1)
        write_pages = np.where(positions < ends[:, None], pages, self.pages_per_group).astype(np.int32)
        window = self._window(max(int(ends.max()), 1))  # keys below each piece's end
        self._count("prefill", (rows, window))
        kept = starting < cfg.num_slots
        self._note_started(starting[kept], lengths[kept])
        with self.mesh_context():
            return self._prefill_jit(
                params,
                state,
                window,
                tokens,
                positions,
                slots,
                table,
                write_pages,
                (positions % cfg.page_size).astype(np.int32),
                starting,
                last_tokens,
                lengths,
                _padded(settings, rows),
            )

    def start_prompts(
        self,
        params: Any,
        state: DecodeState,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        settings: SlotSettings,
    ) -> DecodeState:
        """The engine used without a batcher: take pages for `prompts` in the free `slots`
        (`reserve`; RuntimeError naming the slot if its group lacks them) and prefill them, in as
        many calls as their pieces take; every slot starts with its row of `settings`."""
        pieces: list[PromptPiece] = []
        rows: list[int] = []
        for row, (slot, prompt) in enumerate(zip(slots, prompts, strict=True)):
            if not self.reserve(slot, len(prompt)):
                raise RuntimeError(f"paged KV cache: no pages for a {len(prompt)}-token prompt in slot {slot}")
            pieces += self.prompt_pieces(slot, prompt)
            rows += [row] * (len(pieces) - len(rows))
        step = self.config.max_prefill_rows
        for start in range(0, len(pieces), step):
            taken = rows[start : start + step]
            state = self.prefill(params, state, pieces[start : start + step], _rows(settings, taken))
        return state

    def share_prompt(self, slot: int, source: int, prompt_length: int) -> bool:
        """Take pages for a request about to be forked into free `slot` from `source`, a live slot
        of the same page group whose prompt is the same `prompt_length` tokens: `source`'s pages
        wholly below the prompt's last token, shared, and pages of its own from there to the end of
        its first chunk. False (nothing taken) if the group lacks them."""
        self.pages.share(slot, source, (prompt_length - 1) // self.config.page_size)
        if self.reserve(slot, prompt_length):
            return True
        self.pages.release(slot)
        return False

    def fork(
        self,
        state: DecodeState,
        slots: Any,
        sources: Any,
        prompt_lengths: Any,
        last_tokens: Any,
        settings: SlotSettings,
    ) -> DecodeState:
        """Start requests in `slots` (int32[M]; `num_slots` = a dropped row) on the prompts that
        `sources` (int32[M]) hold, `prompt_lengths` tokens ending in `last_tokens`, their pages
        taken by `share_prompt`; copies each source's page holding the prompt's last token into the
        slot's own; donates `state`."""
        slots, sources = np.asarray(slots, np.int32), np.asarray(sources, np.int32)
        lengths, last_tokens = np.asarray(prompt_lengths, np.int32), np.asarray(last_tokens, np.int32)
        page_size, kept = self.config.page_size, slots < self.config.num_slots
        tail = (lengths - 1) // page_size
        table = self._table_rows(slots)
        # A last token at a page's first row leaves nothing of the prompt to copy there.
        copy_to = np.where(kept & (lengths - 1 > tail * page_size), table[np.arange(len(slots)), tail], -1)
        copy_from = self._table_rows(np.where(kept, sources, self.config.num_slots))[np.arange(len(slots)), tail]
        groups = np.minimum(slots, self.config.num_slots - 1) // self._slots_per_group()
        self._count("fork", slots.shape)
        self._note_started(slots, lengths)
        with self.mesh_context():
            return self._fork_jit(
                state,
                slots,
                last_tokens,
                lengths,
                settings,
                groups.astype(np.int32),
                copy_from,
                copy_to.astype(np.int32),
            )

    def generate(self, params: Any, state: DecodeState) -> tuple[DecodeState, ChunkResult]:
        """Run up to `chunk_size` decode steps over all slots, attending over the live window; donates `state`.

        First gives every live slot the pages its next `chunk_size` positions need (RuntimeError
        naming the groups if the pool is short: resolve `chunk_shortfall` first, e.g. by `evict`).
        """
        window, table, held = self.prepare_chunk()
        with self.mesh_context():
            return self._generate_jit(params, state, window, table, held)

    def prepare_chunk(self) -> tuple[int, np.ndarray, np.ndarray]:
        """The host part of `generate`: gives every live slot the pages its next chunk needs,
        advances the live bounds, and returns the chunk's (window, page table int32[S, M], held
        lengths int32[S]) (`benchmarks/bench_decode_overhead.py` feeds them to a bare forward)."""
        needs = self._chunk_needs()
        short = self.pages.shortfall(needs)
        if short:
            raise RuntimeError(
                f"paged KV cache: page groups {short} (group: pages missing) cannot "
                f"cover the next chunk; evict slots first (Engine.chunk_shortfall)"
            )
        for slot, length in needs.items():
            self.pages.grow(slot, length)
        window = self.decode_window()
        self._count("generate", (window,))
        live = self._live_bound > 0
        self._live_bound[live] = np.minimum(self._live_bound[live] + self.config.chunk_size, self.config.max_len)
        return window, self.pages.table.copy(), self._held_lengths()

    def release_slots(self, slots: Any) -> None:
        """Slots whose request finished (inactive on the device) give their pages back and no longer
        widen the window; a start sets their bound again."""
        for slot in np.asarray(slots, np.int64).reshape(-1):
            self._live_bound[slot] = 0
            self.pages.release(int(slot))

    def reserve(self, slot: int, prompt_length: int) -> bool:
        """Take pages for a request of `prompt_length` tokens about to be prefilled into free `slot`:
        its prompt and first chunk. False (nothing taken) if the slot's group lacks them."""
        reach = min(prompt_length + self.config.chunk_size - 1, self.config.max_len)
        return self.pages.grow(slot, reach)

    def chunk_shortfall(self) -> dict[int, int]:
        """Page groups that cannot cover the next chunk of their live slots: {group: pages missing}."""
        return self.pages.shortfall(self._chunk_needs())

    def evict(self, state: DecodeState, slots: Any) -> DecodeState:
        """Stop `slots` (live requests preempted to free pages): they turn inactive on the device and
        give their pages back; donates `state`. Their requests must be inserted again from scratch."""
        slots = np.asarray(slots, np.int64).reshape(-1)
        mask = np.zeros((self.config.num_slots,), bool)
        mask[slots] = True
        self.release_slots(slots)
        self._count("evict", ())
        with self.mesh_context():
            return self._evict_jit(state, mask)

    def warm_up(self, params: Any, state: DecodeState, *, max_prompt_length: int) -> DecodeState:
        """Compile, before decoding starts, every call the decode path can make later
        (`decode_path_calls`), by running each on no slot (every row dropped, every slot idle), so
        `state`, which must have no live slot, comes back unchanged; donates `state`."""
        if self._live_bound.any():
            raise ValueError("Engine.warm_up needs a decode state with no live slot")
        with self.mesh_context():
            for call in self.decode_path_calls(max_prompt_length):
                self._count(call.name, call.shape)
                out = call.jitted(*((params,) if call.takes_params else ()), state, *call.args)
                state = out[0] if call.name == "generate" else out
        return state

    def decode_path_calls(self, max_prompt_length: int) -> Iterator[DecodeCall]:
        """Every jitted call the decode path can make for prompts up to `max_prompt_length`, with
        arguments that touch no slot: prefill for every (row bucket, window), fork
        for every row bucket (when prompts are shared), generate for every window (all slots idle), and evict (of no slot)."""
        cfg = self.config
        idle_table = np.full((cfg.num_slots, self.pages_per_slot), self.pages_per_group, np.int32)
        top = self._window(max(max_prompt_length - 1, 1))
        row_buckets = _doublings(1, row_bucket(cfg.max_prefill_rows, max_rows=cfg.max_prefill_rows))
        for window in self._windows(top):
            for rows in row_buckets:
                dropped = np.full((rows,), cfg.num_slots, np.int32)
                positions = np.zeros((rows, cfg.prefill_chunk), np.int32)
                nowhere = np.full((rows, cfg.prefill_chunk), self.pages_per_group, np.int32)
                ones = np.ones((rows,), np.int32)
                args = (
                    window,
                    positions,
                    positions,
                    dropped,
                    self._table_rows(dropped),
                    nowhere,
                    positions,
                    dropped,
                    ones,
                    ones,
                    self._idle_settings(rows),
                )
                yield DecodeCall("prefill", (rows, window), ("rows", "window"), self._prefill_jit, True, args)
        for rows in row_buckets if cfg.share_prompts else ():
            dropped, nowhere = np.full((rows,), cfg.num_slots, np.int32), np.full((rows,), -1, np.int32)
            ones, zeros = np.ones((rows,), np.int32), np.zeros((rows,), np.int32)
            args = (dropped, zeros, ones, self._idle_settings(rows), zeros, zeros, nowhere)
            yield DecodeCall("fork", (rows,), ("rows",), self._fork_jit, False, args)
        for window in self._windows(cfg.max_len):
            args = (window, idle_table, np.zeros((cfg.num_slots,), np.int32))
            yield DecodeCall("generate", (window,), ("window",), self._generate_jit, True, args)
        yield DecodeCall("evict", (), (), self._evict_jit, False, (np.zeros((cfg.num_slots,), bool),))

    def decode_window(self) -> int:
        """W of the next chunk: covers positions up to max(live bound) + chunk_size - 2 (module doc)."""
        cfg = self.config
        return self._window(int(self._live_bound.max()) + cfg.chunk_size - 1)

    def mesh_context(self) -> contextlib.AbstractContextManager:
        """The context the engine's calls are traced in: its mesh's sharding rules (nothing
        without a mesh)."""
        if self.mesh is None:
            return contextlib.nullcontext()
        return use_mesh_rules(self.mesh, self.rules)

    # ------------------------------------------------------------------------------ internals
    def _note_started(self, slots: np.ndarray, lengths: np.ndarray) -> None:
        """Host bound of the started slots: next position + 1 <= prompt length (padding rows dropped);
        each gets pages for its prompt (RuntimeError if its group lacks them: `reserve` first)."""
        for slot, length in zip(slots.tolist(), lengths.tolist()):
            if slot >= self.config.num_slots:
                continue
            if not self.pages.grow(slot, length):
                raise RuntimeError(
                    f"paged KV cache: slot {slot} needs {self.pages.missing(slot, length)} pages for a "
                    f"{length}-token prompt; group {self.pages.group_of(slot)} has "
                    f"{self.pages.free_pages(self.pages.group_of(slot))} free"
                )
            self._live_bound[slot] = length

    def _window(self, keys: int) -> int:
        """The attention window covering key positions [0, keys): the smallest power-of-two multiple
        of `min_decode_window` that is >= keys, capped at `max_len`."""
        return doubled_bucket(keys, min_bucket=self.config.min_decode_window, max_len=self.config.max_len)

    def _windows(self, top: int) -> list[int]:
        """Every window up to `top` (itself a window)."""
        return _doublings(min(self.config.min_decode_window, top), top)

    def _idle_settings(self, rows: int) -> SlotSettings:
        """Settings of `rows` requests that are never started (the rows of a warm-up call)."""
        return host_settings(
            seeds=np.zeros(rows),
            streams=np.zeros(rows),
            max_new_tokens=np.ones(rows),
            temperature=np.zeros(rows),
            stop_tokens=np.full((rows, self.config.max_stop_tokens), -1),
            interrupt=np.zeros(rows, bool),
        )

    def _new_page_table(self) -> PageTable:
        return PageTable(
            num_slots=self.config.num_slots,
            groups=self.page_groups,
            pages_per_group=self.pages_per_group,
            page_size=self.config.page_size,
            pages_per_slot=self.pages_per_slot,
        )

    def _table_rows(self, slots: np.ndarray) -> np.ndarray:
        """Page table rows of `slots` (all out of range for a dropped row, slot == num_slots)."""
        padded = np.concatenate([self.pages.table, np.full((1, self.pages_per_slot), self.pages_per_group, np.int32)])
        return padded[np.minimum(slots, self.config.num_slots)]

    def _held_lengths(self) -> np.ndarray:
        """int32[S]: positions each slot holds pages for (pages x page_size, capped at max_len)."""
        return np.minimum(self.pages.held * self.config.page_size, self.config.max_len).astype(np.int32)

    def _chunk_needs(self) -> dict[int, int]:
        """{live slot: positions its next chunk can reach (bound + chunk_size - 1, capped at max_len)}."""
        reach = np.minimum(self._live_bound + self.config.chunk_size - 1, self.config.max_len)
        return {int(slot): int(reach[slot]) for slot in np.flatnonzero(self._live_bound)}

    def _count(self, name: str, shape: tuple) -> None:
        signature = (name, tuple(shape))
        if signature not in self._signatures:
            self._signatures.add(signature)
            self.compile_counts[name] += 1
            logging.info(
                "sampler engine: compiling %s for shape %s (%d %s compiles)",
                name,
                shape,
                self.compile_counts[name],
                name,
            )

    def _decode_block(self) -> int | None:
        """Keys per decode attention piece (`EngineConfig.decode_block`; None = the whole window)."""
        if self.config.decode_block:
            return self.config.decode_block
        platform = self.mesh.devices.flat[0].platform if self.mesh is not None else jax.default_backend()
        return {"cpu": CPU_DECODE_BLOCK, "tpu": TPU_DECODE_BLOCK}.get(platform)

    def _prefill(
        self,
        params: Any,
        state: DecodeState,
        window: int,
        tokens: jax.Array,
        positions: jax.Array,
        slots: jax.Array,
        tables: jax.Array,
        write_pages: jax.Array,
        write_offsets: jax.Array,
        starting: jax.Array,
        last_tokens: jax.Array,
        lengths: jax.Array,
        settings: SlotSettings,
    ) -> DecodeState:
        """Prompt pieces tokens [R, C] at `positions` [R, C] through the model, their K/V written to
        `write_pages` / `write_offsets` (out of range past each piece's end) in the groups of
        `slots` (page table rows `tables`); then the slots `starting` (num_slots: none) start."""
        model = nnx.merge(self.graphdef, params)
        view = PagedView(
            table=tables,
            lengths=jnp.zeros(slots.shape, jnp.int32),
            write_group=jnp.minimum(slots, self.config.num_slots - 1) // self._slots_per_group(),
            write_page=write_pages,
            write_offset=write_offsets,
            window=window,
            pages_per_block=1,
            kernel="xla",
        )
        _, cache, _ = model.forward_paged(tokens, positions, state.cache, view)
        return self._start(state._replace(cache=cache), starting, last_tokens, lengths, settings)

    def _pinned(self, state: DecodeState) -> DecodeState:
        """`state` (traced) constrained to the shardings `init_decode_state` gives it: the KV pages
        by the rules (`kv_pages_sharding`), every other field replicated; unchanged without a mesh."""
        if self.mesh is None:
            return state
        replicated = NamedSharding(self.mesh, PartitionSpec())
        fields = {
            name: jax.lax.with_sharding_constraint(value, replicated)
            for name, value in state._asdict().items()
            if name != "cache"
        }
        fields["cache"] = {
            name: jax.lax.with_sharding_constraint(leaf, kv_pages_sharding(leaf.shape, self.mesh, self.rules))
            for name, leaf in state.cache.items()
        }
        return DecodeState(**fields)

    def _fork(
        self,
        state: DecodeState,
        slots: jax.Array,
        last_token: jax.Array,
        true_length: jax.Array,
        settings: SlotSettings,
        groups: jax.Array,
        copy_from: jax.Array,
        copy_to: jax.Array,
    ) -> DecodeState:
        """pool[:, groups[i], copy_to[i]] = pool[:, groups[i], copy_from[i]] for every layer (rows
        whose copy_to is out of range copy nothing), then the slots start (`_start`)."""
        page_count = jax.tree.leaves(state.cache)[0].shape[2]
        copy_to = jnp.where(copy_to < 0, page_count, copy_to)  # negative ids would wrap around

        def copy(pool: jax.Array) -> jax.Array:
            return pool.at[:, groups, copy_to].set(pool[:, groups, jnp.clip(copy_from, 0, page_count - 1)], mode="drop")

        state = state._replace(cache=jax.tree.map(copy, state.cache))
        return self._start(state, slots, last_token, true_length, settings)

    def _start(
        self,
        state: DecodeState,
        slots: jax.Array,
        last_token: jax.Array,
        true_length: jax.Array,
        settings: SlotSettings,
    ) -> DecodeState:
        """Slots `slots` (rows at `num_slots` dropped) begin their requests: the next step feeds
        `last_token` at position `true_length - 1`, with each request's settings and PRNG stream."""
        cfg = self.config

        def put(field: jax.Array, value: jax.Array | np.ndarray) -> jax.Array:
            return field.at[slots].set(jnp.asarray(value).astype(field.dtype), mode="drop")

        request_keys = jax.vmap(lambda s, r: jax.random.fold_in(jax.random.key(s), r))(settings.seed, settings.stream)
        split_keys = jax.vmap(jax.random.split)(request_keys)
        budget_keys, sample_keys = split_keys[:, 0], split_keys[:, 1]
        rows = settings.seed.shape[0]
        if cfg.interruption is not None:
            lo, hi = cfg.interruption.think_budget_min, cfg.interruption.think_budget_max
            drawn = jax.vmap(lambda k: jax.random.randint(k, (), lo, hi + 1))(budget_keys)
            think_budget = jnp.where(settings.interrupt, drawn, -1)
            answer_budget = jnp.where(settings.interrupt, cfg.interruption.answer_budget, settings.max_new_tokens)
        else:
            think_budget = jnp.full((rows,), -1, jnp.int32)
            answer_budget = settings.max_new_tokens
        phase = jnp.where(think_budget >= 0, PHASE_THINK, PHASE_ANSWER)
        zeros = jnp.zeros((rows,), jnp.int32)
        falses = jnp.zeros((rows,), bool)
        started = state._replace(
            tokens=put(state.tokens, last_token),
            positions=put(state.positions, true_length - 1),
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
            num_think=put(state.num_think, zeros),
            num_answer=put(state.num_answer, zeros),
            interrupted=put(state.interrupted, falses),
            truncated=put(state.truncated, falses),
            stopped=put(state.stopped, falses),
        )
        return self._pinned(started)

    def _paged_view(self, state: DecodeState, window: int, table: jax.Array, held: jax.Array) -> PagedView:
        """Where each slot writes this step (its page, or nowhere if idle) and the keys it reads
        (positions <= its own, inside the pages it holds)."""
        cfg = self.config
        feed = self._feed_positions(state)
        page = jnp.take_along_axis(table, (feed // cfg.page_size)[:, None], axis=1)[:, 0]
        block = self._decode_block()
        return PagedView(
            table=table,
            lengths=jnp.where(state.active, jnp.minimum(feed + 1, held), 0),
            write_group=jnp.arange(cfg.num_slots, dtype=jnp.int32) // self._slots_per_group(),
            write_page=jnp.where(state.active, page, self.pages_per_group)[:, None],
            write_offset=(feed % cfg.page_size)[:, None],
            window=window,
            pages_per_block=(
                PALLAS_PAGES_PER_BLOCK
                if self.decode_kernel == "pallas"
                else pages_for(window, cfg.page_size)
                if block is None
                else max(1, block // cfg.page_size)
            ),
            kernel=self.decode_kernel,
        )

    def _slots_per_group(self) -> int:
        return self.config.num_slots // self.page_groups

    def _decode_step(
        self, model: Any, state: DecodeState, window: int, table: jax.Array, held: jax.Array
    ) -> tuple[DecodeState, tuple]:
        """One token for every active slot: (new state, (token, logprob, sampled, emitted[, experts
        [S, MoE layers, k] for a mixture-of-experts policy])) per slot.

        Attention reads the slot's keys below its position + 1 (inside `window`); the caller ensures
        active slots feed below the window and inside the pages they hold (`held` positions).
        """
        cfg = self.config
        feed_positions = self._feed_positions(state)
        hidden, cache, routed = model.forward_paged(
            state.tokens[:, None], feed_positions[:, None], state.cache, self._paged_view(state, window, table, held)
        )
        logits = model.head(hidden[:, 0]).astype(jnp.float32)
        step_keys = jax.vmap(jax.random.fold_in)(state.keys, state.num_generated)
        drawn, drawn_logprob = sample_tokens(logits, step_keys, state.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
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
        out_of_room = active & ((num_generated >= state.max_new_tokens) | (positions + 1 >= cfg.max_len))
        answer_full = answering & (num_answer >= state.answer_budget)
        finished = stop | out_of_room | answer_full
        # The phrase starts only if the sequence goes on (a stop or a full budget ends it first).
        start_forcing = thinking & ~closed & ~finished & (num_think >= state.think_budget)
        phase = jnp.where(closed | phrase_done, PHASE_ANSWER, jnp.where(start_forcing, PHASE_FORCING, state.phase))
        new_state = state._replace(
            cache=cache,
            tokens=jnp.where(active, token, state.tokens),
            positions=positions,
            num_generated=num_generated,
            active=active & ~finished,
            phase=phase,
            forced_index=forced_index,
            recent=recent,
            num_think=num_think,
            num_answer=num_answer,
            interrupted=state.interrupted | start_forcing,
            truncated=state.truncated | (finished & ~stop),
            stopped=state.stopped | stop,
        )
        emitted_token = jnp.where(active, token, PAD_TOKEN)
        emitted_logprob = jnp.where(active, logprob, 0.0)
        emitted = (emitted_token, emitted_logprob, active & ~forcing, active)
        if routed is not None:  # [L_moe, S, 1, k] -> [S, L_moe, k], in the batch's narrow dtype
            experts = jnp.where(active[:, None, None], jnp.transpose(routed[:, :, 0], (1, 0, 2)), -1)
            emitted += (experts.astype(routing_dtype(self.model_config.num_experts)),)
        return new_state, emitted

    def _feed_positions(self, state: DecodeState) -> jax.Array:
        """Where each slot's next token is written (its position, kept inside the cache)."""
        return jnp.minimum(state.positions, self.config.max_len - 1)

    def _generate(
        self, params: Any, state: DecodeState, window: int, table: jax.Array, held: jax.Array
    ) -> tuple[DecodeState, ChunkResult]:
        model = nnx.merge(self.graphdef, params)
        slots, chunk = self.config.num_slots, self.config.chunk_size
        outputs = (
            jnp.full((slots, chunk), PAD_TOKEN, jnp.int32),
            jnp.zeros((slots, chunk), jnp.float32),
            jnp.zeros((slots, chunk), bool),
            jnp.zeros((slots, chunk), bool),
        )
        config = self.model_config
        moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
        if moe_layers:
            shape = (slots, chunk, moe_layers, config.num_experts_per_tok)
            outputs += (jnp.full(shape, -1, routing_dtype(config.num_experts)),)

        def keep_going(carry):
            step, current, _ = carry
            feed = self._feed_positions(current)
            inside = jnp.all(~current.active | ((feed < window) & (feed < held)))
            return (step < chunk) & jnp.any(current.active) & inside

        def body(carry):
            step, current, outs = carry
            current, emitted = self._decode_step(model, current, window, table, held)
            outs = tuple(
                jax.lax.dynamic_update_index_in_dim(buf, value, step, axis=1) for buf, value in zip(outs, emitted)
            )
            return step + 1, current, outs

        steps, state, outputs = jax.lax.while_loop(keep_going, body, (jnp.int32(0), state, outputs))
        result = ChunkResult(
            *outputs[:4],
            experts=outputs[4] if len(outputs) > 4 else None,
            active=state.active,
            interrupted=state.interrupted,
            truncated=state.truncated,
            stopped=state.stopped,
            num_think=state.num_think,
            num_answer=state.num_answer,
            think_budget=state.think_budget,
            steps=steps,
        )
        # The per-slot fields are separate output buffers from the state's (which the next call
        # donates); the batcher reads them after dispatching that call (tested via the batcher).
        return self._pinned(state), result


def _doublings(first: int, last: int) -> list[int]:
    """first, 2 first, 4 first, ... below last, then last."""
    values = [first]
    while values[-1] < last:
        values.append(min(values[-1] * 2, last))
    return values


def _batch_shards(mesh: Mesh | None, rules: Rules) -> int:
    """Devices the slots (logical axis 'batch') are split over on `mesh` (1 without a mesh)."""
    if mesh is None:
        return 1
    axes = logical_to_spec(("batch",), rules, mesh=mesh)[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[axis] for axis in axes]))


def _rows(settings: SlotSettings, rows: Sequence[int]) -> SlotSettings:
    """Rows `rows` of `settings` (host arrays), in that order."""
    return SlotSettings(*(np.asarray(field)[list(rows)] for field in settings))


def _padded(settings: SlotSettings, rows: int) -> SlotSettings:
    """`settings` with rows of zeros appended up to `rows` (rows of requests that never start)."""

    def pad(field: Any) -> np.ndarray:
        field = np.asarray(field)
        return np.concatenate([field, np.zeros((rows - len(field), *field.shape[1:]), field.dtype)])

    return SlotSettings(*(pad(field) for field in settings))


def host_settings(
    *,
    seeds: np.ndarray,
    streams: np.ndarray,
    max_new_tokens: np.ndarray,
    temperature: np.ndarray,
    stop_tokens: np.ndarray,
    interrupt: np.ndarray,
) -> SlotSettings:
    """Pack numpy per-request arrays into a `SlotSettings` with the engine's dtypes."""
    return SlotSettings(
        seed=np.asarray(seeds, np.uint32),
        stream=np.asarray(streams, np.uint32),
        max_new_tokens=np.asarray(max_new_tokens, np.int32),
        temperature=np.asarray(temperature, np.float32),
        stop_tokens=np.asarray(stop_tokens, np.int32),
        interrupt=np.asarray(interrupt, bool),
    )
