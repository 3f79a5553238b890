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
    """Kernel times per step: `timer.new_step()` as a step begins, then `with timer.measure("write"): ...`.

    A step's figures are the sum of its measurements of each kind; kinds never measured in a step are absent
    from its dict (so an accounting-only cache, which measures nothing, reports `{}`, never a fake zero).

    CUDA: nothing in `measure` or `new_step` waits for the GPU; `step_times()` waits for one step's last
    event, `all_steps()` synchronises once at the end. A replay that reads timings only at the end never
    syncs inside its loop.
    """

    def __init__(self, device: torch.device | str = "cpu", *, enabled: bool = True):
        self.device = torch.device(device)
        self.enabled = enabled
        self._cuda = self.device.type == "cuda"
        # Per step: its raw records (kind, start, end) until resolved, then its totals. start/end are ns ints
        # on CPU and CUDA events on CUDA; a resolved step drops its records (events are a finite resource).
        self._records: list[list[tuple[str, object, object]]] = [[]]
        self._totals: list[dict[str, float] | None] = [None]
        self._unresolved = 0  # first closed step not yet resolved

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
        self._records[-1].append((kind, start, end))

    @contextmanager
    def measure_steps(self, kind: str, num_steps: int) -> Iterator[None]:
        """Time the block once as `kind` spread evenly over `num_steps` steps: the current one and the
        `num_steps - 1` it opens (CPU only: a synchronous op's host time can be split after it ran).

        For work that covers several steps in one op (a decode run's writes): each step gets the mean.
        """
        assert num_steps >= 1 and not self._cuda, (num_steps, self.device)
        start = time.perf_counter_ns()
        yield
        record = (kind, 0, (time.perf_counter_ns() - start) / num_steps)
        self._records[-1].append(record)
        if num_steps > 1:
            self.new_step()  # settles the steps closed so far
            self._records[-1].append(record)
            # The steps in between close at once: a CPU step is settled whenever asked (`_done` is true).
            self._records[-1:-1] = [[record] for _ in range(num_steps - 2)]
            self._totals[-1:-1] = [None] * (num_steps - 2)

    def new_step(self) -> None:
        """Close the current step and open the next one: the replay calls it as each scheduler step begins.

        Closed steps whose events have already completed are resolved here without waiting (`query`).
        """
        self._records.append([])
        self._totals.append(None)
        closed = len(self._records) - 1
        while self._unresolved < closed and self._done(self._unresolved):
            self._settle(self._unresolved)
            self._unresolved += 1

    @property
    def num_steps(self) -> int:
        """Steps opened so far, the current one included."""
        return len(self._records)

    def step_times(self, step: int = -1) -> dict[str, float]:
        """Microseconds per kind measured in `step` (default: the current step, i.e. since the last `new_step`).

        On CUDA this waits for that step's last event if it has not completed yet.
        """
        if step < 0:
            step += len(self._records)
        if step == len(self._records) - 1:  # still open: resolve without caching
            return self._resolve(self._records[step])
        if self._totals[step] is None:
            self._settle(step)
        return dict(self._totals[step])  # type: ignore[arg-type]

    def all_steps(self) -> list[dict[str, float]]:
        """Microseconds per kind for every step so far (one host sync on CUDA)."""
        if self._cuda and self.enabled:
            torch.cuda.synchronize(self.device)
        return [self.step_times(i) for i in range(len(self._records))]

    def _done(self, step: int) -> bool:
        records = self._records[step]
        return not (self._cuda and records) or bool(records[-1][2].query())  # type: ignore[union-attr]

    def _settle(self, step: int) -> None:
        self._totals[step] = self._resolve(self._records[step])
        self._records[step] = []

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
