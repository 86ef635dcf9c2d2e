"""Held-out evaluation: N prompts x K samples through a sampler callable.

Metrics (under ``prefix``, default ``eval``):

- ``pass_rate``: mean over prompts of the per-prompt pass rate ``c_i / K`` (the paper's
  validation metric, 1,000 prompts x 16 samples);
- ``pass@k`` for each requested ``k``: mean over prompts of the unbiased estimator
  ``1 - C(K - c_i, k) / C(K, k)`` (Chen et al., 2021); ``pass@1`` equals ``pass_rate``;
- ``interrupted_frac``, ``truncated_frac``: fractions of samples the sampler interrupted (forced
  end of thinking) or truncated (hit the length limit);
- ``format_failure_frac`` (no ``</think>``, or no answer found by the answer styles),
  ``answer_found_frac`` (samples whose answer an answer style found: a prompt asking for one
  format while the reward reads another shows here, not only as a low pass rate; a sample the
  verifier's hard time limit stopped counts as not found), ``timeouts`` (verifier time limits hit),
  ``mean_completion_tokens`` and ``max_completion_tokens`` (generated tokens per sample, forced
  ones included), ``num_prompts``, ``num_samples``;
- ``pass_rate/difficulty_<d>`` per difficulty label when difficulties are given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from scalerl_jax.data import rewards as rewards_lib
from scalerl_jax.data import verify_pool


class CompletionLike(Protocol):
    """What evaluation reads from a sampler completion (``scalerl_jax.sampler.Completion`` fits)."""

    tokens: list[int]
    interrupted: bool
    truncated: bool


SampleFn = Callable[[list[list[int]]], Sequence[CompletionLike]]
RewardFn = Callable[[list[str], list[str]], rewards_lib.ScoredBatch]


def pass_at_k(num_samples: int, num_correct: np.ndarray, k: int) -> np.ndarray:
    """Unbiased pass@k per prompt: ``1 - C(n - c, k) / C(n, k)`` with ``n = num_samples``.

    Computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (exact for ``n - c >= k``; 1
    otherwise), which avoids huge binomials.
    """
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= num_samples ({num_samples}), got k={k}")
    out = np.empty(len(num_correct), np.float64)
    for i, c in enumerate(np.asarray(num_correct)):
        if num_samples - c < k:
            out[i] = 1.0
        else:
            terms = 1.0 - k / np.arange(num_samples - c + 1, num_samples + 1, dtype=np.float64)
            out[i] = 1.0 - float(np.prod(terms))
    return out


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Metrics and the per-prompt pass rates (float64[N]) and correctness (bool[N, K])."""

    metrics: dict[str, float]
    per_prompt_pass_rate: np.ndarray
    correct: np.ndarray


def evaluate(
    sample_fn: SampleFn,
    prompts: Sequence[Sequence[int]],
    golds: Sequence[str],
    *,
    num_samples: int,
    decode: Callable[[list[int]], str],
    reward_fn: RewardFn,
    pass_at: Sequence[int] = (1,),
    difficulties: Sequence[str | int] | None = None,
    prefix: str = "eval",
) -> EvalResult:
    """Samples ``num_samples`` completions per prompt, scores them and aggregates the metrics.

    Args:
      sample_fn: takes the prompt token lists (each prompt repeated ``num_samples`` times, one
        after another) and returns one completion per entry, in order.
      prompts, golds: held-out prompts (token ids) and their gold answers.
      num_samples: K, samples per prompt.
      decode: token ids -> text (e.g. ``tokenizer.decode``).
      reward_fn: ``(texts, golds) -> ScoredBatch`` (e.g. ``rewards.score_completions`` with a
        config and pool bound).
      pass_at: the k values of ``pass@k`` to report.
      difficulties: optional label per prompt for per-difficulty pass rates.
      prefix: metric key prefix.
    """
    if len(prompts) != len(golds) or not prompts:
        raise ValueError(f"evaluate: need as many golds ({len(golds)}) as prompts ({len(prompts)}), and at least one")
    if difficulties is not None and len(difficulties) != len(prompts):
        raise ValueError(f"evaluate: {len(difficulties)} difficulties for {len(prompts)} prompts")
    if num_samples < 1:
        raise ValueError(f"evaluate: num_samples must be >= 1, got {num_samples}")
    requests = [list(p) for p in prompts for _ in range(num_samples)]
    completions = list(sample_fn(requests))
    if len(completions) != len(requests):
        raise ValueError(f"evaluate: sample_fn returned {len(completions)} completions for {len(requests)} requests")
    texts = [decode(list(c.tokens)) for c in completions]
    scored = reward_fn(texts, [g for g in golds for _ in range(num_samples)])
    correct = np.asarray(scored.correct, bool).reshape(len(prompts), num_samples)
    num_correct = correct.sum(axis=1)
    per_prompt = num_correct / num_samples
    metrics = {
        "pass_rate": float(per_prompt.mean()),
        "interrupted_frac": float(np.mean([bool(c.interrupted) for c in completions])),
        "truncated_frac": float(np.mean([bool(c.truncated) for c in completions])),
        "format_failure_frac": sum(scored.counts[o] for o in rewards_lib.FORMAT_FAILURES) / len(completions),
        "answer_found_frac": float(scored.answer_found.mean()),
        "timeouts": float(scored.counts[verify_pool.TIMEOUT]),
        "mean_completion_tokens": float(np.mean([len(c.tokens) for c in completions])),
        "max_completion_tokens": float(max(len(c.tokens) for c in completions)),
        "num_prompts": float(len(prompts)),
        "num_samples": float(len(completions)),
    }
    for k in pass_at:
        metrics[f"pass@{k}"] = float(pass_at_k(num_samples, num_correct, k).mean())
    if difficulties is not None:
        labels = np.asarray([str(d) for d in difficulties])
        for label in sorted(set(labels.tolist())):
            metrics[f"pass_rate/difficulty_{label}"] = float(per_prompt[labels == label].mean())
    return EvalResult(
        metrics={f"{prefix}/{key}": value for key, value in metrics.items()},
        per_prompt_pass_rate=per_prompt,
        correct=correct,
    )
