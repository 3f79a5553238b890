"""Rich tables (and --json) for `kvsim size` and `kvsim models`: presentation only, the math is in sizing."""

from __future__ import annotations

import json

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvsim.errors import KvsimError
from kvsim.units import format_bytes


def _b(num_bytes: int | None) -> str:
    """'114,688 B (112.0 KiB)'."""
    if num_bytes is None:
        return "-"
    return f"{num_bytes:,} B" if num_bytes < 1024 else f"{num_bytes:,} B ({format_bytes(num_bytes)})"


def _h(num_bytes: int) -> str:
    """'4.4 GiB' (exact bytes are in the summary and --json)."""
    return format_bytes(num_bytes)


def show_size(
    model: str | None,
    config: str | None,
    *,
    kv_dtype: str = "bf16",
    block_size: int = 16,
    context: int | None = None,
    tp: int = 1,
    gpu: str | None = None,
    memory: str | None = None,
    utilization: float = 0.9,
    weight_dtype: str | None = None,
    max_num_batched_tokens: int = 8192,
    kernel_block_size: int = 16,
    mamba_cache_mode: str = "none",
    mamba_checkpoint_alignment: int = 0,
    async_scheduling: bool = True,
    params: float | None = None,
    layout: bool = False,
    num_blocks: int | None = None,
    address: str | None = None,
    as_json: bool = False,
) -> None:
    """Resolve the model and device, compute the size report, print it as tables or one JSON object."""
    from dataclasses import replace

    from kvsim.catalogue import resolve_model
    from kvsim.hf_config import load_hf_config
    from kvsim.size_report import size_report
    from kvsim.sizing import is_mla
    from kvsim.vllm_sizing import VllmSettings

    if (model is None) == (config is None):
        raise KvsimError("give exactly one of --model NAME or --config FILE", field="--model")
    spec = resolve_model(model) if model else load_hf_config(config)
    if params is not None:
        if params <= 0:
            raise KvsimError(f"must be positive, got {params}", field="--params")
        spec = replace(spec, num_params=int(params), params_source="--params", checkpoint_bytes=None)
    if gpu and memory:
        raise KvsimError("give --gpu or --memory, not both", field="--memory")
    memory_bytes, gpu_name = None, None
    if gpu:
        from kvsim.hardware import get_gpu

        device = get_gpu(gpu)
        memory_bytes, gpu_name = device.memory_bytes, device.name
    elif memory:
        from kvsim.units import parse_bytes

        memory_bytes = parse_bytes(memory, field="--memory")
    report = size_report(
        spec,
        kv_dtype=kv_dtype,
        block_size=block_size,
        context_tokens=context,
        tp=tp,
        memory_bytes=memory_bytes,
        gpu_name=gpu_name,
        utilization=utilization,
        weight_dtype=weight_dtype,
        settings=VllmSettings(
            max_num_batched_tokens=max_num_batched_tokens,
            async_scheduling=async_scheduling,
            kernel_block_size=kernel_block_size,
            mamba_cache_mode=mamba_cache_mode,
            mamba_checkpoint_alignment=mamba_checkpoint_alignment,
        ),
    )
    pool = offset = None
    if layout or address:
        from kvsim.layout import parse_address, pool_layout

        if num_blocks is None:
            raise KvsimError("--layout and --address need --num-blocks", field="--num-blocks")
        pool = pool_layout(report.spec, num_blocks, mla=is_mla(spec))
        if address:
            offset = pool.byte_offset(*parse_address(address))

    if as_json:
        out = report.as_json()
        if pool is not None:
            out.update({"pool_shape": list(pool.shape), "pool_strides": list(pool.strides), "pool_bytes": pool.total_bytes})
        if offset is not None:
            out.update({"address": address, "address_byte_offset": offset})
        print(json.dumps(out, indent=2))
        return
    console = Console()
    _print_report(console, report)
    if pool is not None:
        _print_layout(console, pool, address, offset)


