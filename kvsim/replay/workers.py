"""Worker processes for a replay: the allocator configs split among forked processes before any runs (by
estimated cost), progress forwarded to the parent through a queue."""

from __future__ import annotations

import itertools
import multiprocessing
import queue as queue_module

from kvsim.replay.loop import replay_allocator
from kvsim.replay.options import ProgressFn
from kvsim.replay.records import AllocatorRun


# Inherited by forked workers (never pickled): the request stream and everything a worker needs.
_FORK_STATE: tuple | None = None


# Estimated cost of one allocator config's replay, relative to a flat one: a paged replay walks block tables and
# slot mappings and scatters block by block (the main job with CPU tensors: 2.5-2.8 s per paged config against
# 1.6-1.7 s per flat one, one process each; scripts/bench_main_job.py). Integers, so equal loads compare equal.
_COST = {"paged": 8, "flat": 5}


def plan_workers(configs, workers: int) -> list[list[int]]:
    """Config indices for each of `workers` processes, fixed before any runs: the split whose busiest process
    has the least estimated cost (every split, for 2 processes and up to 12 configs; else longest first).

    Handing configs out one at a time as processes free up leaves the last one running alone: five configs
    on two processes ended with a paged replay alone on one core for over a second. Each list is ordered
    longest first.
    """
    cost = [_COST.get(c.kind, 5) for c in configs]
    order = sorted(range(len(configs)), key=lambda j: (-cost[j], j))
    if workers == 2 and len(configs) <= 12:
        total = sum(cost)

        def busiest(subset: tuple[int, ...]) -> int:
            load = sum(cost[j] for j in subset)
            return max(load, total - load)

        subsets = (subset for r in range(len(order) + 1) for subset in itertools.combinations(order, r))
        first = min(subsets, key=busiest)  # the first best, in a fixed order: the same plan every run
        plan = [list(first), [j for j in order if j not in first]]
    else:
        plan = [[] for _ in range(workers)]
        loads = [0] * workers
        for j in order:
            w = loads.index(min(loads))
            plan[w].append(j)
            loads[w] += cost[j]
    return [p for p in plan if p]


def replay_in_processes(configs, requests, ctx, options, progress, workers) -> list[AllocatorRun]:
    """The allocator configs in `workers` forked processes, split by `plan_workers` (the configs share
    nothing); results come back in the workload's order.

    The runs are independent and deterministic, so this changes wall time, not a single simulated figure.
    Workers report progress through a queue that the parent drains while it waits. With CPU tensors each
    worker runs torch on one thread (as DataLoader workers do): the cores go to the processes, and a forked
    child never enters an OpenMP region its parent's thread pool was set up for.
    """
    global _FORK_STATE
    mp = multiprocessing.get_context("fork")
    queue = mp.Queue()
    _FORK_STATE = (configs, requests, ctx, options, queue)
    plan = plan_workers(configs, min(workers, len(configs)))
    try:
        with mp.Pool(len(plan)) as pool:
            pending = [pool.apply_async(_replay_worker, (indices,)) for indices in plan]
            while not all(job.ready() for job in pending):
                _drain(queue, progress, timeout=0.05)
            runs = dict(pair for job in pending for pair in job.get())
        _drain(queue, progress, timeout=0)
    finally:
        _FORK_STATE = None
    return [runs[j] for j in range(len(configs))]


def _replay_worker(indices: list[int]) -> list[tuple[int, AllocatorRun]]:
    configs, requests, ctx, options, queue = _FORK_STATE
    if options.tensors:
        import torch

        torch.set_num_threads(1)
    report = lambda *msg: queue.put(msg)  # noqa: E731
    return [(j, replay_allocator(configs[j], requests, ctx, options, progress=report)) for j in indices]


def _drain(queue, progress: ProgressFn | None, *, timeout: float) -> None:
    """Pass queued progress messages on; wait up to `timeout` for the first."""
    try:
        msg = queue.get(timeout=timeout) if timeout else queue.get_nowait()
        while True:
            if progress is not None:
                progress(*msg)
            msg = queue.get_nowait()
    except queue_module.Empty:
        pass
