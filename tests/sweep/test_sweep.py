"""kvsim.sweep: the sweep file, point expansion and validation, rows, resume, failures, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvsim.errors import KvsimError
from kvsim.replay.run import run_replay
from kvsim.replay.options import ReplayOptions
from kvsim.replay.reports import summary_records
from kvsim.sweep import task as task_module
from kvsim.sweep.points import expand_points, make_tasks, set_path
from kvsim.sweep.results import JOURNAL, Results
from kvsim.sweep.spec import TABLE_METRICS, load_sweep
from kvsim.sweep.view import run_sweep
from kvsim.workload.spec import load_workload

REPO = Path(__file__).resolve().parents[2]
ACCOUNTING = ReplayOptions(tensors=False)

BASE = {
    "name": "tiny",
    "seed": 3,
    "model": "qwen3-0.6b",
    "hardware": "h100-80gb",
    "kv_budget": "256MiB",
    "max_model_len": 2048,
    "requests": {
        "count": 40,
        "arrival": {"process": "poisson", "rate": 20.0},
        "prompt_tokens": {"dist": "uniform", "min": 16, "max": 512},
        "output_tokens": {"dist": "uniform", "min": 8, "max": 128},
    },
    "allocators": [{"kind": "flat", "reserve": "max"}, {"kind": "paged", "block_size": 16}],
}


def make_sweep(tmp_path: Path, **fields) -> Path:
    """A sweep file over BASE (inline) with `fields` (axes, set, search, combine) beside it."""
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": BASE, **fields}, sort_keys=False))
    return path


def test_set_path_makes_mappings_indexes_lists_and_drops_the_other_budget():
    mapping = {"gpu_memory_utilization": 0.9, "allocators": [{"kind": "paged", "block_size": 16}]}
    set_path(mapping, "scheduler.max_num_seqs", 8)
    set_path(mapping, "allocators.0.block_size", 32)
    set_path(mapping, "kv_budget", "1GiB")
    assert mapping == {"allocators": [{"kind": "paged", "block_size": 32}], "scheduler": {"max_num_seqs": 8},
                       "kv_budget": "1GiB"}
    with pytest.raises(KeyError, match="no item 3"):
        set_path(mapping, "allocators.3.block_size", 8)


def test_grid_varies_the_last_axis_fastest_and_zip_pairs(tmp_path):
    axes = {"kv_budget": ["128MiB", "256MiB"], "requests.arrival.rate": [5, 10, 20]}
    grid = expand_points(load_sweep(make_sweep(tmp_path, axes=axes)))
    assert [dict(values) for values, _ in grid][:4] == [
        {"kv_budget": "128MiB", "requests.arrival.rate": 5}, {"kv_budget": "128MiB", "requests.arrival.rate": 10},
        {"kv_budget": "128MiB", "requests.arrival.rate": 20}, {"kv_budget": "256MiB", "requests.arrival.rate": 5}]
    assert len(grid) == 6 and grid[5][1]["requests"]["arrival"]["rate"] == 20 and grid[5][1]["kv_budget"] == "256MiB"
    axes = {"kv_budget": ["128MiB", "256MiB"], "requests.arrival.rate": [5, 10]}
    zipped = expand_points(load_sweep(make_sweep(tmp_path, axes=axes, combine="zip")))
    assert [dict(v) for v, _ in zipped] == [{"kv_budget": "128MiB", "requests.arrival.rate": 5},
                                            {"kv_budget": "256MiB", "requests.arrival.rate": 10}]
    with pytest.raises(KvsimError, match="combine: zip needs axes of one length"):
        load_sweep(make_sweep(tmp_path, axes={"kv_budget": ["1GiB"], "seed": [1, 2]}, combine="zip"))


def test_tasks_are_one_per_point_and_allocator_with_an_allocators_axis_as_labels(tmp_path):
    axes = {"allocators": [{"kind": "flat", "reserve": "pow2"}, [{"kind": "paged", "block_size": 8},
                                                                 {"kind": "paged", "block_size": 32}]]}
    tasks = make_tasks(load_sweep(make_sweep(tmp_path, axes=axes)), ACCOUNTING)
    assert [(t.point, t.allocator, dict(t.axis_values)["allocators"]) for t in tasks] == [
        (0, "flat-pow2", "flat-pow2"), (1, "paged-8", "paged-8+paged-32"), (1, "paged-32", "paged-8+paged-32")]
    assert all(len(t.workload["allocators"]) == 1 for t in tasks)
    assert len({t.key for t in tasks}) == 3


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        ({"kv_dtype": ["bf16", "fp9"]}, "axes.kv_dtype: kv_dtype = 'fp9': "),
        ({"requests.arrival.rate": [10, -1]}, "axes.requests.arrival.rate: requests.arrival.rate = -1: "),
        ({"model": ["qwen3-0.6b", "no-such-model"]}, "axes.model: model = 'no-such-model': "),
        ({"hardware": ["h100-80gb", "h999"]}, "axes.hardware: hardware = 'h999': "),
        ({"scheduler.max_num_seqs": [4, 0]}, "axes.scheduler.max_num_seqs: scheduler.max_num_seqs = 0: "),
        ({"allocators.1.block_size": [16, 0]}, "axes.allocators.1.block_size: allocators.1.block_size = 0: "),
        ({"allocators.5.block_size": [16]}, "axes.allocators.5.block_size: allocators.5.block_size = 16: "),
        # a tp that divides no head count is known before any replay (it was a failed row, exit 0)
        ({"deployment.tp": [1, 3]}, "axes.deployment.tp: deployment.tp = 3: "),
        # the model's allocator rules too (qwen3-0.6b keeps no state): it was a failed row, exit 0
        ({"allocators.1.mamba_cache_mode": ["align"]}, "axes.allocators.1.mamba_cache_mode: allocators.1.mamba_cache_mode = 'align': "),
        # a `set` value is named as such, not blamed on an axis (it was "axes.seed: seed = 1: ...")
        ({"seed": [1, 2], "set": {"requests.foo": 1}}, "set: requests.foo = 1: "),
        ({"seed": [1], "set": {"model": "no-such-model"}}, "set: model = 'no-such-model': "),
    ],
)
def test_a_bad_point_is_one_error_naming_its_axis_and_value_before_anything_runs(tmp_path, axes, message):
    fixed = axes.pop("set", None)
    path = make_sweep(tmp_path, axes=axes, **({"set": fixed} if fixed else {}))
    with pytest.raises(KvsimError) as info:
        make_tasks(load_sweep(path), ACCOUNTING)
    assert str(info.value).startswith(f"{path}: {message}")
    assert "\n" not in str(info.value)


def test_a_row_holds_the_axis_values_then_the_summary_of_kvsim_replay(tmp_path):
    """The sweep's row for a point equals the summary `kvsim replay` computes for the same workload."""
    path = make_sweep(tmp_path, axes={"kv_budget": ["128MiB"]})
    outcome = run_sweep(path, out=tmp_path / "out", workers=1)
    table = pd.read_parquet(outcome.paths[0])
    workload_file = tmp_path / "w.yaml"
    workload_file.write_text(yaml.safe_dump({**BASE, "kv_budget": "128MiB"}))
    expected = summary_records(run_replay(load_workload(workload_file), ACCOUNTING, workers=1), kernels=False)
    assert list(table.columns[:3]) == ["point", "kv_budget", "allocator"] and table.columns[-1] == "error"
    assert list(table["allocator"]) == ["flat-max", "paged-16"] and table["error"].isna().all()
    for (_, row), record in zip(table.iterrows(), expected):
        for key, value in record.items():
            if key != "allocator":
                assert row[key] == value or (pd.isna(row[key]) and pd.isna(value)), key
        assert row["preemptions_per_request"] == record["preemptions"] / 40
    # what `metrics:` may name is exactly the table's figures (the columns after the allocator but its labels and clock)
    figures = [c for c in table.columns[3:] if c not in ("model", "workload", "tp", "async_scheduling", "clock", "error")]
    assert sorted(figures) == sorted(TABLE_METRICS)


