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


def _tokens_label(value: float) -> str:
    """'8.39M', '524k', '1k': three significant digits."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
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
    ax.legend(loc="upper left")
    subtitle = (f"{ctx.name} · {curve.num_requests:,} requests · {curve.prompt_tokens:,} prompt tokens · block size {bs}"
                " · arrival order, each request alone")
    titles(fig, "Prefix-cache hit rate vs cache capacity", subtitle)
    return fig


def two_tier_chart(rows: list[dict], curve, ctx, cpu_block_size: int):
    """The two-tier surface (kvsim.cache_curve.view_tiers rows): left, the total hit rate against GPU capacity, a
    line per CPU capacity over the GPU tier alone; right, the CPU tier's own hit rate at every pair."""
    gpu_caps = sorted({r["capacity_tokens"] for r in rows})
    cpu_caps = sorted({r["cpu_capacity_tokens"] for r in rows})
    at = {(r["capacity_tokens"], r["cpu_capacity_tokens"]): r for r in rows}
    fig, axes = new_figure(14.0, 5.6, ncols=2)
    ax, heat = axes[0, 0], axes[0, 1]
    x = np.array([max(c, 1) for c in gpu_caps], dtype=float)
    ax.plot(x, [at[(c, cpu_caps[0])]["hit_rate"] for c in gpu_caps], color="#222222", linestyle="--", linewidth=1.6,
            marker="o", markersize=3, label="GPU prefix cache alone", gid="gpu")
    colors = __import__("matplotlib").colormaps["viridis"](np.linspace(0.15, 0.85, len(cpu_caps)))
    for m, color in zip(cpu_caps, colors):
        gib = f" ({m * ctx.bytes_per_token / 2**30:,.0f} GiB)" if ctx.bytes_per_token else ""
        ax.plot(x, [at[(c, m)]["total_hit_rate"] for c in gpu_caps], color=color, linewidth=2, marker="o", markersize=3,
                label=f"+ CPU tier {_tokens_label(m)} tokens{gib}", gid=f"cpu-{m}")
    ax.axhline(curve.ideal_hit_rate, color="#2e8b57", linestyle=":", linewidth=1.2, label=f"unbounded (ideal): {curve.ideal_hit_rate:.1%}")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens_tick))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, max(curve.ideal_hit_rate * 1.35, 0.05))
    ax.set_xlabel("GPU prefix-cache capacity (tokens, log scale)")
    ax.set_ylabel("prompt tokens from cache (GPU + CPU)")
    ax.legend(loc="upper left", fontsize=8, ncols=2)
    grid = np.array([[at[(c, m)]["cpu_hit_rate"] for c in gpu_caps] for m in cpu_caps])  # (cpu, gpu)
    image = heat.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=0)
    heat.grid(False)
    heat.set_xticks(range(len(gpu_caps)), [_tokens_label(c) for c in gpu_caps], rotation=45)
    gib = (lambda m: f"\n{m * ctx.bytes_per_token / 2**30:,.0f} GiB") if ctx.bytes_per_token else (lambda m: "")
    heat.set_yticks(range(len(cpu_caps)), [_tokens_label(m) + gib(m) for m in cpu_caps])
    for i in range(len(cpu_caps)):
        for j in range(len(gpu_caps)):
            heat.text(j, i, f"{grid[i, j]:.0%}" if grid[i, j] >= 0.1 or grid[i, j] == 0 else f"{grid[i, j]:.1%}",
                      ha="center", va="center", fontsize=7,
                      color="white" if grid[i, j] < grid.max() * 0.6 else "black")
    heat.set_xlabel("GPU prefix-cache capacity (tokens)")
    heat.set_ylabel("CPU tier capacity (tokens)")
    heat.set_title("hit rate from the CPU tier (beyond the GPU's)", fontsize=10)
    fig.colorbar(image, ax=heat, format=PercentFormatter(1.0))
    subtitle = (f"{ctx.name} · {curve.num_requests:,} requests · GPU block {curve.block_size}, CPU block {cpu_block_size} tokens"
                " · vLLM 0.33 OffloadingConnector, LRU · arrival order, each request alone, no transfer time")
    titles(fig, "Prefix-cache hit rate with a CPU tier", subtitle)
    return fig
