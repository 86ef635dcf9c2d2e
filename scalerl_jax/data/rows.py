"""Reading problem/answer rows from local jsonl or parquet files, strictly, and splitting them.

Every row must carry each mapped field as a non-empty string (valid UTF-8); the first bad row
fails the whole read with its index and field, so a malformed dataset is never half-used.
With a gold extraction (``data.gold_extraction``, e.g. ``'hashes'`` for GSM8K's worked solutions)
each row's answer field is replaced by the gold its styles find (``answers.gold_of``); rows where
none is found are counted, named in one warning and skipped (none left: DataFileError).
Exact duplicate problems keep their first occurrence (the count of dropped rows is returned),
then a seeded draw of distinct problems forms the held-out split: disjoint from training by
problem text and identical across runs for the same file, size and seed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

import numpy as np
from absl import logging

from scalerl_jax.data.answers import gold_of


class DataFileError(ValueError):
    """A data file that cannot be used as given; the message names the file, the row (and line)
    or field, and what was expected."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One problem: fields by output name, and its 0-based row index in the source file."""

    fields: dict[str, str]
    source_index: int


def _checked_field(record: Mapping, field: str, index: int, where: str) -> str:
    """The non-empty string ``record[field]`` (bytes are decoded as UTF-8), else DataFileError."""
    if field not in record or record[field] is None:
        raise DataFileError(f"{where}: row {index} has no field {field!r} (fields: {sorted(record)})")
    value = record[field]
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataFileError(f"{where}: row {index} field {field!r} is not valid UTF-8: {e}") from e
    if not isinstance(value, str):
        raise DataFileError(f"{where}: row {index} field {field!r} is {type(value).__name__}, expected a string")
    if not value.strip():
        raise DataFileError(f"{where}: row {index} field {field!r} is empty")
    return value


def check_data_file(path: str) -> None:
    """DataFileError unless ``path`` is an existing regular file."""
    if os.path.isdir(path):
        raise DataFileError(f"{path}: is a directory, expected a .jsonl or .parquet file")
    if not os.path.isfile(path):
        raise DataFileError(f"{path}: no such file")


