"""Answer styles as real instruct models write them (`#### 3`, `The answer is: 3`, a number at the
end), GSM8K's worked-solution golds, the numeric comparison, and the answer-found counts.

Every expected value is a hand judgement of the text (GSM8K rows were read by eye: test.jsonl row
0's gold is 18, row 1's 3, row 146's `2,125`, row 489's `-10`). GSM8K is read from
`../shared/data/gsm8k/` relative to the project root, as the project's data README says.
"""

import dataclasses
import json
import logging
import os
from fractions import Fraction

import ml_collections
import numpy as np
import pytest
from repo_paths import GSM8K_DIR

from scalerl_jax.config import recipes, relevance
from scalerl_jax.config import validation as config_validation
from scalerl_jax.config.adapters import reward_config_of
from scalerl_jax.data import answers, builders, rows
from scalerl_jax.data.evaluation import evaluate
from scalerl_jax.data.rewards import RewardConfig, RewardTally, ScoredBatch, score_completions
from scalerl_jax.data.verify_pool import VerifyPool

GSM8K_TEST = os.path.join(GSM8K_DIR, "test.jsonl")
needs_gsm8k = pytest.mark.skipif(not os.path.isfile(GSM8K_TEST), reason=f"GSM8K not found at {GSM8K_TEST}")
GSM8K_STYLES = ("hashes", "answer_is", "last_number")


def _gsm8k_rows(indices):
    with open(GSM8K_TEST, encoding="utf-8") as f:
        lines = f.read().splitlines()
    return [json.loads(lines[i]) for i in indices]


def _gold(answer_text: str) -> str:
    """The GSM8K gold of a worked solution (every published row has one)."""
    gold = answers.gold_of(answer_text, "hashes")
    assert gold is not None, answer_text
    return gold


@pytest.fixture(scope="module")
def pool():
    with VerifyPool(2, time_limit_s=5.0) as p:
        yield p


# ------------------------------------------------------------------ styles, one by one


@pytest.mark.parametrize(
    "text, boxed, hashes, answer_is, last_number",
    [
        ("The answer is: 18", None, None, "18", "18"),
        ("So she makes $18 every day.", None, None, None, "18"),
        ("9 * 2 = 18\n#### 18", None, "18", None, "18"),
        ("#### 1,000\nThat is all.", None, "1,000", None, "1,000"),
        ("She makes \\boxed{18} dollars.", "18", None, None, "18"),
        ("The final answer is $\\boxed{18}$. I hope it is correct.", "18", None, "18", "18"),
        ("Answer: 3.5 hours. Then she rests 2 hours", None, None, "3.5 hours", "2"),
        ("THE ANSWER IS 7\nand 8 more", None, None, "7", "8"),
        ("the answer is 12. The answer is: $1,250.", None, None, "$1,250", "1,250"),
        ("It dropped to -3 degrees", None, None, None, "-3"),
        ("5-3 leaves 2 and x2 is not a number", None, None, None, "2"),
        ("A quarter is 1/4 of it", None, None, None, "1/4"),
        ("the answer is:\n42", None, None, None, "42"),  # nothing after the phrase on its line
        ("#### \n", None, None, None, None),
        ("no digits at all", None, None, None, None),
    ],
)
def test_each_style(text, boxed, hashes, answer_is, last_number):
    assert answers.last_boxed(text) == boxed
    assert answers.after_hashes(text) == hashes
    assert answers.after_answer_is(text) == answer_is
    assert answers.last_number(text) == last_number


def test_first_style_in_the_list_that_finds_wins():
    text = "I think \\boxed{17}. The answer is 19.\n#### 18\nso 20"
    assert answers.find_answer(text, ("hashes", "answer_is", "last_number")) == ("18", "hashes")
    assert answers.find_answer(text, ("answer_is", "hashes")) == ("19", "answer_is")
    assert answers.find_answer(text, ("boxed", "hashes")) == ("17", "boxed")
    assert answers.find_answer(text, ("last_number",)) == ("20", "last_number")
    assert answers.find_answer("nothing here", ("hashes", "answer_is")) == (None, None)


