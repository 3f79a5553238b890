"""`kvsim replay` of a deployment (replicas > 1, or a router given): the fleet replay, its reports and charts,
and a table of one row per replica and one for the deployment."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvsim.errors import KvsimError
from kvsim.out_paths import output_dir


def router_of(workload, policy: str | None):
    """The workload's router, its policy replaced by --router (checked against the known names)."""
    from kvsim.workload.spec import ROUTER_POLICIES

    if policy is None:
        return workload.router
    if policy not in ROUTER_POLICIES:
        raise KvsimError(f"unknown router policy {policy!r}; choose from {', '.join(ROUTER_POLICIES)}", field="--router")
    return replace(workload.router, policy=policy)


def run_fleet_cli(workload, *, replicas: int | None, router: str | None, out: Path | None, timing: str, tp: int | None,
                  quiet: bool, json_out: bool, command: str | None, charts: bool = True) -> Path:
    """Replay `workload` as a fleet; write reports/<name>/ (or `out`) with a chart per allocator; print the table."""
    from kvsim.deployment.fleet import replay_fleet
    from kvsim.deployment.reports import write_fleet_reports
    from kvsim.replay.options import ReplayOptions
    from kvsim.replay.reports import jsonable

    if replicas is not None and replicas < 1:
        raise KvsimError(f"must be >= 1, got {replicas}", field="--replicas")
    out_dir = output_dir(out if out is not None else Path("reports") / workload.name, create=False)
    fleet = replay_fleet(workload, ReplayOptions(tensors=False, timing=timing, tp=tp), replicas=replicas,
                         router=router_of(workload, router))
    written = write_fleet_reports(fleet, out_dir, command=command)
    if charts:
        from kvsim.deployment.charts import fleet_charts

        fleet_charts(fleet, written["out_dir"])
    records = written["records"]
    if json_out:
        print(json.dumps(jsonable(records), indent=2))
    elif not quiet:
        Console().print(fleet_table(records, fleet))
        Console(stderr=True).print(f"reports: {written['out_dir']}", markup=False)
    return written["out_dir"]


def fleet_table(records: list[dict], fleet) -> Table:
    result = fleet.result
    table = Table(title=f"{result.workload.name}: {fleet.num_replicas} x {result.model_name} on {result.hardware_name} "
                        f"x tp {result.tp} ({fleet.num_gpus} GPUs) behind {fleet.router.policy}, "
                        f"{'async' if result.workload.scheduler.async_scheduling else 'sync'} scheduling")
    for name in ("allocator", "replica", "requests", "TTFT p50", "TTFT p99", "TPOT p99", "tok/s", "hit rate",
                 "bound", "imbalance"):
        table.add_column(name, justify="left" if name == "allocator" else "right")
    for rec in records:
        hit = rec.get("fleet_hit_rate", math.nan) if rec["replica"] == "all" else rec["prefill_saved_pct"] / 100
        table.add_row(rec["allocator"], rec["replica"], f"{rec['num_requests']:,}", _s(rec["ttft_p50_s"]), _s(rec["ttft_p99_s"]),
                      _s(rec["tpot_p99_s"], ms=True), _n(rec["throughput_tokens_per_s"], "{:,.0f}"), _n(hit, "{:.1%}"),
                      _n(rec.get("hit_rate_bound", math.nan), "{:.1%}"), _n(rec.get("load_imbalance", math.nan), "{:.2f}"))
    return table


def _s(value, *, ms: bool = False) -> str:
    if value is None or value != value:
        return "-"
    return f"{value * 1e3:.1f} ms" if ms else f"{value:.3f} s"


def _n(value, spec: str) -> str:
    return "-" if value is None or value != value else spec.format(value)
