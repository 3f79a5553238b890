"""Where the KV budget goes: waste over time (chart 1), the paper's Figure 2 (chart 2), waste vs block size (3)."""

from __future__ import annotations

import math
import re

import numpy as np

from kvsim.plots.report import CATEGORIES, CATEGORY_LABELS, MissingData, Report
from kvsim.plots.style import CATEGORY_COLORS, GIB, new_figure, titles

# Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023
# (arXiv:2309.06180), Figure 2: average % of KV cache memory per category during the paper's experiments.
# The paper's last category is "external fragmentation & others"; it does not itemise vLLM's remaining 3.7%
# nor Orca (Oracle)'s internal fragmentation, so neither is drawn (None). Max and Pow2 sum to 99.9 as printed.
PAPER_FIGURE2: dict[str, dict[str, float | None]] = {
    "Orca (Max)": {"token_states": 20.4, "reservation": 13.3, "internal_fragmentation": 57.3,
                   "external_fragmentation": 8.9},
    "Orca (Pow2)": {"token_states": 26.8, "reservation": 17.9, "internal_fragmentation": 13.6,
                    "external_fragmentation": 41.6},
    "Orca (Oracle)": {"token_states": 38.2, "reservation": 25.2, "internal_fragmentation": None,
                      "external_fragmentation": 36.6},
    "vLLM": {"token_states": 96.3, "reservation": None, "internal_fragmentation": None,
             "external_fragmentation": None},
}
PAPER_ANALOGUES = {"flat-max": "Orca (Max)", "flat-pow2": "Orca (Pow2)", "flat-oracle": "Orca (Oracle)",
                   "paged-16": "vLLM"}  # our allocator that plays each of the paper's systems
PAPER_WORKLOADS = ("sharegpt", "alpaca")  # the paper's datasets: its bars are drawn beside ours for these
MAX_POINTS = 800  # time bins per allocator in the waste curves (a replay can have 10^5 steps)

_BYTE_COLUMNS = tuple(f"{c}_bytes" for c in CATEGORIES)
_PCT_COLUMNS = tuple(f"{c}_pct" for c in CATEGORIES)


def is_paper_like(report: Report) -> bool:
    """Whether the workload is one of the paper's (ShareGPT-like or Alpaca-like), by name."""
    name = f"{report.workload or ''} {report.name}".lower().replace("_", "").replace("-", "")
    return any(w in name for w in PAPER_WORKLOADS)


def binned(times: np.ndarray, values: np.ndarray, num_bins: int, weights: np.ndarray | None = None):
    """Weighted mean of `values` (rows, k) over `num_bins` equal time bins; unchanged with fewer rows.

    Weights are each row's duration (`step_time_s`: a row may cover several identical decode steps), so a
    bin shows each category's time-averaged share of the budget, as summary.csv computes it.
    """
    if len(times) <= num_bins:
        return times, values
    w = np.ones(len(times)) if weights is None else weights.astype(float)
    edges = np.linspace(times[0], times[-1], num_bins + 1)
    index = np.clip(np.searchsorted(edges, times, side="right") - 1, 0, num_bins - 1)
    totals = np.bincount(index, weights=w, minlength=num_bins)
    keep = totals > 0
    sums = np.stack([np.bincount(index, weights=values[:, j] * w, minlength=num_bins) for j in range(values.shape[1])], 1)
    centres = (edges[:-1] + edges[1:]) / 2
    return centres[keep], sums[keep] / totals[keep, None]


def grid_shape(num_panels: int) -> tuple[int, int]:
    """(rows, columns) for the waste curves: 4 panels as 2x2, at most 3 columns, so at most one slot is empty
    for 4-6 panels (and that slot holds the legend)."""
    ncols = 2 if num_panels == 4 else min(num_panels, 3)
    return math.ceil(num_panels / ncols), ncols


