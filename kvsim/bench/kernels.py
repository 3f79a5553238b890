"""`kvsim bench kernels`: what paging costs in the write and decode-attention kernels, against a roofline.

For one layer of a model's real shapes and each (batch size, context length, block size): the K/V write
through a slot mapping (index_copy_, index_put_, the fused Triton scatter), and decode attention (contiguous
SDPA baseline, gather-then-SDPA, paged FlexAttention and its contiguous control), beside a same-size
device-to-device copy and a read-only reduction measured in the same run. CPU numbers are not GPU numbers.
"""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from kvsim.bench import flex_paged
from kvsim.engine import kernels
from kvsim.engine.cache import TORCH_DTYPES, resolve_device
from kvsim.errors import KvsimError

BENCH_DTYPES = ("bf16", "fp16", "fp32")  # SDPA and FlexAttention compute in these
DEFAULT_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
# GPU sizes reach KV reads of GiBs (>> L2); CPU sizes keep the whole run to seconds.
DEFAULT_SIZES = {"cuda": ((8, 64), (2048, 16384)), "cpu": ((2,), (256,))}
WRITE_KERNELS = ("index_copy", "index_put", "triton")
COLUMNS = [
    "device", "torch_version", "triton_version", "model", "kv_dtype", "num_kv_heads", "num_q_heads", "head_dim",
    "block_size", "batch_size", "context_len", "op", "kernel", "status", "num_tokens", "bytes", "median_us",
    "p20_us", "p80_us", "reps", "bandwidth_gbps", "roofline_gbps", "pct_of_roofline", "max_abs_err",
    "working_set_bytes", "l2_bytes", "l2_flushed", "flex_compiled",
]  # fmt: skip


@dataclass(frozen=True)
class KernelShape:
    """One attention layer as the kernels see it (per TP rank): KV heads, query heads, head dim, dtype."""

    model: str
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    kv_dtype: str
    dtype_bytes: int

    def kv_bytes(self, num_tokens: int) -> int:
        """K and V of `num_tokens` tokens of one layer."""
        return 2 * num_tokens * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def write_bytes(self, num_tokens: int) -> int:
        """A scatter's algorithmic traffic: read the new K/V, write it to the pool, read int64 slots."""
        return 2 * self.kv_bytes(num_tokens) + 8 * num_tokens

    def decode_bytes(self, batch: int, context_len: int, index_bytes: int = 0) -> int:
        """One decode step: read every sequence's K/V, read q and write the output (+ the block table read)."""
        return self.kv_bytes(batch * context_len) + 2 * batch * self.num_q_heads * self.head_dim * self.dtype_bytes + index_bytes


def model_shape(model: str, kv_dtype: str = "bf16") -> KernelShape:
    """The first attention layer of `model` (catalogue name, HF id or config.json). MLA reads one latent head."""
    from kvsim.catalogue import resolve_model
    from kvsim.sizing import kv_cache_spec

    if kv_dtype not in BENCH_DTYPES:
        raise KvsimError(f"the kernel benchmark runs {', '.join(BENCH_DTYPES)}, got {kv_dtype!r}", field="--kv-dtype")
    spec = resolve_model(model)
    kv = kv_cache_spec(spec, kv_dtype=kv_dtype)
    if kv.num_kv_heads == 0:
        raise KvsimError(f"{spec.name} has no attention layer to benchmark", field="--model")
    return KernelShape(spec.name, kv.num_kv_heads, spec.num_attention_heads, kv.head_dim, kv_dtype, kv.dtype_bytes)


@dataclass(frozen=True)
class Timing:
    """Microseconds per call over `reps` repetitions: median and the 20th/80th percentiles."""

    median_us: float
    p20_us: float
    p80_us: float
    reps: int


