"""`kvsim profile`: per-request `torch.empty` vs one paged pool under PyTorch's CUDA caching allocator, same stream and
budget, once per allocator setting (default, `expandable_segments:True`), each in its own child process
(`python -m kvsim.profile.run JOB_JSON`) because PYTORCH_CUDA_ALLOC_CONF is read at CUDA initialisation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from kvsim.errors import KvsimError
from kvsim.out_paths import output_dir
from kvsim.profile.stream import PagedPool, PerRequestTensors, replay_stream

SETTINGS = {"default": None, "expandable": "expandable_segments:True"}
# The allocator reads its settings from the first of these that is set (newer torch: PYTORCH_ALLOC_CONF first;
# older: PYTORCH_CUDA_ALLOC_CONF only), once, when CUDA initialises: a child gets both or neither.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
MODES = ("per-request", "paged-pool")
GRANULE = 2 * 2**20  # the caching allocator rounds large blocks to 2 MiB: the budget's slack for the pool
TORCH_STATS = {  # timeline column <- torch.cuda.memory_stats() key
    "memory_allocated": "allocated_bytes.all.current",
    "memory_reserved": "reserved_bytes.all.current",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
}


def run_profile(workload: str | Path, *, reserve: str = "max", block_size: int = 16, settings: tuple[str, ...] = tuple(SETTINGS),
                step_ms: float = 20.0, sample_every: int = 50, seed: int | None = None, limit: int | None = None,
                snapshot: bool = False, out_dir: str | Path | None = None, progress: Callable[[str], None] | None = None):
    """Both modes under each allocator setting, a child process each; returns (timeline, summary, out dir).

    Writes timeline.csv, summary.csv, memory.png (and snapshot-<setting>-<mode>.pickle, loadable by PyTorch's
    memory_viz, with `snapshot`) to `out_dir`, by default reports/profile/<device>/.
    """
    import shutil
    import tempfile

    import pandas as pd
    import torch

    from kvsim.engine.tensors.device import slugify
    from kvsim.engine.flat.flat_allocator import RESERVES
    from kvsim.workload.spec import load_workload

    if not settings:
        raise KvsimError(f"name at least one setting (from {', '.join(SETTINGS)})", field="--settings")
    for name in settings:
        if name not in SETTINGS:
            raise KvsimError(f"unknown setting {name!r} (choose from {', '.join(SETTINGS)})", field="--settings")
    if reserve not in RESERVES:
        raise KvsimError(f"unknown reserve {reserve!r} (choose from {', '.join(RESERVES)})", field="--reserve")
    for field, value in (("--block-size", block_size), ("--sample-every", sample_every)):
        if value < 1:
            raise KvsimError(f"must be >= 1, got {value}", field=field)
    if not step_ms > 0:
        raise KvsimError(f"must be > 0, got {step_ms}", field="--step-ms")
    load_workload(workload, seed=seed, limit=limit)  # a bad file fails here, in one line, not in every child
    if not torch.cuda.is_available():
        raise KvsimError("needs a CUDA device: it measures PyTorch's CUDA caching allocator, and torch sees no GPU here",
                         field="kvsim profile")  # fmt: skip
    timelines, summaries = [], []
    with tempfile.TemporaryDirectory(prefix="kvsim-profile-") as tmp:
        for setting in settings:
            for mode in MODES:
                if progress:
                    progress(f"{setting} allocator, {mode}")
                prefix = str(Path(tmp) / f"{setting}-{mode}")
                job = dict(workload=str(workload), seed=seed, limit=limit, mode=mode, reserve=reserve, block_size=block_size,
                           step_s=step_ms / 1e3, sample_every=sample_every, prefix=prefix,
                           snapshot=prefix + ".pickle" if snapshot else None)  # fmt: skip
                proc = subprocess.run([sys.executable, "-m", "kvsim.profile.run", json.dumps(job)], env=child_env(setting),
                                      capture_output=True, text=True)  # fmt: skip
                label = dict(setting=setting, alloc_conf=SETTINGS[setting] or "", mode=mode,
                             reserve=reserve if mode == "per-request" else "", block_size=block_size if mode == "paged-pool" else None)  # fmt: skip
                if proc.returncode != 0:
                    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                    summaries.append({**label, "status": f"failed (exit {proc.returncode}): {last[:200]}"})
                    continue
                totals = json.loads(Path(prefix + ".json").read_text())
                summaries.append({**label, "status": "ok", **totals})
                timelines.append(pd.read_csv(prefix + ".csv").assign(**label))
        summary = pd.DataFrame(summaries)
        ok = summary[summary["status"] == "ok"]
        slug = ok["device"].iat[0] if len(ok) else "cuda"
        out = Path(out_dir) if out_dir else Path("reports/profile") / slugify(slug)
        output_dir(out)
        for pickle in Path(tmp).glob("*.pickle"):
            shutil.move(str(pickle), out / f"snapshot-{pickle.name}")
    timeline = pd.concat(timelines, ignore_index=True) if timelines else pd.DataFrame()
    timeline.to_csv(out / "timeline.csv", index=False)
    summary.to_csv(out / "summary.csv", index=False)
    if len(timeline):
        _chart(timeline, out / "memory.png")
    return timeline, summary, out


def child_env(setting: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the child that runs `setting`: the parent's, with the allocator settings replaced.

    An inherited PYTORCH_ALLOC_CONF (which newer torch reads before PYTORCH_CUDA_ALLOC_CONF) would otherwise
    give every setting the same allocator, and label the runs wrongly.
    """
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in ALLOC_CONF_VARS}
    if SETTINGS[setting]:
        env.update(dict.fromkeys(ALLOC_CONF_VARS, SETTINGS[setting]))
    return env


