"""TFDS builders: synthetic arithmetic, the arithmetic ladder, Polaris-53K from a local file, any
local jsonl/parquet, and code problems (MBPP, HumanEval) as published.

All write ``array_record`` files into a caller-given ``data_dir`` and are read back with
``builder.as_data_source(split)`` (random access, no TensorFlow anywhere). Config names carry a
digest of everything that determines the data (for local files: the file's SHA-256), so a
changed seed, size or file never silently reuses an old build. Splits: ``train`` and
``heldout`` (plus ``sft`` for the synthetic task: worked traces for the supervised warm start;
``transfer`` for the ladder: rungs evaluated and never trained; for code files, MBPP's authors'
split by task id, and HumanEval's problems as ``heldout`` alone).
Dropped duplicate rows are counted in ``builder.info.metadata['duplicates_dropped']``, rows
without a gold answer by ``gold_extraction`` in ``builder.info.metadata['golds_not_found']``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os

import numpy as np
import tensorflow_datasets as tfds
from absl import logging

from scalerl_jax.data import code_rows, ladder, synthetic
from scalerl_jax.data import rows as rows_lib

FILE_FORMAT = "array_record"
POLARIS_FILENAME = "polaris-data-53K.jsonl"
# `data.dataset`: build_polaris, build_synthetic, build_ladder, build_local_file
DATASETS = ("polaris_53k", "synthetic", "ladder", "jsonl")
FROM_PATH = ""  # `data.dataset` = '': the builder follows `data.path` (`dataset_kind`)
DATASET_CHOICES = (FROM_PATH, *DATASETS)
_VERSION = tfds.core.Version("1.0.0")


def dataset_kind(dataset: str, path: str) -> str:
    """The builder that `data.dataset` and `data.path` select: `dataset` when set; when '' (the
    default), 'polaris_53k' for a file named polaris-data-53K.jsonl, else 'jsonl' (the reader of
    any local .jsonl or .parquet file)."""
    if dataset != FROM_PATH:
        return dataset
    return "polaris_53k" if os.path.basename(path) == POLARIS_FILENAME else "jsonl"


def suggested_heldout_size(num_rows: int) -> int:
    """A held-out split for a file of `num_rows` distinct problems: a fifth of them (at least 1)."""
    return max(1, num_rows // 5)


def check_heldout_size(path: str, field_map: dict[str, str], heldout_size: int, *, max_solution_steps: int = 0) -> None:
    """DataFileError unless `heldout_size` (`data.heldout_size`) leaves `path`'s distinct
    problems (read with `field_map`, at most `max_solution_steps` solution steps) some rows to
    train on, with a value that would."""
    rows = rows_lib.read_rows(path, field_map)
    rows = rows_lib.with_solution_steps_at_most(rows, max_solution_steps, path=path, field=field_map["answer"])
    rows, _ = rows_lib.drop_duplicate_problems(rows)
    if 0 <= heldout_size < len(rows):
        return
    hint = f"; e.g. --config.data.heldout_size={suggested_heldout_size(len(rows))}" if len(rows) > 1 else ""
    raise rows_lib.DataFileError(
        f"config key `data.heldout_size` = {heldout_size}: {path} has {len(rows)} distinct problems, so a "
        f"held-out split of {heldout_size} leaves none to train on; expected a value below {len(rows)}{hint}"
    )


def _sha256_of_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _short_digest(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode("utf-8")).hexdigest()[:12]


# --- synthetic arithmetic -------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class SyntheticArithmeticConfig(tfds.core.BuilderConfig):
    """Builder config wrapping the task definition."""

    task: synthetic.SyntheticTaskConfig = synthetic.SyntheticTaskConfig()


class SyntheticArithmetic(tfds.core.GeneratorBasedBuilder):
    """``synthetic.generate_splits(config.task)`` as a dataset with features problem, answer,
    solution (worked trace) and level."""

    name = "scalerl_synthetic_arithmetic"
    VERSION = _VERSION

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Chains of integer + and - with worked <think> traces and boxed answers.",
            features=tfds.features.FeaturesDict(
                {
                    "problem": tfds.features.Text(),
                    "answer": tfds.features.Text(),
                    "solution": tfds.features.Text(),
                    "level": tfds.features.Scalar(dtype=np.int32),
                }
            ),
        )

    def _split_generators(self, dl_manager):
        config = self.builder_config
        assert isinstance(config, SyntheticArithmeticConfig), config
        splits = synthetic.generate_splits(config.task)
        return {name: self._generate_examples(problems) for name, problems in splits.items()}

    def _generate_examples(self, problems):
        for index, problem in enumerate(problems):
            yield (
                index,
                {
                    "problem": problem.text,
                    "answer": str(problem.answer),
                    "solution": problem.solution,
                    "level": problem.level,
                },
            )


def build_synthetic(data_dir: str, task: synthetic.SyntheticTaskConfig) -> SyntheticArithmetic:
    """Builds (or reuses an identical earlier build of) the synthetic task under ``data_dir``."""
    config = SyntheticArithmeticConfig(name=f"task_{task.digest()}", version=_VERSION, task=task)
    builder = SyntheticArithmetic(config=config, data_dir=data_dir, file_format=FILE_FORMAT)
    _prepare(builder)
    return builder


# --- the arithmetic ladder ------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class LadderArithmeticConfig(tfds.core.BuilderConfig):
    """Builder config wrapping the ladder's definition."""

    task: ladder.LadderConfig = ladder.LadderConfig()


