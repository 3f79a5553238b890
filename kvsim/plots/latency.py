"""Chart 5: TTFT and TPOT distributions per allocator, as empirical CDFs (read a percentile off the y axis)."""

from __future__ import annotations

import numpy as np
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from matplotlib.transforms import offset_copy

from kvsim.plots.report import MissingData, Report
from kvsim.plots.style import allocator_colors, new_figure, titles


MAX_POINTS = 2000  # points per CDF line: a 20k-request trace keeps its shape at a tenth of the file size


def ecdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted finite values and the fraction of requests at or below each (NaN = rejected, dropped).

    Beyond MAX_POINTS requests, evenly spaced ranks are kept (always the first and last), which are exact
    points of the same CDF.
    """
    values = np.sort(values[np.isfinite(values)])
    fractions = np.arange(1, len(values) + 1) / max(len(values), 1)
    if len(values) > MAX_POINTS:
        keep = np.unique(np.linspace(0, len(values) - 1, MAX_POINTS).round().astype(int))
        return values[keep], fractions[keep]
    return values, fractions


def _log_scale_if_wide(ax, values: list[np.ndarray], *, always: bool = False) -> None:
    """Log x when the data span more than 10x (or `always`), so the bulk and a long tail both stay readable."""
    positive = np.concatenate([v[v > 0] for v in values]) if values else np.array([])
    if len(positive) and (always or positive.max() / positive.min() > 10):
        ax.set_xscale("log")
        decades = np.log10(positive.max() / positive.min())
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0,) if decades > 2.5 else (1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())


def rows_of(frame, label: str):
    """The rows of one allocator."""
    return frame[frame["allocator"].astype(str) == label]


def latency(report: Report):
    """Two panels: CDF of time to first token (s) and of time per output token (ms), a line per allocator."""
    requests = report.table("requests", ("allocator", "ttft_s", "tpot_s"))
    if not np.isfinite(requests["ttft_s"].to_numpy(float)).any():
        raise MissingData("requests.csv has no finished request (every one rejected?)")
    colors = allocator_colors(report.allocators)
    fig, axes = new_figure(11.0, 4.0 + 0.2 * len(report.allocators), ncols=2)
    panels = ((axes[0, 0], "ttft_s", 1.0, "time to first token, TTFT (s)", "s"),
              (axes[0, 1], "tpot_s", 1000.0, "time per output token, TPOT (ms)", "ms"))
    for ax, column, scale, xlabel, unit in panels:
        drawn = []
        for label in report.allocators:
            values = rows_of(requests, label)[column].to_numpy(float) * scale
            x, y = ecdf(values)
            if not len(x):
                continue
            drawn.append(x)
            p50, p99 = np.percentile(values[np.isfinite(values)], [50, 99])  # all of them, as summary.csv
            ax.plot(x, y, drawstyle="steps-post", color=colors[label], linewidth=1.5, gid=f"{column}:{label}",
                    marker="o" if len(x) < 3 else None,  # one or two requests: a step line alone would not show
                    label=f"{label}: p50 {p50:.3g} {unit}, p99 {p99:.3g} {unit}")
        # TPOT is always on a log axis, so runs compare at a glance; TTFT only when it spans more than 10x.
        _log_scale_if_wide(ax, drawn, always=column == "tpot_s")
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            ax.axhline(q, color="#999999", linewidth=0.7, linestyle=":", gid=f"guide:{name}")
            ax.text(1.0, q, f" {name}", transform=ax.get_yaxis_transform(), ha="left", va="center", fontsize=8,
                    color="#777777")
        ax.set_ylim(0, 1.01)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of finished requests")
        if not drawn:  # e.g. TPOT when no finished request produced an output token
            ax.text(0.5, 0.5, "no finished request to show", transform=ax.transAxes, ha="center", va="center",
                    color="#777777")
            continue
        # below the x label (an offset in points, whatever the figure size): never over a curve
        below = offset_copy(ax.transAxes, fig=fig, y=-36, units="points")
        ax.legend(loc="upper left", bbox_to_anchor=(0.0, 0.0), bbox_transform=below, fontsize=8.5)
    axes[0, 0].set_title("TTFT: queueing + prefill", loc="left")
    axes[0, 1].set_title("TPOT: decode step time under the batch", loc="left")
    clock = report.meta.get("clock")  # which step clock the latencies come from (roofline, kernels-db ...)
    subtitle = report.subtitle() + (f" · clock {clock}" if clock else "")
    titles(fig, "Latency per allocator: cumulative distributions of TTFT and TPOT", subtitle)
    return fig
