"""One sweep task into one table row: its workload replayed (`run_replay`, read through `summary_records`) or
its capacity searched; a failing task's row carries the error instead of figures."""

from __future__ import annotations

import copy
import math
import os

import numpy as np

from kvsim.errors import KvsimError
from kvsim.sweep.points import Task, set_path


def run_task(task: Task) -> dict:
    """The table row of `task`: point, axis values, allocator, (capacity), summary metrics, error (None)."""
    row = _head(task)
    try:
        if task.search is None:
            row.update(replay_metrics(task.workload, task.workload_path, task))
        else:
            from kvsim.sweep.search import search_capacity

            found = search_capacity(task.search, lambda value: replay_metrics(_with(task, value), task.workload_path, task))
            row.update({"capacity": found.value, "capacity_replays": found.replays, "capacity_status": found.status})
            row.update(found.metrics)
        row["error"] = None
    except KvsimError as exc:
        row["error"] = str(exc)
    except Exception as exc:  # noqa: BLE001  (a failing point is recorded in its row; the sweep goes on)
        row["error"] = f"{type(exc).__name__}: {exc}"
    return _plain(row)


def error_row(task: Task, message: str) -> dict:
    """The row of a task whose worker died (killed, out of memory) before it could return one."""
    return {**_head(task), "error": message}


def _head(task: Task) -> dict:
    row: dict = {"point": task.point, **dict(task.axis_values), "allocator": task.allocator}
    if task.search is not None:
        row.update({"search_axis": task.search.axis, "capacity": None, "capacity_replays": 0, "capacity_status": None})
    return row


def replay_metrics(mapping: dict, path: str, task: Task) -> dict:
    """Replay one workload mapping of one allocator; its summary metrics (as `kvsim replay` writes them)."""
    from kvsim.replay.run import run_replay
    from kvsim.replay.reports import summary_records
    from kvsim.workload.spec import workload_from_mapping

    workload = workload_from_mapping(mapping, path, sha256=task.key)
    result = run_replay(workload, task.options, workers=1)
    (record,) = summary_records(result, kernels=False)
    record.pop("allocator")
    record.update(derived_metrics(result, result.runs[0], record))
    record["clock"] = result.clock  # what priced the steps: a capacity differs several-fold between clocks
    return record


def derived_metrics(result, run, record: dict) -> dict:
    """Two figures a capacity target may bound beside the summary's: preemptions per request, and how fast
    the waiting queue grows over the arrivals (mean waiting in the arrival window's second half minus its
    first half, per second of half window: about 0 while the engine keeps up, the excess rate when not)."""
    steps = run.steps
    t, dt, waiting = steps["time_s"], steps["step_time_s"], steps["num_waiting"].astype(np.float64)
    first, last = float(result.arrival_s.min()), float(result.arrival_s.max())
    half = (last - first) / 2
    growth = 0.0
    if half > 0:
        means = []
        for lo, hi in ((first, first + half), (first + half, last)):
            inside = (t >= lo) & (t < hi)
            weight = dt[inside].sum()
            means.append(float((waiting[inside] * dt[inside]).sum() / weight) if weight > 0 else 0.0)
        growth = (means[1] - means[0]) / half
    return {
        "preemptions_per_request": record["preemptions"] / record["num_requests"],
        "queue_growth_per_s": growth,
    }


def _with(task: Task, value) -> dict:
    """The task's workload with the search axis set to `value`."""
    mapping = copy.deepcopy(task.workload)
    set_path(mapping, task.search.axis, value)
    return mapping


def _plain(row: dict) -> dict:
    """Python scalars only (numpy's become int/float), so the row round-trips through JSON unchanged."""
    out = {}
    for key, value in row.items():
        if isinstance(value, np.integer):
            value = int(value)
        elif isinstance(value, np.floating):
            value = float(value)
        if isinstance(value, float) and math.isnan(value):
            value = None
        out[key] = value
    return out


def run_task_in(task: Task, cwd: str, run=run_task) -> dict:
    """`run(task)` from `cwd` (a Ray worker starts elsewhere; the workload's relative paths are relative to it)."""
    if os.getcwd() != cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    return run(task)