def measure(fn: Callable[[], object], device: torch.device, *, reps: int) -> Timing:
    """Time `fn`, already warmed up (and compiled) by the caller, over at least `reps` repetitions.

    CUDA: CUDA events around each call, L2 flushed before each by zeroing a buffer twice its size (as
    triton.testing.do_bench does), and repetitions added until they span about 100 ms.
    CPU: a perf_counter loop of at least `reps` calls, more (up to 1000) until they span 0.2 s, so that a
    shared machine's scheduler preempting one call does not move the median.
    """
    import time

    if device.type != "cuda":
        times: list[float] = []
        while len(times) < reps or (sum(times) < 2e5 and len(times) < 1000):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        reps = len(times)
    else:
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        flush = torch.empty(max(2 * l2, 2**28) // 4, dtype=torch.int32, device=device)
        probe = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        probe[0].record()
        for _ in range(5):
            fn()
        probe[1].record()
        torch.cuda.synchronize(device)
        estimate_ms = max(probe[0].elapsed_time(probe[1]) / 5, 1e-3)
        reps = max(reps, min(1000, int(100 / estimate_ms)))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) * 1e3 for start, end in events]
    p20, median, p80 = np.percentile(times, [20, 50, 80])
    return Timing(float(median), float(p20), float(p80), reps)


