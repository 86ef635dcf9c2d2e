"""TFDS builders build and read back (array_record, no TensorFlow); held-out splits; bad rows."""

import importlib.util
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from repo_paths import GSM8K_DIR

from scalerl_jax.data import builders, synthetic

GSM8K_TEST = os.path.join(GSM8K_DIR, "test.jsonl")

TASK = synthetic.SyntheticTaskConfig(seed=1, split_sizes=(("heldout", 16), ("sft", 40), ("train", 48)))


def test_tensorflow_is_not_installed():
    # The builders below run in this environment, so they need no TensorFlow.
    assert importlib.util.find_spec("tensorflow") is None


def test_synthetic_builds_and_reads_back(tmp_path):
    builder = builders.build_synthetic(str(tmp_path), TASK)
    splits = {s: builders.read_split(builder, s) for s in ("heldout", "sft", "train")}
    assert {s: len(rows) for s, rows in splits.items()} == {"heldout": 16, "sft": 40, "train": 48}
    for rows in splits.values():
        for row in rows:
            # Independent check of the stored gold: sum of the signed terms of the expression.
            terms = re.findall(r"[+-]?\d+", row["problem"])
            assert int(row["answer"]) == sum(int(t) for t in terms)
            assert row["solution"].endswith("\\boxed{" + row["answer"] + "}")
            assert row["solution"].startswith("<think>")
            assert 0 <= row["level"] < len(TASK.levels)
    problems = {s: {r["problem"] for r in rows} for s, rows in splits.items()}
    assert not problems["heldout"] & problems["train"]
    assert not problems["heldout"] & problems["sft"]
    assert any(f.name.endswith(".array_record-00000-of-00001") for f in tmp_path.rglob("*") if f.is_file())
    # A second build of the same config in another directory holds the same held-out problems.
    again = builders.build_synthetic(str(tmp_path / "again"), TASK)
    assert {r["problem"] for r in builders.read_split(again, "heldout")} == problems["heldout"]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def _polaris_rows(n):
    return [
        {"problem": f"Find x if x - {i} = 0.", "answer": str(i), "difficulty": f"{i % 8}/8", "extra": i}
        for i in range(n)
    ]


def test_polaris_builds_with_disjoint_stable_heldout(tmp_path):
    manual = tmp_path / "manual"
    manual.mkdir()
    records = _polaris_rows(60)
    records.insert(30, dict(records[5]))  # exact duplicate problem: dropped and counted
    _write_jsonl(manual / builders.POLARIS_FILENAME, records)
    builder = builders.build_polaris(str(tmp_path / "d1"), str(manual), heldout_size=10, seed=0)
    train = builders.read_split(builder, "train")
    heldout = builders.read_split(builder, "heldout")
    assert len(heldout) == 10 and len(train) == 50
    metadata = builder.info.metadata
    assert metadata is not None and metadata["duplicates_dropped"] == 1
    train_p, heldout_p = {r["problem"] for r in train}, {r["problem"] for r in heldout}
    assert not train_p & heldout_p
    assert train_p | heldout_p == {r["problem"] for r in records}
    by_problem = {r["problem"]: r for r in records}
    for row in train + heldout:
        source = by_problem[row["problem"]]
        assert row["answer"] == source["answer"]
        assert row["difficulty"] == source["difficulty"]
        assert records[row["source_index"]]["problem"] == row["problem"]
    # Stable: same file, size and seed in a fresh data dir -> same held-out set.
    rebuilt = builders.build_polaris(str(tmp_path / "d2"), str(manual), heldout_size=10, seed=0)
    assert {r["problem"] for r in builders.read_split(rebuilt, "heldout")} == heldout_p
    reseeded = builders.build_polaris(str(tmp_path / "d1"), str(manual), heldout_size=10, seed=1)
    assert {r["problem"] for r in builders.read_split(reseeded, "heldout")} != heldout_p


def test_polaris_missing_file(tmp_path):
    with pytest.raises(ValueError, match="polaris-data-53K.jsonl"):
        builders.build_polaris(str(tmp_path / "d"), str(tmp_path))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.pop("answer"), r"row 3 has no field 'answer'"),
        (lambda r: r.update(problem="   "), r"row 3 field 'problem' is empty"),
        (lambda r: r.update(answer=7), r"row 3 field 'answer' is int"),
        (lambda r: r.update(difficulty=None), r"row 3 has no field 'difficulty'"),
    ],
)
def test_polaris_bad_row_fails_with_index_and_field(tmp_path, mutate, message):
    records = _polaris_rows(8)
    mutate(records[3])
    _write_jsonl(tmp_path / builders.POLARIS_FILENAME, records)
    with pytest.raises(ValueError, match=message):
        builders.build_polaris(str(tmp_path / "d"), str(tmp_path), heldout_size=2)


