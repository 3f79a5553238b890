"""Tables (and --json) for `kvsim size`: presentation only, the math is in sizing; vLLM's lines are
`view_vllm`, `kvsim models` is `view_models`. Printed through `console.SizeConsole` (rich on a terminal only)."""

from __future__ import annotations

import json

from kvsim.errors import KvsimError
from kvsim.size.kv_dtype import kv_cache_dtype
from kvsim.size.console import SizeConsole, Table
from kvsim.units import format_bytes
from kvsim.size.view_vllm import print_hybrid_pages, print_vllm_lines


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
    kv_dtype: str = "auto",
    block_size: int = 16,
    context: int | None = None,
    tp: int = 1,
    gpu: str | None = None,
    memory: str | None = None,
    utilization: float = 0.92,
    weight_dtype: str | None = None,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    enforce_eager: bool = False,
    kv_cache_memory: str | None = None,
    kernel_block_size: int = 16,
    mamba_cache_mode: str | None = None,
    mamba_checkpoint_alignment: int | None = None,
    async_scheduling: bool = True,
    params: float | None = None,
    layout: bool = False,
    num_blocks: int | None = None,
    address: str | None = None,
    as_json: bool = False,
    step_time: bool = False,
    cpu_offload: str | None = None,
    kv_offloading_size: str | None = None,
    cpu_block_size: int | None = None,
) -> None:
    """Resolve the model and device, compute the size report, print it as tables or one JSON object."""
    from dataclasses import replace

    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hf_config import load_hf_config
    from kvsim.size.report import size_report
    from kvsim.size.sizing import is_mla
    from kvsim.size.startup import StartupSettings, serve_batch_defaults
    from kvsim.size.vllm import VllmSettings
    from kvsim.units import parse_bytes

    if (model is None) == (config is None):
        raise KvsimError("give exactly one of --model NAME or --config FILE", field="--model")
    spec = resolve_model(model) if model else load_hf_config(config)
    if params is not None:
        if not 0 < params < float("inf"):  # nan too: int() of nan or inf was a traceback
            raise KvsimError(f"must be a positive, finite count, got {params}", field="--params")
        spec = replace(spec, num_params=int(params), params_source="--params", checkpoint_bytes=None)
    if gpu and memory:
        raise KvsimError("give --gpu or --memory, not both", field="--memory")
    memory_bytes, gpu_name = None, None
    if gpu:
        from kvsim.models.hardware import get_gpu

        device = get_gpu(gpu)
        memory_bytes, gpu_name = device.reported_memory_bytes, device.name
    elif memory:
        memory_bytes = parse_bytes(memory, field="--memory")
    mamba_note = ""  # which of vllm serve's mamba defaults were assumed
    if mamba_cache_mode is None or mamba_checkpoint_alignment is None:
        from kvsim.size.vllm_settings import serve_mamba_defaults

        serve_mode, serve_alignment, mamba_note = serve_mamba_defaults(spec, device.key if gpu else None)
        if mamba_cache_mode is None:
            mamba_cache_mode = serve_mode
        elif mamba_cache_mode != serve_mode:
            serve_alignment, mamba_note = 0, ""
        if mamba_checkpoint_alignment is None:
            mamba_checkpoint_alignment = serve_alignment if mamba_cache_mode == "align" else 0
        else:
            mamba_note = ""
    startup = StartupSettings(
        gpu_memory_utilization=utilization,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enforce_eager=enforce_eager,
        kv_cache_memory_bytes=parse_bytes(kv_cache_memory, field="--kv-cache-memory") if kv_cache_memory else None,
    )
    if max_num_batched_tokens is None:  # vllm serve's for the device (8192 where none is given)
        max_num_batched_tokens = serve_batch_defaults(memory_bytes, gpu_name or "")[0] if memory_bytes else 8192
    report = size_report(
        spec,
        kv_dtype=kv_cache_dtype(kv_dtype, spec, weight_dtype),
        block_size=block_size,
        context_tokens=context,
        tp=tp,
        memory_bytes=memory_bytes,
        gpu_name=gpu_name,
        weight_dtype=weight_dtype,
        startup=startup,
        kv_budget_bytes=startup.kv_cache_memory_bytes if memory_bytes is None else None,
        settings=VllmSettings(
            max_num_batched_tokens=max_num_batched_tokens,
            async_scheduling=async_scheduling,
            kernel_block_size=kernel_block_size,
            mamba_cache_mode=mamba_cache_mode,
            mamba_checkpoint_alignment=mamba_checkpoint_alignment,
        ),
    )
    cpu = _cpu_tier(report, cpu_offload, kv_offloading_size, cpu_block_size)
    pool = offset = None
    if layout or address:
        from kvsim.size.layout import parse_address, pool_layout

        if num_blocks is None:
            raise KvsimError("--layout and --address need --num-blocks", field="--num-blocks")
        pool = pool_layout(report.spec, num_blocks, mla=is_mla(spec))
        if address:
            offset = pool.byte_offset(*parse_address(address))

    if as_json:
        out = report.as_json()
        if mamba_note:
            out["vllm_mamba_defaults"] = mamba_note
        if pool is not None:
            out.update({"pool_shape": list(pool.shape), "pool_strides": list(pool.strides), "pool_bytes": pool.total_bytes})
        if offset is not None:
            out.update({"address": address, "address_byte_offset": offset})
        if cpu is not None:
            out.update(cpu.as_json())
        print(json.dumps(out, indent=2))
        _raise_verdict(report)
        return
    console = SizeConsole()  # rich only on a terminal: --json and plain output never load it
    _print_report(console, report)
    if mamba_note:
        console.print(f"assumed: {mamba_note}", style="dim", highlight=False, soft_wrap=True)
    if step_time:
        console.print(_step_time_line(spec, device if gpu else None, report, tp), highlight=False, soft_wrap=True)
    if pool is not None:
        _print_layout(console, pool, address, offset)
    if cpu is not None:
        from kvsim.size.view_cpu_offload import print_cpu_tier

        print_cpu_tier(console, cpu)
    _raise_verdict(report)


