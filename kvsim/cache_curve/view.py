"""`kvsim cache-curve`: a trace's or workload's prefix-cache hit rate at every capacity, as a table, JSON, CSV and chart."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import typer

from kvsim.cache_curve.curve import CacheCurve, lru_prefix_curve
from kvsim.errors import KvsimError
from kvsim.cache_curve.blocks import block_unit_arrays
from kvsim.workload.requests import RequestSpec


@dataclass(frozen=True)
class CurveContext:
    """What the curve is of, and what turns its tokens into bytes: a model's KV bytes per token, a GPU's budget."""

    name: str
    model: str | None = None
    bytes_per_token: int | None = None
    gpu: str | None = None
    budget_bytes: int | None = None
    budget_of: str = ""  # where the budget comes from, for labels

    @property
    def budget_tokens(self) -> int | None:
        return None if self.budget_bytes is None or not self.bytes_per_token else self.budget_bytes // self.bytes_per_token


def cache_curve_of(requests: list[RequestSpec], *, block_size: int) -> CacheCurve:
    """The exact LRU prefix-cache curve of `requests` (arrival order) at `block_size`.

    Each request may hit at most (prompt - 1) // block_size blocks: vLLM computes at least the prompt's
    last token, so a prompt of whole blocks never hits its last one.
    """
    keys, counts, offsets = block_unit_arrays(requests, block_size)
    prompt = np.array([r.num_prompt_tokens for r in requests], dtype=np.int64)  # (r,)
    return lru_prefix_curve(keys, counts, offsets, (prompt - 1) // block_size, block_size=block_size,
                            prompt_tokens=int(prompt.sum()))


def load_requests(target: Path, *, model: str | None, gpu: str | None, kv_dtype: str = "auto") -> tuple[list[RequestSpec], CurveContext]:
    """A workload YAML's requests (its model and KV budget by default) or a trace file's."""
    from kvsim.workload.requests import generate_requests, trace_requests
    from kvsim.workload.traces import read_trace

    budget, budget_of = None, ""
    if target.suffix in (".yaml", ".yml"):
        from kvsim.workload.spec import load_workload

        workload = load_workload(target)
        requests = generate_requests(workload)
        name, kv_dtype = workload.name, workload.kv_dtype
        if model is None and gpu is None:
            model, gpu, budget = workload.model, workload.hardware, _workload_budget(workload)
            budget_of = f"workload {workload.name}"
        model = model or workload.model
    else:
        requests = trace_requests(read_trace(target))
        name = target.stem
    if not requests:
        raise KvsimError("no requests", source=str(target))
    bytes_per_token = None
    if model is not None:
        from kvsim.models.catalogue import resolve_model
        from kvsim.size.sizing import kv_cache_spec

        from kvsim.size.kv_dtype import kv_cache_dtype

        spec = resolve_model(model)
        in_file = target.suffix in (".yaml", ".yml")  # else a trace with --model: vllm serve's auto
        kv_dtype = kv_cache_dtype(kv_dtype, spec, field="kv_dtype" if in_file else "--model", source=str(target) if in_file else None)
        bytes_per_token = kv_cache_spec(spec, kv_dtype=kv_dtype).bytes_per_token
        if gpu is not None and budget is None:
            from kvsim.models.hardware import get_gpu
            from kvsim.size.startup import DEFAULT_GPU_MEMORY_UTILIZATION, vllm_kv_cache_memory

            device = get_gpu(gpu)
            budget = vllm_kv_cache_memory(spec, device.reported_memory_bytes, device_name=device.name, field="--gpu")
            budget_of = f"vLLM's start-up at utilization {DEFAULT_GPU_MEMORY_UTILIZATION}"
        model = spec.name
    elif gpu is not None:
        raise KvsimError("a GPU's KV budget needs a model's KV bytes per token: give --model too", field="--gpu")
    return requests, CurveContext(name, model, bytes_per_token, gpu, budget, budget_of)


def _workload_budget(workload) -> int:
    """The workload's KV budget in bytes, as the replay sizes it."""
    if workload.kv_budget_bytes is not None:
        return workload.kv_budget_bytes
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu
    from kvsim.size.startup import vllm_kv_cache_memory

    gpu = get_gpu(workload.hardware)
    return vllm_kv_cache_memory(resolve_model(workload.model), gpu.reported_memory_bytes,
                                utilization=workload.gpu_memory_utilization, device_name=gpu.name)


def parse_capacities(text: str | None, curve: CacheCurve, field: str = "--capacities") -> np.ndarray:
    """Capacities in tokens, (k,) int64: the comma-separated list, or a 1-2-5 log grid up to where the curve
    reaches the ideal."""
    if text is None:
        top = max(int(curve.knots()[-1]) * curve.block_size, 1000)
        grid = [m * 10**e for e in range(3, 16) for m in (1, 2, 5)]
        return np.array([c for c in grid if c < top] + [next(c for c in grid if c >= top)], dtype=np.int64)
    values = []
    for part in text.split(","):
        try:
            value = float(part.strip())
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or value != int(value) or value > 2**62:
            raise KvsimError(f"expected whole token counts >= 0 like 1e4,1e5,3e6; got {part.strip()!r}", field=field)
        values.append(int(value))
    return np.array(values, dtype=np.int64)


