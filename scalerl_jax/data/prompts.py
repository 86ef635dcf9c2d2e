"""Prompt formatting and encoding: a template string or a chat template, under a token budget.

The user turn is ``template`` with the literal ``{problem}`` replaced by the problem (plain
replacement, so the template may contain LaTeX braces such as ``\\boxed{}``). Prompts are encoded
exactly as Hugging Face transformers (5.x) encodes them:

- without a chat template, as ``tokenizer(text)``: ``encode(text, add_special_tokens=True)``, so
  the ``tokenizer.json`` post-processor adds what the checkpoint adds (bos for Llama 3, nothing
  for Qwen);
- with a chat template, as ``apply_chat_template([system?, user], add_generation_prompt=True,
  tokenize=True)``: the template is rendered in transformers' jinja environment with the
  checkpoint's named special tokens, ``tools=None`` and ``documents=None``, and the text is
  encoded with ``add_special_tokens=False`` (the template writes bos itself).

Prompts longer than ``max_prompt_tokens`` are skipped, counted and reported with a warning:
never truncated.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import numpy as np
from absl import logging
from tokenizers import Tokenizer

PROBLEM_PLACEHOLDER = "{problem}"
DEFAULT_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."


def format_problem(problem: str, template: str) -> str:
    """``template`` with ``{problem}`` replaced by ``problem`` (ValueError without placeholder)."""
    if PROBLEM_PLACEHOLDER not in template:
        raise ValueError(f"prompt template has no {PROBLEM_PLACEHOLDER} placeholder: {template!r}")
    return template.replace(PROBLEM_PLACEHOLDER, problem)


def _raise_template_exception(message: str) -> None:
    """``raise_exception`` as Hugging Face chat templates call it."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``json.dumps`` as a filter (jinja's ``tojson`` HTML-escapes; chat templates expect not)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string: str) -> str:
    """The local time now, formatted (templates such as Llama 3.2's print today's date)."""
    return datetime.datetime.now().strftime(format_string)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged.

    Training templates mark assistant text with it (transformers uses the marks for assistant
    masks); prompts never need the marks, only the text.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def compile_chat_template(chat_template: str) -> jinja2.Template:
    """Compiles a chat template in the jinja environment transformers renders chat templates in.

    An immutable sandbox with ``trim_blocks``, ``lstrip_blocks`` and ``loopcontrols``; globals
    ``raise_exception`` and ``strftime_now`` (the current local time, so a template that prints
    today's date does so here too); a ``tojson`` filter that does not HTML-escape; and the
    ``{% generation %}`` block tag.
    """
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_template_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(chat_template)


def render_chat(
    chat_template: jinja2.Template,
    user_message: str,
    *,
    special_tokens: Mapping[str, str],
    system_message: str | None = None,
) -> str:
    """The chat template rendered for ``[system?, user]`` with ``add_generation_prompt=True``.

    The variables are those of transformers' ``apply_chat_template``: ``messages``, ``tools`` and
    ``documents`` (None), ``add_generation_prompt``, and the named special tokens
    (``special_tokens``, e.g. ``{'bos_token': '<|begin_of_text|>', 'eos_token': '<|eot_id|>'}``).
    """
    messages = []
    if system_message is not None:
        messages.append({"role": "system", "content": system_message})
    messages.append({"role": "user", "content": user_message})
    return chat_template.render(
        **special_tokens, messages=messages, tools=None, documents=None, add_generation_prompt=True
    )


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How problems become prompt text.

    Attributes:
      template: user-turn template containing ``{problem}``.
      chat_template: optional jinja chat template (the checkpoint's, e.g.
        ``CheckpointTokenizer.chat_template``); None encodes the user turn as plain text.
      system_message: optional system turn (chat template only).
      max_prompt_tokens: prompts with more tokens are skipped and counted.
    """

    template: str = DEFAULT_TEMPLATE
    chat_template: str | None = None
    system_message: str | None = None
    max_prompt_tokens: int = 2048


@dataclasses.dataclass(frozen=True)
class EncodedPrompts:
    """Prompts that fit the budget: ``tokens[i]`` encodes ``problems[source_indices[i]]``."""

    tokens: list[list[int]]
    source_indices: list[int]
    num_too_long: int


class PromptEncoder:
    """Formats and encodes problems as transformers does (see the module docstring).

    Args:
      tokenizer: the checkpoint's ``tokenizers.Tokenizer`` (``tokenizer.json``, post-processor
        included).
      prompt_format: the template, chat template, system message and budget.
      special_tokens: the checkpoint's named special tokens given to the chat template
        (``CheckpointTokenizer.special_tokens``); unused without a chat template.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_format: PromptFormat, *, special_tokens: Mapping[str, str] | None = None
    ):
        format_problem("", prompt_format.template)  # validates the placeholder early
        if prompt_format.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {prompt_format.max_prompt_tokens}")
        if prompt_format.system_message is not None and prompt_format.chat_template is None:
            raise ValueError("PromptFormat.system_message needs a chat_template")
        self._tokenizer = tokenizer
        self._format = prompt_format
        self._special_tokens = dict(special_tokens or {})
        self._chat = (
            compile_chat_template(prompt_format.chat_template) if prompt_format.chat_template is not None else None
        )

    def text(self, problem: str) -> str:
        """The prompt text of ``problem`` (before the tokenizer's post-processor)."""
        user_message = format_problem(problem, self._format.template)
        if self._chat is None:
            return user_message
        return render_chat(
            self._chat, user_message, special_tokens=self._special_tokens, system_message=self._format.system_message
        )

    def encode_unchecked(self, problem: str) -> list[int]:
        """Prompt token ids of ``problem`` whatever their length."""
        add_special_tokens = self._chat is None
        return list(self._tokenizer.encode(self.text(problem), add_special_tokens=add_special_tokens).ids)

    def encode(self, problems: Sequence[str]) -> EncodedPrompts:
        """Encodes ``problems``, skipping (and counting, with a warning) those over the budget."""
        tokens, source_indices, too_long = [], [], []
        for index, problem in enumerate(problems):
            ids = self.encode_unchecked(problem)
            if len(ids) > self._format.max_prompt_tokens:
                too_long.append((index, len(ids)))
                continue
            tokens.append(ids)
            source_indices.append(index)
        if too_long:
            index, length = too_long[0]
            logging.warning(
                "skipped %d of %d prompts longer than max_prompt_tokens=%d (first: problem %d with %d tokens)",
                len(too_long),
                len(problems),
                self._format.max_prompt_tokens,
                index,
                length,
            )
        return EncodedPrompts(tokens=tokens, source_indices=source_indices, num_too_long=len(too_long))


