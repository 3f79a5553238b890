"""The capacity search: bisection against a slow linear scan, on a made-up monotone metric and on real replays."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kvsim.errors import KvsimError
from kvsim.sweep.points import make_tasks
from kvsim.sweep.search import meets, search_capacity
from kvsim.sweep.spec import Search, load_sweep
from kvsim.sweep.task import _with, replay_metrics
from kvsim.sweep.view import run_sweep
from tests.sweep.test_sweep import ACCOUNTING, make_sweep


def linear_capacity(search: Search, replay) -> float | int | None:
    """The slow answer: walk the grid up from lo; the value before the first that fails."""
    best = None
    for k in range(search.num_values):
        if not meets(search, replay(search.value(k))):
            break
        best = search.value(k)
    return best


@pytest.mark.parametrize("threshold", [-1, 0, 0.5, 1, 7, 12.5, 63, 99, 100, 1000])
def test_bisection_finds_the_linear_scans_answer_in_log_replays(threshold):
    search = Search("requests.arrival.rate", lo=1, hi=100, step=1, targets=(("ttft_p99_s", 1.0),))
    calls = []

    def replay(rate):  # TTFT p99 crosses 1 s at `threshold` requests/s
        calls.append(rate)
        return {"ttft_p99_s": 0.5 if rate <= threshold else 2.0}

    found = search_capacity(search, replay)
    assert found.value == linear_capacity(search, replay)
    assert found.replays == len(calls[: found.replays]) <= math.ceil(math.log2(100)) + 2
    assert found.status == ("below lo" if threshold < 1 else "at hi" if threshold >= 100 else "found")


def test_fractional_steps_give_grid_values():
    search = Search("requests.arrival.rate", lo=0.5, hi=2.0, step=0.25, targets=(("rejected", 0),))
    assert [search.value(k) for k in range(search.num_values)] == [0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0]
    found = search_capacity(search, lambda rate: {"rejected": int(rate > 1.3)})
    assert (found.value, found.status) == (1.25, "found")


def test_a_missing_figure_fails_the_target():
    search = Search("x", lo=1, hi=2, step=1, targets=(("ttft_p99_s", 5.0),))
    assert not meets(search, {"ttft_p99_s": math.nan}) and not meets(search, {})
    assert meets(search, {"ttft_p99_s": 5.0})


def test_capacity_of_real_replays_matches_a_linear_scan(tmp_path):
    """Per allocator, the rate 64 MiB of KV holds at p99 TTFT <= 0.1 s (near 55 requests/s), bisected and scanned."""
    search = {"axis": "requests.arrival.rate", "lo": 4, "hi": 120, "step": 4, "target": {"ttft_p99_s": 0.1}}
    path = make_sweep(tmp_path, axes={"kv_budget": ["64MiB"]}, search=search,
                      set={"allocators": [{"kind": "paged", "block_size": 16}, {"kind": "flat", "reserve": "oracle"}]})
    spec = load_sweep(path)
    table = pd.read_parquet(run_sweep(path, out=tmp_path / "out", workers=1).paths[0])
    tasks = make_tasks(spec, ACCOUNTING)
    for task, (_, row) in zip(tasks, table.iterrows()):
        scanned = linear_capacity(spec.search, lambda rate: replay_metrics(_with(task, rate), task.workload_path, task))
        assert row["capacity_status"] == "found" and row["capacity"] == scanned, task.allocator
        assert row["capacity_replays"] <= math.ceil(math.log2(spec.search.num_values)) + 2
        at_capacity = replay_metrics(_with(task, scanned), task.workload_path, task)
        assert row["ttft_p99_s"] == at_capacity["ttft_p99_s"] <= 0.1


@pytest.mark.parametrize(
    ("search", "message"),
    [
        ({"axis": "kv_budget", "lo": 1, "hi": 2, "step": 1, "target": {"rejected": 0}}, "search.axis: kv_budget is also an axis"),
        ({"axis": "x", "lo": 1, "hi": 2, "step": 0.3, "target": {"rejected": 0}}, "search.step: must divide"),
        ({"axis": "x", "lo": 2, "hi": 2, "step": 1, "target": {"rejected": 0}}, "search.hi: must be > lo"),
        ({"axis": "x", "lo": 1, "hi": 2, "step": 1, "target": {"ttft": 1}}, "search.target.ttft: not a target metric"),
    ],
)
def test_bad_search_fields_are_named(tmp_path, search, message):
    with pytest.raises(KvsimError, match=message):
        load_sweep(make_sweep(tmp_path, axes={"kv_budget": ["1GiB"]}, search=search))
