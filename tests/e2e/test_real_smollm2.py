"""SmolLM2-135M-Instruct, a real pretrained checkpoint (tests/support/real_models.py), against transformers.

transformers in torch on the CPU is the independent reference: logits in float32, logits with
bfloat16 parameters and the float32 head, and greedy completions of GSM8K questions in the
model's own chat template. Then what a run does with a checkpoint directory whose files do not
belong together: a tokenizer of another model, a missing chat template.
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from scalerl_jax.config import recipes  # noqa: E402
from scalerl_jax.config.errors import ConfigError  # noqa: E402
from scalerl_jax.data import prompts  # noqa: E402
from scalerl_jax.models import load_checkpoint_tokenizer, load_hf  # noqa: E402
from scalerl_jax.run.sampling_setup import check_token_ids, make_prompt_encoder  # noqa: E402
from scalerl_jax.sampler import generate  # noqa: E402

MAX_NEW_TOKENS = 48
# float32 on both sides; the two differ only in the order of float32 sums over 30 layers
# (measured: 1.06e-4 max abs on logits of magnitude up to 38; 1.6e-4 over 188 positions), so 5e-4
# leaves room for other CPUs' kernels and stays far below what a wrong weight or op would make.
FLOAT32_ATOL = 5e-4


@pytest.fixture(scope="module")
def torch_model(smollm2_dir):
    torch.set_num_threads(1)  # torch's threads spin against jax's on a busy 2-core machine: 20x slower
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_prompts(smollm2_dir, gsm8k_test_questions):
    """GSM8K questions in the default prompt template inside SmolLM2's chat template, as transformers
    encodes them (`apply_chat_template`); our encoder must give the same ids."""
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    tokens = load_checkpoint_tokenizer(smollm2_dir)
    encoder = prompts.PromptEncoder(
        tokens.tokenizer,
        prompts.PromptFormat(chat_template=tokens.chat_template),
        special_tokens=tokens.special_tokens,
    )
    out = []
    for question in gsm8k_test_questions:
        messages = [{"role": "user", "content": prompts.format_problem(question, prompts.DEFAULT_TEMPLATE)}]
        ids = list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        assert encoder.encode_unchecked(question) == ids
        out.append(ids)
    return out


def torch_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def our_logits(model, ids: list[int]) -> np.ndarray:
    return np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray([ids]))[0]).astype(np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def mean_kl(reference_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean over positions of KL(p_ref || p) = sum_v p_ref(v) (log p_ref(v) - log p(v))."""
    ref, other = log_softmax(reference_logits), log_softmax(logits)
    return float((np.exp(ref) * (ref - other)).sum(-1).mean())


def test_float32_logits_match_transformers(smollm2_dir, torch_model, chat_prompts):
    model = load_hf(smollm2_dir, dtype="float32")
    for ids in chat_prompts[:2]:
        want = torch_logits(torch_model, ids)
        got = our_logits(model, ids)
        # `make upgrade` runs this file with -s: the number a new jax or torch moves, in its output.
        print(f"numerics: float32 max abs logit difference {np.abs(got - want).max():.3g} over {len(ids)} positions")
        assert np.abs(want).max() > 10  # real logits, not a degenerate model
        np.testing.assert_allclose(got, want, atol=FLOAT32_ATOL, rtol=0)


def test_bfloat16_with_float32_head_is_as_close_as_transformers_own_bfloat16(smollm2_dir, torch_model, chat_prompts):
    """bfloat16 keeps 8 significant bits (relative rounding up to 2^-9 per op), so over 30 layers
    the logits move by up to a unit or two. The bar is transformers running the same weights in
    bfloat16: with the head in float32 our distributions must be as close to float32's by KL, to
    within 10%, and closer than with the head in bfloat16. Measured on these 188 positions with jax
    0.10.2 and torch 2.13: ours 1.68e-3 nats (1.25 max abs logit, every argmax kept), ours with a
    bfloat16 head 2.02e-3, transformers' bfloat16 1.66e-3. An older jax gave ours 1.2e-3 on the
    same weights: XLA's CPU rounding of bfloat16 chains moves this by tens of percent between
    releases, hence parity within 10% rather than a strict win."""
    ours = load_hf(smollm2_dir, dtype="bfloat16", fp32_head=True)
    assert ours.config.dtype == "bfloat16" and ours.config.fp32_head
    torch_bf16 = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    ids = chat_prompts[0] + chat_prompts[1]
    want = torch_logits(torch_model, ids)
    got = our_logits(ours, ids)
    ours_kl, theirs_kl = mean_kl(want, got), mean_kl(want, torch_logits(torch_bf16, ids))
    bf16_head_kl = mean_kl(want, our_logits(load_hf(smollm2_dir, dtype="bfloat16", fp32_head=False), ids))
    ours_agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    print(
        f"numerics: bfloat16 KL to float32 ours {ours_kl:.3g} nats, transformers' {theirs_kl:.3g}, "
        f"ours with a bfloat16 head {bf16_head_kl:.3g}; argmax kept {ours_agree:.3f}"
    )
    assert 0 < ours_kl <= 1.1 * theirs_kl, (ours_kl, theirs_kl)
    assert ours_kl < bf16_head_kl, (ours_kl, bf16_head_kl)
    assert ours_kl < 0.01 and ours_agree > 0.95, (ours_kl, ours_agree)


