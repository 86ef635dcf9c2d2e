"""A tiny byte-level BPE tokenizer trained locally with the `tokenizers` library.

Layout of the vocabulary (ids are fixed by construction):

- ``0 <pad>``, ``1 <s>`` (bos), ``2 </s>`` (eos): special tokens, skipped by
  ``decode(..., skip_special_tokens=True)``.
- ``3 .. 258``: the 256 byte-level symbols, so any text encodes (no unknown token).
- then the learned merges, up to ``vocab_size`` entries;
- then ``<think>`` and ``</think>`` as *added, non-special* tokens: each is always one token
  and survives decoding, so the reward's ``</think>`` check sees it.

Digits are split one per token before BPE (as Llama and Qwen do), so arithmetic sees aligned
digits. ``train_tokenizer`` writes the directory as a Llama 3 base checkpoint ships it, so the
tiny run reads it through the same door (``models.load_checkpoint_tokenizer``) as a real one:

- ``tokenizer.json`` whose post-processor prepends bos (``encode(text)`` gives ``[bos] + ids``;
  ``add_special_tokens=False`` gives the bare ids);
- ``tokenizer_config.json`` naming ``bos_token``, ``eos_token`` and ``pad_token``, with the
  ``added_tokens_decoder`` of every added token (no chat template: a base model);
- ``generation_config.json`` with ``bos_token_id``, ``eos_token_id`` and ``pad_token_id``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from scalerl_jax.data.synthetic import THINK_END, THINK_START

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
THINK_TOKENS = (THINK_START, THINK_END)
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Version of the files `train_tokenizer` writes; part of the warm start's cache key, so a directory
# written in an older layout (no bos post-processor, no generation_config.json) is rebuilt.
TOKENIZER_LAYOUT = 2


def _strip_think_tags(text: str) -> str:
    """Removes the think tags: they are added tokens, so BPE need not learn merges for them."""
    return text.replace(THINK_START, "").replace(THINK_END, "")


def train_tokenizer(texts: Iterable[str], vocab_size: int, path: str) -> Tokenizer:
    """Trains a byte-level BPE on ``texts`` and writes it to ``path`` as a checkpoint's tokenizer.

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
        raise ValueError(f"vocab_size must be >= {minimum} (specials + 256 bytes), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((_strip_think_tags(t) for t in texts), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, ids[BOS_TOKEN])],
    )
    os.makedirs(path, exist_ok=True)
    tokenizer.save(os.path.join(path, TOKENIZER_FILE))
    added_tokens_decoder = {
        str(token_id): {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
        for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    tokenizer_config = {
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    generation_config = {"bos_token_id": ids[BOS_TOKEN], "eos_token_id": ids[EOS_TOKEN], "pad_token_id": ids[PAD_TOKEN]}
    for name, content in ((TOKENIZER_CONFIG_FILE, tokenizer_config), (GENERATION_CONFIG_FILE, generation_config)):
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
    return tokenizer
