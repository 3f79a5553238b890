"""What `kvsim bench kernels` shows: its size options parsed, the sweep run under a status line, and two rich
tables (writes as % of the copy roofline, decode times with the paging cost); presentation only."""

from __future__ import annotations

from pathlib import Path

from kvsim.bench.kernels import WRITE_KERNELS, bench_kernels
from kvsim.engine.tensors.device import resolve_device
from kvsim.errors import KvsimError


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


CPU_NOTES = (
    "sdpa vs gather: `sdpa` is torch SDPA over the contiguous cache with enable_gqa=True; `gather` copies the "
    "blocks out and runs SDPA with each KV head's query heads folded into rows and a padding mask "
    "(kvsim.engine.tensors.kernels.decode_attention). On a CPU these take different SDPA code paths, so their ratio "
    "measures those paths (either may win by several times), not the gather's cost.",
    "* eager FlexAttention over the paged pool evaluates its mask over every block of the pool for every "
    "sequence (only a compiled kernel skips blocks outside a block table), so `flex paged` grows with the "
    "pool, i.e. with the batch, and `paged/contig` here is not the cost of paging. Compile it (--compile-flex) "
    "or read the GPU run for that.",
)


def render_table(frame, console) -> None:
    """Two rich tables, a row per (batch, context, block size): writes as % of the copy roofline, and
    decode times with the paging cost (paged / contiguous FlexAttention) and the best % of the read roofline."""

    def pick(rows, kernel, field):
        hit = rows[(rows["kernel"] == kernel) & (rows["status"] == "ok")]
        return hit[field].iat[0] if len(hit) else None

    def fmt(value, spec="{:.0f}"):
        return "-" if value is None or value != value else spec.format(value)

    def us(value):  # 3 significant digits up to 999, whole microseconds above
        return fmt(value, "{:.3g}" if value is not None and value < 1000 else "{:.0f}")

    title = f"{frame['model'].iat[0]} on {frame['device'].iat[0]}"
    on_cpu = frame["device"].iat[0].startswith("cpu")
    star = "*" if on_cpu and not frame["flex_compiled"].iat[0] else ""  # eager paged FlexAttention: see the notes
    write_cols = ("batch", "context", "block", "copy\nGB/s", *WRITE_KERNELS)
    decode_cols = ("batch", "context", "block", "sdpa", "gather", f"flex\npaged{star}", "flex\ncontig",
                   f"paged/\ncontig{star}", "best %\nread")  # fmt: skip
    write_rows, decode_rows = [], []
    for (batch, ctx), group in frame.groupby(["batch_size", "context_len"], sort=False):
        shared = group[group["block_size"].isna()]
        for bs, rows in group.dropna(subset=["block_size"]).groupby("block_size", sort=False):
            key = (str(batch), str(ctx), str(int(bs)))
            write_rows.append((*key, fmt(pick(shared, "copy", "bandwidth_gbps"), "{:.1f}"),
                               *(fmt(pick(rows, k, "pct_of_roofline")) for k in WRITE_KERNELS)))  # fmt: skip
            paged, contig = pick(rows, "flex_paged", "median_us"), pick(rows, "flex_contiguous", "median_us")
            ok = group[(group["op"] == "decode") & (group["status"] == "ok") & (group["block_size"].isna() | (group["block_size"] == bs))]
            decode_rows.append((
                *key, us(pick(shared, "sdpa_contiguous", "median_us")), us(pick(rows, "gather_sdpa", "median_us")),
                us(paged), us(contig), fmt(paged / contig if paged and contig else None, "{:.3f}"),
                fmt(ok["pct_of_roofline"].max() if len(ok) else None),
            ))  # fmt: skip
    console.print(_uncut_table(f"K/V write, % of copy bandwidth: {title}", write_cols, write_rows))
    console.print(_uncut_table(f"Decode attention, us per step: {title}", decode_cols, decode_rows))
    if on_cpu:
        console.print("[yellow]CPU run: one thread, eager FlexAttention, no Triton, no L2 flush. These are not GPU numbers.[/yellow]")
        for note in CPU_NOTES if star else CPU_NOTES[:1]:
            console.print(note, markup=False, highlight=False)


def _uncut_table(title: str, headers: tuple[str, ...], rows: list[tuple[str, ...]]):
    """A right-aligned table whose cells and header words are never cut: each column is as wide as its widest
    cell or header line, with one space between columns and no vertical rules (the kernels' tables fit 80
    columns this way; a wider table wraps the terminal's lines rather than eat a digit)."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), pad_edge=False)
    for j, header in enumerate(headers):
        width = max([len(line) for line in header.split("\n")] + [len(row[j]) for row in rows])
        table.add_column(header, justify="right", no_wrap=True, min_width=width)
    for row in rows:
        table.add_row(*row)
    return table


def show_bench_kernels(model: str, *, block_sizes: str | None, batch_sizes: str | None, context_lens: str | None,
                       kv_dtype: str, device: str, reps: int | None, out_dir: str, compile_flex: bool | None) -> Path:
    """The `kvsim bench kernels` command: run the sweep with a status line, print the table and the CSV path."""
    import time

    from rich.console import Console

    console = Console()
    dev = resolve_device(device, field="--device")
    start = time.monotonic()
    with console.status("benchmarking kernels") as status:

        def progress(text: str) -> None:
            if console.is_terminal:
                status.update(f"benchmarking kernels: {text}")
            else:  # a log (e.g. a GPU run piped through tee) shows how far a long or killed run got, and when
                console.print(f"[{time.monotonic() - start:6.0f} s] benchmarking kernels: {text}", markup=False, highlight=False)

        frame, path = bench_kernels(
            model, block_sizes=parse_sizes(block_sizes, "--block-sizes"), batch_sizes=parse_sizes(batch_sizes, "--batch-sizes"),
            context_lens=parse_sizes(context_lens, "--context-lens"), kv_dtype=kv_dtype, device=device,
            reps=reps if reps is not None else (10 if dev.type == "cuda" else 3), out_dir=out_dir,
            compile_flex=compile_flex, progress=progress,
        )  # fmt: skip
    render_table(frame, console)
    failed = frame[frame["status"].str.startswith("error")]
    for _, r in failed.iterrows():
        console.print(f"[red]{r['kernel']} (block {r['block_size']}, batch {r['batch_size']}, context {r['context_len']}): {r['status']}[/red]")
    console.print(f"wrote {path}")
    return path
