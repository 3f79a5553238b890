"""Where the prefill came from, over time, with a CPU KV tier: prompt tokens computed, served by the GPU prefix
cache, and loaded from the CPU tier (steps.parquet's `num_prefill_tokens`, `gpu_hit_tokens`, `cpu_hit_tokens`)."""

from __future__ import annotations

import numpy as np

from kvsim.plots.report import Report
from kvsim.plots.style import new_figure, titles

NUM_BINS = 60
SOURCES = (("num_prefill_tokens", "computed", "#4c72b0"), ("gpu_hit_tokens", "GPU prefix-cache hit", "#55a868"),
           ("cpu_hit_tokens", "CPU tier hit (loaded)", "#dd8452"))


def prefill_sources(report: Report):
    """One panel per allocator: prompt tokens per second by source, in NUM_BINS bins of simulated time, stacked.

    A hit counts in the row that admitted its request (a load: when it started); computed prefill where it ran.
    """
    steps = report.table("steps", ("allocator", "time_s", "num_prefill_tokens", "gpu_hit_tokens", "cpu_hit_tokens"))
    steps = steps.dropna(subset=["cpu_hit_tokens"])
    labels = [label for label in report.allocators if (steps["allocator"].astype(str) == label).any()]
    fig, axes = new_figure(9.5, 2.6 * len(labels) + 1.4, nrows=len(labels), sharex=True)
    end = float(steps["time_s"].max()) or 1.0
    edges = np.linspace(0.0, end, NUM_BINS + 1)
    width = edges[1] - edges[0]
    for ax, label in zip(axes[:, 0], labels):
        rows = steps[steps["allocator"].astype(str) == label]
        where = np.clip(np.searchsorted(edges, rows["time_s"].to_numpy(float), side="right") - 1, 0, NUM_BINS - 1)
        base = np.zeros(NUM_BINS)
        totals = []
        for column, name, color in SOURCES:
            per_bin = np.bincount(where, weights=rows[column].to_numpy(float), minlength=NUM_BINS) / width
            totals.append(float(rows[column].sum()))
            ax.bar(edges[:-1], per_bin, width=width, bottom=base, align="edge", color=color, label=name, linewidth=0)
            base += per_bin
        share = 100.0 * np.array(totals) / max(sum(totals), 1.0)
        ax.set_title(f"{label}: computed {share[0]:.1f}%, GPU hit {share[1]:.1f}%, CPU hit {share[2]:.1f}% of prompt tokens",
                     loc="left")
        ax.set_ylabel("prompt tokens / s")
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center", ncols=3)
    titles(fig, "Where the prefill came from: computed, GPU prefix cache, CPU tier", report.subtitle())
    return fig