def _raise_verdict(report) -> None:
    """vLLM's start-up refusal (one request of max_model_len does not fit) as the command's error: exit 2."""
    if report.verdict is not None:
        raise KvsimError(report.verdict, field="--max-model-len")


def _cpu_tier(report, cpu_offload: str | None, kv_offloading_size: str | None, cpu_block_size: int | None):
    """The CPU tier of --cpu-offload / --kv-offloading-size (kvsim.size.cpu_offload), or None without one."""
    if cpu_offload is not None and kv_offloading_size is not None:
        raise KvsimError("give --cpu-offload or --kv-offloading-size, not both", field="--kv-offloading-size")
    if cpu_offload is None and kv_offloading_size is None:
        if cpu_block_size is not None:
            raise KvsimError("a CPU block size needs a CPU tier: give --cpu-offload too", field="--cpu-block-size")
        return None
    from kvsim.size.cpu_offload import model_cpu_offload, parse_offloading_size  # loaded with a tier only
    from kvsim.units import parse_bytes

    if cpu_offload is not None:
        return model_cpu_offload(report, parse_bytes(cpu_offload, field="--cpu-offload"), cpu_block_size=cpu_block_size)
    size = parse_offloading_size(kv_offloading_size, field="--kv-offloading-size")
    return model_cpu_offload(report, size, cpu_block_size=cpu_block_size, field="--kv-offloading-size")


