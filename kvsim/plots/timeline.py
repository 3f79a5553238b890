"""Chart 4: running requests and queue length over simulated time per allocator, preemptions as marks.

What paging buys is concurrency: the same budget runs more requests at once, so the queue drains sooner.
"""

from __future__ import annotations

import numpy as np

from kvsim.plots.report import PREEMPTIONS_CUMULATIVE, Report
from kvsim.plots.style import allocator_colors, new_figure, titles


def preemptions_per_step(values: np.ndarray) -> np.ndarray:
    """Preemptions that happened at each step, whether the report counts them per step or cumulatively."""
    values = np.nan_to_num(values.astype(float))
    if PREEMPTIONS_CUMULATIVE:
        return np.diff(values, prepend=0.0)
    return values


def timeline(report: Report):
    """Two panels sharing the time axis: running requests (with preemptions marked) and waiting requests."""
    steps = report.table("steps", ("allocator", "time_s", "num_running", "num_waiting"))
    colors = allocator_colors(report.allocators)
    fig, axes = new_figure(9.0, 6.2, nrows=2, sharex=True)
    running_ax, waiting_ax = axes[0, 0], axes[1, 0]
    for label in report.allocators:
        rows = steps[steps["allocator"].astype(str) == label].sort_values("time_s")
        t = rows["time_s"].to_numpy(float)
        running = rows["num_running"].to_numpy(float)
        preempted = (preemptions_per_step(rows["num_preemptions"].to_numpy())
                     if "num_preemptions" in rows.columns else np.zeros(len(rows)))
        total = int(preempted.sum())
        running_ax.plot(t, running, drawstyle="steps-post", color=colors[label], linewidth=1.2, gid=f"running:{label}",
                        label=f"{label} (peak {int(running.max())}, {total} preemptions)")
        waiting_ax.plot(t, rows["num_waiting"].to_numpy(float), drawstyle="steps-post", color=colors[label],
                        linewidth=1.2, gid=f"waiting:{label}", label=label)
        marks = preempted > 0
        if marks.any():
            running_ax.plot(t[marks], running[marks], linestyle="none", marker="v", markersize=5,
                            color=colors[label], markeredgecolor="black", markeredgewidth=0.5,
                            gid=f"preemptions:{label}")
    running_ax.set_ylabel("running requests")
    running_ax.set_ylim(bottom=0)
    running_ax.set_title("Requests in the running batch (▼ = a step with preemptions)", loc="left")
    waiting_ax.set_ylabel("waiting requests (queue)")
    waiting_ax.set_ylim(bottom=0)
    waiting_ax.set_title("Requests waiting for admission", loc="left")
    waiting_ax.set_xlabel("simulated time (s)")
    running_ax.margins(x=0)
    running_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the panel, never over a line
    titles(fig, "Concurrency per allocator: running batch and admission queue over time", report.subtitle())
    return fig