def test_extraction_reads_only_the_answer_part():
    completion = "<think>\n#### 5\nmaybe the answer is 6\n</think>\nThen she has 7 left."
    styles = ("hashes", "answer_is", "last_number")
    assert answers.extract_answer(completion, answer_format="think", think_end="</think>", styles=styles) == (
        "7",
        None,
    )
    assert answers.extract_answer(completion, answer_format="plain", think_end="</think>", styles=styles) == (
        "5",
        None,
    )
    assert answers.extract_answer(
        "<think>#### 5</think>none", answer_format="think", think_end="</think>", styles=styles
    ) == (None, "no_answer")
    # boxed alone keeps its outcome name; any longer list reports no_answer.
    assert answers.extract_answer("x</think>y", answer_format="think", think_end="</think>") == (None, "no_box")
    assert answers.extract_answer("no tag", answer_format="think", think_end="</think>", styles=styles) == (
        None,
        "no_think_end",
    )


@pytest.mark.parametrize(
    "spec, ok",
    [
        ("boxed", ("boxed",)),
        (" hashes , answer_is,last_number ", ("hashes", "answer_is", "last_number")),
        ("", None),
        ("boxed,", None),
        ("hashes,hashes", None),
        ("boxed,final_answer", None),
    ],
)
def test_parse_styles(spec, ok):
    if ok is not None:
        assert answers.parse_styles(spec) == ok
    else:
        with pytest.raises(ValueError, match="boxed, hashes, answer_is, last_number"):
            answers.parse_styles(spec)


@pytest.mark.parametrize(
    "text, value",
    [
        ("18", Fraction(18)),
        ("18.00", Fraction(18)),
        ("18.", Fraction(18)),
        (" $18 ", Fraction(18)),
        ("\\$18", Fraction(18)),
        ("$18$", Fraction(18)),
        ("1,000", Fraction(1000)),
        ("1{,}000", Fraction(1000)),
        ("$1,250.50", Fraction(2501, 2)),
        ("-10", Fraction(-10)),
        ("-$5", Fraction(-5)),
        ("25%", Fraction(25)),
        ("12.5\\%", Fraction(25, 2)),
        ("3/4", Fraction(3, 4)),
        (".5", Fraction(1, 2)),
        ("3,4", None),  # not thousands: a list
        ("1/0", None),
        ("x + 1", None),
        ("18 dollars", None),
        ("\\frac{1}{2}", None),  # LaTeX goes to math-verify
    ],
)
def test_as_number(text, value):
    assert answers.as_number(text) == value


def test_gold_of_worked_solutions():
    solution = "She has 500*3=<<500*3=1500>>1500 pieces\nIn total 2125 blocks\n#### 2,125"
    assert answers.gold_of(solution, "hashes") == "2,125"
    assert answers.gold_of(solution, "") == solution
    assert answers.gold_of("no marker, 12 apples", "hashes") is None
    assert answers.gold_of("no marker, 12 apples", "hashes,last_number") == "12"


@needs_gsm8k
def test_gsm8k_golds_by_hashes():
    rows_ = _gsm8k_rows([0, 1, 146, 489, 1113])
    assert [answers.gold_of(r["answer"], "hashes") for r in rows_] == ["18", "3", "2,125", "-10", "-3"]
    with open(GSM8K_TEST, encoding="utf-8") as f:
        every = [json.loads(line)["answer"] for line in f]
    # Every one of the 1,319 published test rows ends with one `#### <number>` line.
    assert len(every) == 1319
    assert all(answers.as_number(answers.gold_of(a, "hashes") or "") is not None for a in every)


# ------------------------------------------------------------------ scoring through the pool