class LadderArithmetic(tfds.core.GeneratorBasedBuilder):
    """``ladder.generate_splits(config.task)`` as a dataset with features problem, answer and level
    (the rung's name)."""

    name = "scalerl_arithmetic_ladder"
    VERSION = _VERSION

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Arithmetic questions for instruct models, in named rungs of difficulty.",
            features=tfds.features.FeaturesDict(
                {"problem": tfds.features.Text(), "answer": tfds.features.Text(), "level": tfds.features.Text()}
            ),
        )

    def _split_generators(self, dl_manager):
        config = self.builder_config
        assert isinstance(config, LadderArithmeticConfig), config
        splits = ladder.generate_splits(config.task)
        # TFDS refuses a split without examples: no transfer levels, no `transfer` split.
        return {name: self._generate_examples(problems) for name, problems in splits.items() if problems}

    def _generate_examples(self, problems):
        for index, problem in enumerate(problems):
            yield index, problem.row()


def build_ladder(data_dir: str, task: ladder.LadderConfig) -> LadderArithmetic:
    """Builds (or reuses an identical earlier build of) the arithmetic ladder under ``data_dir``."""
    config = LadderArithmeticConfig(name=f"ladder_{task.digest()}", version=_VERSION, task=task)
    builder = LadderArithmetic(config=config, data_dir=data_dir, file_format=FILE_FORMAT)
    _prepare(builder)
    return builder


# --- local problem/answer files (Polaris-53K and any jsonl/parquet) ----------------------------


_LOCAL_FEATURES = {
    "problem": tfds.features.Text(),
    "answer": tfds.features.Text(),
    "difficulty": tfds.features.Text(),
    "source_index": tfds.features.Scalar(dtype=np.int64),
}


@dataclasses.dataclass(eq=False)
class LocalFileConfig(tfds.core.BuilderConfig):
    """A local file and how to read it.

    Attributes:
      path: the jsonl/parquet file (for Polaris: the file name inside the manual dir).
      problem_field, answer_field: source fields mapped to ``problem`` / ``answer``.
      difficulty_field: source field mapped to ``difficulty`` ('' for every row when None).
      heldout_size, seed: the held-out split (a seeded draw of distinct problems).
      gold_extraction: '' (the answer field is the gold) or the answer styles that find the gold
        in it (``data.gold_extraction``; rows without one are skipped and counted).
      max_solution_steps: keep only rows whose answer field has at most this many solution
        steps (``rows.solution_steps``; ``data.max_solution_steps``; 0 keeps every row).
    """

    path: str = ""
    problem_field: str = "problem"
    answer_field: str = "answer"
    difficulty_field: str | None = None
    heldout_size: int = 1000
    seed: int = 0
    gold_extraction: str = ""
    max_solution_steps: int = 0


def _local_config(builder: tfds.core.DatasetBuilder) -> LocalFileConfig:
    """The builder's ``LocalFileConfig`` (tfds types ``builder_config`` as ``Any | None``)."""
    config = builder.builder_config
    assert isinstance(config, LocalFileConfig), config
    return config


def _local_splits(builder, path: str):
    """Reads, checks, de-duplicates and splits ``path`` per ``builder.builder_config``."""
    config = _local_config(builder)
    field_map = {"problem": config.problem_field, "answer": config.answer_field}
    if config.difficulty_field is not None:
        field_map["difficulty"] = config.difficulty_field
    rows, golds_not_found = _rows_with_golds(path, field_map, config)
    rows, duplicates = rows_lib.drop_duplicate_problems(rows)
    if duplicates:
        logging.warning("%s: dropped %d rows whose problem repeats an earlier row", path, duplicates)
    if not 0 <= config.heldout_size < len(rows):
        raise rows_lib.DataFileError(
            f"{path}: {len(rows)} distinct problems leave none to train on after a held-out split of "
            f"{config.heldout_size} (data.heldout_size); expected more than {config.heldout_size} rows"
        )
    builder.info.metadata["duplicates_dropped"] = duplicates
    builder.info.metadata["golds_not_found"] = golds_not_found
    train, heldout = rows_lib.heldout_split(rows, config.heldout_size, config.seed)
    return {"train": builder._generate_examples(train), "heldout": builder._generate_examples(heldout)}


