"""Where a sweep's tasks run: here, in local worker processes, or as Ray tasks. Each runner yields
(task, row) as results arrive; the rows themselves come from `task.run_task` whichever runs them."""

from __future__ import annotations

import multiprocessing
import os
import signal
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Callable, Iterable, Iterator

from kvsim.errors import KvsimError
from kvsim.sweep.points import Task
from kvsim.sweep.task import error_row, run_task, run_task_in


def run_local(tasks: list[Task], workers: int | None = None, run: Callable[[Task], dict] | None = None) -> Iterable[tuple[Task, dict]]:
    """Run `tasks` in `workers` processes (default: one per CPU; 1 runs them in this process). `run` makes a
    task's row (a module-level function: `kvsim plan` passes its own over tasks with `point`, `allocator_index`,
    `axis_values`, `allocator` and `search`).

    The workers are forked here, before the caller starts its progress bar's thread. They ignore Ctrl-C: the
    sweep's process stops handing out tasks, keeps what finished, and `close()` ends them.
    """
    run = run or run_task
    if workers is None:
        workers = os.cpu_count() or 1
    if workers < 1:
        raise KvsimError(f"must be >= 1, got {workers}", field="--workers")
    if workers == 1 or len(tasks) <= 1:
        return ((task, run(task)) for task in tasks)
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    pool = ProcessPoolExecutor(min(workers, len(tasks)), mp_context=context, initializer=_ignore_sigint)
    return _PoolRows(pool, {pool.submit(run, task): task for task in tasks})


class _PoolRows:
    """Rows from a process pool as they finish (in task order within one wake-up); `close()` ends the pool."""

    def __init__(self, pool: ProcessPoolExecutor, running: dict):
        self.pool, self.running = pool, running

    def __iter__(self) -> Iterator[tuple[Task, dict]]:
        running = self.running
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: (running[f].point, running[f].allocator_index)):
                task = running.pop(future)
                try:
                    row = future.result()
                except Exception as exc:  # noqa: BLE001  (the worker died: killed, out of memory)
                    row = error_row(task, f"worker died: {type(exc).__name__}: {exc}")
                yield task, row

    def close(self) -> None:
        processes = list((self.pool._processes or {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:  # a worker still mid-replay (after Ctrl-C) is ended now
            process.terminate()


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_ray(tasks: list[Task], address: str, run: Callable[[Task], dict] | None = None) -> Iterator[tuple[Task, dict]]:
    """Run each task as a Ray task (one CPU each) on the cluster at `address` (`auto`: a running cluster if
    there is one, else a local instance; a session already initialised in this process is used as it is)."""
    try:
        import ray
    except ImportError:
        raise KvsimError("the Ray backend needs ray: pip install 'kvsim[ray]'", field="--ray") from None
    started = False
    if not ray.is_initialized():  # here, not in the generator: a bad address fails before the progress bar
        try:
            ray.init(address=None if address == "auto" else address, logging_level="ERROR", log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise KvsimError(f"cannot connect to Ray at {address}: {exc}", field="--ray") from None
        started = True
    return _ray_rows(ray, tasks, started, run or run_task)


def _ray_rows(ray, tasks: list[Task], started: bool, run=None) -> Iterator[tuple[Task, dict]]:
    """Submit every task, yield rows as they finish; cancel the rest when closed early (Ctrl-C)."""
    remote = ray.remote(num_cpus=1, max_retries=0)(run_task_in)
    cwd = os.getcwd()
    running = {}
    try:
        running = {remote.remote(task, cwd, run or run_task): task for task in tasks}
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            for ref in done:
                task = running.pop(ref)
                try:
                    row = ray.get(ref)
                except ray.exceptions.RayError as exc:  # the worker died: killed, out of memory
                    row = error_row(task, f"worker died: {type(exc).__name__}")
                yield task, row
    finally:
        for ref in running:
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()
