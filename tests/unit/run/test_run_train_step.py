"""`RunTrainStep.close()`: a run that stops before its first step drops the programs still queued
to compile ahead, so that the interpreter's exit (which joins the pool's threads after they
drain its queue) does not wait for them."""

import threading

import jax.numpy as jnp

from scalerl_jax.run.build import RunTrainStep
from scalerl_jax.telemetry.compile_events import compile_log

PROGRAMS = 6


class BlockingPrograms:
    """A step whose `compile_ahead` hands `PROGRAMS` programs to `compile_map` (`queued` once all
    are handed over); each "compile" sets `started`, waits for `release` and is then counted in
    `compiled` (`finished` set). With `hold_submission`, handing programs 1.. over waits for
    `hand_over`: a `close()` before it lands while the pool is still being filled."""

    batch_sharding = None

    def __init__(self, *, hold_submission: bool = False) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.queued = threading.Event()
        self.finished = threading.Event()
        self.compiled: list[int] = []
        self.hand_over = threading.Event()
        self._hold_submission = hold_submission

    def compile(self, program: int) -> int:
        self.started.set()
        assert self.release.wait(30)
        self.compiled.append(program)
        self.finished.set()
        return program

    def programs(self):
        yield 0
        if self._hold_submission:
            assert self.hand_over.wait(30)
        yield from range(1, PROGRAMS)

    def compile_ahead(self, state, rows, lengths, *, compile_map):
        results = compile_map(self.compile, self.programs())  # hands every program over, then returns
        self.queued.set()
        return len(list(results))

    def __call__(self, state, batch):
        return state, {}


def test_close_drops_the_queued_compiles_and_the_step_still_runs():
    fake = BlockingPrograms()
    step = RunTrainStep(fake, log=compile_log(), timeout_s=30)
    step.compile_ahead_in_background(jnp.ones(3), 8, (32, 64), threads=1)
    assert fake.started.wait(30) and fake.queued.wait(30)  # program 0 is compiling, 1..5 are queued
    step.close()
    fake.release.set()
    assert step.wait_compiled() >= 0.0  # the thread ended, without an error to re-raise
    # One thread, one program under way at the close: it finishes, the 5 queued ones never start.
    assert fake.compiled == [0]
    state, metrics = step(jnp.ones(3), {})
    assert metrics["compile/in_step"] == 0.0 and state.shape == (3,)


def test_close_while_the_programs_are_handed_over_ends_the_thread_and_the_step_still_runs():
    fake = BlockingPrograms(hold_submission=True)
    step = RunTrainStep(fake, log=compile_log(), timeout_s=30)
    step.compile_ahead_in_background(jnp.ones(3), 8, (32, 64), threads=1)
    assert fake.started.wait(30)  # program 0 is compiling; 1..5 are not handed over yet
    step.close()
    fake.hand_over.set()
    assert step.wait_compiled() >= 0.0  # the pool refused program 1: the thread ended without an error
    assert not fake.queued.is_set()
    fake.release.set()
    assert fake.finished.wait(30)  # the program under way at the close still finishes
    state, metrics = step(jnp.ones(3), {})
    assert fake.compiled == [0] and metrics["compile/in_step"] == 0.0 and state.shape == (3,)