def _jsonl_records(path: str):
    """Yields ``(index, dict)`` per line; DataFileError naming the line for bad UTF-8 or JSON."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for index, raw in enumerate(lines):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataFileError(f"{path}: row {index} (line {index + 1}) is not valid UTF-8: {e}") from e
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataFileError(
                f"{path}: row {index} (line {index + 1}) is not valid JSON: {e.msg} at column {e.colno}"
            ) from e
        if not isinstance(record, dict):
            raise DataFileError(
                f"{path}: row {index} (line {index + 1}) is {type(record).__name__}, expected a JSON object"
            )
        yield index, record


def _parquet_records(path: str):
    """Yields ``(index, dict)`` per parquet row (pyarrow; binary columns come as bytes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except pa.ArrowException as e:
        raise DataFileError(f"{path}: not a readable parquet file ({e})") from e
    yield from enumerate(table.to_pylist())


def file_format_of(path: str) -> str:
    """``'jsonl'`` or ``'parquet'`` from the file suffix (DataFileError otherwise)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    raise DataFileError(f"{path}: unknown data file suffix {suffix!r} (expected .jsonl or .parquet)")


def read_records(path: str, *, file_format: str | None = None):
    """Yields ``(index, dict)`` for each row of the jsonl or parquet file ``path`` (DataFileError
    naming the file, and the row and line, for a missing file or a malformed row)."""
    check_data_file(path)
    file_format = file_format or file_format_of(path)
    records = {"jsonl": _jsonl_records, "parquet": _parquet_records}.get(file_format)
    if records is None:
        raise DataFileError(f"{path}: unknown file_format {file_format!r} (jsonl or parquet)")
    yield from records(path)


def read_rows(path: str, field_map: Mapping[str, str], *, file_format: str | None = None) -> list[Row]:
    """All rows of ``path`` with ``field_map`` (output name -> source field) applied and checked."""
    rows = []
    for index, record in read_records(path, file_format=file_format):
        fields = {name: _checked_field(record, source, index, path) for name, source in field_map.items()}
        rows.append(Row(fields=fields, source_index=index))
    if not rows:
        raise DataFileError(f"{path}: the file has no rows")
    return rows


def extract_golds(answers: Sequence[str], gold_extraction: str, *, path: str, field: str) -> dict[int, str]:
    """``{i: gold}`` for each ``answers[i]`` whose gold ``gold_of(answers[i], gold_extraction)``
    finds (every answer, as is, for ``gold_extraction=''``).

    Answers where none is found are skipped and counted in one warning naming the count, the
    field, the file ``path`` and the first such row; DataFileError when none is left.
    """
    golds = {i: gold for i, text in enumerate(answers) if (gold := gold_of(text, gold_extraction)) is not None}
    missing = [i for i in range(len(answers)) if i not in golds]
    if missing and not golds:
        raise DataFileError(
            f"{path}: data.gold_extraction={gold_extraction!r} finds no gold answer in field {field!r} of any of "
            f"its {len(answers)} rows (row {missing[0]}: {answers[missing[0]][:80]!r})"
        )
    if missing:
        logging.warning(
            "%s: skipped %d of %d rows whose field %r has no gold answer by data.gold_extraction=%r (first: row %d, %r)",
            path,
            len(missing),
            len(answers),
            field,
            gold_extraction,
            missing[0],
            answers[missing[0]][:80],
        )
    return golds


def solution_steps(solution: str) -> int:
    """The steps of a worked solution: its non-empty lines before the last ``####`` (the line
    of the final answer), as GSM8K writes one step per line (its problems take 2 to 8 steps):
    ``"Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72"`` has 2."""
    worked = solution.rsplit("####", 1)[0]
    return sum(1 for line in worked.splitlines() if line.strip())


def indices_with_solution_steps_at_most(solutions: list[str], max_steps: int, *, path: str, field: str) -> list[int]:
    """Indices of the worked ``solutions`` with at most ``max_steps`` steps (``solution_steps``);
    ``max_steps`` 0 keeps every one. The ones left out are counted in one log line
    (``data.max_solution_steps`` narrows the task to easier problems); none left is a
    DataFileError naming the file and field."""
    if max_steps == 0:
        return list(range(len(solutions)))
    kept = [i for i, solution in enumerate(solutions) if solution_steps(solution) <= max_steps]
    if not kept:
        raise DataFileError(
            f"{path}: no row's field {field!r} has at most {max_steps} solution steps (lines before the last ####) "
            f"(data.max_solution_steps = {max_steps}; {len(solutions)} rows)"
        )
    logging.info(
        "%s: data.max_solution_steps = %d keeps %d of %d rows (field %r: at most %d lines before the last ####)",
        path,
        max_steps,
        len(kept),
        len(solutions),
        field,
        max_steps,
    )
    return kept


def with_solution_steps_at_most(rows: list[Row], max_steps: int, *, path: str, field: str) -> list[Row]:
    """The ``rows`` whose answer field (``fields['answer']``, the worked solution as read) has at
    most ``max_steps`` steps (``indices_with_solution_steps_at_most``)."""
    kept = indices_with_solution_steps_at_most(
        [row.fields["answer"] for row in rows], max_steps, path=path, field=field
    )
    return [rows[i] for i in kept]


def with_extracted_golds(
    rows: list[Row], gold_extraction: str, *, path: str, field: str, answer_key: str = "answer"
) -> list[Row]:
    """``rows`` (as ``read_rows`` returns them: position = row index in the file) with
    ``fields[answer_key]`` replaced by its extracted gold (``extract_golds``: rows without one
    skipped and counted in a warning; none left is a DataFileError)."""
    if not gold_extraction:
        return rows
    golds = extract_golds([row.fields[answer_key] for row in rows], gold_extraction, path=path, field=field)
    return [
        dataclasses.replace(row, fields={**row.fields, answer_key: golds[i]})
        for i, row in enumerate(rows)
        if i in golds
    ]


def drop_duplicate_problems(rows: list[Row], problem_field: str = "problem") -> tuple[list[Row], int]:
    """Rows with the first occurrence of each exact problem text, and how many were dropped."""
    seen: set[str] = set()
    unique = []
    for row in rows:
        problem = row.fields[problem_field]
        if problem not in seen:
            seen.add(problem)
            unique.append(row)
    return unique, len(rows) - len(unique)


def heldout_split(rows: list[Row], heldout_size: int, seed: int) -> tuple[list[Row], list[Row]]:
    """``(train, heldout)``: ``heldout_size`` rows drawn by a seeded permutation, the rest train.

    Both keep file order. ``rows`` should be duplicate-free so the splits share no problem.
    """
    if not 0 <= heldout_size < len(rows):
        raise ValueError(f"heldout_size={heldout_size} must be in [0, {len(rows)}) for {len(rows)} rows")
    order = np.random.default_rng(seed).permutation(len(rows))
    heldout_positions = set(order[:heldout_size].tolist())
    train = [row for i, row in enumerate(rows) if i not in heldout_positions]
    heldout = [row for i, row in enumerate(rows) if i in heldout_positions]
    return train, heldout
