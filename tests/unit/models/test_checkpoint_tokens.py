"""Special tokens, stop ids and prompt ids of Llama 3.1 / Qwen2.5 / Qwen3 checkpoints, against
transformers (AutoTokenizer, GenerationConfig) as the reference; dtype-likes and file errors of
load_hf."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from family_checkpoints import EXPECTED, FAMILIES, make_family_checkpoint  # noqa: E402

from scalerl_jax.data import prompts  # noqa: E402
from scalerl_jax.models import dtype_name, load_checkpoint_tokenizer, load_hf, load_hf_config  # noqa: E402
from scalerl_jax.models.transformer import DecoderLayer  # noqa: E402

PROBLEMS = (
    "What is 12345 + 678?",
    "Let $f(x) = \\frac{x^{2}}{3}$. Find $f(6)$ and write it as \\boxed{}.",
    "  Leading spaces, trailing newline\n",
    "Ünïcode ∑_{i=1}^{n} i = \\frac{n(n+1)}{2}",
)
SYSTEM_MESSAGES = (None, "You are a careful mathematician. Answer in \\boxed{}.")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: make_family_checkpoint(family, str(root / family)) for family in FAMILIES}


def _copy(src, dst, edit_file=None, edit=None):
    shutil.copytree(src, dst)
    if edit_file is not None:
        assert edit is not None, "an edited file needs its edit"
        with open(os.path.join(dst, edit_file)) as f:
            content = json.load(f)
        edit(content)
        with open(os.path.join(dst, edit_file), "w") as f:
            json.dump(content, f)
    return str(dst)


@pytest.mark.parametrize("family", FAMILIES)
def test_special_and_stop_tokens(checkpoints, family):
    path = checkpoints[family]
    expected = EXPECTED[family]
    loaded = load_checkpoint_tokenizer(path)
    token_id = loaded.tokenizer.token_to_id
    assert (loaded.bos_token, loaded.bos_id) == (expected["bos"], expected["bos"] and token_id(expected["bos"]))
    assert (loaded.eos_token, loaded.eos_id) == (expected["eos"], token_id(expected["eos"]))
    pad = expected["pad"] or expected["eos"]  # no pad token: eos pads
    assert (loaded.pad_token, loaded.pad_id) == (pad, token_id(pad))
    stop_names = list(dict.fromkeys([*expected["generation_eos"], expected["eos"]]))
    assert loaded.stop_ids == tuple(token_id(name) for name in stop_names)
    if family == "llama3.1":
        assert sorted(stop_names) == sorted(["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"])
    else:
        assert stop_names == ["<|im_end|>", "<|endoftext|>"]
    # The same as transformers reads them.
    reference = transformers.AutoTokenizer.from_pretrained(path)
    assert loaded.special_tokens == reference.special_tokens_map
    assert (loaded.bos_id, loaded.eos_id) == (reference.bos_token_id, reference.eos_token_id)
    assert loaded.pad_id == (reference.pad_token_id if reference.pad_token_id is not None else reference.eos_token_id)
    generation = transformers.GenerationConfig.from_pretrained(path)
    assert list(loaded.stop_ids[: len(generation.eos_token_id)]) == generation.eos_token_id
    assert loaded.chat_template == reference.chat_template


@pytest.mark.parametrize("system_message", SYSTEM_MESSAGES)
@pytest.mark.parametrize("family", FAMILIES)
def test_chat_prompt_ids_match_apply_chat_template(checkpoints, family, system_message):
    path = checkpoints[family]
    loaded = load_checkpoint_tokenizer(path)
    reference = transformers.AutoTokenizer.from_pretrained(path)
    encoder = prompts.PromptEncoder(
        loaded.tokenizer,
        prompts.PromptFormat(chat_template=loaded.chat_template, system_message=system_message),
        special_tokens=loaded.special_tokens,
    )
    for problem in PROBLEMS:
        messages = [{"role": "system", "content": system_message}] if system_message else []
        messages.append({"role": "user", "content": prompts.format_problem(problem, prompts.DEFAULT_TEMPLATE)})
        expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert encoder.encode_unchecked(problem) == expected, (family, problem)
    if family == "llama3.1":
        assert encoder.encode_unchecked(PROBLEMS[0])[0] == loaded.bos_id  # written once, by the template


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_prompt_ids_match_tokenizer_call(checkpoints, family):
    path = checkpoints[family]
    loaded = load_checkpoint_tokenizer(path)
    reference = transformers.AutoTokenizer.from_pretrained(path)
    encoder = prompts.PromptEncoder(loaded.tokenizer, prompts.PromptFormat())
    for problem in PROBLEMS:
        expected = reference(prompts.format_problem(problem, prompts.DEFAULT_TEMPLATE))["input_ids"]
        ids = encoder.encode_unchecked(problem)
        assert ids == expected, (family, problem)
        assert (ids[0] == loaded.bos_id) == EXPECTED[family]["adds_bos"]


def test_chat_template_file_and_named_list(checkpoints, tmp_path):
    path = checkpoints["qwen2.5"]
    listed = _copy(
        path,
        tmp_path / "listed",
        "tokenizer_config.json",
        lambda c: c.update(
            chat_template=[
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ messages[0]['content'] }}"},
            ]
        ),
    )
    assert load_checkpoint_tokenizer(listed).chat_template == "{{ messages[0]['content'] }}"
    jinja = _copy(path, tmp_path / "jinja")
    with open(os.path.join(jinja, "chat_template.jinja"), "w") as f:
        f.write("{{ bos_token }}{{ messages[0]['content'] }}")
    assert (
        load_checkpoint_tokenizer(jinja).chat_template
        == transformers.AutoTokenizer.from_pretrained(jinja).chat_template
        == "{{ bos_token }}{{ messages[0]['content'] }}"
    )
    unnamed = _copy(
        path,
        tmp_path / "unnamed",
        "tokenizer_config.json",
        lambda c: c.update(chat_template=[{"name": "rag", "template": "x"}]),
    )
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template list has no 'default'"):
        load_checkpoint_tokenizer(unnamed)


def test_legacy_special_tokens_map_and_addedtoken_dicts(checkpoints, tmp_path):
    """Without added_tokens_decoder, special_tokens_map.json supplies (and overrides) the tokens."""
    path = checkpoints["qwen2.5"]

    def legacy(config):
        del config["added_tokens_decoder"]
        config["eos_token"] = {
            "__type": "AddedToken",
            "content": "<|endoftext|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        }
        del config["pad_token"]

    legacy_dir = _copy(path, tmp_path / "legacy", "tokenizer_config.json", legacy)
    with open(os.path.join(legacy_dir, "special_tokens_map.json"), "w") as f:
        json.dump(
            {
                "eos_token": {
                    "content": "<|im_end|>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                },
                "pad_token": "<|im_start|>",
            },
            f,
        )
    loaded = load_checkpoint_tokenizer(legacy_dir)
    reference = transformers.AutoTokenizer.from_pretrained(legacy_dir)
    assert (loaded.eos_token, loaded.pad_token) == ("<|im_end|>", "<|im_start|>")
    assert (loaded.eos_id, loaded.pad_id) == (reference.eos_token_id, reference.pad_token_id)
    assert loaded.special_tokens == reference.special_tokens_map
    # With added_tokens_decoder present, special_tokens_map.json is not read (as in transformers).
    modern_dir = _copy(path, tmp_path / "modern")
    shutil.copy(os.path.join(legacy_dir, "special_tokens_map.json"), modern_dir)
    assert load_checkpoint_tokenizer(modern_dir).pad_token == "<|endoftext|>"
    assert transformers.AutoTokenizer.from_pretrained(modern_dir).pad_token == "<|endoftext|>"


def test_without_generation_config_stop_ids_come_from_config_json(checkpoints, tmp_path):
    path = _copy(checkpoints["qwen2.5"], tmp_path / "nogen")
    os.remove(os.path.join(path, "generation_config.json"))
    with open(os.path.join(path, "config.json")) as f:
        config_eos = json.load(f)["eos_token_id"]
    loaded = load_checkpoint_tokenizer(path)
    assert loaded.stop_ids == (config_eos,) == (loaded.tokenizer.token_to_id("<|im_end|>"),)


def test_tokenizer_file_errors_name_file_and_field(checkpoints, tmp_path):
    path = checkpoints["llama3.1"]
    broken = _copy(path, tmp_path / "broken")
    with open(os.path.join(broken, "tokenizer_config.json"), "w") as f:
        f.write('{"eos_token": "<|eot_id|>",')
    with pytest.raises(ValueError, match=r"broken/tokenizer_config\.json: malformed JSON"):
        load_checkpoint_tokenizer(broken)
    unknown = _copy(path, tmp_path / "unknown", "tokenizer_config.json", lambda c: c.update(eos_token="<|im_end|>"))
    with pytest.raises(
        ValueError,
        match=r"unknown/tokenizer_config\.json: eos_token '<\|im_end\|>' is not in the "
        r"vocabulary of tokenizer\.json",
    ):
        load_checkpoint_tokenizer(unknown)
    no_eos = _copy(path, tmp_path / "no_eos", "tokenizer_config.json", lambda c: c.pop("eos_token"))
    with pytest.raises(ValueError, match=r"no_eos/tokenizer_config\.json: no eos_token"):
        load_checkpoint_tokenizer(no_eos)
    moved = _copy(
        path,
        tmp_path / "moved",
        "tokenizer_config.json",
        lambda c: c["added_tokens_decoder"].update({"3": c["added_tokens_decoder"]["600"]}),
    )
    with pytest.raises(
        ValueError,
        match=r"moved/tokenizer_config\.json: added_tokens_decoder\['3'\] is "
        r"'<\|begin_of_text\|>', but tokenizer\.json gives that token id 600",
    ):
        load_checkpoint_tokenizer(moved)
    bad_stop = _copy(path, tmp_path / "bad_stop", "generation_config.json", lambda c: c.update(eos_token_id=[1 << 20]))
    with pytest.raises(ValueError, match=r"bad_stop/generation_config\.json: eos_token_id"):
        load_checkpoint_tokenizer(bad_stop)
    with pytest.raises(FileNotFoundError, match=r"missing/tokenizer\.json"):
        load_checkpoint_tokenizer(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "dtype,name",
    [
        (jnp.bfloat16, "bfloat16"),
        (np.float32, "float32"),
        (np.dtype("float32"), "float32"),
        ("bfloat16", "bfloat16"),
        ("float32", "float32"),
        (jnp.float16, "float16"),
    ],
)
def test_load_hf_accepts_dtype_likes(checkpoints, dtype, name):
    assert dtype_name(dtype) == name
    assert load_hf_config(checkpoints["qwen3"], dtype=dtype).dtype == name
    model = load_hf(checkpoints["qwen3"], dtype=dtype, fp32_head=False)
    assert model.config.dtype == name
    assert isinstance(model.layers, DecoderLayer)  # scan_layers: one stacked layer
    assert model.layers.mlp.gate_proj.get_value().dtype == jnp.dtype(name)


def test_load_hf_refuses_unsupported_dtypes(checkpoints):
    for bad, pattern in (
        ("int8", r"dtype='int8' \(int8\) is not supported"),
        ("bf16", r"dtype='bf16' is not a dtype"),
        (np.float64, r"float64.*not supported"),
    ):
        with pytest.raises(ValueError, match=pattern):
            load_hf_config(checkpoints["qwen3"], dtype=bad)


def test_load_hf_file_errors_name_the_file(checkpoints, tmp_path):
    path = checkpoints["qwen2.5"]
    bad_config = _copy(path, tmp_path / "bad_config")
    with open(os.path.join(bad_config, "config.json"), "w") as f:
        f.write('{"model_type": "qwen2", ')
    with pytest.raises(ValueError, match=r"bad_config/config\.json: malformed JSON"):
        load_hf(bad_config)
    truncated = _copy(path, tmp_path / "truncated")
    weights = os.path.join(truncated, "model.safetensors")
    with open(weights, "rb") as f:
        content = f.read()
    with open(weights, "wb") as f:
        f.write(content[: len(content) // 2])
    with pytest.raises(ValueError, match=r"truncated/model\.safetensors"):
        load_hf(truncated)
    garbage = _copy(path, tmp_path / "garbage")
    with open(os.path.join(garbage, "model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json header")
    with pytest.raises(ValueError, match=r"garbage/model\.safetensors"):
        load_hf(garbage)
