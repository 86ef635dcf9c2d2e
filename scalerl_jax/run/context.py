"""What every process kind of a run is built from, gathered once by the composition root."""

from __future__ import annotations

import dataclasses

import ml_collections

from scalerl_jax.distributed.roles import Roles
from scalerl_jax.distributed.wiring import ProcessLinks
from scalerl_jax.run.build import AbstractPolicy, Meshes, PolicySource, TransferSide
from scalerl_jax.sandbox import CodeVerifier


@dataclasses.dataclass(frozen=True)
class RunContext:
    """This process's part of a run: the validated config and workdir, its roles, the policy's
    source (checkpoint, tokenizer, prompt encoder) and abstract architecture, its connections to
    the other processes (None in a one-process run), its meshes and its weight-transfer pieces,
    and on the leader of a run with a code domain, the code verifier."""

    config: ml_collections.ConfigDict
    workdir: str
    roles: Roles
    source: PolicySource
    policy: AbstractPolicy
    links: ProcessLinks | None
    meshes: Meshes
    transfer: TransferSide
    code_verifier: CodeVerifier | None = None