def _print_report(console: Console, report) -> None:
    from kvsim.sizing import sliding_cap_bytes_per_sequence

    model, spec, n = report.model, report.spec, report.context_tokens
    title = f"{model.name}" + (f" ({model.hf_id})" if model.hf_id else "") + f": KV cache, {spec.dtype}, tp={report.tp}, per rank"
    kinds = Table(title=title, title_justify="left")
    for col in ("layer group", "layers", "KV heads", "head dim", "B/token", f"per seq @ {n:,}"):
        kinds.add_column(col, justify="left" if col == "layer group" else "right")
    mla = any(layer.kind.value == "mla" for layer in model.layers)
    for g in spec.groups:
        if g.kind == "state":
            kinds.add_row("linear state", str(g.num_layers), "-", "-", "0", _h(g.state_bytes) + " const")
            continue
        name = ("mla latent" if mla else "full") if g.kind == "full" else f"sliding({g.window})"
        kept = n if g.kind == "full" else min(n, g.window)
        kinds.add_row(name, str(g.num_layers), str(spec.num_kv_heads), str(spec.head_dim), f"{g.bytes_per_token:,}", _h(g.bytes_per_token * kept))
    console.print(kinds)

    summary = Table(show_header=False, box=None, padding=(0, 2))
    summary.add_column(justify="left")
    summary.add_column(justify="right")
    rows = [
        ("KV per token, every per-token layer", _b(spec.bytes_per_token)),
        ("  full attention + MLA", _b(spec.full_bytes_per_token)),
        ("  sliding window", _b(spec.bytes_per_token - spec.full_bytes_per_token)),
        ("sliding-window cap per sequence", _b(sliding_cap_bytes_per_sequence(spec))),
        ("state per sequence (constant)", _b(spec.state_bytes_per_sequence)),
        (f"per block ({spec.block_size} tokens)", _b(spec.block_bytes)),
        (f"per sequence @ {n:,} tok, capped", _b(report.bytes_per_sequence)),
        (f"per sequence @ {n:,} tok, uncapped", _b(report.bytes_per_sequence_uncapped)),
        (f"per sequence @ {n:,} tok, whole blocks", _b(report.bytes_per_sequence_block_rounded)),
    ]
    cap = report.capacity
    if cap is not None:
        rows += [
            ("device", report.gpu_name or "--memory"),
            (f"memory x utilization {report.utilization}", _b(int(report.memory_bytes * report.utilization))),
            (f"weights ({report.weight_dtype}, per rank)", _b(report.weight_bytes)),
            ("KV budget", _b(cap.kv_budget_bytes)),
            ("max tokens (uncapped)", f"{cap.max_tokens:,}" if cap.max_tokens is not None else "-"),
        ]
    for label, value in rows:
        summary.add_row(label, value)
    console.print(summary)
    console.print(
        "capped: sliding layers keep only their window (engines that free blocks outside it); "
        "uncapped: every layer keeps every token.",
        style="dim",
    )
    if report.hybrid is not None:
        _print_hybrid_pages(console, report.hybrid, report.settings.mamba_checkpoint_alignment)
    if cap is not None:
        console.print(f"Maximum concurrency for {n:,} tokens per request: {cap.max_sequences:.2f}x", highlight=False, soft_wrap=True)
        _print_vllm_lines(console, report)
        if cap.max_sequences_uncapped != cap.max_sequences:
            console.print(f"Maximum concurrency, uncapped (no window freeing): {cap.max_sequences_uncapped:.2f}x", highlight=False, soft_wrap=True)


def _print_hybrid_pages(console: Console, h, checkpoint: int = 0) -> None:
    """vLLM's raised block size and padded state page, and the vLLM settings they assume."""
    how = (
        f"raised from --block-size {h.requested_block_size}, in multiples of {h.alignment}, until one attention page holds one layer's state"
        if h.raised
        else f"--block-size {h.requested_block_size} already holds one layer's state"
    )
    pad = f"state page padded to {h.page_bytes:,} B (+{h.padding_pct:.2f}%)" if h.padding_pct else "state page needs no padding"
    console.print(
        f"vLLM block_size for this model: {h.block_size:,} tokens ({how}: {h.block_size:,} x "
        f"{h.attention_bytes_per_token:,} B = {h.page_bytes:,} B >= {h.state_page_bytes:,} B); {pad}",
        highlight=False,
        soft_wrap=True,
    )
    if h.mamba_cache_mode == "none":
        prefix = "off (mamba_cache_mode none; vllm serve turns it on for hybrid models: --mamba-cache-mode align)"
    elif checkpoint:
        prefix = f"on (mamba_cache_mode align, state checkpoints every {checkpoint} tokens: 3 state blocks per request)"
    else:
        prefix = (
            "on (mamba_cache_mode align, 2 state blocks per request; gated delta net layers with FlashInfer's "
            "prefill, vLLM's choice on Hopper, also checkpoint: --mamba-checkpoint-alignment 64)"
        )
    console.print(
        f"vLLM settings assumed: attention kernel block {h.kernel_block_size} "
        f"({'FlashAttention / FlashInfer default' if h.kernel_block_size == 16 else '--kernel-block-size'}), "
        f"prefix caching {prefix}",
        style="dim",
        highlight=False,
        soft_wrap=True,
    )


