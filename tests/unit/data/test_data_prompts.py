"""Prompt formatting: template strings, chat templates (checked against transformers), budgets."""

import logging

import numpy as np
import pytest
from tokenizers import Tokenizer

from scalerl_jax.data import prompts, synthetic
from scalerl_jax.data.tokenizer import train_tokenizer

# A ChatML template in the style of Qwen2's tokenizer_config.json (system turn optional).
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A Llama-style template that uses bos_token, raise_exception and whitespace control.
LLAMA_LIKE = (
    "{{ bos_token }}"
    "{% for message in messages %}\n"
    "    {% if message['role'] not in ['system', 'user'] %}"
    "{{ raise_exception('bad role') }}{% endif %}\n"
    "    {{ '[' + message['role'] | upper + '] ' + message['content'] | trim + '\n' }}"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    problems = synthetic.generate_splits(synthetic.SyntheticTaskConfig(split_sizes=(("train", 64),)))["train"]
    corpus = synthetic.tokenizer_corpus(problems, "Compute {problem}.")
    path = str(tmp_path_factory.mktemp("tok"))
    train_tokenizer(corpus, 290, path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")


def test_format_problem():
    assert prompts.format_problem("1+2", "Q: {problem} in \\boxed{}") == "Q: 1+2 in \\boxed{}"
    with pytest.raises(ValueError, match="placeholder"):
        prompts.format_problem("1+2", "no placeholder")


def test_plain_template_encodes_as_the_tokenizer_call(tokenizer, tokenizer_dir):
    """Without a chat template the post-processor of tokenizer.json adds bos, as in transformers."""
    transformers = pytest.importorskip("transformers")
    encoder = prompts.PromptEncoder(tokenizer, prompts.PromptFormat(template="Compute {problem}."))
    ids = encoder.encode_unchecked("12+7")
    assert ids[0] == tokenizer.token_to_id("<s>") == 1
    assert tokenizer.decode(ids[1:]) == "Compute 12+7."
    assert ids == transformers.AutoTokenizer.from_pretrained(tokenizer_dir)("Compute 12+7.")["input_ids"]


@pytest.mark.parametrize("chat_template", [CHATML, LLAMA_LIKE])
@pytest.mark.parametrize("system_message", [None, "Be brief."])
def test_chat_template_matches_transformers(tokenizer, chat_template, system_message):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fmt = prompts.PromptFormat(
        template="Solve {problem}. Answer in \\boxed{}.", chat_template=chat_template, system_message=system_message
    )
    encoder = prompts.PromptEncoder(tokenizer, fmt, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    messages = [{"role": "system", "content": system_message}] if system_message else []
    messages.append({"role": "user", "content": "Solve 3+4. Answer in \\boxed{}."})
    expected = hf.apply_chat_template(messages, chat_template=chat_template, tokenize=False, add_generation_prompt=True)
    assert encoder.text("3+4") == expected
    # With a chat template, bos comes from the template text, not prepended again.
    assert encoder.encode_unchecked("3+4") == tokenizer.encode(expected, add_special_tokens=False).ids
    assert encoder.encode_unchecked("3+4") == hf.apply_chat_template(
        messages, chat_template=chat_template, add_generation_prompt=True, return_dict=False
    )


def test_over_budget_prompts_are_counted_and_skipped(tokenizer, caplog):
    fmt = prompts.PromptFormat(template="{problem}", max_prompt_tokens=5)
    encoder = prompts.PromptEncoder(tokenizer, fmt)
    # Digits are single tokens, so "1+2" is 3 tokens (+ bos = 4); "12+34" is 5 (+ bos = 6).
    with caplog.at_level(logging.WARNING):
        encoded = encoder.encode(["1+2", "12+34", "5-1", "123+4"])
    assert encoded.source_indices == [0, 2]
    assert encoded.num_too_long == 2
    assert [len(t) for t in encoded.tokens] == [4, 4]
    assert "skipped 2 of 4 prompts" in caplog.text


def test_sft_example():
    tokens, mask = prompts.sft_example([1, 10, 11], [20, 21], eos_id=2, max_len=8, pad_id=0)
    assert tokens == [1, 10, 11, 20, 21, 2, 0, 0]
    assert mask == [0, 0, 0, 1, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="exceed max_len=5"):
        prompts.sft_example([1, 10, 11], [20, 21], eos_id=2, max_len=5, pad_id=0)


def test_bad_format(tokenizer):
    with pytest.raises(ValueError, match="placeholder"):
        prompts.PromptEncoder(tokenizer, prompts.PromptFormat(template="no slot"))
    with pytest.raises(ValueError, match="system_message needs a chat_template"):
        prompts.PromptEncoder(tokenizer, prompts.PromptFormat(system_message="Be brief."))


def test_build_prompt_set_aligns_answers_and_labels(tokenizer):
    encoder = prompts.PromptEncoder(tokenizer, prompts.PromptFormat(template="{problem}", max_prompt_tokens=5))
    rows = [
        {"problem": "1+2", "answer": "3", "level": 0},
        {"problem": "12+34", "answer": "46", "level": 1},  # 6 tokens with bos: skipped
        {"problem": "9-4", "answer": "5", "level": 2},
    ]
    prompt_set = prompts.build_prompt_set(rows, encoder, label_field="level")
    assert prompt_set.answers == ["3", "5"] and prompt_set.labels == ["0", "2"]
    assert prompt_set.source_indices == [0, 2] and prompt_set.num_too_long == 1
    assert [tokenizer.decode(t[1:]) for t in prompt_set.tokens] == ["1+2", "9-4"]
    with pytest.raises(ValueError, match="row 0 has no field 'answer'"):
        prompts.build_prompt_set([{"problem": "1"}], encoder)


def test_sft_arrays(tokenizer):
    encoder = prompts.PromptEncoder(tokenizer, prompts.PromptFormat(template="{problem}="))
    rows = [{"problem": "1+2", "solution": "<think>1+2=3</think>\\boxed{3}"}]
    tokens, mask = prompts.sft_arrays(rows, encoder, tokenizer, max_len=24, eos_id=2, pad_id=0)
    assert tokens.shape == mask.shape == (1, 24) and tokens.dtype == np.int32
    # bos + "1+2=" is 5 tokens; the completion and eos follow, then padding.
    completion = tokenizer.encode(rows[0]["solution"], add_special_tokens=False).ids
    n = len(completion)
    assert tokens[0, :5].tolist() == [1] + tokenizer.encode("1+2=", add_special_tokens=False).ids
    assert tokens[0, 5 : 5 + n].tolist() == completion and tokens[0, 5 + n] == 2
    assert mask[0].tolist() == [0.0] * 5 + [1.0] * (n + 1) + [0.0] * (24 - 6 - n)
    with pytest.raises(ValueError, match="row 0"):
        prompts.sft_arrays(rows, encoder, tokenizer, max_len=8, eos_id=2, pad_id=0)


# Uses transformers' extra template globals: strftime_now and the {% generation %} block.
DATED = (
    "{{ bos_token }}Today is {{ strftime_now('%d %b %Y') }}.\n"
    "{% for message in messages %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{{ eos_token }}{% endfor %}"
    "{% if tools is none and documents is none %}[no tools]{% endif %}"
)


def test_transformers_template_globals(tokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    encoder = prompts.PromptEncoder(
        tokenizer,
        prompts.PromptFormat(template="{problem}", chat_template=DATED),
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )
    expected = hf.apply_chat_template(
        [{"role": "user", "content": "1+2"}], chat_template=DATED, tokenize=False, add_generation_prompt=True
    )
    assert encoder.text("1+2") == expected
    assert expected.endswith("1+2</s>[no tools]")
