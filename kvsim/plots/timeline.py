"""Chart 4: running requests and queue length over simulated time per allocator, preemptions as marks.

What paging buys is concurrency: the same budget runs more requests at once, so the queue drains sooner.
"""

from __future__ import annotations

import numpy as np
from matplotlib.ticker import MaxNLocator

from kvsim.plots.report import PREEMPTIONS_CUMULATIVE, Report
from kvsim.plots.style import allocator_colors, new_figure, titles
from kvsim.plots.waste import MAX_POINTS, binned


def preemptions_per_step(values: np.ndarray) -> np.ndarray:
    """Preemptions that happened at each step, whether the report counts them per step or cumulatively."""
    values = np.nan_to_num(values.astype(float))
    if PREEMPTIONS_CUMULATIVE:
        return np.diff(values, prepend=0.0)
    return values


LINE_STYLES = ("-", "--", (0, (1, 1)), "-.")  # identical series stay visible: the one drawn later is dashed and thinner


def bin_peaks(times: np.ndarray, values: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """The largest value in each of `num_bins` equal time bins (as `binned`'s bins; unchanged with fewer rows),
    so a peak that a bin's mean hides is still drawn."""
    if len(times) <= num_bins:
        return times, values
    edges = np.linspace(times[0], times[-1], num_bins + 1)
    index = np.clip(np.searchsorted(edges, times, side="right") - 1, 0, num_bins - 1)
    peaks = np.full(num_bins, -np.inf)
    np.maximum.at(peaks, index, values)
    keep = np.isfinite(peaks)
    return ((edges[:-1] + edges[1:]) / 2)[keep], peaks[keep]


def timeline(report: Report):
    """Three panels sharing the time axis: running requests, waiting requests, and a raster of preemptions.

    Running and waiting are time-weighted means over at most MAX_POINTS bins (exact for shorter replays);
    a faint band reaches each bin's peak of running requests, so the legend's peak is seen. Allocators
    whose series coincide stay visible: each is drawn in its own dash pattern and width.
    """
    steps = report.table("steps", ("allocator", "time_s", "num_running", "num_waiting"))
    labels = report.allocators
    colors = allocator_colors(labels)
    fig, axes = new_figure(9.5, 7.6, nrows=3, sharex=True, height_ratios=(3, 3, 0.35 * len(labels) + 0.6))
    running_ax, waiting_ax, preempt_ax = axes[:, 0]
    for lane, label in enumerate(labels):
        rows = steps[steps["allocator"].astype(str) == label].sort_values("time_s")
        if rows.empty:  # it never ran a step (every request rejected): a legend entry says so
            running_ax.plot([], [], color=colors[label], linewidth=1.2, label=f"{label} (no steps: every request rejected)")
            continue
        t = rows["time_s"].to_numpy(float)
        weights = rows["step_time_s"].to_numpy(float) if "step_time_s" in rows.columns else None
        counts = rows[["num_running", "num_waiting"]].to_numpy(float)
        bt, bv = binned(t, counts, MAX_POINTS, weights)
        preempted = (preemptions_per_step(rows["num_preemptions"].to_numpy())
                     if "num_preemptions" in rows.columns else np.zeros(len(rows)))
        legend = f"{label} (peak {int(counts[:, 0].max())} running, {int(preempted.sum())} preemptions)"
        style = dict(color=colors[label], linestyle=LINE_STYLES[lane % len(LINE_STYLES)], linewidth=max(0.8, 1.6 - 0.25 * lane))
        running_ax.plot(bt, bv[:, 0], gid=f"running:{label}", label=legend, **style)
        pt, peaks = bin_peaks(t, counts[:, 0], MAX_POINTS)  # each bin's peak, faint behind its mean
        running_ax.fill_between(pt, np.interp(pt, bt, bv[:, 0]), peaks, color=colors[label], alpha=0.15, linewidth=0,
                                gid=f"running-peaks:{label}")
        waiting_ax.plot(bt, bv[:, 1], gid=f"waiting:{label}", **style)
        marks = preempted > 0
        preempt_ax.plot(t[marks], np.full(marks.sum(), lane), linestyle="none", marker="|", markersize=9,
                        color=colors[label], gid=f"preemptions:{label}")
    running_ax.set_ylabel("running requests")
    running_ax.set_title("Requests in the running batch", loc="left")
    waiting_ax.set_ylabel("waiting requests")
    waiting_ax.set_title("Requests waiting for admission (the queue)", loc="left")
    for ax in (running_ax, waiting_ax):
        ax.set_ylim(0, max(1.0, ax.get_ylim()[1]))  # counts: an empty queue still reads 0..1, not 0..0.05
        ax.yaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    if not any(len(line.get_xdata()) for line in preempt_ax.get_lines()):
        preempt_ax.text(0.5, 0.5, "no preemptions", transform=preempt_ax.transAxes, ha="center", va="center",
                        color="#777777")
    preempt_ax.set_title("Preemptions (a mark per step that preempted)", loc="left")
    preempt_ax.set_yticks(range(len(labels)), labels, fontsize=8)
    preempt_ax.set_ylim(-0.6, len(labels) - 0.4)
    preempt_ax.invert_yaxis()
    preempt_ax.grid(axis="y", visible=False)
    preempt_ax.set_xlabel("simulated time (s)")
    preempt_ax.set_xlim(0, float(steps["time_s"].max()) or 1)
    fig.legend(*running_ax.get_legend_handles_labels(), loc="outside lower center", ncols=2)
    titles(fig, "Concurrency per allocator: running batch, admission queue and preemptions over time",
           report.subtitle())
    return fig