def _print_vllm_lines(console: Console, report) -> None:
    """vLLM's start-up line (or kvsim's whole-block estimate where vLLM's arithmetic is not followed)."""
    from kvsim.vllm_sizing import VLLM_VERSION

    cap, n, st = report.capacity, report.context_tokens, report.settings
    tokens = f"{cap.max_tokens_block_rounded:,}" if cap.max_tokens_block_rounded is not None else "0"
    v = cap.vllm
    if v is None:
        how = "in whole blocks, state once (vLLM's arithmetic not followed for this layout)"
    else:
        sched = "async" if st.async_scheduling else "sync"
        how = f"as vLLM {VLLM_VERSION} computes it (max_num_batched_tokens {st.max_num_batched_tokens:,}, {sched} scheduling"
        how += f", block_size {v.hybrid.block_size:,})" if v.hybrid else ")"
    console.print(
        f"{how}: GPU KV cache size: {tokens} tokens, "
        f"Maximum concurrency for {n:,} tokens per request: {cap.max_sequences_block_rounded:.2f}x",
        highlight=False,
        soft_wrap=True,
    )
    if v is None:
        return
    kinds: dict[str, list] = {}
    for g in v.groups:
        kinds.setdefault(g.kind, []).append(g)
    per_kind = "; ".join(
        f"{len(gs)} {kind} group{'s' if len(gs) > 1 else ''} x {gs[0].blocks_per_request:,} block{'s' if gs[0].blocks_per_request > 1 else ''}"
        for kind, gs in kinds.items()
    )
    console.print(
        f"  vLLM pool: num_gpu_blocks {v.num_blocks:,} = KV budget // {v.bytes_per_block:,} B ({v.group_size} layers x "
        f"{v.page_bytes:,} B pages); per request of {n:,} tokens: {per_kind} = {v.blocks_per_request:,} blocks",
        style="dim",
        highlight=False,
        soft_wrap=True,
    )
    if not v.starts:
        console.print(
            f"vLLM {VLLM_VERSION} would refuse to start: one request of {n:,} tokens needs {v.blocks_per_request:,} blocks "
            f"of {v.bytes_per_block:,} B beside the null block (lower --context or add memory)",
            highlight=False,
            soft_wrap=True,
        )
    if v.hybrid is not None:
        own = f"{cap.own_tokens_block_rounded:,}" if cap.own_tokens_block_rounded is not None else "0"
        console.print(
            f"kvsim's own estimate, whole {report.spec.block_size}-token blocks, each sequence's state once (not paged): {own} tokens, "
            f"{cap.own_sequences_block_rounded:.2f}x",
            highlight=False,
            soft_wrap=True,
        )


def _print_layout(console: Console, pool, address: str | None, offset: int | None) -> None:
    table = Table(title=escape("KV pool tensor [kv, layer, block, token, head, dim] (row-major)"), title_justify="left")
    table.add_column("")
    for name in ("kv", "layer", "block", "token", "head", "dim"):
        table.add_column(name, justify="right")
    table.add_row("shape", *(f"{n:,}" for n in pool.shape))
    table.add_row("stride (elements)", *(f"{s:,}" for s in pool.strides))
    table.add_row("stride (bytes)", *(f"{s:,}" for s in pool.byte_strides))
    console.print(table)
    console.print(f"pool bytes: {_b(pool.total_bytes)}")
    if offset is not None:
        console.print(escape(f"element [{address}] byte offset: {offset:,}"), highlight=False, soft_wrap=True)


def show_models(*, as_json: bool = False) -> None:
    """The catalogue: name, HF id, layers by kind, KV heads, head_dim, KV bytes/token in bf16, params."""
    from kvsim.catalogue import catalogue_models
    from kvsim.sizing import kv_cache_spec

    rows = []
    for model in catalogue_models():
        spec = kv_cache_spec(model)
        rows.append(
            {
                "name": model.name,
                "hf_id": model.hf_id,
                "layers": model.layer_counts,
                "num_kv_heads": model.num_kv_heads,
                "head_dim": model.head_dim,
                "kv_bytes_per_token_bf16": spec.bytes_per_token,
                "state_bytes_per_sequence_bf16": spec.state_bytes_per_sequence,
                "max_model_len": model.max_model_len,
                "num_params": model.num_params,
            }
        )
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    console = Console()
    wide = console.width >= 150  # narrow terminals get the essential columns only
    table = Table(title="kvsim model catalogue (KV per token in bf16, tp=1)", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    cols = ["name", "hf id", "layers", "KV heads", "head dim", "KV B/token", "state B/seq", "max len", "params"]
    if not wide:
        cols = ["name", "layers", "KV HxD", "B/token", "params"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("name", "hf id", "layers") else "right", no_wrap=True)
    for r in rows:
        cells = {
            "name": r["name"],
            "hf id": r["hf_id"],
            "layers": " + ".join(f"{n} {k}" for k, n in r["layers"].items()),
            "KV heads": str(r["num_kv_heads"]),
            "head dim": str(r["head_dim"]),
            "KV HxD": f"{r['num_kv_heads']}x{r['head_dim']}",
            "KV B/token": f"{r['kv_bytes_per_token_bf16']:,}",
            "B/token": f"{r['kv_bytes_per_token_bf16']:,}",
            "state B/seq": f"{r['state_bytes_per_sequence_bf16']:,}" if r["state_bytes_per_sequence_bf16"] else "-",
            "max len": f"{r['max_model_len']:,}",
            "params": f"{r['num_params'] / 1e9:.1f}B",
        }
        table.add_row(*(cells[c] for c in cols))
    console.print(table)
