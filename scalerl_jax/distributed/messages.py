"""Plain-data forms of what crosses the host channel: admissions, evaluation requests, completions
and batch rows.

Everything becomes dicts of numbers, strings and numpy arrays (the channel's wire format has no
pickle), and comes back as the same dataclasses, field for field.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scalerl_jax.pipeline.generator import Admission, EvalItem
from scalerl_jax.pipeline.group import Prompt
from scalerl_jax.sampler.batcher import Completion


def admission_to_message(admission: Admission) -> dict[str, Any]:
    prompt = admission.prompt
    return {
        "group_id": admission.group_id,
        "version": admission.version,
        "index": admission.index,
        "key": prompt.key,
        "tokens": np.asarray(prompt.tokens, np.int32),
    }


def admission_from_message(message: dict[str, Any]) -> Admission:
    prompt = Prompt(message["key"], tuple(int(t) for t in message["tokens"]))
    return Admission(int(message["group_id"]), prompt, int(message["version"]), int(message["index"]))


def eval_item_to_message(item: EvalItem) -> dict[str, Any]:
    return {
        "job": item.job,
        "index": item.index,
        "tokens": np.asarray(item.prompt, np.int32),
        "seed": item.seed,
        "version": item.version,
    }


def eval_item_from_message(message: dict[str, Any]) -> EvalItem:
    return EvalItem(
        int(message["job"]),
        int(message["index"]),
        tuple(int(t) for t in message["tokens"]),
        int(message["seed"]),
        int(message["version"]),
    )


def completion_to_message(completion: Completion) -> dict[str, Any]:
    """The completion without its prompt (the receiver knows the prompt of each request)."""
    return {
        "request_id": list(completion.request_id)
        if isinstance(completion.request_id, tuple)
        else completion.request_id,
        "tokens": np.asarray(completion.tokens, np.int32),
        "logprobs": np.asarray(completion.logprobs, np.float32),
        "versions": np.asarray(completion.versions, np.int64),
        "sampled": np.asarray(completion.sampled, np.bool_),
        "interrupted": bool(completion.interrupted),
        "truncated": bool(completion.truncated),
        "num_think_tokens": int(completion.num_think_tokens),
        "num_answer_tokens": int(completion.num_answer_tokens),
        "finish_reason": completion.finish_reason,
        "think_budget": int(completion.think_budget),
        "routed_experts": None if completion.routed_experts is None else np.asarray(completion.routed_experts),
    }


def completion_from_message(message: dict[str, Any], prompt_tokens: list[int]) -> Completion:
    request_id = message["request_id"]
    return Completion(
        request_id=tuple(request_id) if isinstance(request_id, list) else request_id,
        prompt_tokens=list(prompt_tokens),
        tokens=message["tokens"].tolist(),
        logprobs=message["logprobs"].tolist(),
        versions=message["versions"].tolist(),
        sampled=message["sampled"].tolist(),
        interrupted=message["interrupted"],
        truncated=message["truncated"],
        num_think_tokens=message["num_think_tokens"],
        num_answer_tokens=message["num_answer_tokens"],
        finish_reason=message["finish_reason"],
        think_budget=message["think_budget"],
        routed_experts=message.get("routed_experts"),
    )
