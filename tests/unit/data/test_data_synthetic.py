"""Synthetic task: gold answers and traces recomputed independently; splits; the tiny tokenizer."""

import re

import pytest

from scalerl_jax.data import synthetic
from scalerl_jax.data.tokenizer import train_tokenizer

SMALL = synthetic.SyntheticTaskConfig(seed=3, split_sizes=(("heldout", 40), ("sft", 120), ("train", 120)))


def _value_of(expression: str) -> int:
    """Independent evaluation: the expression is ``d+ ([+-] d+)*``; sum of its signed terms."""
    assert re.fullmatch(r"\d+([+-]\d+)+", expression), expression
    return sum(int(term) for term in re.findall(r"[+-]?\d+", expression))


def test_gold_answers_and_traces_are_correct():
    splits = synthetic.generate_splits(SMALL)
    for problems in splits.values():
        for p in problems:
            assert p.answer == _value_of(p.text)
            solution = p.solution
            match = re.fullmatch(r"<think>(.*)</think>\\boxed\{(-?\d+)\}", solution, re.S)
            assert match, solution
            assert int(match.group(2)) == _value_of(p.text)
            lines = match.group(1).split("\n")
            level = SMALL.levels[p.level]
            assert len(lines) == level.num_ops
            previous = None
            for line in lines:
                step = re.fullmatch(r"(-?\d+)([+-])(\d+)=(-?\d+)", line)
                assert step, line
                a, op, b, r = step.groups()
                a, b, r = int(a), int(b), int(r)
                assert r == (a + b if op == "+" else a - b)
                assert previous is None or a == previous
                assert r >= 0  # nonnegative=True
                previous = r
            assert previous == p.answer
            operands = [int(x) for x in re.findall(r"\d+", p.text)]
            assert len(operands) == level.num_ops + 1
            assert all(0 <= x <= level.max_operand for x in operands)


def test_splits_disjoint_balanced_and_deterministic():
    splits = synthetic.generate_splits(SMALL)
    texts = {name: [p.text for p in problems] for name, problems in splits.items()}
    assert {name: len(t) for name, t in texts.items()} == {"heldout": 40, "sft": 120, "train": 120}
    for name, t in texts.items():
        assert len(set(t)) == len(t), f"duplicates inside {name}"
    assert not set(texts["heldout"]) & set(texts["train"])
    assert not set(texts["heldout"]) & set(texts["sft"])
    assert not set(texts["sft"]) & set(texts["train"])
    levels = [p.level for p in splits["train"]]
    assert [levels.count(i) for i in range(4)] == [30, 30, 30, 30]
    again = synthetic.generate_splits(SMALL)
    assert {n: [p.text for p in ps] for n, ps in again.items()} == texts
    # The held-out split does not depend on the sizes of the splits drawn after it.
    bigger = synthetic.SyntheticTaskConfig(seed=3, split_sizes=(("heldout", 40), ("sft", 500), ("train", 999)))
    assert [p.text for p in synthetic.generate_splits(bigger)["heldout"]] == texts["heldout"]
    other_seed = synthetic.SyntheticTaskConfig(seed=4, split_sizes=SMALL.split_sizes)
    assert [p.text for p in synthetic.generate_splits(other_seed)["heldout"]] != texts["heldout"]


def test_exhausted_level_raises_naming_it():
    # Level(1, 1): a op b with a, b in {0, 1}: at most 8 distinct problems.
    config = synthetic.SyntheticTaskConfig(
        split_sizes=(("train", 20),), levels=(synthetic.Level(1, 1),), nonnegative=False
    )
    with pytest.raises(ValueError, match="level 0"):
        synthetic.generate_splits(config)


def test_config_validation():
    with pytest.raises(ValueError, match="operators"):
        synthetic.SyntheticTaskConfig(operators=("*",))
    with pytest.raises(ValueError, match="num_ops"):
        synthetic.Level(0, 9)
    with pytest.raises(ValueError, match="repeated"):
        synthetic.SyntheticTaskConfig(split_sizes=(("a", 1), ("a", 2)))


def test_tokenizer_round_trip_and_layout(tmp_path):
    problems = synthetic.generate_splits(SMALL)["sft"]
    template = "Compute {problem}. Put the final answer in \\boxed{}."
    phrase = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
    corpus = synthetic.tokenizer_corpus(problems, template, [phrase])
    tokenizer = train_tokenizer(corpus, 300, str(tmp_path))
    assert (tmp_path / "tokenizer.json").exists()
    assert [tokenizer.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
    think_open, think_close = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    assert think_open is not None and think_close is not None
    assert tokenizer.get_vocab_size() <= 302
    for p in problems[:20]:
        text = template.replace("{problem}", p.text) + p.solution
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert ids.count(think_open) == 1 and ids.count(think_close) == 1
    # Digits are one token each: "1234" has four tokens.
    assert len(tokenizer.encode("1234", add_special_tokens=False).ids) == 4
    # Text outside the corpus still encodes (byte-level) and decodes exactly.
    odd = "Ünïcode ∑ 42"
    assert tokenizer.decode(tokenizer.encode(odd).ids) == odd


def test_tokenizer_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    problems = synthetic.generate_splits(SMALL)["sft"]
    tokenizer = train_tokenizer(synthetic.tokenizer_corpus(problems, "{problem}"), 280, str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    text = problems[0].text + problems[0].solution
    ids = hf(text, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer.encode(text, add_special_tokens=False).ids
    assert hf.decode(ids) == text


def test_tokenizer_rejects_tiny_vocab(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["1+1"], 100, str(tmp_path))
