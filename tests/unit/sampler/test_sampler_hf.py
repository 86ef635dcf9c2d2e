"""Continuous batching on a tiny random Llama from transformers: greedy tokens == transformers'
generate, and samples of shared prompts scored as transformers scores them."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from scalerl_jax.models import load_hf  # noqa: E402
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig, Request, generate  # noqa: E402

PROMPT_LENGTHS = (1, 4, 9, 17, 6)
MAX_NEW = 10


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.3,  # well separated logits: argmax robust to float rounding
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf_model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    hf_model.save_pretrained(path, safe_serialization=True)
    return hf_model, str(path)


@pytest.mark.parametrize("prefill_chunk", [4, 32])
def test_greedy_tokens_equal_transformers_generate(hf_checkpoint, prefill_chunk):
    """Prompts of 1 to 17 tokens, prefilled whole (pieces of 32) or in up to 4 pieces of 4."""
    hf_model, path = hf_checkpoint
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, size=n).tolist() for n in PROMPT_LENGTHS]
    model = load_hf(path, dtype="float32")
    ours = generate(model, prompts, max_new_tokens=MAX_NEW, num_slots=3, chunk_size=4, prefill_chunk=prefill_chunk)
    for prompt, completion in zip(prompts, ours):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                eos_token_id=None,
                pad_token_id=0,
            )
        want = out[0, len(prompt) :].tolist()
        assert len(want) == MAX_NEW
        assert completion.tokens == want, (prompt, completion.tokens, want)


def test_samples_sharing_a_prompt_score_as_transformers_scores_them(hf_checkpoint):
    """3 prompts x 4 samples at temperature 1 (each prompt prefilled once, in pieces of 8 tokens,
    two a call, its other samples on its shared pages): every sampled token's log-prob equals transformers' log-softmax at that token
    given the prompt and the sample's tokens before it."""
    hf_model, path = hf_checkpoint
    model = load_hf(path, dtype="float32")
    graphdef, params = nnx.split(model)
    engine = Engine(
        graphdef,
        model.config,
        EngineConfig(
            num_slots=4,
            max_len=64,
            chunk_size=4,
            prefill_chunk=8,
            max_prefill_rows=2,
            min_decode_window=16,
            page_size=4,
        ),
    )
    batcher = ContinuousBatcher(engine, params, seed=5)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, size=n).tolist() for n in (6, 13, 21)]
    for p, prompt in enumerate(prompts):
        for s in range(4):
            batcher.add_request(Request((p, s), prompt, MAX_NEW, seed=4 * p + s, temperature=1.0))
    completions = batcher.drain()
    assert batcher.counters["forked_requests"] == 3 * 3
    assert len({tuple(c.tokens) for c in completions}) == len(completions)  # the samples differ
    for completion in completions:
        sequence = torch.tensor([completion.prompt_tokens + completion.tokens])
        with torch.no_grad():
            logits = hf_model(sequence).logits[0].double()
        start = len(completion.prompt_tokens)
        want = torch.log_softmax(logits[start - 1 : -1], -1)[torch.arange(MAX_NEW), sequence[0, start:]]
        np.testing.assert_allclose(completion.logprobs, want.numpy(), atol=1e-4, rtol=0)
