"""One look for every kvsim chart: headless Agg backend, fixed colours per byte category, titles and saving.

Importing this module selects the Agg backend before pyplot is imported, so charts render on servers without
a display. Every chart module imports pyplot from here.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.transforms import offset_copy  # noqa: E402

from kvsim.errors import KvsimError  # noqa: E402

FORMATS = ("png", "svg", "pdf")
GIB = 2**30

# A byte category has the same colour in every chart: green is useful, warm colours are waste, grey is free.
CATEGORY_COLORS = {
    "token_states": "#2e8b57",
    "reservation": "#f0b429",
    "internal_fragmentation": "#d64545",
    "external_fragmentation": "#8e5bb5",
    "free": "#d9d9d9",
}

# Allocators get colours by their position in the report, the same in every chart of that report. None is
# a green, amber, red or purple: those mean byte categories (CATEGORY_COLORS) in the stacked charts.
_ALLOCATOR_PALETTE = ("#1f77b4", "#17becf", "#8c564b", "#e377c2", "#222222", "#5d6d7e", "#393b79", "#7f7f7f",
                      "#9c9ede", "#c49c94")

RC = {
    "figure.dpi": 100,
    "savefig.dpi": 150,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "legend.fontsize": 9,
    "legend.frameon": False,
    "svg.hashsalt": "kvsim",  # stable element ids: the same report gives the same SVG bytes
}


matplotlib.rcParams.update(RC)  # only the plot command path imports this module


def allocator_colors(labels: list[str]) -> dict[str, str]:
    """A colour per allocator label: by position for up to ten; beyond that (a block-size sweep) the paged
    allocators take a dark-to-light blue ramp in report order and the others browns, pinks and greys."""
    if len(labels) <= len(_ALLOCATOR_PALETTE):
        return {label: _ALLOCATOR_PALETTE[i] for i, label in enumerate(labels)}
    paged = [label for label in labels if label.startswith("paged")]
    ramp = matplotlib.colormaps["Blues"](np.linspace(1.0, 0.4, len(paged)))  # blues: no category's hue
    warm = ("#8c564b", "#e377c2", "#222222", "#7f7f7f", "#5d6d7e", "#c49c94")  # no category's colour
    colors = {label: matplotlib.colors.to_hex(c) for label, c in zip(paged, ramp)}
    others = [label for label in labels if label not in colors]
    colors.update({label: warm[i % len(warm)] for i, label in enumerate(others)})
    return colors


def new_figure(width: float, height: float, *, nrows: int = 1, ncols: int = 1, **kwargs):
    """A figure and its axes in kvsim's style (constrained layout, so labels never overlap)."""
    return plt.subplots(nrows, ncols, figsize=(width, height), layout="constrained", squeeze=False, **kwargs)


def titles(fig: Figure, title: str, subtitle: str) -> None:
    """The chart's title (what it shows) and a smaller grey subtitle (model, budget, workload) above the axes.

    Both sit just above the figure's top edge, out of constrained layout's way; `save` uses a tight bounding
    box, so they are always inside the written image and never overlap an axes title.
    """
    above = lambda points: offset_copy(fig.transFigure, fig=fig, y=points, units="points")  # noqa: E731
    fig.text(0.5, 1.0, subtitle, transform=above(4), ha="center", va="bottom", fontsize=9.5, color="#555555")
    lift = 12 * subtitle.count("\n")  # a subtitle of several lines pushes the title up
    fig.text(0.5, 1.0, title, transform=above(20 + lift), ha="center", va="bottom", fontsize=13, fontweight="bold")
    fig.kvsim_title, fig.kvsim_subtitle = title, subtitle  # read back by tests


def check_format(fmt: str) -> str:
    fmt = fmt.lower().lstrip(".")
    if fmt not in FORMATS:
        raise KvsimError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})", field="--format")
    return fmt


def save(fig: Figure, path: Path) -> Path:
    """Write `fig` to `path` (its suffix picks the format) and release it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, bbox_inches="tight", pad_inches=0.15, metadata=_metadata(path))
    except OSError as exc:  # a directory in the way, no permission, a full disk
        raise KvsimError(f"cannot write chart: {exc.strerror or exc}", source=str(path)) from None
    finally:
        plt.close(fig)
    return path


def _metadata(path: Path) -> dict:
    # Fixed metadata keeps svg/pdf output byte-stable across runs (no creation dates).
    if path.suffix == ".svg":
        return {"Date": None}
    if path.suffix == ".pdf":
        return {"CreationDate": None}
    return {}
