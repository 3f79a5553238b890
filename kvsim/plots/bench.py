"""Chart 6: what paging costs in the kernels (`kvsim bench kernels` CSVs): time and % of roofline, paged vs
contiguous, against context length and against block size.

Paged kernels are solid lines, contiguous ones dashed; the roofline is the copy (writes) or read-only
reduction (decode) measured in the same run, so 100% means "as fast as this device moves the bytes".
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from matplotlib.transforms import offset_copy

from kvsim.plots.report import MissingData, Report
from kvsim.plots.style import allocator_colors, new_figure, titles

KERNEL_COLUMNS = ("op", "kernel", "context_len", "block_size", "batch_size", "median_us", "pct_of_roofline")
CONTIGUOUS_KERNELS = ("sdpa_contiguous", "flex_contiguous")  # the rest read or write through a block table
OPS = (("write", "K/V write (scatter through the slot mapping)"), ("decode", "decode attention"))
PREFERRED_BLOCK_SIZE = 16  # vLLM's default: the block size the vs-context chart shows


def kernel_rows(report: Report, stem: str) -> pd.DataFrame:
    """The successful kernel rows of bench CSV `stem` (roofline rows dropped), else MissingData."""
    frame = report.bench[stem]
    missing = [c for c in KERNEL_COLUMNS if c not in frame.columns]
    if missing:
        raise MissingData(f"{stem}.csv is not a kernel bench CSV (lacks {', '.join(missing)})")
    ok = frame["status"].astype(str).eq("ok") if "status" in frame.columns else True
    rows = frame[ok & frame["op"].isin([op for op, _ in OPS]) & frame["median_us"].notna()]
    if rows.empty:
        raise MissingData(f"{stem}.csv has no successful write or decode rows")
    return rows


def _subtitle(rows: pd.DataFrame, extra: str) -> str:
    parts = []
    for column, prefix in (("model", "model "), ("device", ""), ("kv_dtype", "KV ")):
        if column in rows.columns and rows[column].notna().any():
            parts.append(prefix + str(rows[column].dropna().iloc[0]))
    return " · ".join([*parts, extra])


def _grid(title: str, subtitle: str, xlabel: str):
    fig, axes = new_figure(11.0, 7.0, nrows=2, ncols=2, sharex=True)
    for col, (_op, label) in enumerate(OPS):
        axes[0, col].set_title(label, loc="left")
        axes[0, col].set_ylabel("median kernel time (µs, log scale)")
        axes[0, col].set_yscale("log")
        axes[1, col].set_ylabel("achieved bandwidth (% of roofline)")
        axes[1, col].set_xlabel(xlabel)
        axes[1, col].axhline(100, color="#999999", linewidth=0.8, linestyle=":")
        axes[1, col].set_xscale("log", base=2)
    titles(fig, title, subtitle)
    return fig, axes


def _line(ax_time, ax_pct, x, rows: pd.DataFrame, kernel: str, color: str, marker: str = "o") -> None:
    style = "--" if kernel in CONTIGUOUS_KERNELS else "-"
    kind = "contiguous" if kernel in CONTIGUOUS_KERNELS else "paged"
    label = f"{kernel} ({kind})"
    ax_time.plot(x, rows["median_us"], linestyle=style, marker=marker, color=color, label=label, gid=f"time:{kernel}")
    ax_pct.plot(x, rows["pct_of_roofline"], linestyle=style, marker=marker, color=color, label=label,
                gid=f"pct:{kernel}")


def _ticks(axes, values) -> None:
    values = sorted({int(v) for v in values})
    for ax in axes[1, :]:
        ax.set_xticks(values, [f"{v // 1024}k" if v >= 1024 and v % 1024 == 0 else str(v) for v in values])
        ax.minorticks_off()


def _finish(fig, axes) -> None:
    """Readable time ticks (10, 20, 50 µs ...), % axis from 0 past 100, a legend under each column."""
    for col in range(axes.shape[1]):
        time_ax, pct_ax = axes[0, col], axes[1, col]
        time_ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        time_ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        time_ax.yaxis.set_minor_formatter(NullFormatter())
        top = max((np.nanmax(line.get_ydata()) for line in pct_ax.get_lines() if len(line.get_ydata())), default=100)
        pct_ax.set_ylim(0, max(105.0, float(top) * 1.05))
        below = offset_copy(pct_ax.transAxes, fig=fig, y=-36, units="points")
        pct_ax.legend(*time_ax.get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(0.0, 0.0),
                      bbox_transform=below, fontsize=8.5)


def vs_context(report: Report, stem: str):
    """Kernel time and % of roofline against context length, at block size 16 and the largest batch."""
    rows = kernel_rows(report, stem)
    batch = int(rows["batch_size"].max())
    rows = rows[rows["batch_size"] == batch]
    sizes = rows["block_size"].dropna().unique()
    block = PREFERRED_BLOCK_SIZE if PREFERRED_BLOCK_SIZE in sizes else (int(sorted(sizes)[len(sizes) // 2]) if len(sizes) else None)
    rows = rows[rows["block_size"].isna() | (rows["block_size"] == block)]
    contexts = rows["context_len"].unique()
    if len(contexts) < 2:
        raise MissingData(f"{stem}.csv has one context length (bench with several --context values)")
    kernels = list(dict.fromkeys(rows["kernel"]))
    colors = allocator_colors(kernels)
    fig, axes = _grid("Kernel cost vs context length: paged (solid) vs contiguous (dashed)",
                      _subtitle(rows, f"batch {batch} · block size {block}"), "context length (tokens, log scale)")
    for col, (op, _label) in enumerate(OPS):
        for kernel in kernels:
            k = rows[(rows["op"] == op) & (rows["kernel"] == kernel)].sort_values("context_len")
            if len(k):
                _line(axes[0, col], axes[1, col], k["context_len"].to_numpy(), k, kernel, colors[kernel])
    _ticks(axes, contexts)
    _finish(fig, axes)
    return fig


def vs_block_size(report: Report, stem: str):
    """Kernel time and % of roofline against block size, at the largest context and batch; contiguous as
    horizontal dashed references (they have no blocks)."""
    rows = kernel_rows(report, stem)
    context, batch = int(rows["context_len"].max()), int(rows["batch_size"].max())
    rows = rows[(rows["context_len"] == context) & (rows["batch_size"] == batch)]
    sizes = np.sort(rows["block_size"].dropna().unique())
    if len(sizes) < 2:
        raise MissingData(f"{stem}.csv has fewer than two block sizes")
    kernels = list(dict.fromkeys(rows["kernel"]))
    colors = allocator_colors(kernels)
    fig, axes = _grid("Kernel cost vs block size: paged (solid) vs contiguous (dashed)",
                      _subtitle(rows, f"batch {batch} · context {context} tokens"), "block size (tokens per block, log scale)")
    for col, (op, _label) in enumerate(OPS):
        for kernel in kernels:
            k = rows[(rows["op"] == op) & (rows["kernel"] == kernel)]
            if k.empty:
                continue
            if k["block_size"].isna().all():  # no blocks at all: one measurement, drawn across
                k = pd.concat([k.iloc[[0]]] * len(sizes))
                _line(axes[0, col], axes[1, col], sizes, k, kernel, colors[kernel], marker="")
            else:
                k = k.dropna(subset=["block_size"]).sort_values("block_size")
                _line(axes[0, col], axes[1, col], k["block_size"].to_numpy(), k, kernel, colors[kernel])
    _ticks(axes, sizes)
    _finish(fig, axes)
    return fig
