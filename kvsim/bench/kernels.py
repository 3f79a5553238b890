"""`kvsim bench kernels`, the sweep: per (batch, context length, block size) of one model layer, time the K/V
write (index_copy_, index_put_, numpy row copies on CPU, Triton scatter) and decode attention (SDPA, gather-then-SDPA, paged and contiguous
FlexAttention) beside a same-size copy and a read-only reduction (the rooflines); one CSV row per kernel."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kvsim.bench import flex_paged
from kvsim.bench.kernel_problem import KernelShape, model_shape, random_block_tables, slot_mapping
from kvsim.bench.kernel_timing import measure
from kvsim.engine.tensors import kernels
from kvsim.engine.tensors.device import TORCH_DTYPES, device_name, device_slug, resolve_device
from kvsim.errors import KvsimError
from kvsim.out_paths import output_dir, output_file

DEFAULT_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
# GPU sizes reach KV reads of GiBs (>> L2); CPU sizes keep the whole run to seconds.
DEFAULT_SIZES = {"cuda": ((8, 64), (2048, 16384)), "cpu": ((2,), (256,))}
WRITE_KERNELS = kernels.WRITE_KERNELS  # index_copy, index_put, rows (CPU), triton (CUDA)
COLUMNS = [
    "device", "torch_version", "triton_version", "model", "kv_dtype", "num_kv_heads", "num_q_heads", "head_dim",
    "block_size", "batch_size", "context_len", "op", "kernel", "status", "num_tokens", "bytes", "median_us",
    "p20_us", "p80_us", "reps", "bandwidth_gbps", "roofline_gbps", "pct_of_roofline", "max_abs_err",
    "working_set_bytes", "l2_bytes", "l2_flushed", "flex_compiled", "flex_split_kv",
]  # fmt: skip


def versions() -> tuple[str, str]:
    """(torch version, triton version or '' without triton), written into every CSV row."""
    try:
        import triton

        return torch.__version__, triton.__version__
    except ImportError:
        return torch.__version__, ""


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


def _new_pool(num_blocks: int, block_size: int, shape: KernelShape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's paged pool, [2, 1, num_blocks, block_size, num_kv_heads, head_dim], zeroed."""
    return torch.zeros(2, 1, num_blocks, block_size, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)


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
               *, reps: int, compiled: bool, seed: int = 0, progress: Callable[[str], None] | None = None) -> list[dict]:
    """Every kernel of one (batch, context length) across `block_sizes`: one dict per CSV row (no context columns).

    `progress` hears "block N" as each block size starts.
    """
    case = _Case(shape, batch, context_len, device, seed)
    n = case.num_tokens
    rows: list[dict] = []

    def row(op, kernel, block_size, nbytes, timing, status, roofline=None, err=None, split_kv=None):
        """Append one row; a roofline row (op 'roofline') is its own roofline. Returns the achieved GB/s."""
        bw = nbytes / (timing.median_us * 1e-6) / 1e9 if timing else None
        roofline = bw if op == "roofline" else roofline
        rows.append(dict(
            block_size=block_size, op=op, kernel=kernel, status=status, num_tokens=n, bytes=nbytes,
            median_us=timing.median_us if timing else None, p20_us=timing.p20_us if timing else None,
            p80_us=timing.p80_us if timing else None, reps=timing.reps if timing else None, bandwidth_gbps=bw,
            roofline_gbps=roofline, pct_of_roofline=100 * bw / roofline if bw and roofline else None,
            max_abs_err=err, working_set_bytes=shape.kv_bytes(n), flex_split_kv=split_kv,
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
        if progress:
            progress(f"block {bs}")
        gen = torch.Generator().manual_seed(seed + bs)
        tables = random_block_tables(batch, context_len, bs, gen).to(device)  # (B, M)
        slots = slot_mapping(tables, context_len, bs)  # (B*T,)
        num_blocks = tables.numel()
        kv_cache = _new_pool(num_blocks, bs, shape, case.k.dtype, device)
        kv_flat = kv_cache.view(2, 1, num_blocks * bs, shape.num_kv_heads, shape.head_dim)
        writers = {"index_copy": kernels.scatter_index_copy, "index_put": kernels.scatter_index_put,
                   "triton": kernels.scatter_triton}  # fmt: skip
        if device.type == "cpu":  # numpy token rows of the pool and the source, made once, outside the timing
            pool_rows, src_rows, host_slots = kernels.token_rows(kv_flat), kernels.token_rows(case.src), slots.numpy()
            writers["rows"] = lambda *_: kernels.scatter_rows(pool_rows, host_slots, src_rows)
        for name in WRITE_KERNELS:
            if name == "triton" and not (device.type == "cuda" and kernels.HAS_TRITON):
                row("write", name, bs, shape.write_bytes(n), None, "skipped: needs CUDA and triton")
                continue
            if name == "rows" and device.type != "cpu":
                row("write", name, bs, shape.write_bytes(n), None, "skipped: numpy's row copies run on the CPU")
                continue
            kv_cache.zero_()
            timing, _, status = _time(lambda w=writers[name]: w(kv_flat, slots, case.src), device, reps)
            err = float((kv_flat[:, :, slots] - case.src).abs().max()) if timing else None
            row("write", name, bs, shape.write_bytes(n), timing, status, copy_bw, err)

        def gather_sdpa(tables=tables, kv_cache=kv_cache):
            kv = kernels.gather_paged(kv_cache, tables)  # [2, 1, B, M*bs, H, D]
            return kernels.decode_attention(case.q[:, :, 0], kv[0, 0], kv[1, 0], case.seq_lens).unsqueeze(2)

        decode_bytes = shape.decode_bytes(batch, context_len)
        decoders = {"gather_sdpa": (gather_sdpa, tables.numel() * tables.element_size(), None)}
        flex_skip = flex_paged.unsupported_block_size(bs, case.k.dtype, device, compiled)
        if flex_skip:  # the Triton kernel cannot tile these blocks: say so instead of a compile error per kernel
            for name in ("flex_paged", "flex_contiguous"):
                row("decode", name, bs, decode_bytes, None, flex_skip)
        else:
            split = flex_paged.pool_split_kv(batch, shape.num_kv_heads, num_blocks * bs, context_len, device) if compiled else None
            paged_mask = flex_paged.decode_block_mask(tables, case.seq_lens, bs, num_blocks * bs)
            k_pool, v_pool = flex_paged.pool_as_sequence(kv_cache[0, 0]), flex_paged.pool_as_sequence(kv_cache[1, 0])
            decoders["flex_paged"] = (
                lambda m=paged_mask, k=k_pool, v=v_pool: flex_paged.flex_decode(case.q, k, v, m, compiled=compiled, split_kv=split),
                tables.numel() * 4, split,
            )  # fmt: skip
            del k_pool, v_pool  # views of the pool: only the lambda may keep it alive
            if context_len % bs == 0:
                identity = torch.arange(tables.shape[1], device=device).expand(batch, -1)
                contiguous_mask = flex_paged.decode_block_mask(identity, case.seq_lens, bs, context_len)
                decoders["flex_contiguous"] = (
                    lambda m=contiguous_mask: flex_paged.flex_decode(case.q, case.k, case.v, m, compiled=compiled),
                    tables.numel() * 4, None,
                )
            else:
                row("decode", "flex_contiguous", bs, decode_bytes, None,
                    "skipped: context_len is not a multiple of block_size")  # fmt: skip
        for name, (fn, index_bytes, split_kv) in decoders.items():
            timing, out, status = _time(fn, device, reps)
            err = float((out.float() - ref.float()).abs().max()) if timing else None
            row("decode", name, bs, shape.decode_bytes(batch, context_len, index_bytes), timing, status, read_bw, err, split_kv)
            del out
        # Free this pool before the next block size allocates its own: nothing may hold a view of it, and
        # compiling FlexAttention leaves reference cycles (Dynamo's tracing state) that hold its inputs.
        del kv_cache, kv_flat, decoders, gather_sdpa, writers
        gc.collect()
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
    path = output_file(output_dir(out_dir) / f"kernels-{device_slug(dev)}.csv")
    rows = []
    threads = torch.get_num_threads()
    if dev.type == "cpu":  # one thread: on a busy machine every multi-threaded op waits for a time slice
        torch.set_num_threads(1)
    try:
        for batch in batch_sizes or default_batches:
            for context_len in context_lens or default_contexts:
                where = f"batch {batch}, context {context_len}"
                on_block = (lambda text, where=where: progress(f"{where}, {text}")) if progress else None
                for r in bench_case(shape, batch, context_len, block_sizes, dev, reps=reps, compiled=compiled, progress=on_block):
                    rows.append({**context, "batch_size": batch, "context_len": context_len, **r})
                # Rewritten after every case: a run stopped by a time limit keeps the cases it finished.
                pd.DataFrame(rows, columns=COLUMNS).to_csv(path, index=False)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(threads)
    return pd.DataFrame(rows, columns=COLUMNS), path
