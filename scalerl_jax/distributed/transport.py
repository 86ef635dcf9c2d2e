"""How the leader moves params to every generator.

Params version v travels to generator process g in one of two ways, decided once from the
layout (`Routes`), identically on every process:
- *in place*, when every trainer device belongs to g (one process, or a trainer local to g):
  `jax.device_put` onto the generator's shardings, device to device;
- *by weight transfer* otherwise: every trainer process offers the slices g needs
  (`weight_push.ParamsSender`, collective, so the leader's `TrainerGroup` tells the followers
  first) and g pulls them (`ParamsReceiver`) under transfer id v.
Evaluation needs no params of its own: it runs on the generators' batchers, through the same link
as training requests (`pipeline/generator.py`), after the push of the version it evaluates.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from scalerl_jax.distributed.remote_generator import GeneratorPush
from scalerl_jax.distributed.roles import Roles
from scalerl_jax.distributed.trainer_group import TrainerGroup
from scalerl_jax.sampler import Batcher

TRAIN = "train"  # the purpose of every offer (the followers' protocol names one)


@dataclasses.dataclass(frozen=True)
class Routes:
    """Which generator processes receive params by weight transfer."""

    transfer_generators: tuple[int, ...]


def plan_routes(roles: Roles) -> Routes:
    local = lambda g: all(d.process_index == g for d in roles.trainer_devices)
    return Routes(tuple(g for g in roles.generator_processes if not local(g)))


class LeaderTransport:
    """The leader's `push(state, version)`.

    `offer(purpose, transfer_id, params)`: every trainer process offers (None when nothing goes
    by transfer). `local_batcher`: the leader's own generator, if any, fed in place or through
    `local_pull(version)`. `remote`: the params connections of the other generator processes
    (`GeneratorPush`).
    """

    def __init__(
        self,
        routes: Routes,
        *,
        group: TrainerGroup | None,
        offer: Callable[[str, int, Any], None] | None,
        local_batcher: Batcher | None,
        local_pull: Callable[[int], Any] | None,
        remote: GeneratorPush | None,
    ):
        self._routes, self._group, self._offer = routes, group, offer
        self._local_batcher, self._local_pull, self._remote = local_batcher, local_pull, remote

    def _offer_all(self, version: int, params: Any) -> None:
        """Collective on the trainer processes: the followers are told first."""
        offer = self._offer
        assert offer is not None, "routes with transfer generators need an offer"
        run = lambda: offer(TRAIN, version, params)
        if self._group is not None:
            self._group.offer(version, TRAIN, run)
        else:
            run()

    def push(self, state: Any, version: int) -> float:
        """Sends params `version` to every generator (seconds taken): the local batcher's copy is
        dispatched, not waited for (the generator's next chunk waits for it, the trainer does not)."""
        start = time.perf_counter()
        if self._routes.transfer_generators:
            self._offer_all(version, state.params)
        if self._local_batcher is not None:
            if self._local_pull is not None:
                self._local_batcher.update_params(self._local_pull(version), version, copy=False)
            else:
                self._local_batcher.update_params(state.params, version, wait=False)
        if self._remote is not None:
            self._remote.announce(version)
        return time.perf_counter() - start
