"""What `kvsim sweep` does: read the sweep, validate every point, run the pending tasks on a backend under a
rich progress bar (done, failed, ETA), journal each row as it arrives, and write the table at the end or on
Ctrl-C."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kvsim.errors import KvsimError
from kvsim.out_paths import output_dir
from kvsim.replay.options import ReplayOptions
from kvsim.sweep.points import make_tasks
from kvsim.sweep.results import Results
from kvsim.sweep.spec import load_sweep


@dataclass(frozen=True)
class SweepOutcome:
    """What a sweep left: the table's paths, rows in it, rows failed, tasks run now and skipped as done."""

    paths: list[Path]
    num_rows: int
    num_failed: int
    num_run: int
    num_skipped: int
    interrupted: bool = False


def run_sweep(path: str | Path, *, out: str | Path | None = None, workers: int | None = None, ray: str | None = None,
              tensors: bool = False, timing: str | None = None, device: str = "auto", csv: bool = False,
              quiet: bool = True, console: Console | None = None) -> SweepOutcome:
    """Run the sweep file at `path` into `out` (default reports/sweeps/<name>/); see the module docstring.

    Accounting only unless `tensors`; `timing` (else the file's `timing:`, else roofline) is passed through
    to every replay (the clock is the replay's choice). Raises KeyboardInterrupt after writing the table when interrupted.
    """
    from kvsim.sweep.runners import run_local, run_ray

    if workers is not None and workers < 1:  # checked before the sweep file is even read
        raise KvsimError(f"must be >= 1, got {workers}", field="--workers")
    spec = load_sweep(path)
    options = _options(spec, device=device, tensors=tensors, timing=timing)
    tasks = make_tasks(spec, options)
    out_dir = output_dir(out if out is not None else Path("reports") / "sweeps" / spec.name, create=False)  # before any replay
    results = Results(out_dir, tasks, meta=spec.meta(options.timing))
    pending = results.pending()
    if not pending:
        rows: Iterable = iter(())
    else:
        rows = run_ray(pending, ray) if ray else run_local(pending, workers)
    console = console or Console(stderr=True)
    progress = Progress(
        TextColumn(f"[bold]{spec.name}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]} failed"),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console, disable=quiet,
    )
    run = 0
    interrupted = False
    try:
        with progress:
            bar = progress.add_task("sweep", total=len(pending), failed=0)
            failed = 0
            for task, row in rows:
                results.add(task, row)
                run += 1
                failed += row.get("error") is not None
                progress.update(bar, advance=1, failed=failed)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        getattr(rows, "close", lambda: None)()  # ends the backend's workers when interrupted
        results.close()
        paths = results.write(csv=csv) if results.rows else []
        outcome = SweepOutcome(paths, len(results.rows), results.num_failed, run, len(tasks) - len(pending), interrupted)
        if interrupted:
            console.print(f"interrupted: {outcome.num_rows} of {len(tasks)} rows kept in {out_dir}; rerun to resume")
    return outcome


def _options(spec, *, device: str, tensors: bool, timing: str | None) -> ReplayOptions:
    """Every replay's options; `--timing` wins over the file's `timing:`, and a mistake in the file's (measured
    without --tensors) names the file and field."""
    if timing is not None or spec.timing is None:
        return ReplayOptions(device=device, tensors=tensors, timing=timing or "roofline")
    try:
        return ReplayOptions(device=device, tensors=tensors, timing=spec.timing)
    except KvsimError as exc:
        if exc.field != "--timing":
            raise
        raise KvsimError(str(exc).removeprefix("--timing: "), source=str(spec.path), field="timing") from None


def run_sweep_cli(path: str, **kwargs) -> None:
    """`kvsim sweep`: run, then one line per table written and a count of rows, failures and skips."""
    console = Console(stderr=True)
    try:
        outcome = run_sweep(path, console=console, **kwargs)
    except KeyboardInterrupt:  # run_sweep has written the table and said so
        raise SystemExit(130) from None
    for written in outcome.paths:
        print(written)
    console.print(f"{outcome.num_rows} rows ({outcome.num_failed} failed); {outcome.num_run} run now, "
                  f"{outcome.num_skipped} already done")