def test_greedy_completions_equal_transformers_generate(smollm2_dir, torch_model, chat_prompts):
    """8 GSM8K prompts through 4 decode slots (so finished slots are refilled), 48 new tokens each,
    stopping at the checkpoint's stop ids, token for token what `generate(do_sample=False)` gives."""
    tokens = load_checkpoint_tokenizer(smollm2_dir)
    assert tokens.stop_ids == (tokens.tokenizer.token_to_id("<|im_end|>"),)
    model = load_hf(smollm2_dir, dtype="float32")
    ours = generate(model, chat_prompts, max_new_tokens=MAX_NEW_TOKENS, num_slots=4, stop_tokens=tokens.stop_ids)
    for ids, completion in zip(chat_prompts, ours):
        with torch.no_grad():
            out = torch_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
            )
        want = out[0, len(ids) :].tolist()
        assert completion.tokens == want, (tokens.tokenizer.decode(completion.tokens), tokens.tokenizer.decode(want))


# ----------------------------------------------------------------------------------------------
# Checkpoint directories whose files do not belong together
# ----------------------------------------------------------------------------------------------


def smollm2_with_tokenizer_of(smollm2_dir: str, tokenizer_dir: str, out: str) -> str:
    """SmolLM2's config, generation config and weights (linked) with another model's tokenizer files."""
    os.makedirs(out)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(smollm2_dir, name), out)
    os.symlink(os.path.join(smollm2_dir, "model.safetensors"), os.path.join(out, "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), out)
    return out


def test_a_tokenizer_of_another_model_is_refused_naming_both_files(smollm2_dir, qwen3_tokenizer_dir, tmp_path):
    """SmolLM2's weights (49,152 embedding rows) with Qwen3's tokenizer (ids up to 151,668): one
    line naming config.json and tokenizer.json with both sizes."""
    mixed = smollm2_with_tokenizer_of(smollm2_dir, qwen3_tokenizer_dir, str(tmp_path / "mixed"))
    config = recipes.scalerl_8b()
    config.data.answer_format = "plain"
    tokens = load_checkpoint_tokenizer(mixed)
    with pytest.raises(ConfigError) as raised:
        check_token_ids(config, tokens, mixed)
    (message,) = raised.value.problems
    assert message == (
        f"{mixed}/config.json: vocab_size = 49152, but the tokenizer files of {mixed} (tokenizer.json, "
        "tokenizer_config.json, generation_config.json) give ids outside it: tokenizer.json has 151669 tokens "
        "(ids up to 151668); eos_token '<|im_end|>' = 151645; pad_token '<|endoftext|>' = 151643; "
        "stop ids [151645]. The model has no rows for them: a tokenizer from another model?"
    )
    assert "\n" not in message


def test_a_tokenizer_larger_than_the_embedding_is_refused_when_its_named_ids_fit(qwen3_tokenizer_dir, tmp_path):
    """Qwen3's tokenizer with an embedding of 151,646 rows: its named special and stop ids fit, but
    its added tokens (151,646 to 151,668: <tool_call>, <think>...) have no rows, and a prompt that
    contains one would read a wrong row, silently."""
    checkpoint = str(tmp_path / "model")
    shutil.copytree(qwen3_tokenizer_dir, checkpoint)
    with open(os.path.join(checkpoint, "config.json"), "w") as f:
        f.write('{"vocab_size": 151646, "eos_token_id": 151645}')
    config = recipes.scalerl_8b()
    config.data.answer_format = "plain"
    tokens = load_checkpoint_tokenizer(checkpoint)
    assert all(0 <= (tokens.tokenizer.token_to_id(t) or -1) < 151646 for t in tokens.special_tokens.values())
    assert tokens.tokenizer.encode("<think>", add_special_tokens=False).ids == [151667]
    with pytest.raises(ConfigError, match=r"tokenizer\.json has 151669 tokens \(ids up to 151668\)\. The model"):
        check_token_ids(config, tokens, checkpoint)


def test_a_missing_chat_template_is_refused_naming_the_key_and_the_files(smollm2_dir, tmp_path):
    """SmolLM2 without its chat_template.jinja, under the default `data.use_chat_template=True`."""
    checkpoint = str(tmp_path / "no_template")
    os.makedirs(checkpoint)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(smollm2_dir, name), checkpoint)
    config = recipes.scalerl_8b()
    assert config.data.use_chat_template
    with pytest.raises(ConfigError) as raised:
        make_prompt_encoder(config, load_checkpoint_tokenizer(checkpoint), checkpoint)
    assert raised.value.problems == [
        f"config key `data.use_chat_template` = True, but the checkpoint {checkpoint} has no chat template "
        f"({checkpoint}/chat_template.jinja does not exist and {checkpoint}/tokenizer_config.json has no "
        "`chat_template`); set it to False for a base model's plain prompts"
    ]
    config.data.use_chat_template = False
    encoder = make_prompt_encoder(config, load_checkpoint_tokenizer(checkpoint), checkpoint)
    assert encoder.text("2+3") == prompts.format_problem("2+3", config.data.prompt_template)