def _rows_with_golds(path: str, field_map: dict[str, str], config: LocalFileConfig) -> tuple[list[rows_lib.Row], int]:
    """The file's rows with ``config.gold_extraction`` applied to their answers
    (``rows.with_extracted_golds``), and how many rows had no gold and were skipped."""
    rows = rows_lib.read_rows(path, field_map)
    rows = rows_lib.with_solution_steps_at_most(rows, config.max_solution_steps, path=path, field=config.answer_field)
    kept = rows_lib.with_extracted_golds(rows, config.gold_extraction, path=path, field=config.answer_field)
    return kept, len(rows) - len(kept)


def _local_examples(rows: list[rows_lib.Row]):
    for row in rows:
        yield (
            row.source_index,
            {
                "problem": row.fields["problem"],
                "answer": row.fields["answer"],
                "difficulty": row.fields.get("difficulty", ""),
                "source_index": row.source_index,
            },
        )


class LocalMathFile(tfds.core.GeneratorBasedBuilder):
    """Any local jsonl/parquet of problems with answers (``config.path``)."""

    name = "scalerl_local_math_file"
    VERSION = _VERSION

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Local problem/answer file.",
            features=tfds.features.FeaturesDict(dict(_LOCAL_FEATURES)),
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager):
        return _local_splits(self, _local_config(self).path)

    def _generate_examples(self, rows):
        yield from _local_examples(rows)


class Polaris53k(tfds.core.GeneratorBasedBuilder):
    """POLARIS-Project's Polaris-53K (fields problem, answer, difficulty) from the manual dir."""

    name = "polaris_53k"
    VERSION = _VERSION
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        f"Place {POLARIS_FILENAME} (jsonl with fields problem, answer, difficulty) in the manual "
        "dir; nothing is downloaded."
    )

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Polaris-53K math problems.",
            features=tfds.features.FeaturesDict(dict(_LOCAL_FEATURES)),
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager):
        return _local_splits(self, os.fspath(dl_manager.manual_dir / _local_config(self).path))

    def _generate_examples(self, rows):
        yield from _local_examples(rows)


def build_local_file(
    data_dir: str,
    path: str,
    *,
    problem_field: str = "problem",
    answer_field: str = "answer",
    difficulty_field: str | None = None,
    heldout_size: int = 1000,
    seed: int = 0,
    gold_extraction: str = "",
    max_solution_steps: int = 0,
) -> LocalMathFile:
    """Builds a local jsonl/parquet file into ``data_dir`` (DataFileError naming a bad row).

    ``gold_extraction``: '' (each row's answer field is its gold) or the answer styles that find
    the gold in it (``answers.gold_of``; rows without one are skipped and counted)."""
    path = os.path.abspath(path)
    rows_lib.check_data_file(path)
    fields = (problem_field, answer_field, difficulty_field, heldout_size, seed, gold_extraction, max_solution_steps)
    name = f"file_{_short_digest(_sha256_of_file(path), *fields)}"
    config = LocalFileConfig(
        name=name,
        version=_VERSION,
        path=path,
        problem_field=problem_field,
        answer_field=answer_field,
        difficulty_field=difficulty_field,
        heldout_size=heldout_size,
        seed=seed,
        gold_extraction=gold_extraction,
        max_solution_steps=max_solution_steps,
    )
    builder = LocalMathFile(config=config, data_dir=data_dir, file_format=FILE_FORMAT)
    if not builder.is_prepared():
        field_map = {"problem": problem_field, "answer": answer_field}
        check_heldout_size(
            path,
            field_map | ({"difficulty": difficulty_field} if difficulty_field else {}),
            heldout_size,
            max_solution_steps=max_solution_steps,
        )
    _prepare(builder)
    return builder


