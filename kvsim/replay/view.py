"""What `kvsim replay` shows: a rich progress bar while it runs and a summary table, one row per allocator.

rich is imported where something is drawn: `--quiet --json` prints JSON alone and never loads it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from kvsim.out_paths import output_dir
from kvsim.units import format_bytes, parse_bytes
from kvsim.vllm_version import SCHEDULER_FOLLOWS

if TYPE_CHECKING:
    from rich.console import Console, Group


class ReplayProgress:
    """One progress bar per allocator, counting requests finished or rejected; a no-op when `enabled` is False."""

    def __init__(self, console: Console | None, *, enabled: bool = True):
        self.enabled = enabled
        self._tasks: dict[str, int] = {}
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description:<18}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )

    def __enter__(self) -> "ReplayProgress":
        if self.enabled:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._progress.stop()

    def __call__(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        task = self._tasks.get(label)
        if task is None:
            task = self._tasks[label] = self._progress.add_task(label, total=total)
        self._progress.update(task, completed=done)


def _fmt(value: float | None, spec: str, *, scale: float = 1.0, suffix: str = "") -> str:
    """`value * scale` formatted, or '-' for a missing figure (None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value * scale, spec) + suffix


# (header, cell, essential) per column. Headers break over two lines; optional columns are shown only
# while the table fits the terminal, so 80 columns still get the budget split and the headline rates.
# essential None: essential when some allocator has a figure (prefill saved: with prefix caching only).
_COLUMNS: tuple[tuple[str, Callable[[dict], str], bool | None], ...] = (
    ("tokens\n%", lambda r: _fmt(r["token_states_pct"], ".1f"), True),
    ("resv\n%", lambda r: _fmt(r["reservation_pct"], ".1f"), True),
    ("intl\n%", lambda r: _fmt(r["internal_fragmentation_pct"], ".1f"), True),
    ("extl\n%", lambda r: _fmt(r["external_fragmentation_pct"], ".1f"), True),
    ("free\n%", lambda r: _fmt(r["free_pct"], ".1f"), True),
    ("running\nmean", lambda r: _fmt(r["mean_running"], ".1f"), True),
    ("output\ntok/s", lambda r: _fmt(r["throughput_tokens_per_s"], ",.0f"), True),
    ("pre-\nempt", lambda r: str(r["preemptions"]), True),
    ("TTFT\np50 s", lambda r: _fmt(r["ttft_p50_s"], ".3f"), True),
    ("prefill\nsaved", lambda r: _fmt(r["prefill_saved_pct"], ".0f", suffix="%"), None),
    ("prefix\nhit", lambda r: _fmt(r["prefix_hit_rate"], ".0f", scale=100, suffix="%"), False),
    ("running\npeak", lambda r: str(r["peak_running"]), False),
    ("TTFT\np99 s", lambda r: _fmt(r["ttft_p99_s"], ".3f"), False),
    ("TPOT\np50 ms", lambda r: _fmt(r["tpot_p50_s"], ".2f", scale=1e3), False),
    ("rejected", lambda r: str(r["rejected"]), False),
)
_EMPTY = {"-", "0", "0%"}


LEGEND = (
    "tokens: KV of computed tokens; resv: reserved for tokens a request will still produce; intl: internal "
    "fragmentation (allocated, never to be used); extl: external fragmentation (free, but too scattered to "
    "admit the waiting request); free: unused; pre-empt: preemptions; prefill saved: prompt tokens the prefix cache served at first admission; prefix hit: cached share of every admission's lookup (re-admissions too); TTFT: time to first token; TPOT: time "
    "per output token"
)


def summary_table(records: list[dict], *, title: str | None = None, width: int = 160) -> Group:
    """The replay's headline: per allocator, where the budget went (time-averaged %) and what it bought.

    No cell is ever cut: essential columns that do not fit in `width` terminal columns go on to a second
    table (the allocator column repeated); optional columns are left out when empty for every allocator (no
    prefix caching, nothing rejected) or when they would not fit. A legend line explains the abbreviations.
    """
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    cells = [[cell(r) for _, cell, _ in _COLUMNS] for r in records]

    def col_width(j: int) -> int:
        return max([len(line) for line in _COLUMNS[j][0].split("\n")] + [len(row[j]) for row in cells]) + 2  # pad, rule

    first = max([len("allocator")] + [len(r["allocator"]) for r in records])
    edges = 2  # the box's left and right edge characters
    pages: list[list[int]] = [[]]
    used = first + edges
    for j, (_, _, essential) in enumerate(_COLUMNS):
        if essential is None:
            essential = any(row[j] not in _EMPTY for row in cells)
        fits = used + col_width(j) <= width
        if essential and not fits and pages[-1]:
            pages.append([])
            used = first + edges
            fits = True
        if essential or (fits and any(row[j] not in _EMPTY for row in cells)):
            pages[-1].append(j)
            used += col_width(j)
    tables = []
    for k, page in enumerate(pages):
        table = Table(title=title if k == 0 else None, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1),
                      pad_edge=False)  # fmt: skip
        table.add_column("allocator", no_wrap=True, min_width=first)
        for j in page:
            table.add_column(_COLUMNS[j][0], justify="right", no_wrap=True, min_width=col_width(j) - 2)
        for r, row in zip(records, cells):
            table.add_row(r["allocator"], *(row[j] for j in page))
        tables.append(table)
    return Group(*tables, Text(LEGEND, style="dim"))


