"""The warm start's demonstration mix: worked traces and answer-only replies."""

import numpy as np
import pytest

from scalerl_jax import data as data_lib
from scalerl_jax.run.warm_start import with_direct_answers

ROWS = [
    {"problem": f"{i}+1", "answer": str(i + 1), "solution": f"<think>{i}+1={i + 1}</think>\\boxed{{{i + 1}}}"}
    for i in range(1000)
]


def test_answer_only_reply_is_an_empty_think_block_and_scores_as_correct():
    assert data_lib.direct_answer(51) == "<think></think>\\boxed{51}"
    scored = data_lib.score_completions(["<think></think>\\boxed{51}"], ["51"], data_lib.RewardConfig(kind="exact"))
    assert scored.correct.tolist() == [True]


def test_fraction_of_answer_only_demonstrations():
    mixed = with_direct_answers(ROWS, 0.3, np.random.default_rng(0))
    direct = [r["solution"] == f"<think></think>\\boxed{{{r['answer']}}}" for r in mixed]
    # Binomial(1000, 0.3): standard deviation sqrt(1000 * 0.3 * 0.7) = 14.5, so 300 +- 58 is 4 sigma.
    assert 242 <= sum(direct) <= 358
    kept = [m for m, d in zip(mixed, direct) if not d]
    assert all(m == ROWS[int(m["answer"]) - 1] for m in kept)  # the other rows are untouched
    assert with_direct_answers(ROWS, 0.0, np.random.default_rng(0)) == ROWS
    assert all(
        r["solution"].startswith("<think></think>") for r in with_direct_answers(ROWS, 1.0, np.random.default_rng(0))
    )


def test_fraction_outside_unit_interval_is_refused():
    with pytest.raises(ValueError, match="direct_answer_fraction"):
        with_direct_answers(ROWS, 1.5, np.random.default_rng(0))


def test_warm_start_tokenizer_is_read_like_a_checkpoint(tmp_path):
    """train_tokenizer writes a Llama-3-style directory; transformers reads the same tokens and ids."""
    transformers = pytest.importorskip("transformers")
    from scalerl_jax.models import load_checkpoint_tokenizer

    corpus = [row["problem"] + " " + row["solution"] for row in ROWS[:200]]
    data_lib.train_tokenizer(corpus, 280, str(tmp_path))
    loaded = load_checkpoint_tokenizer(str(tmp_path))
    token_id = loaded.tokenizer.token_to_id
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == ("<s>", "</s>", "<pad>")
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (token_id("<s>"), token_id("</s>"), token_id("<pad>"))
    assert loaded.stop_ids == (token_id("</s>"),) and loaded.chat_template is None
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    encoder = data_lib.PromptEncoder(loaded.tokenizer, data_lib.PromptFormat(template="{problem}="))
    # The SFT prompt is bos + text, exactly as the RL run (and transformers) encodes it.
    assert (
        encoder.encode_unchecked("12+7")
        == reference("12+7=")["input_ids"]
        == ([loaded.bos_id] + loaded.tokenizer.encode("12+7=", add_special_tokens=False).ids)
    )
