"""Per-step timings of the cache's kernels (write, read, attention, swap, copy), in microseconds.

On CUDA each measurement is a pair of CUDA events recorded on the current stream, so the step loop never waits
for the GPU; events are resolved lazily when a figure is asked for. On CPU torch ops run synchronously, so a
monotonic host clock (`time.perf_counter_ns`) measures them directly.

Totals live in one array per kind, a column per step, so a step costs an index increment, not an object:
a CPU replay opens 100,000+ steps.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

KINDS = ("write", "read", "attention", "swap")
_KIND = {kind: i for i, kind in enumerate(KINDS)}


class StepTimer:
    """Kernel times per step: `timer.new_step()` as a step begins, then `with timer.measure("write"): ...`.

    A step's figures are the sum of its measurements of each kind; kinds never measured in a step are absent
    from its dict (so an accounting-only cache, which measures nothing, reports `{}`, never a fake zero).

    CUDA: nothing in `measure` or `new_step` waits for the GPU; `step_times()` waits for one step's events,
    `all_steps()` and `per_step()` synchronise once. A replay that reads timings only at the end never syncs
    inside its loop.
    """

    def __init__(self, device: torch.device | str = "cpu", *, enabled: bool = True):
        self.device = torch.device(device)
        self.enabled = enabled
        self._cuda = self.device.type == "cuda"
        self._num_steps = 1
        self._us = np.zeros((len(KINDS), 1024))  # µs per kind (row) and step (column)
        self._seen = np.zeros((len(KINDS), 1024), dtype=bool)  # whether a kind was measured in a step
        # CUDA: per step, its (kind, start, end) event records until they are resolved into `_us`; a resolved
        # step drops its records (events are a finite resource). Steps are keys in the order they were opened.
        self._pending: dict[int, list[tuple[int, object, object]]] = {}

    @contextmanager
    def measure(self, kind: str) -> Iterator[None]:
        """Time the block as `kind` in the current step (a no-op when disabled)."""
        k = _KIND[kind]
        if not self.enabled:
            yield
            return
        step = self._num_steps - 1
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.setdefault(step, []).append((k, start, end))
        else:
            start = time.perf_counter_ns()
            yield
            self._us[k, step] += (time.perf_counter_ns() - start) / 1e3
            self._seen[k, step] = True

    @contextmanager
    def measure_steps(self, kind: str, num_steps: int) -> Iterator[None]:
        """Time the block once as `kind` spread evenly over `num_steps` steps: the current one and the
        `num_steps - 1` it opens (CPU only: a synchronous op's host time can be split after it ran).

        For work that covers several steps in one op (a decode run's writes): each step gets the mean.
        """
        assert num_steps >= 1 and not self._cuda, (num_steps, self.device)
        k = _KIND[kind]
        start = time.perf_counter_ns()
        yield
        us = (time.perf_counter_ns() - start) / 1e3 / num_steps
        first = self._num_steps - 1
        self._open(num_steps - 1)
        self._us[k, first : first + num_steps] += us
        self._seen[k, first : first + num_steps] = True

    def new_step(self) -> None:
        """Close the current step and open the next one: the replay calls it as each scheduler step begins.

        CUDA: closed steps whose events have already completed are resolved here without waiting (`query`).
        """
        self._open(1)
        if self._pending:
            closed = self._num_steps - 1
            for step in list(self._pending):
                if step >= closed or not self._pending[step][-1][2].query():  # type: ignore[union-attr]
                    break
                self._settle(step)

    @property
    def num_steps(self) -> int:
        """Steps opened so far, the current one included."""
        return self._num_steps

    def step_times(self, step: int = -1) -> dict[str, float]:
        """Microseconds per kind measured in `step` (default: the current step, i.e. since the last `new_step`).

        On CUDA this waits for that step's last event if it has not completed yet.
        """
        if step < 0:
            step += self._num_steps
        assert 0 <= step < self._num_steps, step
        if step in self._pending:
            self._settle(step)
        return {KINDS[k]: float(self._us[k, step]) for k in np.flatnonzero(self._seen[:, step])}

    def all_steps(self) -> list[dict[str, float]]:
        """Microseconds per kind for every step so far (one host sync on CUDA)."""
        us, seen = self.per_step()
        return [{KINDS[k]: float(us[k, t]) for k in np.flatnonzero(seen[:, t])} for t in range(self._num_steps)]

    def per_step(self) -> tuple[np.ndarray, np.ndarray]:
        """(µs, measured): [len(KINDS), num_steps] arrays, a row per kind in KINDS order (one host sync on CUDA).

        `measured[k, t]` is False where kind k never ran in step t (its µs is then 0, not a measurement).
        """
        if self._pending:
            torch.cuda.synchronize(self.device)
            for step in list(self._pending):
                self._settle(step)
        n = self._num_steps
        return self._us[:, :n], self._seen[:, :n]

    def _open(self, count: int) -> None:
        """Open `count` new steps, growing the arrays by doubling."""
        self._num_steps += count
        if self._num_steps > self._us.shape[1]:
            cap = max(2 * self._us.shape[1], self._num_steps)
            self._us = np.concatenate([self._us, np.zeros((len(KINDS), cap - self._us.shape[1]))], axis=1)
            self._seen = np.concatenate([self._seen, np.zeros((len(KINDS), cap - self._seen.shape[1]), dtype=bool)], axis=1)

    def _settle(self, step: int) -> None:
        """Resolve `step`'s CUDA event records into the totals (waiting for its last event) and drop them."""
        records = self._pending.pop(step)
        records[-1][2].synchronize()  # type: ignore[union-attr]
        for k, start, end in records:
            self._us[k, step] += start.elapsed_time(end) * 1e3  # type: ignore[union-attr]  # ms -> µs
            self._seen[k, step] = True
