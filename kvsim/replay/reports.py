"""A replay's reports: steps.parquet, requests.csv, summary.csv/.json and meta.json under one folder, and beside
them what this host measured: kernels.parquet, kernels.json (with cache tensors) and host.json.

The first five hold only what the workload, seed and command determine, so a rerun gives byte-identical files
(the shipped reports/ stay unchanged by `kvsim replay workloads/poisson.yaml`); kernel times, versions and the
platform go to the last three, which git ignores under reports/. The files are written through Arrow
(kvsim.replay.tables), the same bytes pandas writes, without its import; the `*_frame` functions give the same
tables as pandas DataFrames to scripts and tests.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError
from kvsim.out_paths import output_dir
from kvsim.replay import tables
from kvsim.replay.records import KERNEL_COLUMNS, STEP_COLUMNS, AllocatorRun, ReplayResult
from kvsim.vllm_version import SCHEDULER_FOLLOWS

CATEGORIES = (
    "token_states",
    "reservation",
    "internal_fragmentation",
    "external_fragmentation",
    "free",
)
SUMMARY_FLOAT_FORMAT = "%.6g"


@dataclass(frozen=True)
class ReportPaths:
    """Where `write_reports` put each file."""

    out_dir: Path
    steps: Path
    steps_csv: Path | None
    requests: Path
    summary_csv: Path
    summary_json: Path
    meta: Path
    host: Path
    kernels: Path | None  # kernels.parquet and kernels.json, with cache tensors only
    kernels_json: Path | None


def steps_columns(result: ReplayResult, *, kernels: bool = True) -> list[tables.Columns]:
    """Per allocator, its rows' columns: one row per scheduled row (a row covers `num_steps` identical decode
    steps); without `kernels`, only the simulated columns (steps.parquet: kernel times are kernels.parquet's)."""
    names = [name for name, _ in STEP_COLUMNS if kernels or name not in KERNEL_COLUMNS]
    runs = []
    for run in result.runs:
        columns: tables.Columns = {"allocator": [run.label] * len(run.steps["step"])}
        columns.update((name, run.steps[name]) for name in names)
        if run.offload is not None:  # the CPU tier's per-row series
            columns.update(run.offload["steps"])
        runs.append(columns)
    return runs


def kernels_columns(result: ReplayResult) -> list[tables.Columns]:
    """kernels.parquet: each row's measured kernel µs per step (write, read, attention), keyed by allocator and step."""
    return [{"allocator": [run.label] * len(run.steps["step"]), **{name: run.steps[name] for name in ("step", *KERNEL_COLUMNS)}}
            for run in result.runs]


def requests_columns(result: ReplayResult) -> list[tables.Columns]:
    """Per allocator, one row per request: its timeline, preemptions, prefix hit and TTFT/TPOT."""
    runs = []
    n = len(result.arrival_s)
    for run in result.runs:
        ttft, tpot = _latencies(result, run)
        runs.append({
            "allocator": [run.label] * n,
            "request_id": np.arange(n, dtype=np.int64),
            "arrival_s": result.arrival_s,
            "admitted_s": run.admitted_s,
            "first_token_s": run.first_token_s,
            "finished_s": run.finished_s,
            "num_prompt_tokens": result.num_prompt_tokens,
            "max_tokens": result.max_tokens,
            "num_output_tokens": output_tokens(result),
            "num_preemptions": run.num_preemptions,
            "num_cached_tokens": run.num_cached_tokens,
            "ttft_s": ttft,
            "tpot_s": tpot,
            "rejected_reason": list(run.rejected_reason),
        })
    return runs


def steps_frame(result: ReplayResult, *, kernels: bool = True):
    """`steps_columns` as one pandas DataFrame, allocator after allocator."""
    return _frame(steps_columns(result, kernels=kernels))


def kernels_frame(result: ReplayResult):
    """`kernels_columns` as one pandas DataFrame."""
    return _frame(kernels_columns(result))


def requests_frame(result: ReplayResult):
    """`requests_columns` as one pandas DataFrame, allocator after allocator."""
    return _frame(requests_columns(result))


def _frame(runs: list[tables.Columns]):
    """The allocators' columns as one DataFrame (pandas' concat: a column some allocators lack is NaN in theirs);
    a text column of no rows stays text (typed by its values, it would turn float in the concat)."""
    import pandas as pd

    return pd.concat([pd.DataFrame({name: pd.Series(values, dtype="str") if isinstance(values, list) and not values
                                    else values for name, values in columns.items()}) for columns in runs],
                     ignore_index=True)


def _joined(runs: list[tables.Columns]) -> tables.Columns | None:
    """The allocators' columns one after another, or None where their columns differ (pandas' concat fills
    the gaps with NaN, which `_frame` leaves to it)."""
    if any(list(columns) != list(runs[0]) for columns in runs):
        return None
    return {name: [v for columns in runs for v in columns[name]] if isinstance(runs[0][name], list)
            else np.concatenate([columns[name] for columns in runs]) for name in runs[0]}


def output_tokens(result: ReplayResult) -> np.ndarray:
    """(num_requests,) output tokens each request samples: its max_tokens, capped (as vLLM's scheduler caps
    it) so prompt + output stays within max_model_len."""
    room = result.workload.max_model_len - result.num_prompt_tokens
    return np.maximum(np.minimum(result.max_tokens, room), 0)


def _latencies(result: ReplayResult, run: AllocatorRun) -> tuple[np.ndarray, np.ndarray]:
    """TTFT = first token - arrival; TPOT = (finished - first token) / (output tokens - 1), vLLM's
    definition (benchmark_serving: time per output token after the first, so the decode steps between
    them); NaN for a request of one output token, which has no such steps."""
    ttft = run.first_token_s - result.arrival_s
    decode_tokens = output_tokens(result) - 1
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(decode_tokens > 0, (run.finished_s - run.first_token_s) / decode_tokens, np.nan)
    return ttft, tpot


def summary_records(result: ReplayResult, *, kernels: bool = True) -> list[dict]:
    """One dict per allocator: the figures of summary.csv, plus kernel-time medians/p90 when `kernels`."""
    workload = result.workload
    records = []
    for run in result.runs:
        st = run.steps
        dt = st["step_time_s"]
        total_time = float(dt.sum())
        budget = run.budget_bytes
        finished = ~np.isnan(run.finished_s)
        end = float(np.nanmax(run.finished_s)) if finished.any() else 0.0
        ttft, tpot = _latencies(result, run)
        rec: dict = {
            "allocator": run.label,
            "model": result.model_name,
            "workload": workload.name,
            "tp": result.tp,  # budget_bytes and the % of it are one rank's
            "async_scheduling": workload.scheduler.async_scheduling,  # which loop ran: vllm serve's async or sync
            "budget_bytes": budget,
            "num_requests": len(result.arrival_s),
            "finished": int(finished.sum()),
            "rejected": sum(reason is not None for reason in run.rejected_reason),
            "sim_time_s": end,
            "num_steps": int(st["num_steps"].sum()),
        }
        for cat in CATEGORIES + ("shared_saved", "padding"):  # padding: a part of internal_fragmentation
            col = st[f"{cat}_bytes"].astype(np.float64)
            rec[f"{cat}_pct"] = 100.0 * float((col * dt).sum()) / total_time / budget if total_time else math.nan
        running = st["num_running"].astype(np.float64)
        rec["mean_running"] = float((running * dt).sum()) / total_time if total_time else math.nan
        rec["peak_running"] = int(running.max()) if len(running) else 0
        sampled = int(output_tokens(result)[finished].sum())
        computed = int(st["num_prefill_tokens"].sum() + st["num_decode_tokens"].sum())
        rec["throughput_tokens_per_s"] = sampled / end if end else math.nan
        rec["computed_tokens_per_s"] = computed / end if end else math.nan
        rec["preemptions"] = int(st["num_preemptions"].sum())
        rec["ttft_p50_s"], rec["ttft_p99_s"] = _percentiles(ttft[finished], (50, 99))
        rec["tpot_p50_s"], rec["tpot_p99_s"] = _percentiles(tpot[finished], (50, 99))
        # Every admission's lookup, re-admissions after a recompute preemption (finding their own blocks) too:
        rec["prefix_hit_rate"] = run.prefix_hit_tokens / run.prefix_query_tokens if run.prefix_query_tokens else math.nan
        # The prefill the prefix cache spared: prompt tokens served at first admission, of admitted prompts.
        admitted = ~np.isnan(run.admitted_s)
        admitted_prompt = int(result.num_prompt_tokens[admitted].sum())
        rec["prefill_tokens_saved"] = int(run.num_cached_tokens[admitted].sum())
        rec["prefill_saved_pct"] = 100.0 * rec["prefill_tokens_saved"] / admitted_prompt if admitted_prompt else math.nan
        if run.offload is not None:  # the CPU tier (one rank's bytes); prefill_tokens_saved above includes its hits
            rec["cpu_hit_tokens"] = run.offload["cpu_hit_tokens"]
            rec["cpu_prefill_saved_pct"] = 100.0 * run.offload["cpu_hit_tokens"] / admitted_prompt if admitted_prompt else math.nan
            rec["cpu_loaded_bytes"] = run.offload["cpu_loaded_bytes"]
            rec["cpu_stored_bytes"] = run.offload["cpu_stored_bytes"]
            rec["cpu_load_wait_s"] = run.offload["cpu_load_wait_s"]
        if kernels:  # kernel columns are per step (a run's row: the mean of its steps), weighted by steps
            rec["num_read_samples"] = run.num_read_samples  # decode steps whose read + attention were timed
            for name in KERNEL_COLUMNS:
                kind = name[: -len("_us")]
                per_step = np.repeat(st[name], st["num_steps"])
                rec[f"{kind}_us_p50"], rec[f"{kind}_us_p90"] = _percentiles(per_step, (50, 90))
        records.append(rec)
    return records


def _percentiles(values: np.ndarray, qs: tuple[int, ...]) -> tuple[float, ...]:
    values = values[~np.isnan(values)]
    if not len(values):
        return tuple(math.nan for _ in qs)
    return tuple(float(v) for v in np.percentile(values, qs))


def summary_frame(result: ReplayResult):
    """summary.csv as a pandas DataFrame: simulated figures only (no wall-clock value), one row per allocator."""
    import pandas as pd

    return pd.DataFrame(summary_records(result, kernels=False))


def kernel_records(result: ReplayResult) -> list[dict]:
    """kernels.json: per allocator, the decode steps whose reads were timed and the kernel µs medians and p90."""
    records = summary_records(result)
    keys = ["allocator", "num_read_samples"] + [f"{name[:-3]}_us_p{q}" for name in KERNEL_COLUMNS for q in (50, 90)]
    return [{k: rec[k] for k in keys} for rec in records]


def host(result: ReplayResult) -> dict:
    """host.json: what ran the replay (versions, platform), which a rerun elsewhere does not reproduce."""
    return {
        "kvsim_version": tables.installed_version("kvsim"),
        "torch_version": tables.installed_version("torch"),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": result.device,
    }


def meta(result: ReplayResult, *, command: str | None = None) -> dict:
    """meta.json: the settings, seed and the workload's hash: what it takes to reproduce the run (the host's
    versions and platform are host.json's, so a rerun gives the same file)."""
    workload = result.workload
    opts = result.options
    return {
        "kvsim_version": tables.installed_version("kvsim"),
        "scheduler": SCHEDULER_FOLLOWS,
        "device": result.device,
        "tensors": opts.tensors,
        "materialised_layers": opts.num_layers if opts.tensors else 0,
        "integrity": opts.integrity,
        "timing": opts.timing,
        "clock": result.clock,
        "seed": workload.seed,
        "workload": workload.name,
        "workload_path": str(workload.path),
        "workload_sha256": workload.sha256,
        "model": result.model_name,
        "kv_dtype": workload.kv_dtype,  # as resolved for the model (auto: the checkpoint's fp8, else the model's dtype)
        "hardware": result.hardware_name,
        "tp": result.tp,
        "ep": result.ep,
        "async_scheduling": workload.scheduler.async_scheduling,  # vLLM's AsyncScheduler (vllm serve's default) or sync
        "budget_bytes": result.budget_bytes,  # one tensor-parallel rank's
        "num_requests": len(result.arrival_s),
        "allocators": [run.label for run in result.runs],
        "command": command if command is not None else " ".join(sys.argv),
    }


def write_reports(result: ReplayResult, out_dir: str | Path, *, csv: bool = False, command: str | None = None) -> ReportPaths:
    """Write every report of `result` under `out_dir` (created if needed) and return their paths."""
    out = output_dir(out_dir)
    paths = ReportPaths(
        out_dir=out,
        steps=out / "steps.parquet",
        steps_csv=out / "steps.csv" if csv else None,
        requests=out / "requests.csv",
        summary_csv=out / "summary.csv",
        summary_json=out / "summary.json",
        meta=out / "meta.json",
        host=out / "host.json",
        kernels=out / "kernels.parquet" if result.options.tensors else None,
        kernels_json=out / "kernels.json" if result.options.tensors else None,
    )
    try:
        _write_parquet(steps_columns(result, kernels=False), paths.steps)
        if paths.steps_csv is not None:
            _write_csv(steps_columns(result), paths.steps_csv)  # the CSV, never shipped, keeps the kernel columns
        _write_csv(requests_columns(result), paths.requests)
        records = summary_records(result, kernels=False)
        text = tables.summary_csv(records, SUMMARY_FLOAT_FORMAT)
        if text is not None:
            paths.summary_csv.write_text(text, encoding="utf-8")
        else:  # a column pandas types by its own rules (a gap, mixed kinds): its writer
            import pandas as pd

            pd.DataFrame(records).to_csv(paths.summary_csv, index=False, float_format=SUMMARY_FLOAT_FORMAT)
        paths.summary_json.write_text(json.dumps(jsonable(records), indent=2) + "\n")
        paths.meta.write_text(json.dumps(meta(result, command=command), indent=2) + "\n")
        paths.host.write_text(json.dumps(host(result), indent=2) + "\n")
        for stale in (out / "kernels.parquet", out / "kernels.json"):  # an earlier run's, with tensors
            if paths.kernels is None and stale.is_file():
                stale.unlink()
        if paths.kernels is not None:
            _write_parquet(kernels_columns(result), paths.kernels)
            paths.kernels_json.write_text(json.dumps(jsonable(kernel_records(result)), indent=2) + "\n")
    except OSError as exc:  # e.g. a directory where a report file goes, a full disk
        name = exc.filename or out
        raise KvsimError(f"cannot write {name}: {exc.strerror or exc}", field="--out") from None
    return paths


def _write_parquet(runs: list[tables.Columns], path: Path) -> None:
    """The allocators' rows as one Parquet file, the bytes pandas' `to_parquet(index=False)` writes."""
    columns = _joined(runs)
    if columns is None or not tables.write_parquet(columns, path):
        _frame(runs).to_parquet(path, index=False)


def _write_csv(runs: list[tables.Columns], path: Path) -> None:
    """The allocators' rows as one CSV through Arrow's writer (`tables.write_csv`)."""
    columns = _joined(runs)
    if columns is None or not tables.write_csv(columns, path):  # pandas' concat fills gaps, then Arrow's writer
        import pyarrow as pa
        import pyarrow.csv as pa_csv

        table = pa.Table.from_pandas(_frame(runs), preserve_index=False)
        pa_csv.write_csv(table, path, write_options=pa_csv.WriteOptions(quoting_style="needed"))


def jsonable(value):
    """NaN -> None (JSON has no NaN), numpy scalars -> Python numbers."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return None if math.isnan(value) else float(value)
    return value