def random_block_tables(batch: int, context_len: int, block_size: int, generator: torch.Generator) -> torch.Tensor:
    """(B, ceil(context_len / block_size)) int64: a random permutation of the pool's blocks, as a long-running
    allocator leaves them (no two neighbouring logical blocks are physically adjacent on purpose)."""
    blocks_per_seq = -(-context_len // block_size)
    perm = torch.randperm(batch * blocks_per_seq, generator=generator)
    return perm.view(batch, blocks_per_seq)


def slot_mapping(block_tables: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """(B * context_len,) int64: the pool slot of every token of every sequence, sequence-major."""
    positions = torch.arange(context_len, device=block_tables.device)  # (T,)
    blocks = block_tables[:, positions // block_size]  # (B, T)
    return (blocks * block_size + positions % block_size).reshape(-1)


def versions() -> tuple[str, str]:
    try:
        import triton

        return torch.__version__, triton.__version__
    except ImportError:
        return torch.__version__, ""


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def slugify(name: str) -> str:
    """A file-name-safe device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_slug(device: torch.device) -> str:
    """`slugify` of the CUDA device's name, or 'cpu'."""
    return slugify(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu"


def parse_sizes(text: str | None, field: str) -> tuple[int, ...] | None:
    """'8,16,32' -> (8, 16, 32); None stays None (the device's default); a KvsimError naming `field` otherwise."""
    if text is None:
        return None
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise KvsimError(f"expected comma-separated whole numbers like 8,16,32, got {text!r}", field=field) from None
    if not sizes or min(sizes) < 1:
        raise KvsimError(f"expected whole numbers >= 1, got {text!r}", field=field)
    return sizes


class _Case:
    """The tensors of one (batch, context length): a contiguous cache, the same K/V as a write source, a query.

        k, v  (B, num_kv_heads, T, head_dim)           contiguous, the SDPA baseline's cache
        src   [2, 1, B*T, num_kv_heads, head_dim]      the same values token-major: what a write scatters
        q     (B, num_q_heads, 1, head_dim)
    """

    def __init__(self, shape: KernelShape, batch: int, context_len: int, device: torch.device, seed: int):
        gen = torch.Generator(device=device).manual_seed(seed)
        dtype = TORCH_DTYPES[shape.kv_dtype]
        h, d = shape.num_kv_heads, shape.head_dim
        self.batch, self.context_len, self.num_tokens = batch, context_len, batch * context_len
        self.k = torch.randn(batch, h, context_len, d, generator=gen, device=device, dtype=dtype)
        self.v = torch.randn(batch, h, context_len, d, generator=gen, device=device, dtype=dtype)
        self.q = torch.randn(batch, shape.num_q_heads, 1, d, generator=gen, device=device, dtype=dtype)
        self.src = torch.stack([self.k.transpose(1, 2), self.v.transpose(1, 2)]).reshape(2, 1, self.num_tokens, h, d)
        self.seq_lens = torch.full((batch,), context_len, dtype=torch.int64, device=device)

    def reference(self) -> torch.Tensor:
        """Contiguous SDPA decode: (B, num_q_heads, 1, head_dim)."""
        return F.scaled_dot_product_attention(self.q, self.k, self.v, enable_gqa=True)


def _time(fn: Callable[[], torch.Tensor | None], device: torch.device, reps: int):
    """Warm `fn` up (compiling it), then `measure` it: (Timing, first output, "ok"). A kernel's failure
    (compile error, OOM) becomes (None, None, "error: ...") instead of aborting the sweep."""
    try:
        out = fn()
        return measure(fn, device, reps=reps), out, "ok"
    except Exception as exc:  # noqa: BLE001 - any kernel failure becomes a CSV row, the sweep goes on
        message = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        return None, None, f"error: {type(exc).__name__}: {message}"


def bench_case(shape: KernelShape, batch: int, context_len: int, block_sizes: tuple[int, ...], device: torch.device,
               *, reps: int, compiled: bool, seed: int = 0) -> list[dict]:
    """Every kernel of one (batch, context length) across `block_sizes`: one dict per CSV row (no context columns)."""
    case = _Case(shape, batch, context_len, device, seed)
    n = case.num_tokens
    rows: list[dict] = []

    def row(op, kernel, block_size, nbytes, timing, status, roofline=None, err=None):
        """Append one row; a roofline row (op 'roofline') is its own roofline. Returns the achieved GB/s."""
        bw = nbytes / (timing.median_us * 1e-6) / 1e9 if timing else None
        roofline = bw if op == "roofline" else roofline
        rows.append(dict(
            block_size=block_size, op=op, kernel=kernel, status=status, num_tokens=n, bytes=nbytes,
            median_us=timing.median_us if timing else None, p20_us=timing.p20_us if timing else None,
            p80_us=timing.p80_us if timing else None, reps=timing.reps if timing else None, bandwidth_gbps=bw,
            roofline_gbps=roofline, pct_of_roofline=100 * bw / roofline if bw and roofline else None,
            max_abs_err=err, working_set_bytes=shape.kv_bytes(n),
        ))  # fmt: skip
        return bw

    # Rooflines at this case's size: a device-to-device copy of the K/V (read + write) and a read-only sum.
    dst = torch.empty_like(case.src)
    timing, _, status = _time(lambda: dst.copy_(case.src), device, reps)
    copy_bw = row("roofline", "copy", None, 2 * shape.kv_bytes(n), timing, status)
    del dst
    timing, _, status = _time(lambda: case.src.sum(dtype=torch.float32), device, reps)
    read_bw = row("roofline", "read", None, shape.kv_bytes(n), timing, status)
    timing, ref, status = _time(case.reference, device, reps)
    row("decode", "sdpa_contiguous", None, shape.decode_bytes(batch, context_len), timing, status, read_bw, 0.0)
    if ref is None:  # nothing to check the paged kernels against: compute it once, untimed
        ref = case.reference()

    for bs in block_sizes:
        gen = torch.Generator().manual_seed(seed + bs)
        tables = random_block_tables(batch, context_len, bs, gen).to(device)  # (B, M)
        slots = slot_mapping(tables, context_len, bs)  # (B*T,)
        num_blocks = tables.numel()
        kv_cache = torch.zeros(2, 1, num_blocks, bs, shape.num_kv_heads, shape.head_dim, dtype=case.k.dtype, device=device)
        kv_flat = kv_cache.view(2, 1, num_blocks * bs, shape.num_kv_heads, shape.head_dim)
        writers = {"index_copy": kernels.scatter_index_copy, "index_put": kernels.scatter_index_put,
                   "triton": kernels.scatter_triton}  # fmt: skip
        for name in WRITE_KERNELS:
            if name == "triton" and not (device.type == "cuda" and kernels.HAS_TRITON):
                row("write", name, bs, shape.write_bytes(n), None, "skipped: needs CUDA and triton")
                continue
            kv_cache.zero_()
            timing, _, status = _time(lambda w=writers[name]: w(kv_flat, slots, case.src), device, reps)
            err = float((kv_flat[:, :, slots] - case.src).abs().max()) if timing else None
            row("write", name, bs, shape.write_bytes(n), timing, status, copy_bw, err)

        def gather_sdpa(tables=tables, kv_cache=kv_cache):
            kv = kernels.gather_paged(kv_cache, tables)  # [2, 1, B, M*bs, H, D]
            return kernels.decode_attention(case.q[:, :, 0], kv[0, 0], kv[1, 0], case.seq_lens).unsqueeze(2)

        paged_mask = flex_paged.decode_block_mask(tables, case.seq_lens, bs, num_blocks * bs)
        k_pool, v_pool = flex_paged.pool_as_sequence(kv_cache[0, 0]), flex_paged.pool_as_sequence(kv_cache[1, 0])
        decoders = {
            "gather_sdpa": (gather_sdpa, tables.numel() * tables.element_size()),
            "flex_paged": (lambda m=paged_mask, k=k_pool, v=v_pool: flex_paged.flex_decode(case.q, k, v, m, compiled=compiled),
                           tables.numel() * 4),
        }  # fmt: skip
        if context_len % bs == 0:
            identity = torch.arange(tables.shape[1], device=device).expand(batch, -1)
            contiguous_mask = flex_paged.decode_block_mask(identity, case.seq_lens, bs, context_len)
            decoders["flex_contiguous"] = (
                lambda m=contiguous_mask: flex_paged.flex_decode(case.q, case.k, case.v, m, compiled=compiled),
                tables.numel() * 4,
            )
        else:
            row("decode", "flex_contiguous", bs, shape.decode_bytes(batch, context_len), None,
                "skipped: context_len is not a multiple of block_size")  # fmt: skip
        for name, (fn, index_bytes) in decoders.items():
            timing, out, status = _time(fn, device, reps)
            err = float((out.float() - ref.float()).abs().max()) if timing else None
            row("decode", name, bs, shape.decode_bytes(batch, context_len, index_bytes), timing, status, read_bw, err)
        del kv_cache, kv_flat, paged_mask, decoders, gather_sdpa  # free this pool before the next one
    return rows


def bench_kernels(model: str = "llama-3.1-8b", *, block_sizes: tuple[int, ...] | None = None,
                  batch_sizes: tuple[int, ...] | None = None, context_lens: tuple[int, ...] | None = None,
                  kv_dtype: str = "bf16", device: str = "auto", reps: int = 10, out_dir: str | Path = "reports/bench",
                  compile_flex: bool | None = None, progress: Callable[[str], None] | None = None):
    """Run the sweep and write `out_dir/kernels-<device>.csv`; returns (DataFrame, csv path).

    Defaults follow the device (DEFAULT_SIZES). `compile_flex` None compiles FlexAttention on CUDA only:
    compiling on CPU costs seconds per shape, so CPU runs the exact but unfused eager FlexAttention, on
    one thread.
    """
    import pandas as pd

    shape = model_shape(model, kv_dtype)
    dev = resolve_device(device)
    if reps < 1:
        raise KvsimError(f"must be >= 1, got {reps}", field="--reps")
    default_batches, default_contexts = DEFAULT_SIZES["cuda" if dev.type == "cuda" else "cpu"]
    block_sizes = block_sizes or DEFAULT_BLOCK_SIZES
    compiled = dev.type == "cuda" if compile_flex is None else compile_flex
    torch_version, triton_version = versions()
    context = dict(
        device=device_name(dev), torch_version=torch_version, triton_version=triton_version, model=shape.model,
        kv_dtype=kv_dtype, num_kv_heads=shape.num_kv_heads, num_q_heads=shape.num_q_heads, head_dim=shape.head_dim,
        l2_bytes=torch.cuda.get_device_properties(dev).L2_cache_size if dev.type == "cuda" else None,
        l2_flushed=dev.type == "cuda", flex_compiled=compiled,
    )  # fmt: skip
    rows = []
    threads = torch.get_num_threads()
    if dev.type == "cpu":  # one thread: on a busy machine every multi-threaded op waits for a time slice
        torch.set_num_threads(1)
    try:
        for batch in batch_sizes or default_batches:
            for context_len in context_lens or default_contexts:
                if progress:
                    progress(f"batch {batch}, context {context_len}")
                for r in bench_case(shape, batch, context_len, block_sizes, dev, reps=reps, compiled=compiled):
                    rows.append({**context, "batch_size": batch, "context_len": context_len, **r})
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(threads)
    frame = pd.DataFrame(rows, columns=COLUMNS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernels-{device_slug(dev)}.csv"
    frame.to_csv(path, index=False)
    return frame, path


def render_table(frame, console) -> None:
    """Two rich tables, a row per (batch, context, block size): writes as % of the copy roofline, and
    decode times with the paging cost (paged / contiguous FlexAttention) and the best % of the read roofline."""
    from rich.table import Table

    def pick(rows, kernel, field):
        hit = rows[(rows["kernel"] == kernel) & (rows["status"] == "ok")]
        return hit[field].iat[0] if len(hit) else None

    def fmt(value, spec="{:.0f}"):
        return "-" if value is None or value != value else spec.format(value)

    def us(value):  # 3 significant digits up to 999, whole microseconds above
        return fmt(value, "{:.3g}" if value is not None and value < 1000 else "{:.0f}")

    title = f"{frame['model'].iat[0]} on {frame['device'].iat[0]}"
    writes = Table(title=f"K/V write, % of copy bandwidth: {title}")
    decode = Table(title=f"Decode attention, us per step: {title}")
    for table, cols in ((writes, ("batch", "context", "block", "copy GB/s", *WRITE_KERNELS)),
                        (decode, ("batch", "context", "block", "sdpa", "gather", "flex paged", "flex contig",
                                  "paged/contig", "best % read"))):  # fmt: skip
        for col in cols:
            table.add_column(col, justify="right")
    for (batch, ctx), group in frame.groupby(["batch_size", "context_len"], sort=False):
        shared = group[group["block_size"].isna()]
        for bs, rows in group.dropna(subset=["block_size"]).groupby("block_size", sort=False):
            key = (str(batch), str(ctx), str(int(bs)))
            writes.add_row(*key, fmt(pick(shared, "copy", "bandwidth_gbps"), "{:.1f}"),
                           *(fmt(pick(rows, k, "pct_of_roofline")) for k in WRITE_KERNELS))  # fmt: skip
            paged, contig = pick(rows, "flex_paged", "median_us"), pick(rows, "flex_contiguous", "median_us")
            ok = group[(group["op"] == "decode") & (group["status"] == "ok") & (group["block_size"].isna() | (group["block_size"] == bs))]
            decode.add_row(
                *key, us(pick(shared, "sdpa_contiguous", "median_us")), us(pick(rows, "gather_sdpa", "median_us")),
                us(paged), us(contig), fmt(paged / contig if paged and contig else None, "{:.3f}"),
                fmt(ok["pct_of_roofline"].max() if len(ok) else None),
            )  # fmt: skip
    console.print(writes)
    console.print(decode)
    if frame["device"].iat[0].startswith("cpu"):
        console.print("[yellow]CPU run: one thread, eager FlexAttention, no Triton, no L2 flush. These are not GPU numbers.[/yellow]")


def show_bench_kernels(model: str, *, block_sizes: str | None, batch_sizes: str | None, context_lens: str | None,
                       kv_dtype: str, device: str, reps: int | None, out_dir: str, compile_flex: bool | None) -> Path:
    """The `kvsim bench kernels` command: run the sweep with a status line, print the table and the CSV path."""
    from rich.console import Console

    console = Console()
    dev = resolve_device(device)
    with console.status("benchmarking kernels") as status:
        frame, path = bench_kernels(
            model, block_sizes=parse_sizes(block_sizes, "--block-sizes"), batch_sizes=parse_sizes(batch_sizes, "--batch-sizes"),
            context_lens=parse_sizes(context_lens, "--context-lens"), kv_dtype=kv_dtype, device=device,
            reps=reps if reps is not None else (10 if dev.type == "cuda" else 3), out_dir=out_dir,
            compile_flex=compile_flex, progress=lambda text: status.update(f"benchmarking kernels: {text}"),
        )  # fmt: skip
    render_table(frame, console)
    failed = frame[frame["status"].str.startswith("error")]
    for _, r in failed.iterrows():
        console.print(f"[red]{r['kernel']} (block {r['block_size']}, batch {r['batch_size']}, context {r['context_len']}): {r['status']}[/red]")
    console.print(f"wrote {path}")
    return path
