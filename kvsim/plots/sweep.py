"""Charts of a sweep table (results.parquet beside sweep.json): a metric against one axis, a heatmap for two
axes, and the capacity found per allocator as bars; written into the sweep's directory."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.errors import KvsimError
from kvsim.plots.report import MissingData
from kvsim.plots.style import allocator_colors, new_figure, titles

TABLE, META = "results.parquet", "sweep.json"
MAX_PANELS = 8  # small multiples per chart; more are cut with a note in the title
LABELS = {
    "throughput_tokens_per_s": "output tokens/s",
    "ttft_p99_s": "p99 time to first token (s)",
    "ttft_p50_s": "p50 time to first token (s)",
    "tpot_p50_s": "p50 time per output token (s)",
    "preemptions_per_request": "preemptions per request",
    "internal_fragmentation_pct": "internal fragmentation (% of budget)",
    "token_states_pct": "token states (% of budget)",
    "queue_growth_per_s": "waiting-queue growth (requests/s)",
    "capacity": "capacity",
    "mean_running": "mean running requests",
}


# A workload field swept or searched: what to call it on an axis, and its unit
AXIS_NAMES = {
    "requests.arrival.rate": ("arrival rate", "requests/s"),
    "requests.duration_s": ("duration of arrivals", "s"),
    "requests.arrival.every_s": ("burst interval", "s"),
    "requests.trace.time_scale": ("time scale", "x"),
    "requests.count": ("requests", "requests"),
    "max_model_len": ("max_model_len", "tokens"),
    "gpu_memory_utilization": ("gpu_memory_utilization", "fraction of GPU memory"),
}


def _axis_label(path: str) -> str:
    """`requests.arrival.rate` -> 'arrival rate (requests/s)'; a field without a known unit as itself."""
    name, unit = AXIS_NAMES.get(path, (path, None))
    return f"{name} ({unit})" if unit else name


def _label(metric: str, meta: dict) -> str:
    if metric == "capacity" and meta.get("search_axis"):
        return f"capacity: {_axis_label(meta['search_axis'])}"
    return LABELS.get(metric, metric)


def _clock(table: pd.DataFrame, meta: dict) -> str:
    """The clock the table's replays ran on (a table written before rows named it: the sweep's `timing`)."""
    if "clock" in table.columns and table["clock"].notna().any():
        clocks = list(dict.fromkeys(table["clock"].dropna()))
        return "clock " + " / ".join(str(c) for c in clocks)
    timing = meta.get("timing", "roofline")
    return "clock " + ("auto (kernels-db where it applies, else roofline)" if timing == "auto" else timing)


def is_sweep(path: Path) -> bool:
    return (Path(path) / TABLE).is_file()


def load_sweep_table(path: Path) -> tuple[pd.DataFrame, dict]:
    """The table (failed rows dropped) and the sweep's meta (axes, search axis, chart metrics)."""
    path = Path(path)
    try:
        table = pd.read_parquet(path / TABLE)
        meta = json.loads((path / META).read_text()) if (path / META).is_file() else {}
    except (OSError, ValueError) as exc:
        raise KvsimError(f"cannot read the sweep table: {exc}", source=str(path)) from None
    if not isinstance(meta, dict):
        raise KvsimError("expected a JSON object", source=str(path / META))
    meta.setdefault("axes", [c for c in table.columns[1: list(table.columns).index("allocator")]])
    meta.setdefault("metrics", ["throughput_tokens_per_s"])
    if "error" in table.columns:
        table = table[table["error"].isna()]
    if table.empty:
        raise MissingData("no finished rows in the table")
    return table.reset_index(drop=True), meta


def _axes(meta: dict) -> list[str]:
    return [a for a in meta["axes"] if a != "allocators"]  # the `allocator` column carries that one


def _metrics(table: pd.DataFrame, meta: dict) -> list[str]:
    metrics = [m for m in meta["metrics"] if m in table.columns]
    if not metrics:
        raise MissingData(f"none of the metrics {', '.join(meta['metrics'])} is a column of the table")
    return metrics


def _subtitle(table: pd.DataFrame, meta: dict) -> str:
    parts = [f"sweep {meta.get('name', '')}".strip()]
    for column in ("model", "workload"):
        if column in table.columns and table[column].nunique() == 1 and column not in meta["axes"]:
            parts.append(str(table[column].iloc[0]))
    if meta.get("search_target"):
        parts.append("target " + ", ".join(f"{m} <= {v:g}" for m, v in meta["search_target"].items()))
    return " · ".join(parts) + "\n" + _clock(table, meta)


def _positions(values: pd.Series) -> tuple[list, np.ndarray, bool]:
    """Distinct values in table order, and x positions: the numbers themselves, or 0, 1, ... for text."""
    order = list(dict.fromkeys(values))
    numeric = all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in order)
    return order, np.array(order if numeric else range(len(order)), dtype=float), numeric


