"""Prompt ids of real tokenizers and real chat templates == transformers' `apply_chat_template`.

The tokenizers are SmolLM2-135M-Instruct's (rebuilt from its GGUF), Qwen3's and Llama 3.1's (npm
packages); the templates are each tokenizer's own and the ones llama.cpp ships for Qwen2.5, Qwen3,
Llama 3.1 and the DeepSeek-R1 distills (tests/support/real_models.py). The user turns are GSM8K questions.
"""

import functools
import os
import subprocess
import sys

import pytest
from repo_paths import SUPPORT

transformers = pytest.importorskip("transformers")

import real_models  # noqa: E402

from scalerl_jax.data import prompts  # noqa: E402
from scalerl_jax.models import load_checkpoint_tokenizer  # noqa: E402

SYSTEM_MESSAGES = (None, "You are a careful math tutor. Think step by step.")


TOKENIZER_FIXTURES = {"smollm2": "smollm2_dir", "qwen3": "qwen3_tokenizer_dir", "llama3_1": "llama3_1_tokenizer_dir"}


@functools.cache
def transformers_tokenizer(path: str):
    return transformers.AutoTokenizer.from_pretrained(path)


def transformers_ids(tokenizer, messages: list[dict], chat_template: str | None) -> list[int]:
    """`apply_chat_template(..., add_generation_prompt=True, tokenize=True)` as a list of ids."""
    ids = tokenizer.apply_chat_template(
        messages, chat_template=chat_template, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def assert_prompt_ids_match(
    path: str, chat_template: str | None, system_message: str | None, questions: list[str]
) -> None:
    """Our encoder and transformers give the same ids for GSM8K questions in the default prompt template."""
    ours = load_checkpoint_tokenizer(path)
    theirs = transformers_tokenizer(path)
    template = chat_template if chat_template is not None else ours.chat_template
    assert template is not None
    encoder = prompts.PromptEncoder(
        ours.tokenizer,
        prompts.PromptFormat(chat_template=template, system_message=system_message),
        special_tokens=ours.special_tokens,
    )
    for question in questions:
        user = prompts.format_problem(question, prompts.DEFAULT_TEMPLATE)
        messages = ([{"role": "system", "content": system_message}] if system_message else []) + [
            {"role": "user", "content": user}
        ]
        want = transformers_ids(theirs, messages, chat_template)
        assert encoder.encode_unchecked(question) == want, theirs.decode(want)


@pytest.mark.parametrize("family", ["smollm2", "qwen3", "llama3_1"])
@pytest.mark.parametrize("system_message", SYSTEM_MESSAGES)
def test_own_chat_template_ids_match_transformers(request, gsm8k_test_questions, family, system_message):
    path = request.getfixturevalue(TOKENIZER_FIXTURES[family])
    assert_prompt_ids_match(path, None, system_message, gsm8k_test_questions)


@pytest.mark.parametrize("name", sorted(real_models.TEMPLATES))
@pytest.mark.parametrize("system_message", SYSTEM_MESSAGES)
def test_llama_cpp_template_ids_match_transformers(
    request, llama_cpp_chat_templates, gsm8k_test_questions, name, system_message
):
    with open(llama_cpp_chat_templates[name], encoding="utf-8") as f:
        chat_template = f.read()
    path = request.getfixturevalue(TOKENIZER_FIXTURES[real_models.TEMPLATES[name][1]])
    assert_prompt_ids_match(path, chat_template, system_message, gsm8k_test_questions)


def test_smollm2_template_is_chatml_with_its_default_system_turn(smollm2_dir):
    """The rebuilt checkpoint's template is ChatML and, without a system message, writes SmolLM2's
    own default system turn (the one in the GGUF's metadata), so the parity above covers a real template."""
    tokens = load_checkpoint_tokenizer(smollm2_dir)
    encoder = prompts.PromptEncoder(
        tokens.tokenizer, prompts.PromptFormat(template="{problem}", chat_template=tokens.chat_template)
    )
    text = encoder.text("What is 2+3?")
    assert text.startswith("<|im_start|>system\n"), text
    assert text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"), text
    assert tokens.eos_token == "<|im_end|>"


def test_racing_builds_leave_one_complete_entry(tmp_path):
    """Two processes building the same cache entry at once both get the same complete directory,
    and neither leaves its temporary directory behind."""
    script = (
        "import os, sys, time; sys.path.insert(0, sys.argv[1]); import real_models\n"
        "def build(out):\n"
        "    time.sleep(1)\n"
        "    open(os.path.join(out, 'built_by'), 'w').write(str(os.getpid()))\n"
        "print(real_models.cached('entry', build))\n"
    )
    env = dict(os.environ, SCALERL_TEST_CACHE=str(tmp_path))
    racers = [
        subprocess.Popen([sys.executable, "-c", script, SUPPORT], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [racer.communicate(timeout=120)[0].strip() for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0]
    assert outputs == [str(tmp_path / "entry")] * 2
    assert sorted(os.listdir(tmp_path)) == ["entry"]
    assert (tmp_path / "entry" / "built_by").read_text() in {str(racer.pid) for racer in racers}
