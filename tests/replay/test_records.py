"""The replay's records: a row's kernel columns are the mean µs per step over the timer steps it spans,
counting only the steps that measured that kind (NaN where none did)."""

from __future__ import annotations

import math
from array import array
from contextlib import contextmanager

import numpy as np

from kvsim.engine.tensors.timing import StepTimer
from kvsim.replay.records import fill_kernel_columns


def test_a_rows_kernel_columns_are_its_steps_means():
    timer = StepTimer("cpu")

    @contextmanager
    def fixed(us):  # a measurement of exactly `us` microseconds: perf_counter_ns is patched per call
        import time

        real = time.perf_counter_ns
        ticks = iter([0, int(us * 1000)])
        time.perf_counter_ns = lambda: next(ticks)
        try:
            yield
        finally:
            time.perf_counter_ns = real

    with fixed(10), timer.measure("write"):  # step 0: write 10
        pass
    timer.new_step()  # step 1: write 30, read 5
    with fixed(30), timer.measure("write"):
        pass
    with fixed(5), timer.measure("read"):
        pass
    timer.new_step()  # step 2: nothing
    with fixed(60), timer.measure_steps("write", 3):  # steps 2-4: write 20 each
        pass
    steps: dict[str, np.ndarray] = {}
    spans = array("q", [0, 0, 0, 1, 1, 4, 2, 2])  # rows: [0], [0, 1], [1..4], [2]
    fill_kernel_columns(steps, timer, spans)
    assert steps["write_us"].tolist() == [10.0, 20.0, 22.5, 20.0]  # (30 + 20 * 3) / 4 over rows 1..4
    read = steps["read_us"].tolist()
    assert math.isnan(read[0]) and read[1] == 5.0 and read[2] == 5.0 and math.isnan(read[3])
    assert all(math.isnan(x) for x in steps["attention_us"])
