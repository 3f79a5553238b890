"""Per-step timings of the cache's kernels (write, read, attention, swap, copy), in microseconds.

On CUDA each measurement is a pair of CUDA events recorded on the current stream, so the step loop never waits
for the GPU; events are resolved lazily when a figure is asked for. On CPU torch ops run synchronously, so a
monotonic host clock (`time.perf_counter_ns`) measures them directly.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

KINDS = ("write", "read", "attention", "swap", "copy")


class StepTimer:
    """Accumulates kernel times per step: `timer.new_step()` when a step begins, then `with timer.measure("write"): ...`.

    A step's figures are the sum of its measurements of each kind; kinds never measured in a step are absent
    from its dict (so an accounting-only cache, which measures nothing, reports `{}`, never a fake zero).

    CUDA: `step_times()` resolves the latest step only (it waits for that step's last event: one host sync per
    call); `all_steps()` resolves everything at once. Neither is called inside `measure`, so a replay that
    reads timings only at the end never syncs inside its loop.
    """

    def __init__(self, device: torch.device | str = "cpu", *, enabled: bool = True):
        self.device = torch.device(device)
        self.enabled = enabled
        self._cuda = self.device.type == "cuda"
        # One list per step: (kind, start, end) with start/end ns ints (CPU) or CUDA events (resolved lazily).
        self._steps: list[list[tuple[str, object, object]]] = [[]]
        self._resolved: dict[int, dict[str, float]] = {}

    @contextmanager
    def measure(self, kind: str) -> Iterator[None]:
        """Time the block as `kind` in the current step (a no-op when disabled)."""
        assert kind in KINDS, kind
        if not self.enabled:
            yield
            return
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter_ns()
            yield
            end = time.perf_counter_ns()
        self._steps[-1].append((kind, start, end))

    def new_step(self) -> None:
        """Close the current step and open the next one: the replay calls it as each scheduler step begins."""
        self._steps.append([])

    @property
    def num_steps(self) -> int:
        """Steps opened so far, the current one included."""
        return len(self._steps)

    def step_times(self, step: int = -1) -> dict[str, float]:
        """Microseconds per kind measured in `step` (default: the current step, i.e. since the last `new_step`)."""
        if step < 0:
            step += len(self._steps)
        if step not in self._resolved or step == len(self._steps) - 1:
            self._resolved[step] = self._resolve(self._steps[step])
        return dict(self._resolved[step])

    def all_steps(self) -> list[dict[str, float]]:
        """Microseconds per kind for every step so far (one host sync on CUDA)."""
        if self._cuda and any(self._steps):
            torch.cuda.synchronize(self.device)
        return [self.step_times(i) for i in range(len(self._steps))]

    def _resolve(self, records: list[tuple[str, object, object]]) -> dict[str, float]:
        totals: dict[str, float] = {}
        if self._cuda and records:
            records[-1][2].synchronize()  # type: ignore[union-attr]
        for kind, start, end in records:
            if self._cuda:
                us = start.elapsed_time(end) * 1e3  # type: ignore[union-attr]  # ms -> us
            else:
                us = (end - start) / 1e3  # type: ignore[operator]  # ns -> us
            totals[kind] = totals.get(kind, 0.0) + us
        return totals
