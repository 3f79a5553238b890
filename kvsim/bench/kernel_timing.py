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


FLUSH_BYTES = 2**28  # the L2 flush buffer: at least this, and at least twice the L2 (as triton.testing.do_bench)
WARMUP_MS = 25  # CUDA: calls before timing, as do_bench's warm-up (clocks up, caches and allocator settled)
REPEAT_MS = 100  # CUDA: repetitions until the timed calls span about this long (at most 1000)


def _flush_buffer(device: torch.device) -> torch.Tensor:
    """A buffer whose zeroing evicts the L2: max(2 x L2, FLUSH_BYTES) bytes on `device`."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return torch.empty(max(2 * l2, FLUSH_BYTES) // 4, dtype=torch.int32, device=device)


def measure(fn: Callable[[], object], device: torch.device, *, reps: int) -> Timing:
    """Time `fn`, already called once (compiled) by the caller, over at least `reps` repetitions.

    CUDA (triton.testing.do_bench's method): 5 calls estimate the time of one; calls for WARMUP_MS more;
    then CUDA events around each call, the L2 flushed before each by zeroing a buffer (`_flush_buffer`),
    repetitions added until they span about REPEAT_MS (at most 1000).
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
        flush = _flush_buffer(device)
        probe = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        probe[0].record()
        for _ in range(5):
            fn()
        probe[1].record()
        torch.cuda.synchronize(device)
        estimate_ms = max(probe[0].elapsed_time(probe[1]) / 5, 1e-3)
        for _ in range(min(1000, int(WARMUP_MS / estimate_ms))):
            fn()
        reps = max(reps, min(1000, int(REPEAT_MS / estimate_ms)))
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
