"""Evaluation of the policy at a version: every evaluation set sampled on the generators' own
batchers, scored, and the first held-out prompts' samples appended to `WORKDIR/samples.jsonl`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from scalerl_jax import data as data_lib
from scalerl_jax.data.rewards import RewardTallies
from scalerl_jax.run.build import EvalSet, PolicySource, TaskData
from scalerl_jax.sampler import Completion

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


class Evaluator:
    """`evaluate(version, sample_eval)`: the metrics of all sets (held-out under `eval/`, extras
    under `eval_<name>/`); for the first `eval.samples_logged` held-out prompts, every sample
    (rendered prompt, completion, extracted answer, gold, reward, finish reason) is appended to
    the samples file. Items the reward failed on are counted per set in `tallies` (`<set>/reward_*`)."""

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        task: TaskData,
        source: PolicySource,
        reward_config: data_lib.RewardConfig,
        verify_pool: data_lib.VerifyPool,
        samples_path: str,
        tallies: RewardTallies,
    ):
        self._config, self._task, self._source = config, task, source
        self._reward_config, self._pool = reward_config, verify_pool
        self._samples_path = samples_path
        self._tallies = tallies

    def evaluate(self, version: int, sample_eval: SampleEval) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for eval_set in self._task.eval_sets:
            metrics.update(self._evaluate_set(eval_set, version, sample_eval))
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
            captured["scored"] = data_lib.score_completions(
                texts, golds, self._reward_config, pool=self._pool, problems=problems
            )
            tally.add(captured["scored"], problems, golds)
            return captured["scored"]

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
        if eval_set.name == "eval":
            self._write_samples(
                eval_set, version, _Sampled(captured["completions"], captured["texts"], captured["scored"])
            )
        return result.metrics

    def _write_samples(self, eval_set: EvalSet, version: int, sampled: _Sampled) -> None:
        samples, logged = self._config.eval.samples_per_prompt, self._config.eval.samples_logged
        scored = sampled.scored
        with open(self._samples_path, "a", encoding="utf-8") as f:
            for index in range(min(logged, len(eval_set.prompts)) * samples):
                completion = sampled.completions[index]
                problem = eval_set.problems[index // samples]
                row = {
                    "step": version,
                    "set": eval_set.name,
                    "prompt_index": index // samples,
                    "sample": index % samples,
                    "prompt": self._source.encoder.text(problem),
                    "completion": sampled.texts[index],
                    "extracted_answer": scored.predictions[index],
                    "gold": eval_set.golds[index // samples],
                    "reward": float(scored.rewards[index]),
                    "outcome": scored.outcomes[index],
                    "finish_reason": completion.finish_reason,
                    "last_token": completion.tokens[-1] if completion.tokens else None,
                    "num_tokens": len(completion.tokens),
                }
                f.write(json.dumps(row) + "\n")
