"""Compute meter: device-hours from a hand-driven clock, exact checkpoint round trip, bad use."""

import threading

import pytest

from scalerl_jax.scaling import ComputeMeter


class FakeClock:
    """Seconds set by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_device_hours_are_wall_hours_times_devices():
    clock = FakeClock()
    meter = ComputeMeter(clock=clock)
    meter.start(8)  # t = 0: 8 devices (e.g. 4 generator + 4 trainer)
    clock.now = 1_800.0  # half an hour x 8 devices = 4 device-hours
    assert meter.device_hours == pytest.approx(4.0)
    meter.set_num_devices(4)
    clock.now = 5_400.0  # one more hour x 4 devices: 4 + 4 = 8
    meter.stop()
    clock.now = 9_000.0  # stopped: an hour passes unmetered
    meter.add_tokens(generated=1_000, trained=600)
    meter.add_tokens(generated=24)
    assert meter.state_dict() == {
        "device_hours": pytest.approx(8.0),
        "wall_hours": pytest.approx(1.5),
        "tokens_generated": 1_024,
        "tokens_trained": 600,
    }
    assert meter.metrics()["compute/device_hours"] == pytest.approx(8.0)


def test_state_dict_round_trip_is_exact_and_resumes():
    clock = FakeClock()
    meter = ComputeMeter(clock=clock)
    meter.start(3)
    clock.now = 1_234.5
    meter.add_tokens(generated=77, trained=55)
    saved = meter.state_dict()
    assert all(isinstance(v, (int, float)) for v in saved.values())

    restored_clock = FakeClock()
    restored_clock.now = 50_000.0  # another process, another clock origin
    restored = ComputeMeter(clock=restored_clock)
    restored.load_state_dict(saved)
    assert restored.state_dict() == saved  # bit-exact
    restored.start(2)
    restored_clock.now = 50_000.0 + 3_600.0  # + 1 h x 2 devices
    assert restored.device_hours == pytest.approx(saved["device_hours"] + 2.0)

    running_clock = FakeClock()
    running = ComputeMeter(clock=running_clock)
    running.start(1)
    running_clock.now = 7_200.0  # 2 device-hours that the load replaces, not adds to
    running.load_state_dict(saved)
    running_clock.now = 7_200.0 + 360.0  # + 0.1 h x 1 device since the load
    assert running.device_hours == pytest.approx(saved["device_hours"] + 0.1)


def test_concurrent_token_counts_are_exact():
    meter = ComputeMeter(clock=FakeClock())

    def add(kind):
        for _ in range(5_000):
            meter.add_tokens(**{kind: 3})

    threads = [threading.Thread(target=add, args=(kind,)) for kind in ("generated", "trained", "generated")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert meter.state_dict()["tokens_generated"] == 30_000
    assert meter.state_dict()["tokens_trained"] == 15_000


def test_misuse_is_an_error():
    clock = FakeClock()
    meter = ComputeMeter(clock=clock)
    with pytest.raises(ValueError, match="not running"):
        meter.stop()
    with pytest.raises(ValueError, match="call start first"):
        meter.set_num_devices(2)
    with pytest.raises(ValueError, match="num_devices must be >= 1"):
        meter.start(0)
    meter.start(2)
    with pytest.raises(ValueError, match="already running"):
        meter.start(2)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        meter.add_tokens(generated=-1)
    clock.now = -10.0
    with pytest.raises(ValueError, match="clock went backwards"):
        meter.stop()
    with pytest.raises(ValueError, match=r"missing keys \['tokens_trained'\]"):
        meter.load_state_dict({"device_hours": 1.0, "wall_hours": 1.0, "tokens_generated": 0})
    with pytest.raises(ValueError, match="device_hours=nan"):
        meter.load_state_dict(
            {"device_hours": float("nan"), "wall_hours": 1.0, "tokens_generated": 0, "tokens_trained": 0}
        )
