"""Special tokens, stop tokens and the chat template of a Hugging Face checkpoint directory.

`load_checkpoint_tokenizer` reads the files a checkpoint ships with, with the precedence rules of
transformers 5 (`PreTrainedTokenizerBase._from_pretrained` and `TokenizersBackend`):

- `tokenizer.json`: the `tokenizers.Tokenizer`, used as is. Its post-processor decides what
  `encode(text, add_special_tokens=True)` adds (a bos for Llama 3, nothing for Qwen); the
  `add_bos_token` / `add_eos_token` keys of `tokenizer_config.json` are ignored when a
  `tokenizer.json` exists, as transformers ignores them.
- `tokenizer_config.json`: `bos_token`, `eos_token`, `pad_token`, `unk_token` (and `sep_token`,
  `cls_token`, `mask_token`): a string, an AddedToken-like dict with `"content"`, or null;
  `added_tokens_decoder` (id -> AddedToken dict), checked against `tokenizer.json`;
  `chat_template` (a string, or a list of `{name, template}` from which 'default' is taken);
  `split_special_tokens`.
- `special_tokens_map.json`: read only when `tokenizer_config.json` has no
  `added_tokens_decoder` (legacy checkpoints), and then its entries take precedence.
- `chat_template.jinja`: when present, it is the chat template (it wins over the config's).
- `generation_config.json` `eos_token_id` (an int or a list): the ids generation stops at; without
  that file, `config.json`'s `eos_token_id`, as `GenerationConfig.from_model_config` takes it.

Tokenizer classes that rebuild their pipeline in `__init__` (e.g. `Qwen2Tokenizer`) get their
normalizer and pre-tokenizer from the class in transformers and from `tokenizer.json` here; the
two agree for checkpoints as shipped. No token is looked up by an assumed name.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
# The named special tokens transformers passes to chat templates (`special_tokens_map`), in order.
SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class CheckpointFileError(ValueError):
    """A checkpoint directory's file that cannot be used (malformed JSON, an unreadable tokenizer or
    safetensors file, weights that disagree with config.json); the message names the file and
    field and what was expected."""


class MissingCheckpointFile(CheckpointFileError, FileNotFoundError):
    """A file the checkpoint directory must have is not there: bad input like any other
    `CheckpointFileError`, and a `FileNotFoundError` for callers that ask for that."""


@dataclasses.dataclass(frozen=True)
class CheckpointTokenizer:
    """A checkpoint's tokenizer with its special tokens, stop ids and chat template.

    Attributes:
      tokenizer: the `tokenizers.Tokenizer` of `tokenizer.json`.
      bos_token, bos_id: the beginning-of-sequence token, or None (Qwen has none).
      eos_token, eos_id: the tokenizer's end-of-sequence token (`tokenizer_config.json`).
      pad_token, pad_id: the padding token; the eos token when the checkpoint names none.
      stop_ids: every eos id of the generation config, then `eos_id` if not among them.
      chat_template: the jinja chat template, or None (base models).
      special_tokens: the named special tokens given to chat templates ({'bos_token': ..., ...}),
        as the files name them (no pad fallback), like transformers' `special_tokens_map`.
    """

    tokenizer: tokenizers.Tokenizer
    bos_token: str | None
    bos_id: int | None
    eos_token: str
    eos_id: int
    pad_token: str
    pad_id: int
    stop_ids: tuple[int, ...]
    chat_template: str | None
    special_tokens: dict[str, str]


def read_json(file: str) -> Any:
    """Parsed JSON of `file`; a ValueError naming the file when it is not valid JSON."""
    with open(file, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointFileError(f"{file}: malformed JSON ({e})") from e


def _read_json_object(file: str) -> dict[str, Any]:
    """`read_json(file)` that must be a JSON object."""
    value = read_json(file)
    if not isinstance(value, dict):
        raise CheckpointFileError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def token_content(value: Any, file: str, field: str) -> str | None:
    """A special-token entry as a string: a string, `{"content": ...}` (AddedToken), or None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise CheckpointFileError(
        f"{file}: {field} must be a string, an AddedToken object with 'content', or null; got {value!r}"
    )


def _chat_template_of(config: dict[str, Any], config_file: str) -> str | None:
    """`chat_template` of a parsed tokenizer config: a string, or the 'default' of a named list."""
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and all(isinstance(t, dict) for t in template):
        named = {entry.get("name"): entry.get("template") for entry in template}
        if not isinstance(named.get("default"), str):
            raise CheckpointFileError(
                f"{config_file}: chat_template list has no 'default' template (names {sorted(map(str, named))})"
            )
        return named["default"]
    raise CheckpointFileError(
        f"{config_file}: chat_template must be a string or a list of {{name, template}}; got {type(template).__name__}"
    )