@needs_gsm8k
def test_pool_scores_real_model_answers_against_gsm8k_golds(pool):
    row = {i: r for i, r in zip([0, 1, 146, 489], _gsm8k_rows([0, 1, 146, 489]))}
    golds = {i: _gold(r["answer"]) for i, r in row.items()}
    # (completion, row, expected outcome): judged by hand against the gold of that row.
    cases = [
        ("Janet sells 9 eggs and makes 9 * 2 = 18 dollars.\nThe answer is: 18", 0, "fast_equal"),
        ("16 - 3 - 4 = 9 eggs; 9 * 2 = 18\n#### 18", 0, "fast_equal"),
        ("She sells 9 eggs at $2 each. So she makes $18 every day.", 0, "fast_equal"),
        ("She makes \\boxed{18}", 0, "fast_equal"),  # no box style: the last number, 18
        ("9 * 2 = 18.00", 0, "fast_equal"),
        ("The answer is: 16", 0, "fast_not_equal"),
        ("#### 18\nWait, the answer is 20", 0, "fast_equal"),  # hashes comes first in the list
        ("It takes 1 bolt of white fiber, 3 in total.\n#### 3", 1, "fast_equal"),
        ("2 + 2 = 4 bolts. The answer is 4.", 1, "fast_not_equal"),
        ("500 + 1500 + 125 = 2125\n#### 2125", 146, "fast_equal"),
        ("In total he picks up 2,125 blocks.", 146, "fast_equal"),
        ("The average is -30/3 = -10 degrees.", 489, "fast_equal"),
        ("The answer is: 10", 489, "fast_not_equal"),
        ("I cannot solve this.", 489, "no_answer"),
    ]
    config = RewardConfig(kind="math", answer_format="plain", answer_styles=GSM8K_STYLES)
    scored = score_completions([c for c, _, _ in cases], [golds[i] for _, i, _ in cases], config, pool=pool)
    assert scored.outcomes == [outcome for _, _, outcome in cases]
    assert scored.correct.tolist() == [outcome == "fast_equal" for _, _, outcome in cases]
    assert scored.styles[:4] == ["answer_is", "hashes", "last_number", "last_number"]
    assert scored.answer_found.tolist() == [True] * 13 + [False]
    # The default (boxed) reads only the boxed completion: the rest are format failures.
    boxed = score_completions([c for c, _, _ in cases], [golds[i] for _, i, _ in cases], RewardConfig(), pool=pool)
    assert boxed.counts["no_think_end"] == 14  # the default is the think format
    plain_boxed = RewardConfig(answer_format="plain")
    boxed = score_completions([c for c, _, _ in cases], [golds[i] for _, i, _ in cases], plain_boxed, pool=pool)
    assert boxed.outcomes.count("no_box") == 13 and boxed.correct.tolist() == [False] * 3 + [True] + [False] * 10


def test_numbers_compare_numerically_and_the_rest_goes_to_math_verify(pool):
    config = RewardConfig(kind="math", answer_format="plain", answer_styles=("answer_is",))
    completions = [
        "The answer is $1,000.",
        "The answer is 0.75.",
        "The answer is 3/4.",
        "The answer is 50%.",
        "The answer is \\frac{1}{2}.",
        "The answer is x+1.",
    ]
    golds = ["1000", "3/4", "0.75", "50", "0.5", "1+x"]
    scored = score_completions(completions, golds, config, pool=pool)
    assert scored.outcomes == ["fast_equal", "fast_equal", "fast_equal", "fast_equal", "equal", "equal"]
    assert scored.predictions == ["$1,000", "0.75", "3/4", "50%", "\\frac{1}{2}", "x+1"]


def test_exact_kind_also_compares_numbers(pool):
    config = RewardConfig(kind="exact", answer_format="plain", answer_styles=("hashes",))
    scored = score_completions(["#### 12.0", "#### twelve", "#### twelve"], ["12", "12", "twelve"], config, pool=pool)
    assert scored.outcomes == ["fast_equal", "fast_not_equal", "fast_equal"]


def test_pool_rejects_bad_styles(pool):
    with pytest.raises(ValueError, match="styles"):
        pool.score([("#### 1", "1", "")], kind="math", answer_format="plain", think_end="</think>", styles=("hash",))
    with pytest.raises(ValueError, match="answer_styles"):
        RewardConfig(answer_styles=("boxed", "boxed"))


# ------------------------------------------------------------------ counting


@dataclasses.dataclass
class _Completion:
    tokens: list[int]
    interrupted: bool = False
    truncated: bool = False


@needs_gsm8k
def test_evaluate_reports_the_answer_found_fraction(pool):
    # 2 GSM8K prompts x 3 scripted samples; the samples' texts are the token ids read as characters.
    # Found by (hashes, answer_is, last_number): 5 of 6 (only "I give up." has no answer).
    # Correct: prompt 0: "#### 18" and "makes $18." -> 2 of 3; prompt 1: "The answer is: 3" -> 1 of 3.
    samples = {
        "p0": ["#### 18", "She makes $18.", "I give up."],
        "p1": ["The answer is: 3", "It takes 4 bolts", "#### 5"],
    }
    golds = [_gold(r["answer"]) for r in _gsm8k_rows([0, 1])]
    assert golds == ["18", "3"]

    def sample_fn(requests):
        texts = [samples["".join(map(chr, r))] for r in requests]
        return [_Completion([ord(c) for c in t[i % 3]]) for i, t in enumerate(texts)]

    config = RewardConfig(kind="math", answer_format="plain", answer_styles=GSM8K_STYLES)
    result = evaluate(
        sample_fn,
        [[ord(c) for c in "p0"], [ord(c) for c in "p1"]],
        golds,
        num_samples=3,
        decode=lambda t: "".join(map(chr, t)),
        reward_fn=lambda texts, g: score_completions(texts, g, config, pool=pool),
        prefix="eval_gsm8k",
    )
    assert result.metrics["eval_gsm8k/answer_found_frac"] == pytest.approx(5 / 6)
    assert result.metrics["eval_gsm8k/format_failure_frac"] == pytest.approx(1 / 6)
    assert result.correct.tolist() == [[True, True, False], [True, False, False]]
    assert result.metrics["eval_gsm8k/pass_rate"] == pytest.approx((2 / 3 + 1 / 3) / 2)