def waste_curves(report: Report):
    """Chart 1: the KV budget over simulated time as stacked areas, one panel per allocator.

    Each panel has its own time axis, running to the end of that allocator's last step (one that runs long
    would squeeze the others to slivers); the KV axis is shared, so heights compare across panels.
    """
    steps = report.table("steps", ("allocator", "time_s", *_BYTE_COLUMNS))
    allocators = report.allocators
    nrows, ncols = grid_shape(len(allocators))
    fig, axes = new_figure(4.2 * ncols, 3.0 * nrows + 0.6, nrows=nrows, ncols=ncols, sharey=True)
    top = 0.0
    for ax, label in zip(axes.flat, allocators):
        rows = steps[steps["allocator"].astype(str) == label].sort_values("time_s")
        ax.set_title(label)
        ax.set_xlabel("simulated time (s)")
        if rows.empty:  # it never ran a step
            ax.text(0.5, 0.5, "no steps: every request rejected", transform=ax.transAxes, ha="center", va="center",
                    color="#777777")
            continue
        weights = rows["step_time_s"].to_numpy(float) if "step_time_s" in rows.columns else None
        t, v = binned(rows["time_s"].to_numpy(float), rows[list(_BYTE_COLUMNS)].to_numpy(float) / GIB, MAX_POINTS,
                      weights)
        end = float(rows["time_s"].iat[-1] + (rows["step_time_s"].iat[-1] if weights is not None else 0.0))
        if end > t[-1]:  # the last step's bytes hold until it ends, not only at its start
            t, v = np.append(t, end), np.vstack([v, v[-1:]])
        ax.stackplot(t, v.T, colors=[CATEGORY_COLORS[c] for c in CATEGORIES],
                     labels=[CATEGORY_LABELS[c] for c in CATEGORIES], linewidth=0, gid=f"stack:{label}")
        ax.set_xlim(0, end or 1)
        top = max(top, float(v.sum(axis=1).max()) if len(v) else 0.0)
    for ax in axes[:, 0]:
        ax.set_ylabel("KV memory (GiB)")
    for ax in axes.flat:
        ax.set_ylim(0, top * 1.02 or 1)
    handles, labels = max((ax.get_legend_handles_labels() for ax in axes.flat), key=lambda hl: len(hl[0]))
    spare = list(axes.flat[len(allocators):])
    for ax in spare:
        ax.set_visible(False)
    if spare:  # the empty grid slot holds the legend
        spare[0].set_visible(True)
        spare[0].axis("off")
        spare[0].legend(handles, labels, loc="center", title="KV budget")
    else:
        fig.legend(handles, labels, loc="outside lower center", ncols=len(CATEGORIES))
    titles(fig, "Where the KV budget goes over time, per allocator (each panel on its own time axis)", report.subtitle())
    return fig


def figure2(report: Report):
    """Chart 2: time-averaged % of the budget per category per allocator (the paper's Figure 2 form).

    For ShareGPT-/Alpaca-like workloads the paper's own bars stand beside ours, hatched.
    """
    summary = report.table("summary", ("allocator", *_PCT_COLUMNS))
    ours = {str(row["allocator"]): {c: float(row[f"{c}_pct"]) for c in CATEGORIES} for _, row in summary.iterrows()
            if not all(math.isnan(float(row[f"{c}_pct"])) for c in CATEGORIES)}  # NaN: never ran a step
    if not ours:
        raise MissingData("summary.csv has no time-averaged figures (no allocator ran a step: every request rejected?)")
    paper = PAPER_FIGURE2 if is_paper_like(report) else {}
    names = [*ours, *paper]
    x = np.arange(len(names), dtype=float)
    x[len(ours):] += 0.6  # a gap between our bars and the paper's
    fig, axes = new_figure(max(6.0, 1.05 * len(names) + 2.5), 4.8)
    ax = axes[0, 0]
    thin: dict[str, list] = {}  # per bar, the figures of its thin segments, written beside it
    for category in CATEGORIES:
        heights = [ours[n][category] if n in ours else (paper[n].get(category) or 0.0) for n in names]
        bottoms = [sum((ours[n] if n in ours else {k: v or 0.0 for k, v in paper[n].items()}).get(c, 0.0)
                       for c in CATEGORIES[:CATEGORIES.index(category)]) for n in names]
        bars = ax.bar(x, heights, 0.7, bottom=bottoms, color=CATEGORY_COLORS[category],
                      label=CATEGORY_LABELS[category], edgecolor="white", linewidth=0.6)
        for bar, name in zip(bars, names):
            bar.set_gid(f"{name}:{category}")  # how tests find a segment
            if name in paper:
                bar.set_hatch("//")
                bar.set_edgecolor("#ffffff")
            if bar.get_height() >= 6:
                box = dict(boxstyle="round,pad=0.15", facecolor="white", alpha=0.75, linewidth=0) if name in paper else None
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_y() + bar.get_height() / 2,
                        f"{bar.get_height():.1f}", ha="center", va="center", fontsize=8, color="#111111", bbox=box,
                        gid=f"label:{name}:{category}")
            elif bar.get_height() >= 0.05:  # a thin segment: its figure beside the bar, in the segment's colour
                thin.setdefault(name, []).append(ax.text(
                    bar.get_x() + bar.get_width() + 0.03, bar.get_y() + bar.get_height() / 2, f"{bar.get_height():.1f}",
                    ha="left", va="center", fontsize=6.5, color=_darker(CATEGORY_COLORS[category]),
                    gid=f"label:{name}:{category}"))
    for labels in thin.values():  # thin segments next to each other: their figures one above the other, not on top
        _spread(labels, THIN_LABEL_GAP)
    saved = _sharing_saved(report)
    for i, name in enumerate(names):
        if saved.get(name, 0) >= 0.05:  # prefix sharing: bytes that would be duplicated without it
            ax.text(x[i], 100.5, f"sharing saved\n{saved[name]:.1f}% of budget", ha="center", va="bottom", fontsize=7,
                    color="#2e8b57", gid=f"saved:{name}")
    ticks = [f"{n}\n≈ {PAPER_ANALOGUES[n]}" if paper and n in PAPER_ANALOGUES and n in ours else n for n in names]
    crowded = len(names) > 4 or max(len(line) for t in ticks for line in t.split("\n")) * len(names) > 48
    ax.set_xticks(x, ticks, rotation=25 if crowded else 0, ha="right" if crowded else "center",
                  rotation_mode="anchor")
    ax.set_ylim(0, 100)
    ax.set_ylabel("time-averaged share of the KV budget (%)")
    ax.grid(axis="x", visible=False)
    if paper:
        ax.axvline((x[len(ours) - 1] + x[len(ours)]) / 2, color="#999999", linewidth=0.8, linestyle="--")
        ax.text(x[len(ours):].mean(), 108, "PagedAttention paper, Fig. 2\n(its ShareGPT run, hatched)", ha="center",
                va="bottom", fontsize=8.5, color="#555555", gid="paper-heading")
        ax.text(x[:len(ours)].mean(), 108, "this replay", ha="center", va="bottom", fontsize=8.5, color="#555555")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right center")
    note = None
    if paper:
        note = ("Paper bars: Kwon et al., SOSP 2023, Fig. 2, measured on ShareGPT; its last category is 'external "
                "frag. & others'; parts it does not itemise are left blank.")
        if "alpaca" in f"{report.workload or ''} {report.name}".lower():
            note += " The paper gives no Alpaca bars: these are its ShareGPT ones."
    if note:
        fig.text(0.0, 0.0, note, fontsize=7.5, color="#555555", ha="left", va="top")
    titles(fig, "KV budget by category, time-averaged (the PagedAttention paper's Figure 2)", report.subtitle())
    return fig