def _step_time_line(spec, gpu, report, tp: int) -> str:
    """A decode step's time at the maximum concurrency on the kernels-db clock (imports the database here only)."""
    if gpu is None or report.capacity is None:
        raise KvsimError("needs --gpu (the kernels-db clock times a catalogue GPU)", field="--step-time")
    from kvsim.clock.kernels_db import decode_step_line

    num_seqs = int(report.capacity.max_sequences_block_rounded)
    try:
        return decode_step_line(spec, gpu, num_seqs=num_seqs, context_tokens=report.context_tokens, tp=tp,
                                kv_dtype=report.spec.dtype)
    except KvsimError as exc:  # the clock names workload fields; here they are flags
        flag = {"hardware": "--gpu", "model": "--model", "kv_dtype": "--kv-dtype"}.get(exc.field or "", exc.field)
        raise KvsimError(str(exc).removeprefix(f"{exc.field}: "), field=flag) from None


def _group_shape(model, group, tp: int) -> tuple[str, str]:
    """KV heads per rank and head size ('192/128' where V differs) of a group's layers; '-' where they differ."""
    from kvsim.models.spec import LayerKind

    kinds = {"full": (LayerKind.FULL, LayerKind.MLA), "sliding": (LayerKind.SLIDING,), "chunked": (LayerKind.CHUNKED,)}[group.kind]
    layers = [layer for layer in model.layers if layer.kind in kinds and (group.window is None or layer.window == group.window)]
    shapes = {
        (layer.kv_heads_per_rank(tp), str(layer.latent_dim) if layer.kind == LayerKind.MLA else
         f"{layer.head_dim}" + (f"/{layer.head_dim_v}" if layer.head_dim_v and layer.head_dim_v != layer.head_dim else ""))
        for layer in layers
    }  # fmt: skip
    if len(shapes) != 1:
        return "-", "-"
    heads, dim = shapes.pop()
    return str(heads), dim


def _print_report(console: SizeConsole, report) -> None:
    from kvsim.size.sizing import sliding_cap_bytes_per_sequence

    model, spec, n = report.model, report.spec, report.context_tokens
    title = f"{model.name}" + (f" ({model.hf_id})" if model.hf_id else "") + f": KV cache, {spec.dtype}, tp={report.tp}, per rank"
    kinds = Table(title)
    for col in ("layer group", "layers", "KV heads", "head dim", "B/token", f"per seq @ {n:,}"):
        kinds.add_column(col, justify="left" if col == "layer group" else "right")
    mla = any(layer.kind.value == "mla" for layer in model.layers)
    for g in spec.groups:
        if g.kind == "state":
            kinds.add_row("linear state", str(g.num_layers), "-", "-", "0", _h(g.state_bytes) + " const")
            continue
        name = ("mla latent" if mla else "full") if g.kind == "full" else f"{g.kind}({g.window})"
        kept = n if g.kind == "full" else min(n, g.window)
        heads, dim = _group_shape(model, g, report.tp)
        kinds.add_row(name, str(g.num_layers), heads, dim, f"{g.bytes_per_token:,}", _h(g.bytes_per_token * kept))
    console.print(kinds)

    summary = Table(grid=True)
    summary.add_column(justify="left")
    summary.add_column(justify="right")
    rows = [
        ("KV per token, every per-token layer", _b(spec.bytes_per_token)),
        ("  full attention + MLA", _b(spec.full_bytes_per_token)),
        ("  sliding window / chunked", _b(spec.bytes_per_token - spec.full_bytes_per_token)),
        ("window / chunk cap per sequence", _b(sliding_cap_bytes_per_sequence(spec))),
        ("state per sequence (constant)", _b(spec.state_bytes_per_sequence)),
        (f"per block ({spec.block_size} tokens)", _b(spec.block_bytes)),
        (f"per sequence @ {n:,} tok, capped", _b(report.bytes_per_sequence)),
        (f"per sequence @ {n:,} tok, uncapped", _b(report.bytes_per_sequence_uncapped)),
        (f"per sequence @ {n:,} tok, whole blocks", _b(report.bytes_per_sequence_block_rounded)),
    ]
    cap = report.capacity
    if cap is not None:
        rows += [("device", report.gpu_name or "--memory")]
        rows += _startup_rows(report.startup) if report.startup is not None else []
        rows += [
            ("KV budget", _b(cap.kv_budget_bytes)),
            ("max tokens (uncapped)", f"{cap.max_tokens:,}" if cap.max_tokens is not None else "-"),
        ]
    for label, value in rows:
        summary.add_row(label, value)
    console.print(summary)
    console.print(
        "capped: sliding layers keep only their window, chunked layers their chunk (engines that free blocks outside it); "
        "uncapped: every layer keeps every token.",
        style="dim",
    )
    if report.startup is not None:
        console.print(_startup_note(report.startup), style="dim", highlight=False, soft_wrap=True)
    if report.hybrid is not None:
        print_hybrid_pages(console, report.hybrid, report.settings.mamba_checkpoint_alignment)
    if cap is not None:
        console.print(f"Maximum concurrency for {n:,} tokens per request: {cap.max_sequences:.2f}x", highlight=False, soft_wrap=True)
        print_vllm_lines(console, report)
        if cap.max_sequences_uncapped != cap.max_sequences:
            console.print(f"Maximum concurrency, uncapped (no window freeing): {cap.max_sequences_uncapped:.2f}x", highlight=False, soft_wrap=True)