def test_training_tally_counts_answers_found(pool):
    config = RewardConfig(kind="math", answer_format="plain", answer_styles=("hashes",))
    tally = RewardTally("data", "a training item")
    assert "data/answer_found_frac" not in tally.metrics()  # no item scored yet
    first = score_completions(["#### 1", "none", "#### 2", "none"], ["1"] * 4, config, pool=pool)
    tally.add(first, [""] * 4, ["1"] * 4)
    second = score_completions(["#### 3", "#### 4"], ["3", "3"], config, pool=pool)
    tally.add(second, [""] * 2, ["3"] * 2)
    metrics = tally.metrics()
    assert metrics["data/reward_items"] == 6 and metrics["data/answers_found"] == 4
    assert metrics["data/answer_found_frac"] == pytest.approx(4 / 6)
    restored = RewardTally("data", "a training item")
    restored.load_state_dict(tally.state_dict())
    assert restored.metrics() == metrics
    assert "eval/answer_found_frac" not in RewardTally("eval", "an eval item").metrics()


def test_training_tally_reports_each_steps_found_fraction_beside_the_cumulative_one(pool):
    """Hand count: step 1 scores 4 items, 3 with a `####` answer; step 2 scores 2 + 2 items, 1
    found (a format collapse); step 3 scores nothing. Cumulative after step 2: 4 of 8."""
    config = RewardConfig(kind="math", answer_format="plain", answer_styles=("hashes",))
    tally = RewardTally("data", "a training item")
    assert tally.take_step() == {}  # nothing scored yet

    def score(texts):
        tally.add(
            score_completions(texts, ["1"] * len(texts), config, pool=pool), [""] * len(texts), ["1"] * len(texts)
        )

    score(["#### 1", "#### 2", "none", "#### 1"])
    assert tally.take_step() == {"data/step_answer_found_frac": pytest.approx(3 / 4)}
    score(["none", "#### 5"])
    score(["none", "none"])
    assert tally.take_step() == {"data/step_answer_found_frac": pytest.approx(1 / 4)}
    assert tally.metrics()["data/answer_found_frac"] == pytest.approx(4 / 8)
    assert tally.take_step() == {}  # no item since the last step's row


def test_a_step_without_any_answer_is_counted_and_the_count_survives_a_resume(pool):
    """Hand count: steps 1 and 3 find no answer in any of their items, step 2 finds one, step 4
    scores nothing (not counted: it has no completions to find an answer in)."""
    config = RewardConfig(kind="math", answer_format="plain", answer_styles=("hashes",))
    tally = RewardTally("data", "a training item")
    for texts in (["none", "no"], ["#### 1", "none"], ["nothing"], []):
        if texts:
            scored = score_completions(texts, ["1"] * len(texts), config, pool=pool)
            tally.add(scored, [""] * len(texts), ["1"] * len(texts))
        tally.take_step()
    assert tally.metrics()["data/steps_without_answers"] == 2
    restored = RewardTally("data", "a training item")
    restored.load_state_dict(tally.state_dict())
    assert restored.metrics()["data/steps_without_answers"] == 2


def test_a_custom_rewards_items_are_not_a_step_without_answers():
    """A custom reward reads the whole completion: no answer style ran, so nothing is missing."""
    tally = RewardTally("data", "a training item")
    custom = ScoredBatch(
        rewards=np.array([1.0, -1.0], np.float32),
        correct=np.array([True, False]),
        outcomes=["custom", "custom"],
        counts={},
        predictions=[None, None],
    )
    tally.add(custom, ["", ""], ["1", "1"])
    assert tally.take_step() == {}
    assert tally.metrics()["data/steps_without_answers"] == 0


