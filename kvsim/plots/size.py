"""Chart 7: KV bytes per sequence against context length for one or more models, from `kvsim.size.sizing`.

Log-log axes make each kind of layer show as what it is: full attention a straight line of slope 1, a
sliding window a bend where the window fills (the capped line flattens), a linear/mamba state a floor at
short contexts. The dashed line is the uncapped figure: what an engine without window freeing allocates.
"""

from __future__ import annotations

import numpy as np
from matplotlib.ticker import FuncFormatter, NullLocator

from kvsim.errors import KvsimError
from kvsim.plots.style import allocator_colors, new_figure, titles
from kvsim.units import format_bytes

MIN_CONTEXT = 16  # tokens: the left edge of the chart


def context_points(max_context: int, knees: list[int]) -> np.ndarray:
    """Token counts to evaluate: a geometric grid, every power of two, and the exact knees (windows)."""
    grid = np.geomspace(MIN_CONTEXT, max_context, 200).round().astype(int)
    powers = [2**p for p in range(4, 40) if 2**p <= max_context]
    extra = [k for k in (*knees, *powers) if MIN_CONTEXT <= k <= max_context]
    return np.unique(np.concatenate([grid, extra, [max_context]]).astype(int))


def size_curves(model_name: str, *, kv_dtype: str = "auto", tp: int = 1, max_context: int | None = None) -> dict:
    """{'model', 'kv_dtype', 'tokens', 'capped', 'uncapped', 'windows', 'state_bytes'}: what the chart draws for
    one model; `kv_dtype` auto is what `kvsim size` takes (the checkpoint's fp8, else the model's dtype)."""
    from kvsim.models.catalogue import resolve_model
    from kvsim.size.kv_dtype import kv_cache_dtype
    from kvsim.size.sizing import bytes_per_sequence, kv_cache_spec

    model = resolve_model(model_name)
    kv_dtype = kv_cache_dtype(kv_dtype, model)
    spec = kv_cache_spec(model, kv_dtype=kv_dtype, tp=tp)
    windows = sorted({g.window for g in spec.groups if g.kind == "sliding"})
    tokens = context_points(max_context or model.max_model_len, windows)
    return {
        "model": model.name,
        "kv_dtype": kv_dtype,
        "tokens": tokens,
        "capped": np.array([bytes_per_sequence(spec, int(n), capped=True) for n in tokens], dtype=float),
        "uncapped": np.array([bytes_per_sequence(spec, int(n), capped=False) for n in tokens], dtype=float),
        "windows": windows,
        "state_bytes": spec.state_bytes_per_sequence,
        "max_model_len": model.max_model_len,
    }


def _bytes_tick(value: float, _pos) -> str:
    return format_bytes(value).replace(".0 ", " ")


def _tokens_tick(value: float, _pos) -> str:
    return f"{value / 1024:g}k" if value >= 1024 else f"{value:g}"


def bytes_per_sequence(models: list[str], *, kv_dtype: str = "auto", tp: int = 1, max_context: int | None = None):
    """The chart: one colour per model, solid = capped (sliding layers keep their window), dashed = uncapped."""
    if max_context is not None and max_context <= MIN_CONTEXT:  # 0 or less drew a chart of nothing
        raise KvsimError(f"must be above the chart's left edge, {MIN_CONTEXT} tokens; got {max_context}", field="--max-context")
    curves = [size_curves(m, kv_dtype=kv_dtype, tp=tp, max_context=max_context) for m in models]
    colors = allocator_colors([c["model"] for c in curves])
    fig, axes = new_figure(9.0, 5.6)
    ax = axes[0, 0]
    for c in curves:
        color = colors[c["model"]]
        notes = []
        if c["windows"]:
            notes.append("sliding window " + ", ".join(str(w) for w in c["windows"]))
        if c["state_bytes"]:
            notes.append(f"state {format_bytes(c['state_bytes'])}/seq")
        label = c["model"] + (f" ({'; '.join(notes)})" if notes else "")
        ax.plot(c["tokens"], c["capped"], color=color, linewidth=2, label=label, gid=f"capped:{c['model']}")
        if not np.array_equal(c["capped"], c["uncapped"]):
            ax.plot(c["tokens"], c["uncapped"], color=color, linewidth=1.3, linestyle="--", gid=f"uncapped:{c['model']}",
                    label=f"{c['model']} uncapped (every layer keeps every token)")
        for window in c["windows"]:
            if window in c["tokens"]:
                i = int(np.searchsorted(c["tokens"], window))
                ax.plot(window, c["capped"][i], marker="o", color=color, markeredgecolor="black", markersize=6)
                ax.annotate(f"window {window}", (window, c["capped"][i]), xytext=(-8, 8), textcoords="offset points",
                            ha="right", fontsize=8, color=color)
        if c["state_bytes"]:
            ax.axhline(c["state_bytes"], color=color, linewidth=0.9, linestyle=":", gid=f"state:{c['model']}",
                       label=f"{c['model']} state alone (constant per sequence)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens_tick))
    _byte_ticks(ax)
    ax.yaxis.set_major_formatter(FuncFormatter(_bytes_tick))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("context length (tokens per sequence, log scale)")
    ax.set_ylabel("KV cache + state per sequence (bytes, log scale)")
    ax.legend(loc="upper left", fontsize=8.5)
    dtypes = list(dict.fromkeys(c["kv_dtype"] for c in curves))  # as resolved per model (auto)
    dtype = dtypes[0] if len(dtypes) == 1 else ", ".join(f"{c['model']} {c['kv_dtype']}" for c in curves)
    subtitle = f"KV dtype {dtype} · TP {tp} (per rank) · before block rounding · each line ends at the model's max length"
    titles(fig, "KV cache bytes per sequence vs context length", subtitle)
    return fig


def _byte_ticks(ax) -> None:
    """Ticks at powers of two (1 KiB, 4 KiB, ... 1 GiB), about ten of them, within the data's range."""
    lo, hi = ax.get_ylim()
    powers = np.arange(np.ceil(np.log2(max(lo, 1))), np.floor(np.log2(hi)) + 1)
    step = max(1, int(np.ceil(len(powers) / 10)))
    ax.set_yticks([2.0**p for p in powers if p % step == 0])
    ax.set_ylim(lo, hi)