def test_a_failing_point_records_its_error_and_the_sweep_goes_on(tmp_path):
    # 1 KiB holds not one block: the replay refuses it at run time, after validation passed.
    path = make_sweep(tmp_path, axes={"kv_budget": ["1KiB", "128MiB"]})
    outcome = run_sweep(path, out=tmp_path / "out", workers=1)
    table = pd.read_parquet(outcome.paths[0])
    assert outcome.num_failed == 2 and len(table) == 4
    assert table["error"][:2].str.contains("holds not one").all() and table["error"][2:].isna().all()
    assert table["finished"][:2].isna().all() and list(table["finished"][2:]) == [0, 40]  # flat-max: no 2048-token slab fits


def test_rerun_skips_finished_rows_and_a_changed_point_reruns(tmp_path, monkeypatch):
    path = make_sweep(tmp_path, axes={"kv_budget": ["128MiB", "256MiB"]})
    first = run_sweep(path, out=tmp_path / "out", workers=1)
    before = first.paths[0].read_bytes()
    calls = []
    real = task_module.run_task
    monkeypatch.setattr("kvsim.sweep.runners.run_task", lambda t: calls.append(t.key) or real(t))
    again = run_sweep(path, out=tmp_path / "out", workers=1)
    assert (again.num_run, again.num_skipped, calls) == (0, 4, [])
    assert again.paths[0].read_bytes() == before
    path.write_text(path.read_text().replace("256MiB", "192MiB"))
    changed = run_sweep(path, out=tmp_path / "out", workers=1)
    assert (changed.num_run, changed.num_skipped, len(calls)) == (2, 2, 2)
    assert list(pd.read_parquet(changed.paths[0])["kv_budget"]) == ["128MiB"] * 2 + ["192MiB"] * 2
    monkeypatch.setattr("kvsim.sweep.points.code_fingerprint", lambda: "other kvsim code")
    recoded = run_sweep(path, out=tmp_path / "out", workers=1)  # rows of other code are stale: all rerun
    assert (recoded.num_run, recoded.num_skipped) == (4, 0)