def _startup_rows(m) -> list[tuple[str, str]]:
    """vLLM 0.33's start-up accounting, term by term, as its worker computes it (estimated terms marked)."""
    gib = 2**30
    graphs = f"{m.num_cudagraphs} CUDA graphs (est.)" if m.num_cudagraphs else "CUDA graphs (--enforce-eager)"
    rows = [
        (f"requested: {m.total_memory / gib:.2f} GiB x {m.gpu_memory_utilization}", f"{m.requested / gib:.2f} GiB"),
        (f"- weights ({m.weights_how.split(',')[0]})", f"{m.weights / gib:.2f} GiB"),
        ("- profile run peak (est.)", f"{m.activation_peak / gib:.2f} GiB"),
        ("- non-torch memory (est.)", f"{m.non_torch / gib:.2f} GiB"),
        (f"- {graphs}", f"{m.cudagraph / gib:.2f} GiB"),
    ]
    if m.kv_cache_memory_bytes is not None:
        rows.append(("Available KV (--kv-cache-memory)", f"{m.available / gib:.2f} GiB"))
    else:
        rows.append((f"= Available KV cache memory (+-{m.estimate_error / gib:.2f})", f"{m.available / gib:.2f} GiB"))
    return rows


def _startup_note(m) -> str:
    """What the start-up terms assume, and where the estimates come from."""
    return (
        f"start-up as vLLM 0.33's worker: memory as CUDA reports it; weights {m.weights_how}; the profile run with "
        f"max_num_batched_tokens {m.max_num_batched_tokens:,} and max_num_seqs {m.max_num_seqs:,}; (est.): estimated "
        "from real vLLM logs within +-0.3 GiB each (docs/startup-memory.md)"
    )


def _print_layout(console: SizeConsole, pool, address: str | None, offset: int | None) -> None:
    table = Table("KV pool tensor [kv, layer, block, token, head, dim] (row-major)")
    table.add_column("")
    for name in ("kv", "layer", "block", "token", "head", "dim"):
        table.add_column(name, justify="right")
    table.add_row("shape", *(f"{n:,}" for n in pool.shape))
    table.add_row("stride (elements)", *(f"{s:,}" for s in pool.strides))
    table.add_row("stride (bytes)", *(f"{s:,}" for s in pool.byte_strides))
    console.print(table)
    console.print(f"pool bytes: {_b(pool.total_bytes)}")
    if offset is not None:
        console.print(f"element [{address}] byte offset: {offset:,}", highlight=False, soft_wrap=True)
