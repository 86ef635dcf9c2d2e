"""A policy's pass rates on a local benchmark file, sampled and verified as training samples and
verifies (`scalerl_jax.cli.evaluate` is its command line).

Metrics, for N prompts with K samples each and c_i correct samples of prompt i:
  mean@K = (1/N) sum_i c_i / K   (the paper's metric: mean over prompts of the pass rate)
  pass@k = (1/N) sum_i [1 - C(K - c_i, k) / C(K, k)]   (unbiased estimator, Chen et al. 2021)
and both per value of a group field.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from scalerl_jax import data as data_lib
from scalerl_jax.config.adapters import engine_config_of, reward_config_of
from scalerl_jax.config.memory_fit import check_run_memory
from scalerl_jax.data.code_reward import CODE_KINDS, score_code_completions
from scalerl_jax.data.code_rows import MBPP, TEMPLATES, CodeProblem, mbpp_split, read_code_problems
from scalerl_jax.data.rows import extract_golds, indices_with_solution_steps_at_most, read_records
from scalerl_jax.models import load_checkpoint_tokenizer, make_mesh, param_shardings
from scalerl_jax.run import policy_source
from scalerl_jax.run.sampling_setup import (
    check_think_end,
    check_token_ids,
    make_prompt_encoder,
    make_sample_fn,
)
from scalerl_jax.sampler import Completion, ContinuousBatcher, Engine
from scalerl_jax.sandbox import CodeVerifier, SandboxLimits
from scalerl_jax.telemetry.compile_events import compile_log


class EvaluateError(ValueError):
    """Bad evaluation input; the message names the file, row, field or flag."""


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """Problems and gold answers of a file (`groups[i]` the group field's value, or None). A code
    file (MBPP, HumanEval) also has its `code` problems (answers: their tests) and `code_format`."""

    path: str
    problems: list[str]
    answers: list[str]
    groups: list[str] | None
    rows: list[int]
    code: list[CodeProblem] | None = None
    code_format: str = ""

    def take(self, start: int, end: int) -> Benchmark:
        """Problems `start` to `end` (exclusive, 0-based, in file order) of this benchmark."""
        return dataclasses.replace(
            self,
            problems=self.problems[start:end],
            answers=self.answers[start:end],
            groups=None if self.groups is None else self.groups[start:end],
            rows=self.rows[start:end],
            code=None if self.code is None else self.code[start:end],
        )


def is_code_file(path: str) -> bool:
    """Whether `path` holds code problems: a gzipped jsonl (HumanEval as published) or a file whose
    first row has MBPP's `test_list` or HumanEval's `entry_point`."""
    if path.endswith(".jsonl.gz"):
        return True
    if not path.endswith(".jsonl") or not os.path.isfile(path):
        return False
    for _, record in read_records(path):
        return "test_list" in record or "entry_point" in record
    return False


def read_code_benchmark(path: str, *, split: str = "") -> Benchmark:
    """The code problems of `path` (`data.code_rows`), MBPP's `split` of them when given (its
    authors' task id ranges); EvaluateError for a split of another file or an unknown one."""
    problems = read_code_problems(path)
    with_split = problems
    code_format = problems[0].code_format
    if split:
        if code_format != MBPP:
            raise EvaluateError(f"--split {split!r}: splits are MBPP's; {path} is not MBPP")
        try:
            with_split = mbpp_split(problems, split)
        except ValueError as e:
            raise EvaluateError(f"--split: {e}") from None
    return Benchmark(
        path=path,
        problems=[p.problem for p in with_split],
        answers=[p.tests for p in with_split],
        groups=None,
        rows=[p.source_index for p in with_split],
        code=with_split,
        code_format=code_format,
    )


def _records(path: str) -> list[dict]:
    """The rows of a .jsonl or .parquet file as dicts (`data.rows.read_records`: an error names the
    file and the row and line that cannot be read)."""
    if not os.path.exists(path):
        raise EvaluateError(f"--data {path!r} does not exist")
    if os.path.isdir(path):
        raise EvaluateError(f"--data {path!r} is a directory; expected a .jsonl or .parquet file")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".jsonl", ".parquet"):
        raise EvaluateError(f"--data {path!r}: unknown suffix {suffix!r} (expected .jsonl or .parquet)")
    return [record for _, record in read_records(path)]


