"""The capacity search: bisect one axis over a grid of values for the largest one whose replay meets every
target bound (p99 TTFT, rejections, preemptions per request, queue growth)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from kvsim.sweep.spec import Search


@dataclass(frozen=True)
class Capacity:
    """What a search found: `value` (None when even `lo` fails), the replays it took, and `status`: `found`,
    `at hi` (hi meets the target: the capacity is hi or more) or `below lo`."""

    value: float | int | None
    replays: int
    status: str
    metrics: dict = field(default_factory=dict)  # summary metrics of the replay at `value` (empty if none)


def meets(search: Search, metrics: dict) -> bool:
    """True when every target metric is at or under its bound; a missing figure (NaN: nothing finished) fails."""
    for metric, bound in search.targets:
        value = metrics.get(metric)
        if value is None or (isinstance(value, float) and math.isnan(value)) or value > bound:
            return False
    return True


def search_capacity(search: Search, replay: Callable[[float | int], dict]) -> Capacity:
    """Bisect k in [0, num_values) for the largest `search.value(k)` that meets the targets.

    Tries hi first (a light setup passes in one replay), then lo; then keeps `ok` (meets) < `bad` (fails)
    and halves the gap: about log2(num_values) + 2 replays, each `replay(value)` -> summary metrics.
    Assumes the targets are monotone in the axis (a higher rate never lowers TTFT); where they are not, the
    answer is some value that meets them next to one that does not.
    """
    replays = 0

    def run(k: int) -> tuple[bool, dict]:
        nonlocal replays
        replays += 1
        metrics = replay(search.value(k))
        return meets(search, metrics), metrics

    bad = search.num_values - 1
    passed, metrics = run(bad)
    if passed:
        return Capacity(search.value(bad), replays, "at hi", metrics)
    ok = 0
    passed, best = run(ok)
    if not passed:
        return Capacity(None, replays, "below lo")
    while bad - ok > 1:
        mid = (ok + bad) // 2
        passed, metrics = run(mid)
        if passed:
            ok, best = mid, metrics
        else:
            bad = mid
    return Capacity(search.value(ok), replays, "found", best)
