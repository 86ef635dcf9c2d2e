"""Who does what in a run over one or more processes.

The devices of all processes (`jax.devices()`, ordered by process) are split by
`models.split_devices` into a trainer set (the first devices) and a generator set (the last
`mesh.generator_fraction` of them, at least one each). Trainer devices come first so that process 0 is always a trainer process: it leads, and
orbax's writes from process 0 (JSON items; host arrays when the trainer is one process) are the
leader's. From that split, per process:
- a *generator process* holds generator devices and runs its own engine on a local mesh of them
  (it decides on its own; nothing it computes involves another process);
- a *trainer process* holds trainer devices; all trainer processes run the train step as one SPMD
  program over the trainer mesh;
- the *leader* is the lowest-numbered trainer process, process 0. It owns every host-side decision (the
  group buffer and its schedule, prompt draws and the prompt pool, which rows form each batch,
  when to push, evaluate, checkpoint and stop) and every run output (metrics, samples,
  TensorBoard, the fit and plot); the other trainer processes (*followers*) do what it sends,
  in the order it sends it, so every collective program is issued identically everywhere.
A process can be both a generator and a trainer process (the one where the sets meet). With one
process it is all of these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from scalerl_jax.models import Device, split_devices


@dataclasses.dataclass(frozen=True)
class Roles:
    """This process's place in the run (module docstring)."""

    process: int
    num_processes: int
    generator_devices: tuple[Device, ...]
    trainer_devices: tuple[Device, ...]

    @property
    def generator_processes(self) -> tuple[int, ...]:
        return tuple(sorted({d.process_index for d in self.generator_devices}))

    @property
    def trainer_processes(self) -> tuple[int, ...]:
        return tuple(sorted({d.process_index for d in self.trainer_devices}))

    @property
    def leader(self) -> int:
        return self.trainer_processes[0]

    @property
    def followers(self) -> tuple[int, ...]:
        return self.trainer_processes[1:]

    @property
    def is_leader(self) -> bool:
        return self.process == self.leader

    @property
    def is_generator(self) -> bool:
        return self.process in self.generator_processes

    @property
    def is_trainer(self) -> bool:
        return self.process in self.trainer_processes

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1

    def local_generator_devices(self, process: int | None = None) -> list[Device]:
        """The generator devices of `process` (default: this one): that generator's local mesh."""
        process = self.process if process is None else process
        return [d for d in self.generator_devices if d.process_index == process]

    def describe(self) -> str:
        kinds = [
            name
            for name, flag in (
                ("leader", self.is_leader),
                ("follower trainer", self.is_trainer and not self.is_leader),
                ("generator", self.is_generator),
            )
            if flag
        ]
        return (
            f"process {self.process} of {self.num_processes}: {' + '.join(kinds) or 'idle'} "
            f"({len(self.local_generator_devices())} generator, "
            f"{sum(d.process_index == self.process for d in self.trainer_devices)} trainer devices here)"
        )


def assign_roles(devices: Sequence[Device], generator_fraction: float, process: int, num_processes: int) -> Roles:
    """Roles of `process` when `devices` (all processes', in order) are split by `models.split_devices`:
    trainer devices first, then round(n * `generator_fraction`) generator devices.

    Raises ValueError when some process would hold no device of either set (it could do nothing).
    """
    generator_devices, trainer_devices = split_devices(devices, generator_fraction)
    roles = Roles(process, num_processes, tuple(generator_devices), tuple(trainer_devices))
    idle = sorted(set(range(num_processes)) - set(roles.generator_processes) - set(roles.trainer_processes))
    if idle:
        raise ValueError(
            f"mesh.generator_fraction={generator_fraction} leaves processes {idle} without a "
            f"generator or trainer device ({len(generator_devices)} generator and "
            f"{len(trainer_devices)} trainer devices over {num_processes} processes)"
        )
    return roles