def sft_example(
    prompt_tokens: Sequence[int], completion_tokens: Sequence[int], eos_id: int, max_len: int, pad_id: int
) -> tuple[list[int], list[float]]:
    """A supervised warm-start row: ``prompt + completion + eos`` right-padded to ``max_len``.

    Returns ``(tokens[max_len], loss_mask[max_len])`` with ``loss_mask[t] = 1`` where
    ``tokens[t]`` is a completion token or the final eos (the targets of next-token training),
    0 on the prompt and padding. Raises ValueError if the row does not fit in ``max_len``.
    """
    tokens = list(prompt_tokens) + list(completion_tokens) + [eos_id]
    if len(tokens) > max_len:
        raise ValueError(
            f"sft_example: {len(tokens)} tokens (prompt {len(prompt_tokens)}, "
            f"completion {len(completion_tokens)} + eos) exceed max_len={max_len}"
        )
    mask = [0.0] * len(prompt_tokens) + [1.0] * (len(completion_tokens) + 1)
    padding = max_len - len(tokens)
    return tokens + [pad_id] * padding, mask + [0.0] * padding


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Encoded prompts with their gold answers and labels (e.g. difficulty), all aligned.

    ``source_indices[i]`` is the row of prompt ``i`` in the rows it was built from; rows over
    the prompt budget are left out and counted in ``num_too_long``.
    """

    tokens: list[list[int]]
    answers: list[str]
    labels: list[str]
    source_indices: list[int]
    num_too_long: int


def build_prompt_set(rows: Sequence[dict], encoder: PromptEncoder, *, label_field: str | None = None) -> PromptSet:
    """Encodes ``rows`` (dicts with ``problem`` and ``answer``, e.g. ``builders.read_split``).

    ``label_field`` names a row field copied (as a string) into ``labels``; '' when None.
    """
    for index, row in enumerate(rows):
        for field in ("problem", "answer") + ((label_field,) if label_field else ()):
            if field not in row:
                raise ValueError(f"build_prompt_set: row {index} has no field {field!r}")
    encoded = encoder.encode([row["problem"] for row in rows])
    kept = [rows[i] for i in encoded.source_indices]
    return PromptSet(
        tokens=encoded.tokens,
        answers=[row["answer"] for row in kept],
        labels=[str(row[label_field]) if label_field else "" for row in kept],
        source_indices=encoded.source_indices,
        num_too_long=encoded.num_too_long,
    )


def sft_arrays(
    rows: Sequence[dict],
    encoder: PromptEncoder,
    tokenizer: Tokenizer,
    *,
    max_len: int,
    eos_id: int,
    pad_id: int,
    solution_field: str = "solution",
) -> tuple[np.ndarray, np.ndarray]:
    """Warm-start arrays ``(tokens int32[N, max_len], loss_mask float32[N, max_len])``.

    Row ``i`` is ``sft_example(prompt, encode(rows[i][solution_field]), ...)``; a row that does
    not fit ``max_len`` raises (naming the row) rather than being cut.
    """
    tokens, masks = [], []
    for index, row in enumerate(rows):
        prompt = encoder.encode_unchecked(row["problem"])
        completion = tokenizer.encode(row[solution_field], add_special_tokens=False).ids
        try:
            row_tokens, row_mask = sft_example(prompt, completion, eos_id, max_len, pad_id)
        except ValueError as e:
            raise ValueError(f"sft_arrays: row {index}: {e}") from e
        tokens.append(row_tokens)
        masks.append(row_mask)
    return np.asarray(tokens, np.int32), np.asarray(masks, np.float32)