def load_chat_template(path: str) -> str | None:
    """The chat template of checkpoint directory `path`, or None.

    `chat_template.jinja` when present, else `tokenizer_config.json['chat_template']`.
    """
    jinja_file = os.path.join(path, CHAT_TEMPLATE_FILE)
    if os.path.exists(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    config_file = os.path.join(path, TOKENIZER_CONFIG_FILE)
    if not os.path.exists(config_file):
        return None
    return _chat_template_of(_read_json_object(config_file), config_file)


def load_tokenizer_file(path: str) -> tokenizers.Tokenizer:
    """`tokenizers.Tokenizer` of `path/tokenizer.json` (errors name the file)."""
    file = os.path.join(path, TOKENIZER_FILE)
    if not os.path.exists(file):
        raise MissingCheckpointFile(f"{file} does not exist")
    try:
        return tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a bare Exception on bad files
        raise CheckpointFileError(f"{file}: not a valid tokenizers file ({e})") from e


def _special_token_sources(path: str, config: dict[str, Any], config_file: str) -> dict[str, tuple[str, str]]:
    """{field: (token, file it came from)} for the named special tokens present in the files."""
    found: dict[str, tuple[str, str]] = {}
    for field in SPECIAL_TOKEN_FIELDS:
        token = token_content(config.get(field), config_file, field)
        if token is not None:
            found[field] = (token, config_file)
    map_file = os.path.join(path, SPECIAL_TOKENS_MAP_FILE)
    if "added_tokens_decoder" not in config and os.path.exists(map_file):
        special_map = _read_json_object(map_file)
        for field in SPECIAL_TOKEN_FIELDS:
            if field in special_map:
                token = token_content(special_map[field], map_file, field)
                if token is None:
                    found.pop(field, None)
                else:
                    found[field] = (token, map_file)
    return found


def _check_added_tokens(tokenizer: tokenizers.Tokenizer, config: dict[str, Any], config_file: str) -> None:
    """Each `added_tokens_decoder` entry must be its id's token in `tokenizer.json`."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise CheckpointFileError(f"{config_file}: added_tokens_decoder must be an object (id -> token)")
    for key, entry in decoder.items():
        field = f"added_tokens_decoder[{key!r}]"
        content = token_content(entry, config_file, field)
        try:
            token_id = int(key)
        except ValueError:
            raise CheckpointFileError(f"{config_file}: {field}: the key is not a token id") from None
        actual = tokenizer.token_to_id(content) if content is not None else None
        if actual != token_id:
            raise CheckpointFileError(
                f"{config_file}: {field} is {content!r}, but {TOKENIZER_FILE} gives that token id {actual}"
            )


def _token_id(tokenizer: tokenizers.Tokenizer, token: str, file: str, field: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise CheckpointFileError(f"{file}: {field} {token!r} is not in the vocabulary of {TOKENIZER_FILE}")
    return token_id


def _generation_eos_ids(path: str, tokenizer: tokenizers.Tokenizer) -> list[int]:
    """eos ids of `generation_config.json` (else `config.json`), each checked against the vocabulary."""
    for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
        file = os.path.join(path, name)
        if os.path.exists(file):
            break
    else:
        return []
    value = _read_json_object(file).get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or tokenizer.id_to_token(token_id) is None:
            raise CheckpointFileError(
                f"{file}: eos_token_id {value!r}: {token_id!r} is not a token id of {TOKENIZER_FILE} "
                f"(vocabulary size {vocab_size})"
            )
    return ids


def stop_token_ids(generation_eos_ids: list[int], eos_id: int) -> tuple[int, ...]:
    """`generation_eos_ids` then `eos_id`, each once, in order of first appearance."""
    return tuple(dict.fromkeys([*generation_eos_ids, eos_id]))


def load_checkpoint_tokenizer(path: str) -> CheckpointTokenizer:
    """Reads the tokenizer, special tokens, stop ids and chat template of checkpoint directory `path`.

    See the module docstring for which file wins. Raises FileNotFoundError without
    `tokenizer.json`, and ValueError naming the file (and field) for malformed JSON, a missing
    `eos_token`, a token absent from the vocabulary, or an `added_tokens_decoder` entry that
    disagrees with `tokenizer.json`.
    """
    tokenizer = load_tokenizer_file(path)
    config_file = os.path.join(path, TOKENIZER_CONFIG_FILE)
    config = _read_json_object(config_file) if os.path.exists(config_file) else {}
    _check_added_tokens(tokenizer, config, config_file)
    tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))
    sources = _special_token_sources(path, config, config_file)
    ids = {field: _token_id(tokenizer, token, file, field) for field, (token, file) in sources.items()}
    if "eos_token" not in sources:
        raise CheckpointFileError(
            f"{config_file}: no eos_token (nor in {SPECIAL_TOKENS_MAP_FILE}); cannot tell where generation ends"
        )
    eos_token = sources["eos_token"][0]
    bos_token = sources["bos_token"][0] if "bos_token" in sources else None
    pad_token = sources["pad_token"][0] if "pad_token" in sources else eos_token
    return CheckpointTokenizer(
        tokenizer=tokenizer,
        bos_token=bos_token,
        bos_id=ids.get("bos_token"),
        eos_token=eos_token,
        eos_id=ids["eos_token"],
        pad_token=pad_token,
        pad_id=ids.get("pad_token", ids["eos_token"]),
        stop_ids=stop_token_ids(_generation_eos_ids(path, tokenizer), ids["eos_token"]),
        chat_template=load_chat_template(path),
        special_tokens={field: token for field, (token, _) in sources.items()},
    )
