"""Worker processes for a replay: each allocator config in its own forked process, progress forwarded to
the parent through a queue."""

from __future__ import annotations

import multiprocessing
import queue as queue_module

from kvsim.replay.loop import replay_allocator
from kvsim.replay.options import ProgressFn
from kvsim.replay.records import AllocatorRun


# Inherited by forked workers (never pickled): the request stream and everything a worker needs.
_FORK_STATE: tuple | None = None


def replay_in_processes(configs, requests, ctx, options, progress, workers) -> list[AllocatorRun]:
    """Each allocator config in its own forked process (they share nothing); results come back in order.

    The runs are independent and deterministic, so this changes wall time, not a single simulated figure.
    Workers report progress through a queue that the parent drains while it waits. With CPU tensors each
    worker runs torch on one thread (as DataLoader workers do): the cores go to the processes, and a forked
    child never enters an OpenMP region its parent's thread pool was set up for.
    """
    global _FORK_STATE
    mp = multiprocessing.get_context("fork")
    queue = mp.Queue()
    _FORK_STATE = (configs, requests, ctx, options, queue)
    try:
        with mp.Pool(min(workers, len(configs))) as pool:
            pending = [pool.apply_async(_replay_worker, (j,)) for j in range(len(configs))]
            while not all(job.ready() for job in pending):
                _drain(queue, progress, timeout=0.05)
            runs = [job.get() for job in pending]
        _drain(queue, progress, timeout=0)
    finally:
        _FORK_STATE = None
    return runs


def _replay_worker(index: int) -> AllocatorRun:
    configs, requests, ctx, options, queue = _FORK_STATE
    if options.tensors:
        import torch

        torch.set_num_threads(1)
    return replay_allocator(configs[index], requests, ctx, options, progress=lambda *msg: queue.put(msg))


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
