"""Where a sweep's tasks run: here, in local worker processes, or as Ray tasks. Each runner yields
(task, row) as results arrive; the rows themselves come from `task.run_task` whichever runs them. The pools
under them (`open_pool`) also take tasks one at a time, for a search that picks its next task from the rows
so far (`kvsim plan`)."""

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
    workers = _num_workers(workers)
    if workers == 1 or len(tasks) <= 1:
        return ((task, run(task)) for task in tasks)
    pool = LocalPool(min(workers, len(tasks)), run)
    for task in tasks:
        pool.submit(task)
    return _PoolRows(pool)


class _PoolRows:
    """Rows from a pool as they finish (in task order within one wake-up); `close()` ends the pool."""

    def __init__(self, pool):
        self.pool = pool

    def __iter__(self) -> Iterator[tuple[Task, dict]]:
        while self.pool.num_running:
            yield from self.pool.wait()

    def close(self) -> None:
        self.pool.close()


def open_pool(workers: int | None, ray: str | None, run: Callable[[Task], dict]):
    """A pool handed tasks one at a time, for a search that decides its next task from the rows so far
    (`kvsim plan`): Ray tasks at `ray`, else `workers` local processes (1: in this process). Each has `slots`
    (how many tasks run at once), `submit(task)`, `num_running`, `wait()` (the (task, row) pairs that finished,
    at least one) and `close()`."""
    if ray:
        return RayPool(ray, run)
    workers = _num_workers(workers)
    return InProcess(run) if workers == 1 else LocalPool(workers, run)


def _num_workers(workers: int | None) -> int:
    if workers is None:
        workers = os.cpu_count() or 1
    if workers < 1:
        raise KvsimError(f"must be >= 1, got {workers}", field="--workers")
    return workers


class InProcess:
    """One task at a time, run here when waited for."""

    slots = 1

    def __init__(self, run: Callable[[Task], dict]):
        self.run, self.queue = run, []

    @property
    def num_running(self) -> int:
        return len(self.queue)

    def submit(self, task: Task) -> None:
        self.queue.append(task)

    def wait(self) -> list[tuple[Task, dict]]:
        task = self.queue.pop(0)
        return [(task, self.run(task))]

    def close(self) -> None:
        self.queue.clear()


class LocalPool:
    """`workers` forked processes (forked at the first `submit`), which ignore Ctrl-C; `close()` ends them."""

    def __init__(self, workers: int, run: Callable[[Task], dict]):
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self.slots, self.run = workers, run
        self.pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_ignore_sigint)
        self.running: dict = {}

    @property
    def num_running(self) -> int:
        return len(self.running)

    def submit(self, task: Task) -> None:
        self.running[self.pool.submit(self.run, task)] = task

    def wait(self) -> list[tuple[Task, dict]]:
        running = self.running
        done, _ = wait(running, return_when=FIRST_COMPLETED)
        rows = []
        for future in sorted(done, key=lambda f: (running[f].point, running[f].allocator_index)):
            task = running.pop(future)
            try:
                row = future.result()
            except Exception as exc:  # noqa: BLE001  (the worker died: killed, out of memory)
                row = error_row(task, f"worker died: {type(exc).__name__}: {exc}")
            rows.append((task, row))
        return rows

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
    pool = RayPool(address, run or run_task)  # here, not in the generator: a bad address fails before the progress bar
    return _ray_rows(pool, tasks)


def _ray_rows(pool: "RayPool", tasks: list[Task]) -> Iterator[tuple[Task, dict]]:
    """Submit every task, yield rows as they finish; cancel the rest when closed early (Ctrl-C)."""
    try:
        for task in tasks:
            pool.submit(task)
        while pool.num_running:
            yield from pool.wait()
    finally:
        pool.close()


class RayPool:
    """Ray tasks (one CPU each) at `address`; `close()` cancels what still runs and ends a session it started."""

    def __init__(self, address: str, run: Callable[[Task], dict]):
        try:
            import ray
        except ImportError:
            raise KvsimError("the Ray backend needs ray: pip install 'kvsim[ray]'", field="--ray") from None
        self.started = False
        if not ray.is_initialized():
            try:
                ray.init(address=None if address == "auto" else address, logging_level="ERROR", log_to_driver=False)
            except (ConnectionError, ValueError, RuntimeError) as exc:
                raise KvsimError(f"cannot connect to Ray at {address}: {exc}", field="--ray") from None
            self.started = True
        self.ray, self.run = ray, run
        self.slots = max(int(ray.cluster_resources().get("CPU", 1)), 1)
        self.remote = ray.remote(num_cpus=1, max_retries=0)(run_task_in)
        self.cwd = os.getcwd()
        self.running: dict = {}

    @property
    def num_running(self) -> int:
        return len(self.running)

    def submit(self, task: Task) -> None:
        self.running[self.remote.remote(task, self.cwd, self.run)] = task

    def wait(self) -> list[tuple[Task, dict]]:
        ray = self.ray
        done, _ = ray.wait(list(self.running), num_returns=1)
        rows = []
        for ref in done:
            task = self.running.pop(ref)
            try:
                row = ray.get(ref)
            except ray.exceptions.RayError as exc:  # the worker died: killed, out of memory
                row = error_row(task, f"worker died: {type(exc).__name__}")
            rows.append((task, row))
        return rows

    def close(self) -> None:
        for ref in self.running:
            self.ray.cancel(ref, force=True)
        self.running.clear()
        if self.started:
            self.ray.shutdown()
            self.started = False
