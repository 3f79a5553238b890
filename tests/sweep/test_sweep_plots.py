"""Sweep charts: written by `kvsim plot` for a sweep table, drawing the table's own numbers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvsim.plots import plot
from kvsim.plots.sweep import capacity, heatmap, lines, load_sweep_table
from kvsim.sweep.view import run_sweep
from tests.sweep.test_sweep import make_sweep


@pytest.fixture(scope="module")
def grid_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grid")
    path = make_sweep(tmp, axes={"kv_budget": ["1KiB", "128MiB", "256MiB"], "requests.arrival.rate": [10, 40]},
                      metrics=["throughput_tokens_per_s", "ttft_p99_s"])
    return run_sweep(path, out=tmp / "out", workers=1).paths[0].parent


def test_plot_writes_lines_and_heatmap_and_notes_the_missing_capacity(grid_sweep):
    notes = []
    written = plot([str(grid_sweep)], note=notes.append)
    assert [p.name for p in written] == ["sweep-lines.png", "sweep-heatmap.png"]
    assert notes == [f"{grid_sweep}: skipped sweep-capacity: no capacity column (the sweep has no search)"]


def test_failed_rows_are_left_out_and_the_heatmap_cells_are_the_table(grid_sweep):
    import matplotlib.pyplot as plt

    table, meta = load_sweep_table(grid_sweep)
    assert len(table) == 8 and "1KiB" not in set(table["kv_budget"])  # 1 KiB rows failed: not drawn
    fig = heatmap(table, meta)
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in panels] == ["flat-max", "paged-16"]
    for ax, allocator in zip(panels, ["flat-max", "paged-16"]):
        cells = ax.images[0].get_array()  # (kv_budget values, rates)
        rows = table[table["allocator"] == allocator]
        expected = rows["throughput_tokens_per_s"].to_numpy().reshape(2, 2)
        np.testing.assert_allclose(np.ma.filled(cells, np.nan), expected, equal_nan=True)
    plt.close(fig)
    fig = lines(table, meta)
    first = fig.axes[0]  # paged panels: a line per rate, x = the kv_budget values
    assert [line.get_label() for line in first.lines] == ["10", "40"]
    np.testing.assert_allclose(first.lines[0].get_ydata(), table[(table["allocator"] == "flat-max") &
                               (table["requests.arrival.rate"] == 10)]["throughput_tokens_per_s"])
    plt.close(fig)


def test_capacity_bars_are_the_capacities_found(tmp_path):
    import matplotlib.pyplot as plt

    search = {"axis": "requests.arrival.rate", "lo": 4, "hi": 120, "step": 4, "target": {"ttft_p99_s": 0.1}}
    path = make_sweep(tmp_path, axes={"kv_budget": ["64MiB", "96MiB"]}, search=search)
    out = run_sweep(path, out=tmp_path / "out", workers=1).paths[0].parent
    table, meta = load_sweep_table(out)
    fig = capacity(table, meta)
    heights = [patch.get_height() for patch in fig.axes[0].patches]
    expected = pd.concat([table[table["allocator"] == a] for a in ["flat-max", "paged-16"]])["capacity"]
    assert heights == [0.0 if pd.isna(v) else v for v in expected]
    assert "< lo" in [t.get_text() for t in fig.axes[0].texts]  # flat-max: not one 2048-token slab in 64 MiB
    # the clock and the rate's unit: a capacity differs several-fold between clocks
    assert set(table["clock"].dropna()) == {"roofline"}  # a search that found nothing has no replay
    assert fig.kvsim_subtitle.endswith("\nclock roofline")
    assert fig.axes[0].get_ylabel() == "largest arrival rate (requests/s)"
    assert fig.kvsim_title == "Capacity: the largest arrival rate (requests/s) meeting the target"
    plt.close(fig)
    fig = lines(table, {**meta, "metrics": ["capacity", "throughput_tokens_per_s"]})
    assert fig.axes[0].get_ylabel() == "capacity: arrival rate (requests/s)" and fig.kvsim_subtitle.endswith("clock roofline")
    plt.close(fig)
    # a table written before rows named their clock: the sweep's timing
    fig = capacity(table.drop(columns="clock"), {**meta, "timing": "auto"})
    assert fig.kvsim_subtitle.endswith("\nclock auto (kernels-db where it applies, else roofline)")
    plt.close(fig)
