"""FirstError: the first failure of cooperating threads reaches the thread that joins them."""

import threading

import pytest

from scalerl_jax.contracts.threads import FirstError


class Stopped(Exception):
    pass


def run_threads(targets):
    threads = [threading.Thread(target=t) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads)


def test_the_first_error_is_raised_in_the_joining_thread_and_later_ones_are_not():
    errors, exits, reported = FirstError(), [], []
    first_failed = threading.Event()

    def first():
        raise ValueError("first")

    def second():
        first_failed.wait(timeout=10)
        raise KeyError("second")

    def first_exits():
        exits.append("a")
        first_failed.set()

    targets = [
        errors.guarded("a", first, on_error=reported.append, on_exit=first_exits),
        errors.guarded("b", second, on_error=reported.append, on_exit=lambda: exits.append("b")),
    ]
    run_threads(targets)
    assert sorted(exits) == ["a", "b"]  # every target's on_exit ran
    assert [type(e) for e in reported] == [ValueError]  # on_error only for the kept one
    with pytest.raises(ValueError, match="first"):
        errors.raise_first()


def test_expected_exceptions_end_a_thread_quietly():
    errors, exits = FirstError(), []

    def stops():
        raise Stopped()

    run_threads([errors.guarded("a", stops, expected=(Stopped,), on_exit=lambda: exits.append("a"))])
    assert exits == ["a"] and errors.error is None
    errors.raise_first()  # nothing to raise


def test_keyboard_interrupt_in_a_thread_is_kept_too():
    errors = FirstError()

    def interrupted():
        raise KeyboardInterrupt

    run_threads([errors.guarded("a", interrupted)])
    with pytest.raises(KeyboardInterrupt):
        errors.raise_first()