def test_undecodable_and_malformed_lines(tmp_path):
    good = "".join(json.dumps(r) + "\n" for r in _polaris_rows(4)).encode("utf-8")
    (tmp_path / "bad_utf8.jsonl").write_bytes(good + b'{"problem": "\xff\xfe", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"row 4 \(line 5\) is not valid UTF-8"):
        builders.build_local_file(str(tmp_path / "d"), str(tmp_path / "bad_utf8.jsonl"), heldout_size=1)
    (tmp_path / "bad_json.jsonl").write_bytes(good[:40] + b"\n" + good)
    with pytest.raises(ValueError, match=r"row 0 \(line 1\) is not valid JSON"):
        builders.build_local_file(str(tmp_path / "d"), str(tmp_path / "bad_json.jsonl"), heldout_size=1)


def test_local_parquet_with_field_mapping(tmp_path):
    table = pa.table(
        {"question": [f"What is {i} squared?" for i in range(12)], "final": [str(i * i) for i in range(12)]}
    )
    pq.write_table(table, tmp_path / "rows.parquet")
    builder = builders.build_local_file(
        str(tmp_path / "d"),
        str(tmp_path / "rows.parquet"),
        problem_field="question",
        answer_field="final",
        heldout_size=3,
        seed=5,
    )
    train = builders.read_split(builder, "train")
    heldout = builders.read_split(builder, "heldout")
    assert len(train) == 9 and len(heldout) == 3
    for row in train + heldout:
        number = re.search(r"\d+", row["problem"])
        assert number is not None
        i = int(number.group())
        assert row["answer"] == str(i * i) and row["difficulty"] == ""
    bad = pa.table({"question": ["ok", "fine"], "final": ["1", None]})
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"row 1 has no field 'final'"):
        builders.build_local_file(
            str(tmp_path / "d"),
            str(tmp_path / "bad.parquet"),
            problem_field="question",
            answer_field="final",
            heldout_size=1,
        )


def test_changed_file_is_rebuilt(tmp_path):
    path = tmp_path / "rows.jsonl"
    _write_jsonl(path, _polaris_rows(6))
    first = builders.build_local_file(str(tmp_path / "d"), str(path), heldout_size=1)
    _write_jsonl(path, _polaris_rows(9))
    second = builders.build_local_file(str(tmp_path / "d"), str(path), heldout_size=1)
    assert len(builders.read_split(first, "train")) == 5
    assert len(builders.read_split(second, "train")) == 8


def test_heldout_size_that_leaves_no_train_rows_is_named_before_building(tmp_path):
    # 40 distinct problems (41 rows, one repeated): a held-out split of 1,000 leaves nothing to
    # train on. The error names the key, its value, the file and its 40 problems, and suggests
    # 40 // 5 = 8; nothing is built.
    path = tmp_path / "small.jsonl"
    rows = _polaris_rows(40)
    _write_jsonl(path, rows + [rows[3]])
    with pytest.raises(builders.rows_lib.DataFileError) as error:
        builders.build_local_file(str(tmp_path / "tfds"), str(path), heldout_size=1000)
    message = str(error.value)
    assert message.startswith("config key `data.heldout_size` = 1000: ")
    assert f"{path} has 40 distinct problems" in message and "--config.data.heldout_size=8" in message
    assert not (tmp_path / "tfds").exists()
    manual = tmp_path / "manual"
    manual.mkdir()
    _write_jsonl(manual / builders.POLARIS_FILENAME, rows)
    with pytest.raises(builders.rows_lib.DataFileError, match="`data.heldout_size` = 40: "):
        builders.build_polaris(str(tmp_path / "tfds"), str(manual), heldout_size=40)
    builder = builders.build_local_file(str(tmp_path / "tfds"), str(path), heldout_size=8)
    assert len(builders.read_split(builder, "heldout")) == 8 and len(builders.read_split(builder, "train")) == 32


def _worked(steps: int, gold: int) -> str:
    """A GSM8K-style worked solution of `steps` lines ending in `#### gold`."""
    return "\n".join(f"Step {k}: {k} + {k} = {2 * k}." for k in range(steps)) + f"\n#### {gold:,}"


def test_max_solution_steps_keeps_the_easier_worked_solutions(tmp_path):
    # 3 rows of 2 steps, 4 of 3 and 5 of 5 (one with a blank line, which is no step); at most 3
    # steps keeps 3 + 4 = 7 rows; golds are the `####` line's text (the reward reads `1,000` as 1000).
    rows = [{"question": f"Q{i} (2 steps)?", "answer": _worked(2, 1000 + i)} for i in range(3)]
    rows += [{"question": f"Q{i} (3 steps)?", "answer": _worked(3, 2000 + i)} for i in range(4)]
    rows += [
        {"question": f"Q{i} (5 steps)?", "answer": _worked(5, 3000 + i).replace("\n", "\n\n", 1)} for i in range(5)
    ]
    path = tmp_path / "worked.jsonl"
    _write_jsonl(path, rows)
    builder = builders.build_local_file(
        str(tmp_path / "d"),
        str(path),
        problem_field="question",
        heldout_size=2,
        gold_extraction="hashes",
        max_solution_steps=3,
    )
    kept = builders.read_split(builder, "train") + builders.read_split(builder, "heldout")
    assert len(kept) == 7
    assert sorted(row["answer"] for row in kept) == ["1,000", "1,001", "1,002", "2,000", "2,001", "2,002", "2,003"]
    with pytest.raises(builders.rows_lib.DataFileError, match="at most 1 solution steps"):
        builders.build_local_file(
            str(tmp_path / "d"), str(path), problem_field="question", heldout_size=1, max_solution_steps=1
        )


@pytest.mark.skipif(not os.path.isfile(GSM8K_TEST), reason=f"GSM8K not found at {GSM8K_TEST}")
def test_gsm8k_test_set_has_326_two_step_problems(tmp_path):
    # GSM8K's test split: 326 of its 1,319 worked solutions take two lines before `#### ` (counted
    # by hand with a one-line script over the published file); 26 of them held out leaves 300.
    builder = builders.build_local_file(
        str(tmp_path / "d"),
        GSM8K_TEST,
        problem_field="question",
        heldout_size=26,
        gold_extraction="hashes",
        max_solution_steps=2,
    )
    assert len(builders.read_split(builder, "train")) == 300
    assert len(builders.read_split(builder, "heldout")) == 26