def read_benchmark(
    path: str,
    *,
    problem_field: str = "problem",
    answer_field: str = "answer",
    group_field: str | None = None,
    gold_extraction: str = "",
    max_solution_steps: int = 0,
) -> Benchmark:
    """Reads a benchmark file; a row missing a field (or None there, or an empty problem) is an
    error naming the file, row and field. Answers and group values are taken as `str(value)`; with
    `gold_extraction` (`data.gold_extraction`, e.g. 'hashes' for GSM8K's worked solutions) the
    gold is what its styles find in the answer field, and rows where they find none are skipped
    with one warning naming the count (`data.rows.extract_golds`); `max_solution_steps` > 0 keeps
    the rows whose answer field has at most that many solution steps (`data.max_solution_steps`,
    as training read its file)."""
    records = _records(path)
    if not records:
        raise EvaluateError(f"{path}: the file has no rows")
    fields = [problem_field, answer_field] + ([group_field] if group_field else [])
    for index, record in enumerate(records):
        for field in fields:
            if record.get(field) is None:
                raise EvaluateError(f"{path}: row {index} has no field {field!r} (fields: {sorted(record)})")
        if not isinstance(record[problem_field], str) or not record[problem_field].strip():
            raise EvaluateError(f"{path}: row {index} field {problem_field!r} is not a non-empty string")
        if not str(record[answer_field]).strip():
            raise EvaluateError(f"{path}: row {index} field {answer_field!r} is empty; expected the gold answer")
    answers = [str(r[answer_field]) for r in records]
    narrowed = set(indices_with_solution_steps_at_most(answers, max_solution_steps, path=path, field=answer_field))
    golds = extract_golds(answers, gold_extraction, path=path, field=answer_field)
    kept = sorted(narrowed & set(golds))
    return Benchmark(
        path=path,
        problems=[records[i][problem_field] for i in kept],
        answers=[golds[i] for i in kept],
        groups=[str(records[i][group_field]) for i in kept] if group_field else None,
        rows=kept,
    )


def summarize(correct: np.ndarray, ks: Sequence[int]) -> dict[str, float]:
    """`mean@K` and `pass@k` for each k of a correctness matrix bool[N, K] (module docstring)."""
    num_prompts, num_samples = correct.shape
    num_correct = correct.sum(axis=1)
    out = {f"mean@{num_samples}": float((num_correct / num_samples).mean())}
    for k in ks:
        out[f"pass@{k}"] = float(data_lib.pass_at_k(num_samples, num_correct, k).mean())
    out["num_prompts"] = num_prompts
    return out


def summarize_groups(correct: np.ndarray, groups: Sequence[str], ks: Sequence[int]) -> dict[str, dict]:
    """`summarize` over the prompts of each group value (values sorted as strings)."""
    labels = np.asarray(groups)
    return {value: summarize(correct[labels == value], ks) for value in sorted(set(groups))}


def progress_line(
    samples_done: int, samples: int, prompts_done: int, prompts: int, tokens: int, elapsed_s: float, compiles: int
) -> str:
    """One progress line: samples and prompts done, completion tokens/s = tokens of the finished
    samples / elapsed seconds, ETA = elapsed / samples done x samples left (unknown before the
    first sample), and the programs compiled so far."""
    rate = tokens / elapsed_s if elapsed_s > 0 else 0.0
    eta = f"{elapsed_s / samples_done * (samples - samples_done):.0f} s" if samples_done else "unknown"
    return (
        f"evaluate: {samples_done}/{samples} samples, {prompts_done}/{prompts} prompts done, "
        f"{rate:.1f} completion tokens/s, {elapsed_s:.0f} s elapsed, ETA {eta}, {compiles} programs compiled"
    )


class Progress:
    """Counts finished samples (a prompt is done when all its samples are) and logs
    `progress_line` every `interval_s` seconds from a thread of its own, so that a long compile or
    a slow first chunk shows too; a last line at `close`."""

    def __init__(self, samples: int, samples_per_prompt: int, interval_s: float):
        self.samples, self.per_prompt, self.interval_s = samples, samples_per_prompt, interval_s
        self._lock = threading.Lock()
        self._done: dict[int, int] = {}  # prompt -> finished samples
        self._samples_done = self._tokens = 0
        self._log = compile_log()
        self._compiles_before = self._log.count()
        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="evaluate-progress", daemon=True)
        self._thread.start()

    def add(self, completions: Sequence[Completion]) -> None:
        """Counts finished completions (request id i samples prompt i // samples_per_prompt)."""
        with self._lock:
            for completion in completions:
                assert isinstance(completion.request_id, int)  # make_sample_fn numbers the requests
                prompt = completion.request_id // self.per_prompt
                self._done[prompt] = self._done.get(prompt, 0) + 1
                self._samples_done += 1
                self._tokens += len(completion.tokens)

    def line(self) -> str:
        with self._lock:
            prompts_done = sum(n == self.per_prompt for n in self._done.values())
            return progress_line(
                self._samples_done,
                self.samples,
                prompts_done,
                self.samples // self.per_prompt,
                self._tokens,
                time.perf_counter() - self._start,
                self._log.count() - self._compiles_before,
            )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            logging.info("%s", self.line())

    def close(self) -> float:
        """Stops the thread, logs the last line; returns the seconds since the start."""
        self._stop.set()
        self._thread.join()
        logging.info("%s", self.line())
        return time.perf_counter() - self._start