# ------------------------------------------------------------------ gold extraction when reading


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_rows_without_a_gold_are_skipped_and_named(tmp_path, caplog):
    path = tmp_path / "worked.jsonl"
    records = [{"question": f"q{i}", "answer": f"step {i}\n#### {i * 1000:,}"} for i in range(5)]
    records[2]["answer"] = "a solution that never states its result"
    records[4]["answer"] = "also none"
    _write_jsonl(path, records)
    read = rows.read_rows(str(path), {"problem": "question", "answer": "answer"})
    with caplog.at_level(logging.WARNING):
        kept = rows.with_extracted_golds(read, "hashes", path=str(path), field="answer")
    assert [(r.source_index, r.fields["answer"]) for r in kept] == [(0, "0"), (1, "1,000"), (3, "3,000")]
    [line] = [r.getMessage() for r in caplog.records if "gold" in r.getMessage()]
    assert "skipped 2 of 5 rows" in line and "'answer'" in line and str(path) in line and "row 2" in line
    assert rows.with_extracted_golds(read, "", path=str(path), field="answer") == read
    none = [dataclasses.replace(r, fields={**r.fields, "answer": "no marker"}) for r in read]
    with pytest.raises(rows.DataFileError, match=r"finds no gold answer in field 'answer' of any of its 5 rows"):
        rows.with_extracted_golds(none, "hashes", path=str(path), field="answer")


@needs_gsm8k
def test_local_file_build_extracts_gsm8k_golds(tmp_path):
    path = tmp_path / "gsm8k_head.jsonl"
    records = _gsm8k_rows(range(12)) + [{"question": "An unanswerable row?", "answer": "no marker here"}]
    _write_jsonl(path, records)
    builder = builders.build_local_file(
        str(tmp_path / "d"),
        str(path),
        problem_field="question",
        heldout_size=4,
        seed=0,
        gold_extraction="hashes",
    )
    split = builders.read_split(builder, "train") + builders.read_split(builder, "heldout")
    metadata = builder.info.metadata
    assert metadata is not None and metadata["golds_not_found"] == 1
    assert len(split) == 12
    by_index = {row["source_index"]: row["answer"] for row in split}
    assert by_index[0] == "18" and by_index[1] == "3"
    # The gold is the number after the last `#### `, as GSM8K publishes it.
    assert all(by_index[i] == records[i]["answer"].rsplit("#### ", 1)[1] for i in range(12))


# ------------------------------------------------------------------ config


def _config(**data) -> ml_collections.ConfigDict:
    config = recipes.tiny()
    for key, value in data.items():
        config.data[key] = value
    return config


def test_recipe_defaults_and_validation():
    assert recipes.scalerl_8b().data.answer_extraction == "boxed"
    assert recipes.scalerl_8b().data.gold_extraction == ""
    assert recipes.tiny().data.answer_extraction == "boxed"
    assert reward_config_of(recipes.tiny()).answer_styles == ("boxed",)
    good = _config(answer_extraction="hashes,answer_is,last_number", gold_extraction="hashes")
    assert reward_config_of(good).answer_styles == GSM8K_STYLES
    for key, value in [("answer_extraction", ""), ("answer_extraction", "boxed,boxed"), ("gold_extraction", "hash")]:
        problems = config_validation.check_values(_config(**{key: value}))
        assert len(problems) == 1 and f"`data.{key}` = {value!r}" in problems[0]
        assert "boxed, hashes, answer_is, last_number" in problems[0]


def test_template_and_styles_mismatch_warns_once_each():
    assert relevance.answer_style_warnings(recipes.tiny()) == []
    [boxed] = relevance.answer_style_warnings(_config(answer_extraction="hashes"))
    assert "`data.prompt_template` asks for \\boxed{}" in boxed and "add 'boxed'" in boxed
    worked = _config(prompt_template=recipes.WORKED_SOLUTION_TEMPLATE, answer_extraction="boxed")
    [hashes] = relevance.answer_style_warnings(worked)
    assert "asks for ####" in hashes and "add 'hashes'" in hashes
    worked.data.answer_extraction = "hashes,answer_is,last_number"
    assert relevance.answer_style_warnings(worked) == []
    [synthetic] = relevance.answer_style_warnings(_config(gold_extraction="hashes"))
    assert "`data.gold_extraction`" in synthetic and "synthetic" in synthetic
    # The worked-solution template asks for exactly what `hashes` reads back.
    asked = answers.after_hashes(recipes.WORKED_SOLUTION_TEMPLATE.replace("{problem}", "Q"))
    assert asked == "<number>"
