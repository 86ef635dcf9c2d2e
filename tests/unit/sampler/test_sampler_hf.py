"""Greedy continuous batching on a tiny random Llama from transformers == transformers' generate."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from scalerl_jax.models import load_hf  # noqa: E402
from scalerl_jax.sampler import generate  # noqa: E402

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


def test_greedy_tokens_equal_transformers_generate(hf_checkpoint):
    hf_model, path = hf_checkpoint
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, size=n).tolist() for n in PROMPT_LENGTHS]
    model = load_hf(path, dtype="float32")
    ours = generate(model, prompts, max_new_tokens=MAX_NEW, num_slots=3, chunk_size=4)
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
