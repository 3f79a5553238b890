"""The report files written through Arrow are the bytes pandas writes: Parquet with pandas' schema metadata, CSV,
and summary.csv as `to_csv` formats it; where pandas would type a column its own way, the writers say so."""

from __future__ import annotations

import io
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pa_csv
import pytest

from kvsim.replay import tables
from kvsim.replay.options import ReplayOptions
from kvsim.replay.reports import (
    SUMMARY_FLOAT_FORMAT, kernels_frame, requests_frame, steps_frame, summary_records, write_reports,
)
from kvsim.replay.run import run_replay
from kvsim.workload.spec import load_workload

from tests.replay.test_replay import write_tiny
from tests.replay.test_reports import hand_result

PANDAS_3 = int(pd.__version__.split(".")[0]) == 3


def pandas_csv(frame: pd.DataFrame, path) -> bytes:
    """What reports wrote before: the frame through Arrow's CSV writer."""
    pa_csv.write_csv(pa.Table.from_pandas(frame, preserve_index=False), path,
                     write_options=pa_csv.WriteOptions(quoting_style="needed"))
    return path.read_bytes()


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    """Three allocators' replay of the tiny workload (a prefix-cached one among them)."""
    path = write_tiny(tmp_path_factory.mktemp("tiny"), budget_tokens=440, count=16)
    return run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1)


@pytest.mark.skipif(not PANDAS_3, reason="the Arrow writer copies pandas 3's metadata; other pandas write through pandas")
def test_steps_parquet_is_the_file_pandas_writes(tiny_result, tmp_path):
    paths = write_reports(tiny_result, tmp_path / "out")
    steps_frame(tiny_result, kernels=False).to_parquet(tmp_path / "pandas.parquet", index=False)
    assert paths.steps.read_bytes() == (tmp_path / "pandas.parquet").read_bytes()
    assert len(pd.read_parquet(paths.steps)) == sum(len(run.steps["step"]) for run in tiny_result.runs) > 3


@pytest.mark.skipif(not PANDAS_3, reason="the Arrow writer copies pandas 3's metadata; other pandas write through pandas")
def test_kernels_parquet_with_missing_times_is_the_file_pandas_writes(tmp_path):
    result = hand_result()  # read_us and attention_us have NaN rows: nulls in Arrow, as pandas hands them over
    from kvsim.replay.reports import _write_parquet, kernels_columns

    _write_parquet(kernels_columns(result), tmp_path / "kernels.parquet")
    kernels_frame(result).to_parquet(tmp_path / "pandas.parquet", index=False)
    assert (tmp_path / "kernels.parquet").read_bytes() == (tmp_path / "pandas.parquet").read_bytes()
    assert pd.read_parquet(tmp_path / "kernels.parquet")["attention_us"].isna().all()


def test_requests_csv_is_the_csv_of_the_pandas_frame(tiny_result, tmp_path):
    paths = write_reports(tiny_result, tmp_path / "out", csv=True)
    assert paths.requests.read_bytes() == pandas_csv(requests_frame(tiny_result), tmp_path / "requests.csv")
    assert paths.steps_csv.read_bytes() == pandas_csv(steps_frame(tiny_result), tmp_path / "steps.csv")
    # a rejected request's reason (text with None around it), and NaN times of a request never admitted
    result = hand_result()
    columns = _joined_requests(result)
    assert columns["rejected_reason"] == [None, None, "too long"]
    assert tables.write_csv(columns, tmp_path / "hand.csv")
    assert (tmp_path / "hand.csv").read_bytes() == pandas_csv(requests_frame(result), tmp_path / "hand-pandas.csv")
    text = (tmp_path / "hand.csv").read_text().splitlines()
    assert text[3].endswith(',"too long"') and ",,," in text[3]  # NaN admitted/first token/finished: empty fields


def _joined_requests(result):
    from kvsim.replay.reports import _joined, requests_columns

    return _joined(requests_columns(result))


def test_summary_csv_is_pandas_to_csv():
    records = [
        {"allocator": "paged-16", "async": True, "n": 3, "x": 1 / 3, "y": math.nan, "z": 2e10, "w": math.inf, "q": 'a,"b"'},
        {"allocator": "flat-max", "async": False, "n": np.int64(-4), "x": np.float64(0.0), "y": 1e-7, "z": 5.0, "w": -0.5,
         "q": "c"},
    ]
    expected = pd.DataFrame(records).to_csv(index=False, float_format=SUMMARY_FLOAT_FORMAT)
    assert tables.summary_csv(records, SUMMARY_FLOAT_FORMAT) == expected
    assert "paged-16,True,3,0.333333,,2e+10,inf," in expected  # the hand-checked row: NaN empty, %.6g, True