def build_polaris(
    data_dir: str, manual_dir: str, *, heldout_size: int = 1000, seed: int = 0, gold_extraction: str = ""
) -> Polaris53k:
    """Builds Polaris-53K from ``manual_dir/polaris-data-53K.jsonl`` into ``data_dir``.

    The held-out split is ``heldout_size`` (paper: 1,000) problems drawn with ``seed``;
    ``gold_extraction`` as for ``build_local_file`` (Polaris' answers are golds as they are: '').
    """
    path = os.path.join(manual_dir, POLARIS_FILENAME)
    if not os.path.isfile(path):
        raise rows_lib.DataFileError(f"{path}: no such file ({POLARIS_FILENAME} is expected in {manual_dir})")
    name = f"heldout{heldout_size}_seed{seed}_{_short_digest(_sha256_of_file(path), gold_extraction)}"
    config = LocalFileConfig(
        name=name,
        version=_VERSION,
        path=POLARIS_FILENAME,
        difficulty_field="difficulty",
        heldout_size=heldout_size,
        seed=seed,
        gold_extraction=gold_extraction,
    )
    builder = Polaris53k(config=config, data_dir=data_dir, file_format=FILE_FORMAT)
    if not builder.is_prepared():
        check_heldout_size(path, {"problem": "problem", "answer": "answer", "difficulty": "difficulty"}, heldout_size)
    _prepare(builder, manual_dir=manual_dir)
    return builder


# --- code problems (MBPP, HumanEval) -----------------------------------------------------------


_CODE_FEATURES = {
    "problem": tfds.features.Text(),
    "tests": tfds.features.Text(),
    "program_prefix": tfds.features.Text(),
    "task_id": tfds.features.Text(),
    "code_format": tfds.features.Text(),
    "source_index": tfds.features.Scalar(dtype=np.int64),
}
# The builder's splits from MBPP's (code_rows.MBPP_SPLITS): train trains, test is held out,
# prompt holds the authors' few-shot examples. HumanEval is an evaluation set: held out whole.
MBPP_BUILDER_SPLITS = {"train": "train", "heldout": "test", "prompt": "prompt"}


@dataclasses.dataclass(eq=False)
class LocalCodeFileConfig(tfds.core.BuilderConfig):
    """A local MBPP or HumanEval file (`code_rows.read_code_problems`)."""

    path: str = ""


class LocalCodeFile(tfds.core.GeneratorBasedBuilder):
    """The code problems of ``config.path`` with features problem, tests, program_prefix, task_id,
    code_format and source_index (`code_rows.CodeProblem`); splits per `MBPP_BUILDER_SPLITS`, or
    ``heldout`` for HumanEval."""

    name = "scalerl_local_code_file"
    VERSION = _VERSION

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Local code problems with their tests (MBPP, HumanEval).",
            features=tfds.features.FeaturesDict(dict(_CODE_FEATURES)),
        )

    def _split_generators(self, dl_manager):
        config = self.builder_config
        assert isinstance(config, LocalCodeFileConfig), config
        problems = code_rows.read_code_problems(config.path)
        if problems[0].code_format != code_rows.MBPP:
            return {"heldout": self._generate_examples(problems)}
        return {
            split: self._generate_examples(code_rows.mbpp_split(problems, mbpp_split))
            for split, mbpp_split in MBPP_BUILDER_SPLITS.items()
        }

    def _generate_examples(self, problems):
        for problem in problems:  # the reference solution stays out: a run never shows it
            yield problem.source_index, {name: getattr(problem, name) for name in _CODE_FEATURES}


def build_code_file(data_dir: str, path: str) -> LocalCodeFile:
    """Builds (or reuses an identical earlier build of) a local MBPP or HumanEval file into
    ``data_dir`` (DataFileError naming a bad row)."""
    path = os.path.abspath(path)
    rows_lib.check_data_file(path)
    config = LocalCodeFileConfig(name=f"code_{_short_digest(_sha256_of_file(path))}", version=_VERSION, path=path)
    builder = LocalCodeFile(config=config, data_dir=data_dir, file_format=FILE_FORMAT)
    _prepare(builder)
    return builder


# --- shared ----------------------------------------------------------------------------------


def _prepare(builder: tfds.core.DatasetBuilder, manual_dir: str | None = None) -> None:
    """``download_and_prepare`` without statistics (they would need TensorFlow), quietly.

    TFDS prints its "Downloading and preparing" banner and progress bars to the console; a run's
    console is for the run, so they are replaced by one log line here.
    """
    if builder.is_prepared():
        return
    logging.info("data: building %s into %s", builder.name, builder.data_dir)
    tfds.disable_progress_bar()
    with contextlib.redirect_stdout(io.StringIO()):
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(
                manual_dir=manual_dir, compute_stats=tfds.download.ComputeStatsMode.SKIP
            )
        )


def _to_python(value):
    """Decodes a data-source value: bytes -> str (UTF-8), numpy scalars -> int/float."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    return value


def read_split(builder: tfds.core.DatasetBuilder, split: str) -> list[dict]:
    """Every example of ``split`` as a dict of Python values, in the data source's index order."""
    # tfds' wrapt-based logging decorator on as_data_source hides its real signature from pyright.
    source = builder.as_data_source(split=split)  # pyright: ignore[reportCallIssue]
    return [{key: _to_python(value) for key, value in source[i].items()} for i in range(len(source))]
