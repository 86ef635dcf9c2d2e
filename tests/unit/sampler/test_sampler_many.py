"""10,000 short requests through 16 slots: no slot leak, every request returned exactly once.

Every 50th request is greedy and is checked against a full-recompute reference written here, so
a slot that inherits a stale KV cache or another request's state from an earlier occupant fails.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scalerl_jax.models import Transformer, get_preset
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig, Request

CONFIG = get_preset("tiny-llama", initializer_range=0.15)
NUM_REQUESTS, NUM_SLOTS, GREEDY_EVERY = 10_000, 16, 50
STOP_TOKENS = (3, 5, 7, 11)
REFERENCE_LENGTH = 16


@jax.jit
def _forward(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(tokens)


def naive_greedy(graphdef, params, prompt, steps):
    """Full uncached forward for every new token; stops after a stop token."""
    sequence = list(prompt)
    for _ in range(steps):
        padded = np.zeros((1, REFERENCE_LENGTH), np.int32)
        padded[0, : len(sequence)] = sequence
        token = int(jnp.argmax(_forward(graphdef, params, jnp.asarray(padded))[0, len(sequence) - 1]))
        sequence.append(token)
        if token in STOP_TOKENS:
            break
    return sequence[len(prompt) :]


def test_ten_thousand_requests_through_sixteen_slots():
    model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    engine = Engine(
        graphdef,
        CONFIG,
        EngineConfig(num_slots=NUM_SLOTS, max_len=REFERENCE_LENGTH, chunk_size=4, prefill_chunk=8, max_prefill_rows=4),
    )
    batcher = ContinuousBatcher(engine, params, seed=3)
    rng = np.random.default_rng(0)
    requests = {}
    for i in range(NUM_REQUESTS):
        requests[i] = Request(
            request_id=i,
            prompt_tokens=rng.integers(0, CONFIG.vocab_size, rng.integers(1, 7)).tolist(),
            max_new_tokens=int(rng.integers(1, 5)),
            seed=i,
            temperature=0.0 if i % GREEDY_EVERY == 0 else 1.0,
            stop_tokens=STOP_TOKENS,
        )
    pending = collections.deque(requests.values())
    returned = collections.Counter()
    completions = {}
    while pending or not batcher.idle:
        # Keep the queue short, as the pipeline does, so inserts interleave with decoding.
        while pending and batcher.num_pending < NUM_SLOTS:
            batcher.add_request(pending.popleft())
        for completion in batcher.run_chunk():
            returned[completion.request_id] += 1
            completions[completion.request_id] = completion
        assert batcher.num_free_slots + batcher.num_active == NUM_SLOTS
    assert batcher.idle and batcher.num_free_slots == NUM_SLOTS and batcher.num_pending == 0
    assert sorted(returned) == list(range(NUM_REQUESTS)) and set(returned.values()) == {1}

    total = 0
    for i, c in completions.items():
        n = len(c.tokens)
        total += n
        assert 1 <= n <= requests[i].max_new_tokens
        assert len(c.logprobs) == len(c.versions) == len(c.sampled) == n
        assert all(np.isfinite(c.logprobs)) and max(c.logprobs) <= 0.0
        stops_at = [t for t, token in enumerate(c.tokens) if token in STOP_TOKENS]
        if c.finish_reason == "stop":
            assert stops_at == [n - 1]
        else:
            assert c.finish_reason == "length" and stops_at == [] and n == requests[i].max_new_tokens
    stats = batcher.stats()
    assert stats["sampler/generated_tokens"] == total
    assert stats["sampler/completions"] == NUM_REQUESTS
    assert sum(c.finish_reason == "stop" for c in completions.values()) > 0
    assert engine.compile_counts["generate"] == 1
    assert engine.compile_counts["prefill"] <= 3  # rows 1/2/4 x one window

    for i in range(0, NUM_REQUESTS, GREEDY_EVERY):
        want = naive_greedy(graphdef, params, requests[i].prompt_tokens, requests[i].max_new_tokens)
        assert completions[i].tokens == want, i
