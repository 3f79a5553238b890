"""The prefix-cache curve: hit rate against LRU cache capacity (log x), the unbounded ideal as a line, and a
marker where a GPU's KV budget falls; a GiB axis on top when the model's KV bytes per token are known."""

from __future__ import annotations

import numpy as np
from matplotlib.ticker import FuncFormatter, PercentFormatter

from kvsim.plots.style import new_figure, titles


def _tokens_tick(value: float, _pos) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"


def cache_curve_chart(curve, ctx):
    """The chart of a `CacheCurve` (kvsim.cache_curve.curve) for a `CurveContext` (kvsim.cache_curve.view)."""
    bs = curve.block_size
    top_blocks = max(int(curve.knots()[-1]), 1)
    if ctx.budget_tokens:
        top_blocks = max(top_blocks, ctx.budget_tokens // bs)
    blocks = np.unique(np.concatenate([np.geomspace(1, top_blocks * 2, 400).astype(np.int64), curve.knots()]))
    blocks = blocks[blocks >= 1]
    tokens = blocks * bs  # (k,)
    rates = curve.hit_blocks(blocks) * bs / max(curve.prompt_tokens, 1)
    fig, axes = new_figure(9.0, 5.4)
    ax = axes[0, 0]
    ax.plot(tokens, rates, color="#1f77b4", linewidth=2, label="LRU cache of this capacity", gid="curve")
    ax.axhline(curve.ideal_hit_rate, color="#2e8b57", linestyle="--", linewidth=1.3, gid="ideal",
               label=f"unbounded cache (ideal): {curve.ideal_hit_rate:.1%}")
    if ctx.budget_tokens:
        rate = float(curve.hit_rate(np.array([ctx.budget_tokens]))[0])
        ax.plot(ctx.budget_tokens, rate, marker="o", markersize=8, color="#d62728", markeredgecolor="black", gid="budget",
                linestyle="none", label=f"{ctx.model} KV budget on {ctx.gpu} ({ctx.budget_of}): {ctx.budget_tokens:,} tokens, {rate:.1%}")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens_tick))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, max(curve.ideal_hit_rate * 1.1, 0.05))
    ax.set_xlabel("cache capacity (tokens, log scale)")
    ax.set_ylabel("prefix-cache hit rate (prompt tokens from cache)")
    if ctx.bytes_per_token:
        per = ctx.bytes_per_token / 2**30
        sec = ax.secondary_xaxis("top", functions=(lambda t: t * per, lambda g: g / per))
        sec.set_xlabel(f"{ctx.model} KV cache (GiB)")
    # Below the axes: inside, it sat on the dashed ideal line (the curve's top, wherever the data puts it)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=1, frameon=False)
    subtitle = (f"{ctx.name} · {curve.num_requests:,} requests · {curve.prompt_tokens:,} prompt tokens · block size {bs}"
                " · arrival order, each request alone")
    titles(fig, "Prefix-cache hit rate vs cache capacity", subtitle)
    return fig