def lines(table: pd.DataFrame, meta: dict):
    """Each metric (a row of panels) against the first axis: a line per allocator, or with more axes a panel
    per allocator and a line per value of the others."""
    axes = _axes(meta)
    if not axes:
        raise MissingData("no axis besides the allocators to draw against")
    metrics, x_axis, others = _metrics(table, meta), axes[0], axes[1:]
    allocators = list(dict.fromkeys(table["allocator"]))
    panels = allocators[:MAX_PANELS] if others else [None]
    order, xs, numeric = _positions(table[x_axis])
    fig, grid = new_figure(max(7.0, 3.6 * len(panels) + 2.5), 2.6 * len(metrics), nrows=len(metrics), ncols=len(panels),
                           sharex=True)
    colors = allocator_colors(allocators)
    for col, allocator in enumerate(panels):
        rows = table if allocator is None else table[table["allocator"] == allocator]
        series = ([(a, rows[rows["allocator"] == a], colors[a]) for a in allocators] if allocator is None else
                  [(" / ".join(map(str, key)), group, None) for key, group in rows.groupby(others, sort=False)])
        for r, metric in enumerate(metrics):
            ax = grid[r][col]
            for label, group, color in series:
                x = [xs[order.index(v)] for v in group[x_axis]]
                ax.plot(x, group[metric], marker="o", ms=3.5, label=label, color=color)
            if r == 0 and allocator is not None:
                ax.set_title(allocator)
            if col == 0:
                ax.set_ylabel(_label(metric, meta))
            if r == len(metrics) - 1:
                ax.set_xlabel(_axis_label(x_axis))
                if not numeric:
                    ax.set_xticks(xs, [str(v) for v in order])
    grid[0][-1].legend(title=" / ".join(others) if others else "allocator", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    at = " (at the capacity found)" if meta.get("search_axis") else ""
    titles(fig, f"The sweep's metrics{at} against {x_axis}", _subtitle(table, meta))
    return fig


def heatmap(table: pd.DataFrame, meta: dict):
    """The first metric over two axes (the second is the allocator when only one axis is swept): a panel per
    value of any further axes (and per allocator when it is not an axis of the map)."""
    axes = _axes(meta)
    metric = _metrics(table, meta)[0]
    if len(axes) == 1 and table["allocator"].nunique() > 1:
        rows_axis, cols_axis, facets = axes[0], "allocator", []
    elif len(axes) >= 2:
        rows_axis, cols_axis, facets = axes[0], axes[1], axes[2:] + ["allocator"]
    else:
        raise MissingData("a heatmap needs two axes (or one axis and several allocators)")
    groups = list(table.groupby(facets, sort=False)) if facets else [((), table)]
    groups = [(g, frame) for g, frame in groups if len(frame)][:MAX_PANELS]
    row_order, col_order = list(dict.fromkeys(table[rows_axis])), list(dict.fromkeys(table[cols_axis]))
    fig, grid = new_figure(1.2 * len(col_order) * len(groups) + 2.0, 0.55 * len(row_order) + 1.6,
                           ncols=len(groups))
    values = table[metric].astype(float)
    vmin, vmax = float(values.min()), float(values.max())
    for ax, (key, frame) in zip(grid[0], groups):
        cells = np.full((len(row_order), len(col_order)), np.nan)  # (rows axis values, cols axis values)
        for _, row in frame.iterrows():
            cells[row_order.index(row[rows_axis]), col_order.index(row[cols_axis])] = row[metric]
        image = ax.imshow(cells, cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto")
        for (i, j), v in np.ndenumerate(cells):
            if not np.isnan(v):
                light = (v - vmin) / (vmax - vmin or 1) > 0.6
                ax.text(j, i, _cell(v), ha="center", va="center", fontsize=8, color="black" if light else "white")
        ax.set_xticks(range(len(col_order)), [str(v) for v in col_order], rotation=30, ha="right")
        ax.set_yticks(range(len(row_order)), [str(v) for v in row_order])
        ax.set_xlabel(cols_axis)
        ax.grid(False)
        key = key if isinstance(key, tuple) else (key,)
        if key:
            ax.set_title(" / ".join(map(str, key)))
    grid[0][0].set_ylabel(rows_axis)
    fig.colorbar(image, ax=grid[0].tolist(), label=_label(metric, meta), shrink=0.9)
    titles(fig, f"{_label(metric, meta)} over {rows_axis} and {cols_axis}", _subtitle(table, meta))
    return fig


def _cell(v: float) -> str:
    """A heatmap cell's figure: whole numbers with thousands separators from 100 up, 3 digits below."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def capacity(table: pd.DataFrame, meta: dict):
    """The capacity each allocator holds, a bar per allocator in groups of the other axes' values; a search
    that hit hi is marked >=, one that failed at lo is an empty bar marked < lo."""
    if "capacity" not in table.columns:
        raise MissingData("no capacity column (the sweep has no search)")
    axes = _axes(meta)
    allocators = list(dict.fromkeys(table["allocator"]))
    points = list(dict.fromkeys(tuple(row) for row in table[axes].itertuples(index=False))) if axes else [()]
    colors = allocator_colors(allocators)
    fig, grid = new_figure(max(5.0, 0.55 * len(points) * len(allocators) + 2.5), 3.6)
    ax = grid[0][0]
    width = 0.8 / len(allocators)
    for i, allocator in enumerate(allocators):
        rows = table[table["allocator"] == allocator]
        for _, row in rows.iterrows():
            p = points.index(tuple(row[a] for a in axes)) if axes else 0
            x = p + (i - (len(allocators) - 1) / 2) * width
            value = 0.0 if pd.isna(row["capacity"]) else float(row["capacity"])
            ax.bar(x, value, width * 0.92, color=colors[allocator], label=allocator if p == 0 else None)
            text = {"at hi": f">={value:g}", "below lo": "< lo"}.get(row.get("capacity_status"), f"{value:g}")
            ax.text(x, value, text, ha="center", va="bottom", fontsize=7.5)
    ax.set_xticks(range(len(points)), [" / ".join(map(str, p)) for p in points])
    ax.set_xlabel(" / ".join(_axis_label(a) for a in axes))
    searched = _axis_label(meta["search_axis"]) if meta.get("search_axis") else "capacity"
    ax.set_ylabel(f"largest {searched}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), title="allocator")
    titles(fig, f"Capacity: the largest {searched} meeting the target", _subtitle(table, meta))
    return fig


CHARTS = (("sweep-lines", lines), ("sweep-heatmap", heatmap), ("sweep-capacity", capacity))