class ProgressBatcher(ContinuousBatcher):
    """A `ContinuousBatcher` that tells `progress` of each completion as it finishes."""

    def __init__(self, *args: Any, progress: Progress, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.progress = progress

    def run_chunk(self) -> list[Completion]:
        done = super().run_chunk()
        self.progress.add(done)
        return done


def evaluate_policy(
    policy: policy_source.Policy,
    config: ml_collections.ConfigDict,
    benchmark: Benchmark,
    *,
    num_samples: int,
    ks: Sequence[int],
    seed: int = 0,
    keep_texts: bool = False,
    progress_every_s: float = 10.0,
) -> dict[str, Any]:
    """Samples `num_samples` completions per problem with the run's sampler on all devices
    (`config.mesh.generator_shape`), scores them with the run's verifier, and returns the report
    (metrics, per-group metrics, per-prompt correctness; completion texts when `keep_texts`),
    logging progress every `progress_every_s` seconds (the engine logs each program it compiles)."""
    if benchmark.code is not None:  # the code layout's own user turn (`code_rows.TEMPLATES`)
        config = config.copy_and_resolve_references()
        config.data.prompt_template = TEMPLATES[benchmark.code_format]
    tok = load_checkpoint_tokenizer(policy.checkpoint_dir)
    check_think_end(config, tok, policy.checkpoint_dir)
    check_token_ids(config, tok, policy.checkpoint_dir)
    encoded = make_prompt_encoder(config, tok, policy.checkpoint_dir).encode(benchmark.problems)
    if not encoded.tokens:
        raise EvaluateError(
            f"{benchmark.path}: every problem is longer than data.max_prompt_tokens={config.data.max_prompt_tokens}"
        )
    kept = encoded.source_indices
    reward_config = reward_config_of(config)
    code_outcomes: list[str] = []
    if benchmark.code is not None:
        code_problems = [benchmark.code[i] for i in kept for _ in range(num_samples)]
        verifier = CodeVerifier(SandboxLimits(workers=config.data.verify_workers))  # before any compile
        verify_pool = None

        def reward_fn(texts: Sequence[str], golds: Sequence[str]) -> data_lib.ScoredBatch:
            scored = score_code_completions(
                texts,
                code_problems,
                verifier,
                correct_reward=reward_config.correct_reward,
                incorrect_reward=reward_config.incorrect_reward,
            )
            code_outcomes.extend(scored.outcomes)
            return scored
    else:
        verify_pool = data_lib.VerifyPool(
            config.data.verify_workers, time_limit_s=config.data.verify_timeout_s, reward_fn=reward_config.reward_fn
        )
        problems = [benchmark.problems[i] for i in kept for _ in range(num_samples)]

        def reward_fn(texts: Sequence[str], golds: Sequence[str]) -> data_lib.ScoredBatch:
            return data_lib.score_completions(texts, golds, reward_config, pool=verify_pool, problems=problems)

    mesh = make_mesh(config.mesh.generator_shape)
    params = jax.device_put(policy.params, param_shardings(policy.params, mesh), may_alias=False)
    engine = Engine(policy.graphdef, policy.model_config, engine_config_of(config, tok), mesh=mesh)
    progress = Progress(len(kept) * num_samples, num_samples, progress_every_s)
    batcher = ProgressBatcher(engine, params, version=policy.step or 0, seed=seed, progress=progress)
    texts: list[str] = []

    def decode(tokens: list[int]) -> str:
        texts.append(tok.tokenizer.decode(tokens))
        return texts[-1]

    try:
        result = data_lib.evaluate(
            make_sample_fn(batcher, config, tok.stop_ids),
            encoded.tokens,
            [benchmark.answers[i] for i in kept],
            num_samples=num_samples,
            decode=decode,
            pass_at=ks,
            reward_fn=reward_fn,
        )
    finally:
        sampling_s = progress.close()
        if verify_pool is not None:
            verify_pool.close()
    correct = result.correct
    per_prompt = []
    for n, row in enumerate(kept):
        entry = {"row": benchmark.rows[row], "answer": benchmark.answers[row], "correct": [bool(c) for c in correct[n]]}
        if benchmark.groups is not None:
            entry["group"] = benchmark.groups[row]
        if keep_texts:
            entry["completions"] = texts[n * num_samples : (n + 1) * num_samples]
        per_prompt.append(entry)
    # Every metric the evaluation returns (answer-found and format fractions, truncation, lengths,
    # timeouts); the table's mean@K / pass@k / prompt count are `summarize`'s.
    extra = {key.split("/", 1)[1]: value for key, value in result.metrics.items()}
    if code_outcomes:  # the code verifier's verdicts: the share of samples of each kind
        extra.update({f"code_{kind}_frac": code_outcomes.count(kind) / len(code_outcomes) for kind in CODE_KINDS})
    summary = summarize(correct, ks)
    tokens = extra.get("mean_completion_tokens", 0.0) * len(kept) * num_samples
    report = {
        "metrics": {**extra, **summary},
        "sampling_seconds": sampling_s,
        "completion_tokens_per_s": tokens / sampling_s if sampling_s > 0 else 0.0,
        "samples_per_prompt": num_samples,
        "skipped_too_long": [benchmark.rows[i] for i in sorted(set(range(len(benchmark.problems))) - set(kept))],
        "sampling": {
            "temperature": config.sampler.temperature,
            "top_p": config.sampler.top_p,
            "top_k": config.sampler.top_k,
            "max_new_tokens": config.sampler.max_new_tokens,
            "length_control": config.rl.length_control,
            "reward_kind": "code" if benchmark.code is not None else reward_config.kind,
            "prompt_template": config.data.prompt_template,
            "use_chat_template": config.data.use_chat_template,
            "seed": seed,
        },
        "per_prompt": per_prompt,
    }
    if benchmark.groups is not None:
        report["groups"] = summarize_groups(correct, [benchmark.groups[i] for i in kept], ks)
    return report


def format_table(report: dict[str, Any], group_field: str | None) -> str:
    """The report's metrics (and per-group metrics) as a plain-text table, then every other metric
    of the evaluation, one `name value` pair each, and the wall time."""
    metrics = report["metrics"]
    keys = [k for k in metrics if k.startswith(("mean@", "pass@")) and "/" not in k]
    lines = [f"{'':>16} {'prompts':>8} " + " ".join(f"{k:>9}" for k in keys)]
    rows = [("all", metrics)] + [(f"{group_field}={v}", m) for v, m in report.get("groups", {}).items()]
    for name, values in rows:
        lines.append(f"{name:>16} {values['num_prompts']:>8} " + " ".join(f"{values[k]:>9.4f}" for k in keys))
    others = [(k, v) for k, v in metrics.items() if k not in keys and k not in ("num_prompts", "pass_rate")]
    lines.append("  ".join(f"{k} {v:.4g}" for k, v in others))
    lines.append(
        f"skipped (too long) {len(report['skipped_too_long'])}  sampling {report['sampling_seconds']:.1f} s, "
        f"{report['completion_tokens_per_s']:.1f} completion tokens/s"
        + (f"  wall time {report['wall_seconds']:.1f} s" if "wall_seconds" in report else "")
    )
    return "\n".join(lines)


def load_policy(
    path: str, is_run: bool, config: ml_collections.ConfigDict, *, step: int | None
) -> policy_source.Policy:
    """The policy of a run directory (its checkpoint at `step`, default the latest) or of a Hugging
    Face directory, after checking that the sampler's KV pool and the weights fit this machine's
    devices (`check_run_memory`: a ConfigError naming the keys, before anything loads or compiles)."""
    devices = jax.devices()
    if is_run:
        base = policy_source.base_checkpoint_dir(config, path)
    elif step is not None:
        raise EvaluateError(f"--step is for run directories; {path!r} is a Hugging Face directory")
    else:
        base = path
    check_run_memory(config, policy_source.run_model_config(config, base), generator_devices=devices)
    if is_run:
        return policy_source.load_run_policy(path, config, step=step)
    return policy_source.load_hf_policy(path, config, mesh=make_mesh(config.mesh.generator_shape))
