"""`RunTrainStep.close()`: a run that stops before its first step drops the programs still queued
to compile ahead, so that the interpreter's exit (which joins the pool's threads after they
drain its queue) does not wait for them."""

import threading

import jax.numpy as jnp

from scalerl_jax.run.build import RunTrainStep
from scalerl_jax.telemetry.compile_events import compile_log

PROGRAMS = 6


class BlockingPrograms:
    """A step whose `compile_ahead` hands `PROGRAMS` programs to `compile_map`; each "compile"
    waits for `release` and is counted in `compiled`."""

    batch_sharding = None

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.compiled: list[int] = []

    def compile(self, program: int) -> int:
        self.started.set()
        assert self.release.wait(30)
        self.compiled.append(program)
        return program

    def compile_ahead(self, state, rows, lengths, *, compile_map):
        return len(list(compile_map(self.compile, list(range(PROGRAMS)))))

    def __call__(self, state, batch):
        return state, {}


def test_close_drops_the_queued_compiles_and_the_step_still_runs():
    fake = BlockingPrograms()
    step = RunTrainStep(fake, log=compile_log(), timeout_s=30)
    step.compile_ahead_in_background(jnp.ones(3), 8, (32, 64), threads=1)
    assert fake.started.wait(30)  # program 0 is compiling, 1..5 are queued
    step.close()
    fake.release.set()
    assert step.wait_compiled() >= 0.0  # the thread ended, without an error to re-raise
    # One thread, one program under way at the close: it finishes, the 5 queued ones never start.
    assert fake.compiled == [0]
    state, metrics = step(jnp.ones(3), {})
    assert metrics["compile/in_step"] == 0.0 and state.shape == (3,)