def _chart(timeline, path: Path) -> None:
    """memory_reserved (solid) and memory_allocated (dashed) over simulated time, a panel per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(timeline["setting"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4), sharey=True, squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for mode, rows in timeline[timeline["setting"] == setting].groupby("mode"):
            line = ax.plot(rows["time_s"], rows["memory_reserved"] / 2**30, label=f"{mode} reserved")[0]
            ax.plot(rows["time_s"], rows["memory_allocated"] / 2**30, "--", color=line.get_color(), label=f"{mode} allocated")
        ax.set(title=f"{setting} allocator", xlabel="simulated time (s)", ylabel="GiB")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def profile_table(summary):
    """The summary as a rich table with one column per run (setting, mode) and one row per figure, so that four
    runs fit 80 columns (a piped log) without cutting a header or a number."""
    from rich.table import Table

    from kvsim.units import format_bytes

    records = summary.to_dict("records")
    table = Table(title="PyTorch's CUDA caching allocator:\nper-request tensors vs one paged pool")
    table.add_column("", no_wrap=True)
    for r in records:
        table.add_column(f"{r['setting']}\n{r['mode']}", justify="right")

    def first_oom(r):
        first = r["admitted_before_first_oom"]
        return "no OOM" if first is None or first != first else str(int(first))

    figures = (  # (row label, cell of an ok run)
        ("admitted before OOM", first_oom),
        ("OOMs", lambda r: str(r["ooms"])),
        ("alloc retries", lambda r: str(r["num_alloc_retries"])),
        ("preemptions", lambda r: str(r["preemptions"])),
        ("peak running", lambda r: str(r["peak_running"])),
        ("mean running", lambda r: f"{r['mean_running']:.1f}"),
        ("peak reserved", lambda r: format_bytes(r["peak_reserved_bytes"])),
        ("peak inactive split", lambda r: format_bytes(r["peak_inactive_split_bytes"])),
        ("sim time (s)", lambda r: f"{r['sim_time_s']:.0f}"),
    )
    if any(r["status"] != "ok" for r in records):
        table.add_row("status", *(r["status"] for r in records))
    for label, cell in figures:
        table.add_row(label, *(cell(r) if r["status"] == "ok" else "-" for r in records))
    return table


def show_profile(workload: str, **options) -> Path:
    """The `kvsim profile` command: run, print a rich summary table, say where the files are."""
    from rich.console import Console

    console = Console()
    with console.status("profiling") as status:
        _, summary, out = run_profile(workload, progress=lambda text: status.update(f"profiling: {text}"), **options)
    console.print(profile_table(summary))
    console.print(f"wrote {out}/")
    return out


# --- one run per process: `python -m kvsim.profile.run JOB_JSON` ---------------------------------------------


def _run_job(job: dict) -> None:
    """The child process: one (setting, mode) on CUDA; writes <prefix>.csv (timeline) and <prefix>.json (totals)."""
    import time

    import pandas as pd
    import torch

    from kvsim.models.catalogue import resolve_model
    from kvsim.engine.factory import AllocatorConfig, make_allocator
    from kvsim.workload.requests import generate_requests
    from kvsim.size.sizing import kv_cache_spec
    from kvsim.size.startup import vllm_kv_cache_memory
    from kvsim.workload.spec import load_workload

    workload = load_workload(job["workload"], seed=job["seed"], limit=job["limit"])
    model = resolve_model(workload.model)
    total_memory = torch.cuda.get_device_properties(0).total_memory
    budget = workload.kv_budget_bytes or vllm_kv_cache_memory(
        model, total_memory, utilization=workload.gpu_memory_utilization, device_name=torch.cuda.get_device_name(0)
    )
    torch.cuda.set_per_process_memory_fraction(min(1.0, (budget + GRANULE) / total_memory))
    from kvsim.size.kv_dtype import kv_cache_dtype

    kv_dtype = kv_cache_dtype(workload.kv_dtype, model, field="kv_dtype", source=str(job["workload"]))
    spec = kv_cache_spec(model, kv_dtype=kv_dtype, block_size=job["block_size"])

    def empty(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    if job["snapshot"]:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    if job["mode"] == "per-request":
        flat = make_allocator(AllocatorConfig("flat", reserve=job["reserve"]), spec, budget, max_model_len=workload.max_model_len)
        backend = PerRequestTensors(flat, empty)
    else:
        config = AllocatorConfig("paged", block_size=job["block_size"], watermark=workload.scheduler.watermark)
        backend = PagedPool(make_allocator(config, spec, budget, max_model_len=workload.max_model_len), budget, empty)

    def stats() -> dict:  # a key torch renamed fails the run here instead of reading as zeros
        s = torch.cuda.memory_stats()
        return {column: s[key] for column, key in TORCH_STATS.items()}

    requests = generate_requests(workload)
    start = time.perf_counter()
    rows, totals = replay_stream(
        requests, backend, bytes_per_token=spec.bytes_per_token,
        max_num_seqs=workload.scheduler.max_num_seqs, step_s=job["step_s"], sample_every=job["sample_every"], stats=stats,
    )  # fmt: skip
    totals.update(wall_s=time.perf_counter() - start, device=torch.cuda.get_device_name(0), torch_version=torch.__version__,
                  model=model.name, budget_bytes=budget, requests=len(requests))  # fmt: skip
    final = torch.cuda.memory_stats()
    for column in ("allocated_bytes", "reserved_bytes", "inactive_split_bytes"):
        totals[f"peak_{column}"] = final[f"{column}.all.peak"]
    totals.update(torch_num_ooms=final["num_ooms"], num_alloc_retries=final["num_alloc_retries"])
    if job["snapshot"]:
        torch.cuda.memory._dump_snapshot(job["snapshot"])
        torch.cuda.memory._record_memory_history(enabled=None)
    pd.DataFrame(rows).to_csv(job["prefix"] + ".csv", index=False)
    Path(job["prefix"] + ".json").write_text(json.dumps(totals))


if __name__ == "__main__":
    _run_job(json.loads(sys.argv[1]))
