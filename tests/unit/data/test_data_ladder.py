"""The arithmetic ladder: answers recomputed from the problem texts, echo-proof grading, held-out
split disjoint from training under every phrasing, determinism, and bad levels named."""

import json
import re

import pytest
from repo_paths import REPO

from scalerl_jax.cli import ladder as ladder_cli
from scalerl_jax.data import build_ladder, read_split
from scalerl_jax.data.ladder import LEVELS, RUNGS, LadderConfig, generate_splits

NUMBER = re.compile(r"\d+")
ALL_LEVELS = LadderConfig(levels=LEVELS[:4], transfer_levels=LEVELS[4:], heldout_per_level=20)


def answer_from_text(level: str, text: str) -> int:
    """The answer of a problem text, read independently of the ladder's code: the numbers in the
    text in order, combined by the operation its level names (the rung's definition in words)."""
    a, b, *rest = (int(x) for x in NUMBER.findall(text))
    if level.startswith("add"):
        return a + b + sum(rest)
    if level.startswith("sub"):
        return b - a if text.startswith("Subtract") else a - b  # "Subtract b from a."
    if level == "mul_1d":
        return a * b
    assert level == "mul_add", level
    return a * b + rest[0]


def test_rung_sizes_by_hand():
    # add_1d: 9 x 9; mul_1d: 8 x 8 (no factor 1); add_teen: 10 x 9; add_3: 9^3;
    # sub_1d: for each b in 1..9 the 9 minuends b+1..b+9 give a one-digit difference, less the one
    # whose difference is b itself (an echo "2b - b" would pass): 9 * 9 - 9.
    sizes = {name: len(RUNGS[name].space()) for name in ("add_1d", "mul_1d", "add_teen", "add_3", "sub_1d")}
    assert sizes == {"add_1d": 81, "mul_1d": 64, "add_teen": 90, "add_3": 729, "sub_1d": 72}


def test_every_answer_equals_the_text_read_independently_and_no_echo_can_pass():
    splits = generate_splits(LadderConfig(levels=LEVELS))  # every problem of every rung
    problems = [p for split in splits.values() for p in split]
    assert len(problems) == sum(len(rung.space()) for rung in RUNGS.values())
    for p in problems:
        numbers = [int(x) for x in NUMBER.findall(p.text)]
        assert answer_from_text(p.level, p.text) == p.answer, p
        assert p.answer > 0, p
        # The last number of a completion that repeats the question and stops is one of these.
        assert p.answer not in numbers, p


def test_heldout_is_disjoint_from_training_under_every_phrasing():
    splits = generate_splits(ALL_LEVELS)
    heldout = {(p.level, p.operands) for p in splits["heldout"]}
    train = {(p.level, p.operands) for p in splits["train"]}
    assert len(heldout) == 4 * 20 and not heldout & train
    # Every trained rung's problems are all used: held out or trained, each once.
    for level in ALL_LEVELS.levels:
        assert sum(1 for lv, _ in heldout | train if lv == level) == len(RUNGS[level].space())
    # The transfer rungs are never trained.
    assert {p.level for p in splits["transfer"]} == set(LEVELS[4:])
    assert not {p.level for p in splits["train"]} & set(LEVELS[4:])


def test_phrasings_mix_bare_questions_and_word_problems_at_the_configured_rate():
    problems = generate_splits(LadderConfig(levels=("add_2d",), word_problem_fraction=0.25))["train"]
    word = sum(1 for p in problems if "has" in p.text or "bags" in p.text)
    assert abs(word / len(problems) - 0.25) < 0.03, word / len(problems)
    bare = generate_splits(LadderConfig(levels=("add_1d",), word_problem_fraction=0.0))["train"]
    assert all(p.text.startswith(("What is", "Calculate", "Add")) for p in bare)


def test_splits_are_a_function_of_the_seed():
    first, again = generate_splits(LadderConfig(seed=3)), generate_splits(LadderConfig(seed=3))
    other = generate_splits(LadderConfig(seed=4))
    assert first == again
    assert [p.operands for p in first["heldout"]] != [p.operands for p in other["heldout"]]
    # A held-out split does not change when transfer rungs are added.
    assert generate_splits(LadderConfig(seed=3, transfer_levels=("add_2d",)))["heldout"] == first["heldout"]


@pytest.mark.parametrize(
    "kwargs,named",
    [
        ({"levels": ("add_1d", "add_9d")}, "`ladder.levels` = ('add_1d', 'add_9d'): unknown level(s) ['add_9d']"),
        ({"transfer_levels": ("div_1d",)}, "`ladder.transfer_levels` = ('div_1d',): unknown level(s)"),
        ({"levels": ()}, "`ladder.levels` is empty"),
        ({"transfer_levels": ("add_1d",)}, "['add_1d'] also in `ladder.levels`"),
        ({"heldout_per_level": 64}, "`ladder.heldout_per_level` = 64 leaves level 'mul_1d' (64 problems)"),
    ],
)
def test_a_bad_ladder_is_named(kwargs, named):
    with pytest.raises(ValueError) as raised:
        LadderConfig(**kwargs)
    assert named in str(raised.value)


def test_tfds_builder_holds_the_generated_splits(tmp_path):
    task = LadderConfig(levels=("add_1d", "mul_1d"), transfer_levels=("add_2d",), heldout_per_level=8)
    builder = build_ladder(str(tmp_path), task)
    expected = generate_splits(task)
    for split in ("heldout", "train", "transfer"):
        rows = read_split(builder, split)
        assert sorted((r["level"], r["problem"], r["answer"]) for r in rows) == sorted(
            (p.level, p.text, str(p.answer)) for p in expected[split]
        )
    without_transfer = build_ladder(str(tmp_path), LadderConfig(levels=("add_1d",), heldout_per_level=8))
    assert set(without_transfer.info.splits) == {"heldout", "train"}


def test_cli_writes_the_configs_splits_and_names_a_bad_level(tmp_path, capsys):
    out = tmp_path / "ladder"
    config = f"--config={REPO}/configs/smollm2_arith.py"
    assert ladder_cli.main([config, f"--out={out}", "--config.ladder.heldout_per_level=4"]) == 0
    rows = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 4 and set(rows[0]) == {"problem", "answer", "level"}
    assert (out / "transfer.jsonl").exists()
    status = ladder_cli.main([config, f"--out={out}", "--config.ladder.levels=('add_1d','add_9d')"])
    assert status == 2
    assert "config key `ladder.levels` = ('add_1d', 'add_9d'): unknown level(s) ['add_9d']" in capsys.readouterr().err