def test_ctrl_c_keeps_every_finished_row_and_a_rerun_completes_the_same_table(tmp_path, monkeypatch):
    path = make_sweep(tmp_path, axes={"kv_budget": ["128MiB", "192MiB", "256MiB"]})
    whole = run_sweep(path, out=tmp_path / "whole", workers=1).paths[0].read_bytes()
    real = task_module.run_task
    count = {"n": 0}

    def interrupt_third(task):
        count["n"] += 1
        if count["n"] == 3:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr("kvsim.sweep.runners.run_task", interrupt_third)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(path, out=tmp_path / "out", workers=1)
    assert len(pd.read_parquet(tmp_path / "out" / "results.parquet")) == 2
    assert len((tmp_path / "out" / JOURNAL).read_text().splitlines()) == 2
    monkeypatch.setattr("kvsim.sweep.runners.run_task", real)
    resumed = run_sweep(path, out=tmp_path / "out", workers=1)
    assert (resumed.num_run, resumed.num_skipped) == (4, 2)
    assert resumed.paths[0].read_bytes() == whole


def test_a_line_cut_short_in_the_journal_reruns_its_task(tmp_path):
    path = make_sweep(tmp_path, axes={"kv_budget": ["128MiB"]})
    tasks = make_tasks(load_sweep(path), ACCOUNTING)
    out = tmp_path / "out"
    out.mkdir()
    (out / JOURNAL).write_text(json.dumps({"key": tasks[0].key, "row": {"point": 0}}) + "\n" + '{"key": "' + tasks[1].key)
    assert [t.key for t in Results(out, tasks).pending()] == [tasks[1].key]


def test_two_workers_write_the_same_table_as_one(tmp_path):
    path = make_sweep(tmp_path, axes={"kv_budget": ["128MiB", "256MiB"], "requests.arrival.rate": [10, 40]})
    one = run_sweep(path, out=tmp_path / "one", workers=1, csv=True)
    two = run_sweep(path, out=tmp_path / "two", workers=2, csv=True)
    assert [p.read_bytes() for p in one.paths] == [p.read_bytes() for p in two.paths]
    assert len(pd.read_parquet(one.paths[0])) == 8


@pytest.mark.parametrize("name", ["block-size-x-budget.yaml", "rate-x-allocator-capacity.yaml", "model-x-gpu-x-dtype.yaml"])
def test_shipped_sweeps_validate_every_point(name):
    spec = load_sweep(REPO / "workloads" / "sweeps" / name)
    tasks = make_tasks(spec, ACCOUNTING)
    assert tasks and len({t.key for t in tasks}) == len(tasks)


