"""Prompts drawn from several domains (math, code) by configured weights.

The run's train prompts are the domains' prompts one after another: domain d holds the global
indices `offset_d .. offset_d + size_d - 1`. Each domain has its own `PromptPool` (its own epochs
and No-Positive-Resampling retirements, recorded per prompt); which domain the next prompt comes
from is a smooth weighted round robin: every draw adds `w_d / sum(w)` to each domain's credit and
takes the domain with the most credit, which then pays 1. After n draws domain d has given
`n w_d / sum(w)` prompts, rounded up or down, in an order that is a pure function of the weights,
so a resumed run draws what the uninterrupted one would.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from scalerl_jax.data.pool import PoolExhaustedError, PromptPool

MATH, CODE = "math", "code"
DOMAINS = (MATH, CODE)


class MixturePool:
    """The `PromptPool` interface over several domains (the module docstring). `sizes` and
    `weights` are keyed by domain, in the order of the global indices."""

    def __init__(
        self, sizes: Mapping[str, int], weights: Mapping[str, float], *, seed: int, npr_threshold: float | None
    ):
        if set(sizes) != set(weights) or not sizes:
            raise ValueError(f"MixturePool: domains with sizes {sorted(sizes)} but weights {sorted(weights)}")
        if any(not w > 0 for w in weights.values()):
            raise ValueError(f"MixturePool: every weight must be > 0, got {dict(weights)}")
        self._domains = list(sizes)
        total = sum(weights.values())
        self._shares = {d: weights[d] / total for d in self._domains}
        self._offsets: dict[str, int] = {}
        offset = 0
        for domain in self._domains:
            self._offsets[domain] = offset
            offset += sizes[domain]
        self._num_prompts = offset
        self._pools = {d: PromptPool(sizes[d], seed=seed, npr_threshold=npr_threshold) for d in self._domains}
        self._credit = dict.fromkeys(self._domains, 0.0)
        self._lock = threading.Lock()

    @property
    def num_prompts(self) -> int:
        return self._num_prompts

    def domain_of(self, prompt: int) -> tuple[str, int]:
        """`(domain, index within the domain)` of global index `prompt`."""
        if not 0 <= prompt < self._num_prompts:
            raise IndexError(f"prompt {prompt} outside [0, {self._num_prompts})")
        domain = max((d for d in self._domains if self._offsets[d] <= prompt), key=lambda d: self._offsets[d])
        return domain, prompt - self._offsets[domain]

    def _next_domain(self) -> str:
        for domain in self._domains:
            self._credit[domain] += self._shares[domain]
        chosen = max(self._domains, key=lambda d: self._credit[d])  # ties: the first domain
        self._credit[chosen] -= 1.0
        return chosen

    def next_prompts(self, count: int) -> list[int]:
        """The next `count` global prompt indices, each from the domain the round robin picks."""
        if count < 1:
            raise ValueError(f"next_prompts: count must be >= 1, got {count}")
        with self._lock:
            prompts = []
            for _ in range(count):
                domain = self._next_domain()
                try:
                    (local,) = self._pools[domain].next_prompts(1)
                except PoolExhaustedError as error:
                    raise PoolExhaustedError(f"domain {domain!r}: {error}") from None
                prompts.append(self._offsets[domain] + local)
            return prompts

    def record(self, prompt: int, num_correct: int, num_samples: int) -> None:
        domain, local = self.domain_of(prompt)
        self._pools[domain].record(local, num_correct, num_samples)

    def pass_rate(self, prompt: int) -> float | None:
        domain, local = self.domain_of(prompt)
        return self._pools[domain].pass_rate(local)

    def metrics(self) -> dict[str, float]:
        """Each domain's pool metrics under `data/<domain>/` and their sums (`data/pool_remaining`,
        `data/pool_retired`; `data/pool_epoch`: the fewest epochs any domain has started)."""
        metrics: dict[str, float] = {}
        for domain, pool in self._pools.items():
            for key, value in pool.metrics().items():
                metrics[key.replace("data/", f"data/{domain}/", 1)] = value
        for key in ("pool_remaining", "pool_retired"):
            metrics[f"data/{key}"] = sum(metrics[f"data/{d}/{key}"] for d in self._domains)
        metrics["data/pool_epoch"] = min(metrics[f"data/{d}/pool_epoch"] for d in self._domains)
        return metrics

    def state_dict(self) -> dict:
        with self._lock:
            return {
                "domains": {d: pool.state_dict() for d, pool in self._pools.items()},
                "credit": dict(self._credit),
            }

    def load_state_dict(self, state: dict) -> None:
        if set(state.get("domains", {})) != set(self._domains):
            raise ValueError(
                f"prompt pool state: domains {sorted(state.get('domains', {}))}, the run has {sorted(self._domains)}"
            )
        with self._lock:
            for domain, pool_state in state["domains"].items():
                self._pools[domain].load_state_dict(pool_state)
            self._credit = {d: float(state["credit"][d]) for d in self._domains}
