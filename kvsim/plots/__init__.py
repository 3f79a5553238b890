"""`kvsim plot`: matplotlib charts (headless) written next to the reports they draw.

A replay report gets charts 1-5, a kernel-bench directory chart 6; a chart whose data a report lacks is
skipped with a one-line note. `plot_size` draws chart 7 straight from `kvsim.size.sizing`. Plots read report
files and may import the earlier stages (`models`, `size`, the replay's report columns), nothing later.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable, Iterable

from kvsim.errors import KvsimError
from kvsim.plots.report import MissingData, Report, find_reports, load_report

DEFAULT_ROOT = Path("reports")

Note = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def _replay_charts():
    from kvsim.plots import latency, prefill_sources, timeline, waste

    return (
        ("waste-curves", waste.waste_curves),
        ("figure2", waste.figure2),
        ("block-sizes", waste.block_sizes),
        ("timeline", timeline.timeline),
        ("latency", latency.latency),
        ("prefill-sources", prefill_sources.prefill_sources),  # with a CPU tier only (its step columns)
    )


def _bench_charts(report: Report):
    """Two charts per kernel-bench CSV, named after it: bench-context-<csv>, bench-block-size-<csv>."""
    from kvsim.plots import bench

    charts = []
    for stem in report.bench:
        charts.append((f"bench-context-{stem}", functools.partial(bench.vs_context, stem=stem)))
        charts.append((f"bench-block-size-{stem}", functools.partial(bench.vs_block_size, stem=stem)))
    return tuple(charts)


def plot_report(report: Report, fmt: str = "png", *, note: Note = _stderr) -> list[Path]:
    """Every chart `report` has the data for, written into its directory as `<chart>.<fmt>`."""
    from kvsim.plots.style import check_format, save

    fmt = check_format(fmt)
    if report.is_replay:
        charts = _replay_charts()
        if report.steps is None or "cpu_hit_tokens" not in report.steps.columns:  # no CPU tier: no chart, no note
            charts = tuple(chart for chart in charts if chart[0] != "prefill-sources")
    elif report.bench:
        charts = _bench_charts(report)
    else:
        note(f"{report.path}: skipped: no replay or bench report files")
        return []
    written = []
    for stem, draw in charts:
        try:
            fig = draw(report)
        except MissingData as why:
            note(f"{report.path}: skipped {stem}: {why}")
            continue
        written.append(save(fig, report.path / f"{stem}.{fmt}"))
    return written


def plot_reports(dirs: Iterable[str | Path] | None = None, fmt: str = "png", *, note: Note = _stderr) -> list[Path]:
    """Charts for each report directory in `dirs` (default: every report under reports/); the paths written."""
    dirs = list(dirs or [])
    if not dirs:
        dirs = find_reports(DEFAULT_ROOT)
        if not dirs:
            raise KvsimError("no reports found (run `kvsim replay workloads/poisson.yaml` first)", source="reports/")
    written = []
    for directory in dirs:
        if (Path(directory) / "results.parquet").is_file():  # a `kvsim sweep` table
            written += plot_sweep(directory, fmt, note=note)
            continue
        written += plot_report(load_report(directory), fmt, note=note)
    return written


def plot_sweep(directory: str | Path, fmt: str = "png", *, note: Note = _stderr) -> list[Path]:
    """The charts of a sweep table that its axes allow (lines, heatmap, capacity bars), written beside it."""
    from kvsim.plots import sweep
    from kvsim.plots.style import check_format, save

    fmt = check_format(fmt)
    directory = Path(directory)
    try:
        table, meta = sweep.load_sweep_table(directory)
    except MissingData as why:
        note(f"{directory}: skipped: {why}")
        return []
    written = []
    for stem, draw in sweep.CHARTS:
        try:
            fig = draw(table, meta)
        except MissingData as why:
            note(f"{directory}: skipped {stem}: {why}")
            continue
        written.append(save(fig, directory / f"{stem}.{fmt}"))
    return written


def plot_size(models: list[str], fmt: str = "png", *, out_dir: str | Path = DEFAULT_ROOT / "size", **options) -> list[Path]:
    """Chart 7: bytes per sequence vs context length for `models`, written under `out_dir`."""
    from kvsim.plots import size
    from kvsim.plots.style import check_format, save

    fmt = check_format(fmt)
    if not models:
        raise KvsimError("name at least one model", field="--model")
    fig = size.bytes_per_sequence(models, **options)
    stem = "size-" + "-vs-".join(m.replace("/", "_") for m in models)
    return [save(fig, Path(out_dir) / f"{stem}.{fmt}")]


def plot(targets: list[str] | None, fmt: str = "png", *, models: list[str] | None = None, note: Note = _stderr,
         **size_options) -> list[Path]:
    """What `kvsim plot` does: `size` (or just --model) draws chart 7, anything else names report directories."""
    targets = list(targets or [])
    models = list(models or [])
    if (targets[:1] == ["size"] and not Path("size").is_dir()) or (models and not targets):
        if targets[1:]:
            raise KvsimError(f"`kvsim plot size` takes no report directories, got {' '.join(targets[1:])}")
        return plot_size(models, fmt, **size_options)
    if models:
        raise KvsimError("--model draws sizes: use `kvsim plot size --model NAME`", field="--model")
    return plot_reports(targets, fmt, note=note)