THIN_LABEL_GAP = 3.0  # % of the budget between two thin segments' figures (6.5 pt text on a 100 % axis)


def _spread(labels: list, gap: float) -> None:
    """Move text labels (by their y, in data units) apart to at least `gap`, the lowest kept where it is."""
    last = None
    for label in sorted(labels, key=lambda t: t.get_position()[1]):
        x, y = label.get_position()
        if last is not None and y < last + gap:
            y = last + gap
            label.set_y(y)
        last = y


def _sharing_saved(report: Report) -> dict[str, float]:
    """Time-averaged % of the budget that prefix sharing saved, per allocator (empty if the report has none)."""
    summary = report.table("summary", ("allocator",))
    if "shared_saved_pct" not in summary.columns:
        return {}
    return {str(r["allocator"]): float(r["shared_saved_pct"]) for _, r in summary.iterrows()
            if r["shared_saved_pct"] == r["shared_saved_pct"]}  # fmt: skip


def _darker(color: str) -> str:
    """A darker shade of `color` for text on white (amber and grey are unreadable at full lightness)."""
    import matplotlib.colors as mcolors

    r, g, b = mcolors.to_rgb(color)
    return mcolors.to_hex((r * 0.6, g * 0.6, b * 0.6))


def _block_size_of(label: str) -> int | None:
    m = re.fullmatch(r"paged-(\d+)", label)
    return int(m.group(1)) if m else None


def block_sizes(report: Report):
    """Chart 3: % of the budget against the paged block size; useful bytes on the left (0-100%), the block
    tail's waste on the right on its own scale (it is a few % at most, invisible on a 0-100 axis).

    A paged request's last block is part reservation (slots its own future tokens will fill) and part
    internal fragmentation (slots past its final token), so both are drawn.
    """
    summary = report.table("summary", ("allocator", "token_states_pct", "internal_fragmentation_pct"))
    if "block_size" in summary.columns:
        paged = summary[summary["allocator"].astype(str).str.startswith("paged")].copy()
    else:
        paged = summary.copy()
        paged["block_size"] = [_block_size_of(str(a)) for a in paged["allocator"]]
        paged = paged[paged["block_size"].notna()]
    paged = paged.drop_duplicates("block_size").sort_values("block_size")
    if len(paged) < 2:
        raise MissingData("summary.csv has fewer than two paged block sizes (replay a block-size sweep)")
    fig, axes = new_figure(11.0, 4.4, ncols=2, sharex=True)
    useful_ax, waste_ax = axes[0]
    sizes = paged["block_size"].to_numpy(int)
    panels = ((useful_ax, ("token_states", "free")), (waste_ax, ("reservation", "internal_fragmentation")))
    for ax, categories in panels:
        for category, marker in zip(categories, ("o", "s")):
            if f"{category}_pct" not in paged.columns:
                continue
            ax.plot(sizes, paged[f"{category}_pct"].to_numpy(float), marker=marker, linewidth=2, gid=category,
                    color=CATEGORY_COLORS[category] if category != "free" else "#8c8c8c",
                    label=CATEGORY_LABELS[category])
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("block size (tokens per KV block, log scale)")
        ax.set_ylabel("time-averaged share of the KV budget (%)")
        ax.legend(loc="best")
    useful_ax.set_ylim(0, 100)
    useful_ax.set_title("Token states and free memory", loc="left")
    waste_ax.set_ylim(bottom=0)
    waste_ax.set_title("Reservation and internal fragmentation (own scale)", loc="left")
    titles(fig, "Paged allocator: where the budget goes vs block size", report.subtitle())
    return fig