def test_the_sweep_package_imports_only_the_workload_and_replay_stages():
    """kvsim.sweep sits above the replay: it may import the workload reader, the replay and its summary,
    never the CLI, the charts or the engine's internals."""
    import ast

    allowed = {"kvsim.errors", "kvsim.out_paths", "kvsim.workload.yaml_fields", "kvsim.workload.yaml_file", "kvsim.replay.options", "kvsim.workload.spec", "kvsim.replay.run",
               "kvsim.replay.reports", "kvsim.models.catalogue", "kvsim.models.hardware"}
    for path in (REPO / "kvsim" / "sweep").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvsim"):
                assert node.module in allowed or node.module.startswith("kvsim.sweep"), (path.name, node.module)


def test_the_sweep_file_names_the_clock_and_the_flag_wins(tmp_path):
    """`timing:` is the replays' clock unless --timing names one; it reaches every task and sweep.json."""
    assert load_sweep(make_sweep(tmp_path, axes={"kv_budget": ["128MiB"]})).timing is None
    path = make_sweep(tmp_path, axes={"kv_budget": ["128MiB"]}, timing="auto")
    assert load_sweep(path).timing == "auto"
    outcome = run_sweep(path, out=tmp_path / "file", workers=1)
    assert json.loads((tmp_path / "file" / "sweep.json").read_text())["timing"] == "auto"
    flag = run_sweep(path, out=tmp_path / "flag", workers=1, timing="roofline")
    assert json.loads((tmp_path / "flag" / "sweep.json").read_text())["timing"] == "roofline"
    roofline = run_sweep(make_sweep(tmp_path, axes={"kv_budget": ["128MiB"]}), out=tmp_path / "plain", workers=1)
    assert pd.read_parquet(flag.paths[0]).equals(pd.read_parquet(roofline.paths[0]))  # the flag's clock, not the file's
    from kvsim.clock import kernels_db

    if not kernels_db.available():  # auto fell back to the roofline: the same table
        return
    ttft = pd.read_parquet(outcome.paths[0])["ttft_p99_s"]
    assert not ttft.equals(pd.read_parquet(roofline.paths[0])["ttft_p99_s"])


@pytest.mark.parametrize(
    ("timing", "message"),
    [
        ("fast", "timing: must be one of roofline, measured, kernels-db, auto; got 'fast'"),
        ("measured", "timing: measured timing needs the cache tensors (drop --no-tensors)"),
    ],
)
def test_a_bad_clock_in_the_sweep_file_names_the_file_and_field(tmp_path, timing, message):
    path = make_sweep(tmp_path, axes={"kv_budget": ["128MiB"]}, timing=timing)
    with pytest.raises(KvsimError) as info:
        run_sweep(path, out=tmp_path / "out", workers=1)
    assert str(info.value) == f"{path}: {message}"


@pytest.mark.parametrize(
    ("metrics", "search", "message"),
    [
        (["internal_fragmentaton_pct"], None, "'internal_fragmentaton_pct' is not a column of the table (did you mean internal_fragmentation_pct?)"),
        (["throughput_tokens_per_s", "nosuch"], None, "'nosuch' is not a column of the table; columns: budget_bytes, "),
        (["capacity"], None, "'capacity' is a column only of a sweep with a search"),
    ],
)
def test_a_metric_that_is_no_column_is_refused_when_the_sweep_is_read(tmp_path, metrics, search, message):
    # such a metric used to vanish from `kvsim plot`'s charts without a word
    path = make_sweep(tmp_path, axes={"kv_budget": ["128MiB"]}, metrics=metrics)
    with pytest.raises(KvsimError) as info:
        load_sweep(path)
    assert str(info.value).startswith(f"{path}: metrics: {message}")


def test_capacity_is_a_metric_of_a_sweep_with_a_search(tmp_path):
    search = {"axis": "requests.arrival.rate", "lo": 1, "hi": 4, "step": 1, "target": {"ttft_p99_s": 2.0}}
    assert load_sweep(make_sweep(tmp_path, search=search, metrics=["capacity", "ttft_p99_s"])).metrics == ("capacity", "ttft_p99_s")