def curve_rows(curve: CacheCurve, capacities: np.ndarray, ctx: CurveContext) -> list[dict]:
    """[{capacity_tokens, capacity_bytes, hit_rate}] at each capacity (bytes None without a model)."""
    rates = curve.hit_rate(capacities)
    return [
        {"capacity_tokens": int(c), "capacity_bytes": None if ctx.bytes_per_token is None else int(c) * ctx.bytes_per_token,
         "hit_rate": float(r)}
        for c, r in zip(capacities.tolist(), rates.tolist())
    ]


def write_curve_csv(curve: CacheCurve, ctx: CurveContext, path: Path) -> Path:
    """The whole curve: a row at every capacity where it bends or steps (linear in between)."""
    blocks = curve.knots()
    hits = curve.hit_blocks(blocks)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["capacity_blocks", "capacity_tokens", "capacity_bytes", "hit_blocks", "hit_rate"])
            for b, h in zip(blocks.tolist(), hits.tolist()):
                tokens = b * curve.block_size
                w.writerow([b, tokens, "" if ctx.bytes_per_token is None else tokens * ctx.bytes_per_token, h,
                            f"{h * curve.block_size / curve.prompt_tokens:.6f}"])
    except OSError as exc:
        raise KvsimError(f"cannot write the curve: {exc.strerror or exc}", source=str(path)) from None
    return path


def show_cache_curve(target: str, *, block_size: int, capacities: str | None, model: str | None, gpu: str | None,
                     as_json: bool, out: str | None, cpu_capacities: str | None = None,
                     cpu_block_size: int | None = None) -> None:
    """The command: the curve at the capacities as a table (or JSON); with --out, the whole curve as CSV and a chart."""
    if block_size < 1:
        raise KvsimError(f"must be >= 1, got {block_size}", field="--block-size")
    path = Path(target)
    if not path.is_file():
        raise KvsimError("no such trace or workload file", source=target)
    requests, ctx = load_requests(path, model=model, gpu=gpu)
    curve = cache_curve_of(requests, block_size=block_size)
    caps = parse_capacities(capacities, curve)
    rows = curve_rows(curve, caps, ctx)
    tiers = cpu_caps = None
    if cpu_capacities is not None:  # the second tier: vLLM's CPU offloading (kvsim.cache_curve.view_tiers)
        from kvsim.cache_curve.view_tiers import tier_requests, tier_rows

        cpu_caps = parse_capacities(cpu_capacities, curve, field="--cpu-capacities")
        tier_reqs = tier_requests(requests, block_size=block_size, cpu_block_size=cpu_block_size)
        tiers = tier_rows(tier_reqs, caps, cpu_caps)
    elif cpu_block_size is not None:
        raise KvsimError("a CPU block size needs CPU capacities: give --cpu-capacities too", field="--cpu-block-size")
    if out is not None:
        from kvsim.plots.cache_curve import cache_curve_chart
        from kvsim.plots.style import save

        out_dir = Path(out)
        written = [write_curve_csv(curve, ctx, out_dir / "cache-curve.csv"),
                   save(cache_curve_chart(curve, ctx), out_dir / "cache-curve.png")]
        if tiers is not None:
            from kvsim.cache_curve.view_tiers import write_tiers_csv
            from kvsim.plots.cache_curve import two_tier_chart

            written += [write_tiers_csv(tiers, ctx.bytes_per_token, out_dir / "cache-curve-tiers.csv"),
                        save(two_tier_chart(tiers, curve, ctx, tier_reqs.cpu_block_size), out_dir / "cache-curve-tiers.png")]
    if as_json:
        doc = {"ideal_hit_rate": curve.ideal_hit_rate, "block_size": block_size,
               "num_requests": curve.num_requests, "prompt_tokens": curve.prompt_tokens, "curve": rows}
        if tiers is not None:
            doc.update({"cpu_block_size": tier_reqs.cpu_block_size, "cpu_policy": "lru", "tiers": tiers})
        typer.echo(json.dumps(doc))
        return
    typer.echo(f"{ctx.name}: {curve.num_requests:,} requests, {curve.prompt_tokens:,} prompt tokens, block size {block_size}"
               + (f", {ctx.model} KV {ctx.bytes_per_token:,} B/token" if ctx.model else ""))
    typer.echo("LRU cache of blocks, requests in arrival order, each alone (no concurrency)")
    typer.echo(f"{'capacity tokens':>18} {'capacity GiB':>13} {'hit rate':>9}")
    for row in rows:
        gib = "" if row["capacity_bytes"] is None else f"{row['capacity_bytes'] / 2**30:.2f}"
        typer.echo(f"{row['capacity_tokens']:>18,} {gib:>13} {row['hit_rate']:>9.1%}")
    typer.echo(f"{'unbounded (ideal)':>18} {'':>13} {curve.ideal_hit_rate:>9.1%}")
    if ctx.budget_tokens is not None:
        rate = float(curve.hit_rate(np.array([ctx.budget_tokens]))[0])
        typer.echo(f"KV budget of {ctx.model} on {ctx.gpu} ({ctx.budget_of}): {ctx.budget_tokens:,} tokens "
                   f"({ctx.budget_bytes / 2**30:.1f} GiB): hit rate {rate:.1%}")
    if tiers is not None:
        from kvsim.cache_curve.view_tiers import print_tiers

        print_tiers(typer.echo, tiers, cpu_caps, ctx.bytes_per_token, tier_reqs.cpu_block_size)
    if out is not None:
        for p in written:
            typer.echo(str(p))
