"""A tiny byte-level BPE tokenizer trained locally with the `tokenizers` library.

Layout of the vocabulary (ids are fixed by construction):

- ``0 <pad>``, ``1 <s>`` (bos), ``2 </s>`` (eos): special tokens, skipped by
  ``decode(..., skip_special_tokens=True)``.
- ``3 .. 258``: the 256 byte-level symbols, so any text encodes (no unknown token).
- then the learned merges, up to ``vocab_size`` entries;
- then ``<think>`` and ``</think>`` as *added, non-special* tokens: each is always one token
  and survives decoding, so the reward's ``</think>`` check sees it.

Digits are split one per token before BPE (as Llama and Qwen do), so arithmetic sees aligned
digits. Encoding adds no bos/eos by itself; callers add them explicitly (``prompts.py``).
``train_tokenizer`` writes ``tokenizer.json`` plus a ``tokenizer_config.json`` that names the
special tokens, so Hugging Face ``AutoTokenizer`` can load the same directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from scalerl_jax.data.synthetic import THINK_END, THINK_START

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
THINK_TOKENS = (THINK_START, THINK_END)
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _strip_think_tags(text: str) -> str:
    """Removes the think tags: they are added tokens, so BPE need not learn merges for them."""
    return text.replace(THINK_START, "").replace(THINK_END, "")


def train_tokenizer(texts: Iterable[str], vocab_size: int, path: str) -> Tokenizer:
    """Trains a byte-level BPE on ``texts`` and writes ``path/tokenizer.json`` (+ config).

    Args:
      texts: training corpus (e.g. ``synthetic.tokenizer_corpus``).
      vocab_size: BPE vocabulary size including the 3 special tokens and 256 byte symbols
        (so at least 259); the two think tokens come on top, giving ``get_vocab_size()``
        ``== vocab_size + 2`` when the corpus supports that many merges (fewer otherwise).
      path: directory to write into (created if missing).

    Returns:
      The trained ``tokenizers.Tokenizer``.
    """
    minimum = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size must be >= {minimum} (specials + 256 bytes), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((_strip_think_tags(t) for t in texts), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    os.makedirs(path, exist_ok=True)
    tokenizer.save(os.path.join(path, TOKENIZER_FILE))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD_TOKEN,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(path, TOKENIZER_CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2)
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """``{'pad': id, 'bos': id, 'eos': id}`` looked up by name (ValueError naming a missing one)."""
    ids = {}
    for key, token in (("pad", PAD_TOKEN), ("bos", BOS_TOKEN), ("eos", EOS_TOKEN)):
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no {key} token {token!r}")
        ids[key] = token_id
    return ids
