"""How the leader moves params to every generator and has evaluations sampled.

Params version v travels to generator process g in one of two ways, decided once from the
layout (`Routes`), identically on every process:
- *in place*, when every trainer device belongs to g (one process, or a trainer local to g):
  `jax.device_put` onto the generator's shardings, device to device;
- *by weight transfer* otherwise: every trainer process offers the slices g needs
  (`weight_push.ParamsSender`, collective, so the leader's `TrainerGroup` tells the followers
  first) and g pulls them (`ParamsReceiver`), under transfer id `2 v` (training) or `2 v + 1`
  (an evaluation of v, offered only to the evaluating generator).
Evaluation runs on the leader's own generator when it has one, else on the first generator
process, over its params connection.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from scalerl_jax.distributed.remote_generator import GeneratorPush
from scalerl_jax.distributed.roles import Roles
from scalerl_jax.distributed.trainer_group import TrainerGroup
from scalerl_jax.sampler.batcher import Completion

if TYPE_CHECKING:
    from scalerl_jax.distributed.channel import Connection


TRAIN, EVAL = "train", "eval"


def transfer_id(version: int, purpose: str) -> int:
    """The weight-transfer id of params `version` sent for training or for an evaluation."""
    return 2 * version + (1 if purpose == EVAL else 0)


@dataclasses.dataclass(frozen=True)
class Routes:
    """Which generator processes receive params by transfer, and who evaluates."""

    transfer_generators: tuple[int, ...]
    evaluator: int

    @property
    def eval_by_transfer(self) -> bool:
        return self.evaluator in self.transfer_generators


def plan_routes(roles: Roles) -> Routes:
    local = lambda g: all(d.process_index == g for d in roles.trainer_devices)
    evaluator = roles.leader if roles.leader in roles.generator_processes else roles.generator_processes[0]
    return Routes(tuple(g for g in roles.generator_processes if not local(g)), evaluator)


class LeaderTransport:
    """The leader's `push(state, version)` and `sample_eval(params, version, prompts, seed_offset)`.

    `offer(purpose, transfer_id, params)`: every trainer process offers (None when nothing goes
    by transfer). `local_batcher` / `local_eval_batcher`: the leader's own generator, if any, fed
    in place or through `local_pull(transfer_id)`. `remote`: the params connections of the other
    generator processes (`GeneratorPush`). `sample_local(batcher, prompts, seed_offset)` samples
    an evaluation on the leader's own evaluation batcher.
    """

    def __init__(self, routes: Routes, *, group: TrainerGroup | None,
                 offer: Callable[[str, int, Any], None] | None, local_batcher: Any, local_eval_batcher: Any,
                 local_pull: Callable[[int], Any] | None, remote: GeneratorPush | None,
                 eval_connection: Connection | None,
                 sample_local: Callable[[Any, list[list[int]], int], list[Completion]]):
        self._routes, self._group, self._offer = routes, group, offer
        self._local_batcher, self._local_eval_batcher, self._local_pull = local_batcher, local_eval_batcher, local_pull
        self._remote, self._eval_connection, self._sample_local = remote, eval_connection, sample_local

    def _offer_all(self, purpose: str, version: int, params: Any) -> None:
        """Collective on the trainer processes: the followers are told first."""
        ident = transfer_id(version, purpose)
        run = lambda: self._offer(purpose, ident, params)
        if self._group is not None:
            self._group.offer(ident, purpose, run)
        else:
            run()

    def push(self, state: Any, version: int) -> float:
        """Sends params `version` to every generator; returns when all have them (seconds taken)."""
        start = time.perf_counter()
        if self._routes.transfer_generators:
            self._offer_all(TRAIN, version, state.params)
        if self._local_batcher is not None:
            if self._local_pull is not None:
                self._local_batcher.update_params(self._local_pull(transfer_id(version, TRAIN)), version, copy=False)
            else:
                self._local_batcher.update_params(state.params, version)
        if self._remote is not None:
            self._remote.announce(version, transfer_id(version, TRAIN))
        return time.perf_counter() - start

    def sample_eval(self, params: Any, version: int, prompts: Sequence[Sequence[int]],
                    seed_offset: int) -> list[Completion]:
        prompts = [list(p) for p in prompts]
        if self._routes.eval_by_transfer:
            self._offer_all(EVAL, version, params)
        if self._local_eval_batcher is None:
            return self._remote.evaluate(self._eval_connection, version, transfer_id(version, EVAL), prompts,
                                         seed_offset)
        if self._routes.eval_by_transfer:
            self._local_eval_batcher.update_params(self._local_pull(transfer_id(version, EVAL)), version, copy=False)
        else:
            self._local_eval_batcher.update_params(params, version)
        return self._sample_local(self._local_eval_batcher, prompts, seed_offset)