def rejection_notes(result) -> list[str]:
    """One line per allocator that rejected requests: how many, and the first one's reason (the table may have
    no room for the `rejected` column, and a row of dashes alone does not say why)."""
    n = len(result.arrival_s)
    lines = []
    for run in result.runs:
        rejected = [(i, reason) for i, reason in enumerate(run.rejected_reason) if reason is not None]
        if rejected:
            i, reason = rejected[0]
            lines.append(f"{run.label}: rejected {len(rejected):,} of {n:,} requests, e.g. request {i}: {reason} "
                         "(each reason in requests.csv)")
    return lines


def clock_source(result) -> str:
    """What the replay's clock stands for: the workload's GPU (roofline), or the device that was measured."""
    if result.options.timing == "measured":
        import torch

        from kvsim.engine.tensors.device import device_name

        return f"timed as measured on {device_name(torch.device(result.device))} (not {result.hardware_name})"
    return f"on {result.hardware_name}"


def _stderr() -> Console:
    """A console on stderr (progress, notes): stdout keeps the table, or the JSON alone."""
    from rich.console import Console

    return Console(stderr=True)


def run_replay_cli(
    workload_path: Path,
    *,
    out: Path | None = None,
    device: str = "auto",
    tensors: bool = True,
    seed: int | None = None,
    limit: int | None = None,
    quiet: bool = False,
    json_out: bool = False,
    timing: str = "roofline",
    trace: Path | None = None,
    csv: bool = False,
    layers: int = 1,
    integrity: bool = False,
    read_every: int | None = None,
    command: str | None = None,
    max_host_memory: str = "1GiB",
    tp: int | None = None,
    ep: int | None = None,
    overrides=None,
    cpu_offload: str | None = None,
) -> Path:
    """`kvsim replay`: load, replay with a progress bar, write reports, show the summary; returns the out dir.

    With `json_out` the summary goes to stdout as JSON and everything else (progress, paths) to stderr.
    """
    from kvsim.replay.run import run_replay
    from kvsim.replay.options import ReplayOptions
    from kvsim.replay.reports import jsonable, summary_records, write_reports
    from kvsim.workload.overrides import WorkloadOverrides, load_workload_with, naming_flags

    workload = load_workload_with(workload_path, overrides or WorkloadOverrides(),
                                  trace=str(trace) if trace is not None else None, seed=seed, limit=limit)
    if cpu_offload is not None:  # --cpu-offload: the CPU tier's size over the workload's (0: no tier)
        from kvsim.workload.spec import with_cpu_offload

        workload = with_cpu_offload(workload, cpu_offload)
    max_host_bytes = parse_bytes(max_host_memory, field="--max-host-memory")
    options = ReplayOptions(device=device, tensors=tensors, timing=timing, num_layers=layers, integrity=integrity,
                            read_every=read_every, max_host_bytes=max_host_bytes, tp=tp, ep=ep)  # fmt: skip
    ignored = options.ignored_without_tensors()
    if ignored:
        _stderr().print(f"note: --no-tensors: {', '.join(ignored)} ignored (they shape the cache tensors)", markup=False)
    out_dir = output_dir(out if out is not None else Path("reports") / workload.name, create=False)  # before the replay runs
    with ReplayProgress(None if quiet else _stderr(), enabled=not quiet) as progress, naming_flags(overrides or WorkloadOverrides()):
        result = run_replay(workload, options, progress=progress)  # progress on stderr, always
    if result.note and not quiet:
        _stderr().print(f"note: {result.note}", style="dim", markup=False)
    paths = write_reports(result, out_dir, csv=csv, command=command)
    records = summary_records(result)
    if integrity:  # a failed check raised during the replay; reaching here is the verdict
        reads = sum(run.num_read_samples for run in result.runs)
        _stderr().print(
            f"integrity: passed: {len(result.runs)} allocator(s), every token's K/V as written: {reads:,} sampled batch "
            "reads checked token by token, every finished, swapped-in or prefix-hit request checked in the pool"
            + (", and every load from the CPU tier, in each KV cache group" if workload.offload is not None else ""),
            markup=False, highlight=False,
        )
    if json_out:
        sys.stdout.write(json.dumps(jsonable(records), indent=2) + "\n")
        return paths.out_dir
    if not quiet:
        from rich.console import Console

        console = Console()
        title = (
            f"{workload.name}: {len(result.arrival_s):,} requests, {result.model_name} {clock_source(result)}, "
            f"{f'tp {result.tp}' + (f', ep {result.ep}' if result.ep > 1 else '') + ', ' if result.tp > 1 else ''}"
            f"KV budget {format_bytes(result.budget_bytes)}{' per rank' if result.tp > 1 else ''} (time-averaged % of it), scheduler: {SCHEDULER_FOLLOWS} "
            f"{'async' if workload.scheduler.async_scheduling else 'sync'}, clock: {result.clock}"
        )
        console.print(summary_table(records, title=title, width=console.width))
        for line in rejection_notes(result):
            console.print(line, markup=False, highlight=False)
        kernels = ", kernels.parquet, kernels.json" if paths.kernels is not None else ""
        console.print(f"reports in {paths.out_dir}/ (steps.parquet, requests.csv, summary.csv, summary.json, meta.json; "
                      f"this host's: host.json{kernels})")
    return paths.out_dir
