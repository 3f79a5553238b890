"""StepTimer's CUDA path, on CPU: fake CUDA events show the step loop never waits for the device, steps are
summed per kind, finished steps release their events, and reading all timings costs one device sync."""

from __future__ import annotations

import time
import weakref

import pytest
import torch

from kvsim.engine.tensors.timing import KINDS, StepTimer


class FakeDevice:
    """A GPU whose clock advances one ms per recorded event; `finished` is the last event time it has run."""

    def __init__(self):
        self.clock = 0
        self.finished = 0
        self.event_waits = 0  # Event.synchronize calls that had to wait (on an event not yet reached)
        self.device_syncs = 0  # torch.cuda.synchronize calls
        self.live = weakref.WeakSet()  # events still referenced

    def event_class(self):
        device = self

        class Event:
            def __init__(self, enable_timing: bool = False):
                assert enable_timing
                self.time = None
                device.live.add(self)

            def record(self):
                device.clock += 1
                self.time = device.clock

            def query(self) -> bool:
                return self.time <= device.finished

            def synchronize(self):
                device.event_waits += self.time > device.finished
                device.finished = max(device.finished, self.time)

            def elapsed_time(self, end) -> float:
                assert self.query() and end.query(), "elapsed_time on an event the device has not reached"
                return float(end.time - self.time)  # ms

        return Event

    def synchronize(self, device=None):
        self.device_syncs += 1
        self.finished = self.clock


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeDevice()
    monkeypatch.setattr(torch.cuda, "Event", fake.event_class())
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    return fake


def run_steps(timer: StepTimer, num_steps: int) -> None:
    """Each step: two writes and one read (events 1 ms apart: a write pair spans 1 ms, as does the read)."""
    for _ in range(num_steps):
        timer.new_step()
        for kind in ("write", "write", "read"):
            with timer.measure(kind):
                pass


def test_the_step_loop_never_waits_for_the_device(gpu):
    timer = StepTimer("cuda")
    run_steps(timer, 50)
    assert gpu.event_waits == 0 and gpu.device_syncs == 0
    assert len(gpu.live) == 50 * 3 * 2  # nothing finished, so every event is still held


def test_all_steps_syncs_once_and_sums_each_kind(gpu):
    timer = StepTimer("cuda")
    run_steps(timer, 4)
    steps = timer.all_steps()
    assert gpu.device_syncs == 1
    assert steps[0] == {}  # the step before the first new_step measured nothing
    assert steps[1:] == [{"write": 2000.0, "read": 1000.0}] * 4  # µs: two 1 ms writes, one 1 ms read


def test_finished_steps_release_their_events_without_waiting(gpu):
    timer = StepTimer("cuda")
    run_steps(timer, 10)
    gpu.finished = gpu.clock  # the device catches up
    timer.new_step()  # settles the 10 finished steps by query(), no wait
    assert gpu.event_waits == 0 and gpu.device_syncs == 0
    assert len(gpu.live) == 0
    assert timer.step_times(3) == {"write": 2000.0, "read": 1000.0}


def test_a_step_still_running_is_waited_for_only_when_asked(gpu):
    timer = StepTimer("cuda")
    run_steps(timer, 3)
    gpu.finished = 6  # the first step's events (1-6) are done, the rest are not
    timer.new_step()
    assert gpu.event_waits == 0
    assert timer.step_times(2) == {"write": 2000.0, "read": 1000.0}  # waits for step 2's last event
    assert gpu.event_waits == 1 and gpu.device_syncs == 0


def test_disabled_timer_records_no_events(gpu):
    timer = StepTimer("cuda", enabled=False)
    run_steps(timer, 5)
    assert len(gpu.live) == 0 and timer.all_steps() == [{}] * 6 and gpu.device_syncs == 0


def test_measure_steps_spreads_one_measurement_evenly_over_the_steps_it_opens():
    timer = StepTimer("cpu")
    with timer.measure("read"):
        pass
    with timer.measure_steps("write", 4):
        time.sleep(0.004)
    steps = timer.all_steps()
    assert len(steps) == 4  # the current step and three new ones
    writes = [s["write"] for s in steps]
    assert len(set(writes)) == 1 and sum(writes) >= 4000  # µs: one 4 ms op, a quarter per step
    assert "read" in steps[0] and all("read" not in s for s in steps[1:])


def test_per_step_arrays_mark_what_each_step_measured():
    timer = StepTimer("cpu")
    with timer.measure("write"):
        pass
    timer.new_step()
    timer.new_step()
    with timer.measure("read"):
        pass
    for _ in range(2000):  # past the arrays' first capacity
        timer.new_step()
    us, seen = timer.per_step()
    assert us.shape == seen.shape == (len(KINDS), 2003) and timer.num_steps == 2003
    assert seen[:, 0].tolist() == [True, False, False, False] and not seen[:, 1].any()
    assert seen[1, 2] and not seen[:, 3:].any() and not us[:, 3:].any()
    assert timer.all_steps()[:3] == [{"write": us[0, 0]}, {}, {"read": us[1, 2]}]
