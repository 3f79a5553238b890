"""How `kvsim bench kernels` times one kernel: CUDA events around each call with the L2 flushed before it, or
a perf_counter loop on CPU; the median and 20th/80th percentiles of the calls, in microseconds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch


@dataclass(frozen=True)
class Timing:
    """Microseconds per call over `reps` repetitions: median and the 20th/80th percentiles."""

    median_us: float
    p20_us: float
    p80_us: float
    reps: int


def measure(fn: Callable[[], object], device: torch.device, *, reps: int) -> Timing:
    """Time `fn`, already warmed up (and compiled) by the caller, over at least `reps` repetitions.

    CUDA: CUDA events around each call, L2 flushed before each by zeroing a buffer twice its size (as
    triton.testing.do_bench does), and repetitions added until they span about 100 ms.
    CPU: a perf_counter loop of at least `reps` calls, more (up to 1000) until they span 0.2 s, so that a
    shared machine's scheduler preempting one call does not move the median.
    """
    import time

    if device.type != "cuda":
        times: list[float] = []
        while len(times) < reps or (sum(times) < 2e5 and len(times) < 1000):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        reps = len(times)
    else:
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        flush = torch.empty(max(2 * l2, 2**28) // 4, dtype=torch.int32, device=device)
        probe = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        probe[0].record()
        for _ in range(5):
            fn()
        probe[1].record()
        torch.cuda.synchronize(device)
        estimate_ms = max(probe[0].elapsed_time(probe[1]) / 5, 1e-3)
        reps = max(reps, min(1000, int(100 / estimate_ms)))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) * 1e3 for start, end in events]
    p20, median, p80 = np.percentile(times, [20, 50, 80])
    return Timing(float(median), float(p20), float(p80), reps)
