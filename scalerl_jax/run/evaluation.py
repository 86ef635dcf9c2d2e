"""Evaluation of the policy at a version: every evaluation set sampled on the generators' own
batchers, scored, and the first held-out prompts' samples appended to `WORKDIR/samples.jsonl`;
`EvaluationQueue` runs evaluations one at a time, in order, on a thread of their own."""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections

from scalerl_jax import data as data_lib
from scalerl_jax.data.rewards import RewardTallies
from scalerl_jax.pipeline.queue import PipelineStopped
from scalerl_jax.run.build import EvalSet, PolicySource, TaskData, score_code
from scalerl_jax.sampler import Completion
from scalerl_jax.sandbox import CodeVerifier

SAMPLES_FILE = "samples.jsonl"

# (version, prompts) -> one completion per prompt, sampled on params `version`: the pipeline's
# evaluation sampler (`Pipeline.sample_eval`), which derives each request's seed itself.
SampleEval = Callable[[int, Sequence[Sequence[int]]], list[Completion]]


@dataclasses.dataclass(frozen=True)
class _Sampled:
    """One evaluation set's completions, their texts and their scores."""

    completions: list[Completion]
    texts: list[str]
    scored: data_lib.ScoredBatch


def weighted_pass_rate(metrics: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """`eval/pass_rate` of a run with several domains: sum_d w_d eval/<d>/pass_rate / sum_d w_d."""
    return sum(w * metrics[f"eval/{d}/pass_rate"] for d, w in weights.items()) / sum(weights.values())


class Evaluator:
    """`evaluate(version, sample_eval)`: the metrics of all sets (held-out under `eval/`, or
    `eval/<domain>/` per domain with `eval/pass_rate` their weighted mean; extras under
    `eval_<name>/`); for the first `eval.samples_logged` prompts of each held-out set, every sample
    (rendered prompt, completion, extracted answer or program, whether and by which answer style it
    was found, gold, reward, outcome, finish reason) is appended to the samples file. A code set's
    programs run in the sandbox (`code_verifier`). Items the reward failed on are counted per set in
    `tallies` (`<set>/reward_*`, `<set>/code_*`)."""

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        task: TaskData,
        source: PolicySource,
        reward_config: data_lib.RewardConfig,
        verify_pool: data_lib.VerifyPool,
        samples_path: str,
        tallies: RewardTallies,
        code_verifier: CodeVerifier | None = None,
    ):
        self._config, self._task, self._source = config, task, source
        self._reward_config, self._pool = reward_config, verify_pool
        self._samples_path = samples_path
        self._tallies = tallies
        self._code_verifier = code_verifier

    def evaluate(self, version: int, sample_eval: SampleEval) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for eval_set in self._task.eval_sets:
            metrics.update(self._evaluate_set(eval_set, version, sample_eval))
        if self._task.per_domain:
            metrics["eval/pass_rate"] = weighted_pass_rate(metrics, self._task.weights)
        return metrics

    def _evaluate_set(self, eval_set: EvalSet, version: int, sample_eval: SampleEval) -> dict[str, float]:
        samples = self._config.eval.samples_per_prompt
        problems = [p for p in eval_set.problems for _ in range(samples)]
        tally = self._tallies.evaluation(eval_set.name)
        captured: dict[str, Any] = {}

        def sample(prompts: Sequence[Sequence[int]]) -> list[Completion]:
            captured["completions"] = sample_eval(version, prompts)
            return captured["completions"]

        def score(texts: Sequence[str], golds: Sequence[str]) -> data_lib.ScoredBatch:
            captured["texts"] = list(texts)
            if eval_set.code is None:
                scored = data_lib.score_completions(
                    texts, golds, self._reward_config, pool=self._pool, problems=problems
                )
            else:
                code = [p for p in eval_set.code for _ in range(samples)]
                scored = score_code(self._config, self._code_verifier, texts, code)
            captured["scored"] = scored
            tally.add(scored, problems, golds, code=eval_set.code is not None)
            return scored

        result = data_lib.evaluate(
            sample,
            eval_set.prompts,
            eval_set.golds,
            num_samples=samples,
            decode=lambda t: self._source.tokens.tokenizer.decode(t),
            reward_fn=score,
            difficulties=eval_set.labels,
            prefix=eval_set.name,
        )
        if eval_set.name == "eval" or eval_set.name.startswith("eval/"):
            self._write_samples(
                eval_set, version, _Sampled(captured["completions"], captured["texts"], captured["scored"])
            )
        return result.metrics

    def _write_samples(self, eval_set: EvalSet, version: int, sampled: _Sampled) -> None:
        samples, logged = self._config.eval.samples_per_prompt, self._config.eval.samples_logged
        scored = sampled.scored
        encoder = self._source.code_encoder if eval_set.code is not None else self._source.encoder
        assert encoder is not None  # a run with a code set has the code domain's encoder
        with open(self._samples_path, "a", encoding="utf-8") as f:
            for index in range(min(logged, len(eval_set.prompts)) * samples):
                completion = sampled.completions[index]
                problem = eval_set.problems[index // samples]
                row = {
                    "step": version,
                    "set": eval_set.name,
                    "prompt_index": index // samples,
                    "sample": index % samples,
                    "prompt": encoder.text(problem),
                    "completion": sampled.texts[index],
                    "extracted_answer": scored.predictions[index],
                    "answer_found": scored.predictions[index] is not None,
                    "answer_style": scored.styles[index] if scored.styles else None,
                    "gold": eval_set.golds[index // samples],
                    "reward": float(scored.rewards[index]),
                    "outcome": scored.outcomes[index],
                    "finish_reason": completion.finish_reason,
                    "last_token": completion.tokens[-1] if completion.tokens else None,
                    "num_tokens": len(completion.tokens),
                }
                f.write(json.dumps(row) + "\n")


class EvaluationQueue:
    """Runs submitted evaluations (`submit(version, job)`) one at a time, in submission order, on
    one worker thread, so the trainer thread goes on meanwhile.

    `wait(before=None)` blocks until every job (or every job of a version < `before`) is done.
    A job's exception is re-raised in the next `submit` / `wait`; a job ended by the pipeline's
    stop (`PipelineStopped`) is dropped, counted in `abandoned`. `close()` stops the worker
    after the job it runs.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        self._running: int | None = None
        self._error: BaseException | None = None
        self._closed = False
        self.abandoned: list[int] = []
        self._thread = threading.Thread(target=self._work, name="evaluations", daemon=True)
        self._thread.start()

    def submit(self, version: int, job: Callable[[], None]) -> None:
        with self._cond:
            self._raise_error()
            self._jobs.append((version, job))
            self._cond.notify_all()

    def pending(self) -> list[int]:
        """Versions submitted and not yet done, oldest first."""
        with self._cond:
            return self._pending_locked()

    def wait(self, before: int | None = None) -> None:
        with self._cond:
            while any(before is None or version < before for version in self._pending_locked()):
                self._raise_error()
                self._cond.wait()
            self._raise_error()

    def close(self, timeout_s: float = 30.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)

    def _pending_locked(self) -> list[int]:
        running = [] if self._running is None else [self._running]
        return running + [version for version, _ in self._jobs]

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"evaluation failed: {self._error!r}") from self._error

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    self.abandoned.extend(version for version, _ in self._jobs)
                    self._jobs.clear()
                    self._cond.notify_all()
                    return
                version, job = self._jobs.popleft()
                self._running = version
            try:
                job()
            except PipelineStopped:
                with self._cond:
                    self.abandoned.append(version)
            except BaseException as error:  # noqa: BLE001 - re-raised in the trainer thread by submit / wait
                with self._cond:
                    self._error = self._error or error
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()
