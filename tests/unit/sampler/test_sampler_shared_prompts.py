"""Samples of one prompt share its KV pages: the prompt is prefilled once per group.

References: page counts worked out by hand, and the same requests run with `share_prompts=False`
(every sample prefills its own copy), which must give the same tokens and log-probs, also across a
weight update and under preemption. Transformers scores shared samples in
`test_sampler_hf.py`.
"""

from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

from scalerl_jax.models import Transformer, get_preset
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig, Request
from scalerl_jax.sampler.pages import PageTable

CONFIG = get_preset("tiny-llama", initializer_range=0.15)
COMMON: dict[str, Any] = dict(
    num_slots=8, max_len=64, chunk_size=4, prefill_chunk=8, max_prefill_rows=4, min_decode_window=16, page_size=8
)
PROMPT_LENGTHS = (9, 16, 17, 30)
SAMPLES = 4


@pytest.fixture(scope="module")
def params():
    return nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))


def group_requests(lengths, samples, max_new) -> list[Request]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in lengths]
    return [
        Request((p, s), prompts[p], max_new, seed=10 * p + s, temperature=1.0)
        for p in range(len(prompts))
        for s in range(samples)
    ]


def new_batcher(params, *, share: bool, **overrides) -> ContinuousBatcher:
    graphdef, state = params
    engine = Engine(graphdef, CONFIG, EngineConfig(share_prompts=share, **{**COMMON, **overrides}))
    return ContinuousBatcher(engine, state, seed=1)


def drain(batcher: ContinuousBatcher, requests: list[Request]) -> dict:
    for request in requests:
        batcher.add_request(request)
    return {c.request_id: c for c in batcher.drain()}


def assert_same_completions(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, completion in want.items():
        assert got[key].tokens == completion.tokens, key
        np.testing.assert_allclose(got[key].logprobs, completion.logprobs, atol=1e-5, rtol=0)


def test_page_table_shares_pages_and_frees_them_with_the_last_holder():
    table = PageTable(num_slots=4, groups=2, pages_per_group=6, page_size=4, pages_per_slot=4)
    assert table.grow(0, 10)  # 3 pages of group 0
    first = table.table[0, :3].tolist()
    table.share(1, 0, 2)  # slot 1 holds slot 0's first two pages: nothing taken from the free list
    assert table.table[1, :2].tolist() == first[:2] and table.held[1] == 2 and table.free_pages(0) == 3
    assert table.grow(1, 12)  # and a third page of its own
    assert table.held[1] == 3 and table.free_pages(0) == 2 and table.table[1, 2] not in first
    assert table.shared_pages() == 2
    table.release(0)  # only slot 0's own third page goes back; slot 1 still reads the first two
    assert table.free_pages(0) == 3 and table.shared_pages() == 0 and table.table[1, :2].tolist() == first[:2]
    table.release(1)
    assert table.free_pages(0) == 6
    assert table.grow(0, 4)
    with pytest.raises(ValueError, match="slot 2 \\(group 1\\) cannot share"):
        table.share(2, 0, 1)
    with pytest.raises(ValueError, match="cannot share 2"):
        table.share(1, 0, 2)  # slot 0 holds one page


def test_samples_of_a_prompt_prefill_it_once_and_give_the_unshared_tokens(params):
    """4 prompts x 4 samples at temperature 1 on 8 slots: each prompt is prefilled once (all but
    its last token: 8 + 15 + 16 + 29 = 68 tokens, not 4 x 68), its 3 other samples share its pages wholly below the
    last prompt token (pages of 8 tokens: 1, 1, 2 and 3, so 3 x 7 = 21 pages), every sample gets
    the tokens and log-probs of the unshared run, and every page is free at the end."""
    requests = group_requests(PROMPT_LENGTHS, SAMPLES, max_new=20)
    unshared = new_batcher(params, share=False)
    want = drain(unshared, requests)
    assert unshared.counters["prefill_tokens"] == SAMPLES * (sum(PROMPT_LENGTHS) - len(PROMPT_LENGTHS))

    shared = new_batcher(params, share=True)
    for request in requests:
        shared.add_request(request)
    shared.run_chunk()  # prompts 0 and 1 take the 8 slots: 3 + 3 pages held twice or more
    assert shared.engine.pages.shared_pages() == 3 * 1 + 3 * 1
    got = {c.request_id: c for c in shared.drain()}
    assert_same_completions(got, want)
    assert shared.counters["prefill_tokens"] == sum(PROMPT_LENGTHS) - len(PROMPT_LENGTHS)
    assert shared.counters["forked_requests"] == len(PROMPT_LENGTHS) * (SAMPLES - 1)
    assert shared.counters["shared_prompt_pages"] == (SAMPLES - 1) * (1 + 1 + 2 + 3)
    assert shared.engine.pages.free_pages(0) == shared.engine.pages_per_group
    assert shared.engine.pages.shared_pages() == 0


def test_a_sample_admitted_after_a_weight_update_prefills_its_prompt_again(params):
    """Two slots, three samples of one prompt: the first (4 tokens) ends after one chunk, then new
    params arrive. The third sample must not share the second's prompt pages (written by the old
    params): it is prefilled again, and all three match the unshared run with the same update."""
    graphdef, state = params
    newer = jax.tree.map(lambda leaf: leaf * 1.05, state)
    (prompt,) = {tuple(r.prompt_tokens) for r in group_requests((17,), 1, 1)}
    requests = [Request(i, list(prompt), max_new, seed=i, temperature=1.0) for i, max_new in enumerate((4, 30, 12))]
    runs = {}
    for share in (False, True):
        batcher = new_batcher(params, share=share, num_slots=2)
        for request in requests:
            batcher.add_request(request)
        finished = batcher.run_chunk()
        batcher.update_params(newer, version=1)
        finished += batcher.drain()
        runs[share] = ({c.request_id: c for c in finished}, batcher.counters)
    (want, _), (got, counters) = runs[False], runs[True]
    assert_same_completions(got, want)
    assert [set(got[i].versions) for i in range(3)] == [{0}, {0, 1}, {1}]
    assert counters["prefill_calls"] == 2 and counters["forked_requests"] == 1

    batcher = new_batcher(params, share=True, num_slots=2)  # no update: the third shares the second's pages
    drain(batcher, requests)
    assert batcher.counters["prefill_calls"] == 1 and batcher.counters["forked_requests"] == 2


def test_a_short_pool_with_shared_prompts_preempts_and_gives_the_tokens_of_a_full_pool(params):
    """4 slots on 10 pages of 8 tokens, two prompts x 3 samples of up to 40 tokens: sequences are
    preempted (a preempted prompt holder leaves its sharers their pages) and every sample ends with
    the tokens of the fully provisioned, unshared pool; every page is free at the end."""
    requests = group_requests((9, 20), 3, max_new=40)
    want = drain(new_batcher(params, share=False, num_slots=4), requests)
    short = new_batcher(params, share=True, num_slots=4, num_pages=10)
    got = drain(short, requests)
    assert short.counters["preempted"] >= 1 and short.counters["forked_requests"] >= 1
    assert_same_completions(got, want)
    assert short.engine.pages.free_pages(0) == 10