@pytest.mark.parametrize("second", [
    {"allocator": "b", "n": 2.5},  # ints and floats: pandas makes the column float, and prints 3 as 3 through %.6g
    {"allocator": "b"},  # a gap: NaN, and a float column
    {"n": 2, "allocator": "b"},  # another column order
    {"allocator": None, "n": 2},  # text and None
])
def test_summary_csv_leaves_columns_pandas_types_its_own_way_to_pandas(second):
    assert tables.summary_csv([{"allocator": "a", "n": 3}, second], SUMMARY_FLOAT_FORMAT) is None


def test_summary_csv_of_a_replay_is_pandas_to_csv(tiny_result, tmp_path):
    paths = write_reports(tiny_result, tmp_path / "out")
    records = summary_records(tiny_result, kernels=False)
    assert paths.summary_csv.read_text() == pd.DataFrame(records).to_csv(index=False, float_format=SUMMARY_FLOAT_FORMAT)


def test_columns_arrow_does_not_take_are_refused():
    assert tables.arrow_table({"a": np.arange(3, dtype=np.int32)}) is None
    assert tables.arrow_table({"a": np.zeros((2, 2))}) is None
    assert not tables.write_parquet({"a": np.arange(3, dtype=np.int32)}, io.BytesIO())
    table = tables.arrow_table({"a": [None, None], "b": np.array([1.0, math.nan])})
    assert table.column("a").type == pa.null() and table.column("b").null_count == 1


def test_allocators_with_different_columns_are_written_by_pandas_as_before(tmp_path):
    """A CPU tier's columns on one allocator only: pandas' concat fills the other's with NaN (floats), as the
    frames of each allocator concatenated always did."""
    from dataclasses import replace

    from kvsim.replay.records import OFFLOAD_COLUMNS

    result = hand_result()
    plain = result.runs[0]
    tiered = replace(plain, label="paged-16+prefix+cpu", offload={
        "cpu_hit_tokens": 3, "cpu_loaded_bytes": 4, "cpu_stored_bytes": 5, "cpu_load_wait_s": 0.5,
        "steps": {name: np.array([1, 2], dtype=np.int64) for name in OFFLOAD_COLUMNS}})
    result.runs = [plain, tiered]
    paths = write_reports(result, tmp_path / "out", csv=True)
    steps_parquet_before(result, tmp_path / "before.parquet")
    assert paths.steps.read_bytes() == (tmp_path / "before.parquet").read_bytes()
    steps = pd.read_parquet(paths.steps)
    assert steps["cpu_hit_tokens"].isna().tolist() == [True, True, False, False]
    assert pd.read_csv(paths.summary_csv)["cpu_hit_tokens"].isna().tolist() == [True, False]


@pytest.mark.skipif(not PANDAS_3, reason="the Arrow writer copies pandas 3's metadata; other pandas write through pandas")
@pytest.mark.parametrize("tiered", [False, True], ids=["arrow", "pandas"])
def test_a_replay_without_rows_keeps_its_allocator_column_text(tmp_path, tiered):
    """Every request rejected: no allocator has a row. The label column stays text (large_string), as the frames
    built before the Arrow writer had it (`insert` of the label), through Arrow and through pandas' fallback
    (a CPU tier's columns on one allocator: different columns)."""
    from dataclasses import replace

    from kvsim.replay.records import OFFLOAD_COLUMNS

    result = hand_result()
    empty = {name: column[:0] for name, column in result.runs[0].steps.items()}
    runs = [replace(run, steps=dict(empty)) for run in result.runs]
    if tiered:
        runs[-1] = replace(runs[-1], label="paged-16+prefix+cpu", offload={
            "cpu_hit_tokens": 0, "cpu_loaded_bytes": 0, "cpu_stored_bytes": 0, "cpu_load_wait_s": 0.0,
            "steps": {name: np.zeros(0, dtype=np.int64) for name in OFFLOAD_COLUMNS}})
    result.runs = runs
    paths = write_reports(result, tmp_path / "out")
    steps_parquet_before(result, tmp_path / "before.parquet")
    assert paths.steps.read_bytes() == (tmp_path / "before.parquet").read_bytes()
    assert pa.parquet.read_schema(paths.steps).field("allocator").type == pa.large_string()


def steps_parquet_before(result, path) -> None:
    """steps.parquet as reports wrote it before the Arrow writer: a frame per allocator (the label inserted as a
    scalar, a CPU tier's columns added), pandas' concat, `to_parquet`."""
    frames = []
    for run in result.runs:
        frame = pd.DataFrame({name: run.steps[name] for name in run.steps if not name.endswith("_us")})
        for name, column in (run.offload or {"steps": {}})["steps"].items():
            frame[name] = column
        frame.insert(0, "allocator", run.label)
        frames.append(frame)
    pd.concat(frames, ignore_index=True).to_parquet(path, index=False)
