"""`kvsim plan`: the fewest GPUs for a trace under latency targets. Every (GPU, tp, replicas) point is a fleet
replay, run through the sweep's runners (local processes or Ray); a point meets the SLO when every request
finishes and each target holds. The cheapest plan per GPU kind is the one with the fewest GPUs (then the
lowest p99 TTFT); the plan beside it says why the next smaller deployment fails. The search itself (which
deployments it replays, and which it need not) is `plan_search.py`'s."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvsim.errors import KvsimError

SLO_KEYS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")
DEFAULT_REPLICAS = (1, 2, 3, 4, 6, 8)
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s|us|µs)?\s*$")


@dataclass(frozen=True)
class Slo:
    """Latency targets in seconds, by summary metric (`ttft_p99_s`: 2.0)."""

    targets: tuple[tuple[str, float], ...]

    def misses(self, row: dict) -> list[str]:
        """The targets `row` misses, in words ("ttft_p99 3.1 s > 2 s"); unfinished requests miss everything. A
        replay cut short names the target it certainly missed, with the lower bound it reached ("ttft_p99 >
        2.00 s, certainly (cut short at 41 s simulated, ttft_p99 >= 2.01 s)")."""
        if row.get("error"):
            return [row["error"]]
        if row.get("never_fits"):
            return [row["never_fits"]]
        out = []
        if row.get("unfinished", 0):
            out.append(f"{row['unfinished']} request(s) never finish")
        if row.get("cut_short"):
            metric = row["cut_metric"]
            out.append(f"{metric[:-2]} > {_dur(dict(self.targets)[metric])}, certainly (cut short at "
                       f"{_dur(row['cut_at_s'])} simulated, {metric[:-2]} >= {_dur(row[metric], 1)})")
            return out
        for metric, bound in self.targets:
            value = row.get(metric)
            if value is None or (isinstance(value, float) and math.isnan(value)) or value > bound:
                out.append(f"{metric[:-2]} {_dur(value)} > {_dur(bound)}")
        return out

    def excess(self, row: dict) -> float:
        """How far `row` is from meeting the SLO: the largest value / bound (inf for an error; for a replay cut
        short, a lower bound)."""
        if row.get("error") or row.get("never_fits") or row.get("unfinished", 0):
            return math.inf
        if row.get("cut_short"):
            return row[row["cut_metric"]] / dict(self.targets)[row["cut_metric"]]
        return max((row.get(m) or math.inf) / b for m, b in self.targets)


def parse_slo(text: str) -> Slo:
    """`ttft_p99=2s,tpot_p99=50ms` -> Slo; unknown keys and bad durations are errors naming --slo."""
    targets = []
    for part in (p for p in text.split(",") if p.strip()):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in SLO_KEYS:
            raise KvsimError(f"unknown target {key!r}; give {', '.join(k + '=...' for k in SLO_KEYS)}", field="--slo")
        m = _DURATION.match(value)
        if not m:
            raise KvsimError(f"{key}: {value.strip()!r} is not a duration (e.g. 2s, 50ms)", field="--slo")
        scale = {"ms": 1e-3, "us": 1e-6, "µs": 1e-6}.get(m.group(2) or "s", 1.0)
        seconds = float(m.group(1)) * scale
        if seconds <= 0:
            raise KvsimError(f"{key} must be > 0", field="--slo")
        if any(name == f"{key}_s" for name, _ in targets):
            raise KvsimError(f"{key} given twice", field="--slo")
        targets.append((f"{key}_s", seconds))
    if not targets:
        raise KvsimError("give at least one target, e.g. ttft_p99=2s,tpot_p99=50ms", field="--slo")
    return Slo(tuple(targets))


def parse_ints(text: str, field_name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise KvsimError(f"expected whole numbers separated by commas, got {text!r}", field=field_name) from None
    if not values or min(values) < 1:
        raise KvsimError(f"expected whole numbers >= 1, got {text!r}", field=field_name)
    return sorted(set(values))


@dataclass(frozen=True)
class PlanTask:
    """One deployment to replay: what the sweep's runners hand a worker (`point`, `allocator_index`,
    `axis_values`, `allocator`, `search` are what they read). With `targets` (the SLO's), the replay stops as
    soon as a TTFT target is certainly missed (`kvsim.deployment.slo_watch`)."""

    point: int
    gpu: str
    tp: int
    replicas: int
    workload: dict
    workload_path: str
    timing: str
    allocator: str = ""
    allocator_index: int = 0
    search: None = None
    targets: tuple = ()

    @property
    def axis_values(self) -> tuple:
        return (("gpu", self.gpu), ("tp", self.tp), ("replicas", self.replicas))

    @property
    def gpus(self) -> int:
        return self.tp * self.replicas

    def workload_mapping(self) -> dict:
        """The workload of this deployment: its GPU, tp and replicas set."""
        import copy

        mapping = copy.deepcopy(self.workload)
        mapping["hardware"] = self.gpu
        mapping["deployment"] = {**mapping.get("deployment", {}), "tp": self.tp, "replicas": self.replicas}
        return mapping


def run_plan_task(task: PlanTask) -> dict:
    """The deployment's row: its p50/p99 latencies and throughput, or where its replay was cut short and the
    target it certainly misses, or the error that stopped it."""
    from kvsim.deployment.fleet import FleetResult, replay_config
    from kvsim.deployment.reports import fleet_metrics
    from kvsim.deployment.slo_watch import SloWatch
    from kvsim.replay.options import ReplayOptions
    from kvsim.replay.reports import output_tokens, summary_records
    from kvsim.replay.run import resolve_replay
    from kvsim.workload.spec import workload_from_mapping

    row = {"point": task.point, "gpu": task.gpu, "tp": task.tp, "replicas": task.replicas, "gpus": task.gpus}
    try:
        workload = workload_from_mapping(task.workload_mapping(), task.workload_path, sha256="plan")
        result, ctx, requests, options = resolve_replay(workload, ReplayOptions(tensors=False, timing=task.timing))
        watch = SloWatch(task.targets, result.arrival_s, output_tokens(result))
        run = replay_config(workload.allocators[0], requests, ctx, options, task.replicas, workload.router,
                            watch=watch if watch.active else None)
        row["clock"] = result.clock
        row["async_scheduling"] = workload.scheduler.async_scheduling
        row["error"] = None
        if run is None:
            row.update({"cut_short": True, "cut_at_s": watch.cut_at_s, "cut_metric": watch.metric,
                        watch.metric: watch.lower_bound, "num_requests": len(requests)})
        else:
            fleet = FleetResult(result=result, num_replicas=task.replicas, router=workload.router, context=ctx,
                                requests=requests, fleets=[run])
            (dep,) = summary_records(replace(result, runs=[run.deployment]), kernels=False)
            dep.update(fleet_metrics(fleet, run, bounds=False))  # the LRU bounds: not a plan's figures
            row.update({k: dep[k] for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "throughput_tokens_per_s",
                                              "num_requests", "finished", "rejected", "load_imbalance", "fleet_hit_rate")})
            row["unfinished"] = int(dep["num_requests"] - dep["finished"])
            row["cut_short"] = False
    except KvsimError as exc:
        row["error"] = str(exc)
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}


@dataclass
class Plan:
    """Every row, the SLO, and per GPU kind the cheapest deployment meeting it and the next smaller one."""

    slo: Slo
    rows: list[dict]
    skipped: list[str] = field(default_factory=list)  # (gpu, tp) pairs that cannot hold the model, in words
    pruned: list[dict] = field(default_factory=list)  # deployments not replayed: {gpu, tp, replicas, gpus, reason}

    def meets(self, row: dict) -> bool:
        return not self.slo.misses(row)

    def cheapest(self, gpu: str) -> dict | None:
        ok = [r for r in self.rows if r["gpu"] == gpu and self.meets(r)]
        return min(ok, key=lambda r: (r["gpus"], r["ttft_p99_s"], r["tp"])) if ok else None

    def next_smaller(self, gpu: str) -> dict | None:
        """The largest deployment of `gpu` with fewer GPUs than its cheapest (the one just below it; of those,
        one replayed to its end before one cut short, then the nearest to the SLO)."""
        best = self.cheapest(gpu)
        if best is None:
            return None
        smaller = [r for r in self.rows if r["gpu"] == gpu and r["gpus"] < best["gpus"]]
        return max(smaller, key=lambda r: (r["gpus"], not r.get("cut_short"), -self.slo.excess(r))) if smaller else None

    def closest(self) -> dict:
        """The nearest to the SLO, of those replayed to their end first (a cut-short figure is only a bound)."""
        return min(self.rows, key=lambda r: (bool(r.get("cut_short")), self.slo.excess(r), r["gpus"]))

    def plans_json(self) -> list[dict]:
        """plan.json's `plans`: one per deployment replayed (`status` replayed, or cut short: its
        `cut_metric` figure is then a lower bound, reached at `cut_at_s` simulated, and the others are null) or
        known to miss without a replay (`status` never fits)."""
        keys = ("gpu", "tp", "replicas", "gpus", "ttft_p99_s", "tpot_p99_s", "ttft_p50_s", "tpot_p50_s",
                "throughput_tokens_per_s", "fleet_hit_rate", "async_scheduling", "error")
        return [{**{k: r.get(k) for k in keys[:4]}, "meets_slo": self.meets(r), "status": status(r),
                 **{k: r.get(k) for k in keys[4:]},
                 **({"cut_metric": r["cut_metric"], "cut_at_s": r["cut_at_s"]} if r.get("cut_short") else {})}
                for r in sorted(self.rows, key=lambda r: (r["gpu"], r["gpus"], r["tp"]))]


def status(row: dict) -> str:
    """replayed, cut short, never fits or error."""
    if row.get("error"):
        return "error"
    if row.get("never_fits"):
        return "never fits"
    return "cut short" if row.get("cut_short") else "replayed"


def plan_tasks(target: str, *, model: str | None, gpus: list[str], tps: list[int], replicas: list[int], timing: str,
               router: str | None, async_scheduling: bool | None = None) -> tuple[list[PlanTask], list[str], str]:
    """The deployments to replay, the (GPU, tp) pairs skipped because the model does not fit, and the
    workload's path. Bad input (a tp that divides no head count, nothing that fits) is one line.
    `async_scheduling` (None: the workload's, else vllm serve's default, async) sets every deployment's loop."""

    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu
    from kvsim.size.sizing import kv_cache_spec, weight_bytes
    from kvsim.workload.spec import ROUTER_POLICIES

    path = Path(target)
    if not path.exists():
        raise KvsimError(f"no such file: {target}", field="WORKLOAD_OR_TRACE")
    if path.suffix in (".yaml", ".yml"):
        from kvsim.workload.yaml_file import parse_yaml

        mapping = parse_yaml(path.read_bytes(), source=target) or {}
        if not isinstance(mapping, dict):
            raise KvsimError("expected a workload mapping", source=target)
        if model is not None:
            mapping["model"] = model
        if "model" not in mapping:
            raise KvsimError("give --model (the workload names none)", field="--model")
        named = str(mapping["model"])
        if model is None and (named.endswith(".json") or (path.parent / named).exists()):
            mapping["model"] = str((path.parent / named).resolve())  # a path in the file is the file's, as replay reads it
        allocators = mapping.get("allocators") or [{"kind": "paged", "block_size": 16, "prefix_caching": True}]
        mapping["allocators"] = allocators[:1]  # one engine configuration per deployment: the first
        workload_path = str(path)
    else:  # a trace: a vLLM-like engine over it
        if model is None:
            raise KvsimError("a trace needs --model", field="--model")
        spec = resolve_model(model)
        mapping = {"name": path.stem, "model": model, "gpu_memory_utilization": 0.9, "max_model_len": spec.max_model_len,
                   "requests": {"trace": {"path": str(path.resolve())}},
                   "allocators": [{"kind": "paged", "block_size": 16, "prefix_caching": True}]}
        workload_path = str(path.with_suffix(".plan.yaml"))
    if async_scheduling is not None:
        mapping["scheduler"] = {**(mapping.get("scheduler") or {}), "async_scheduling": async_scheduling}
    if router is not None:
        if router not in ROUTER_POLICIES:
            raise KvsimError(f"unknown router policy {router!r}; choose from {', '.join(ROUTER_POLICIES)}", field="--router")
        mapping["router"] = {**(mapping.get("router") or {}), "policy": router}
    spec = resolve_model(mapping["model"])
    utilization = float(mapping.get("gpu_memory_utilization") or 0.9)
    for tp in tps:  # vLLM's rule against the heads: the same for every GPU
        try:
            kv_cache_spec(spec, tp=tp)
        except KvsimError as exc:
            raise KvsimError(str(exc).removeprefix("--tp: "), field="--tp") from None
    tasks, skipped = [], []
    for gpu_name in gpus:
        gpu = get_gpu(gpu_name)
        for tp in tps:
            weights = weight_bytes(spec, tp=tp)
            if "kv_budget" not in mapping and gpu.memory_bytes * utilization <= weights:
                skipped.append(f"{gpu_name} tp {tp} ({spec.name}'s weights are {weights / 2**30:.1f} GiB a rank)")
                continue
            for n in replicas:
                tasks.append(PlanTask(len(tasks), gpu_name, tp, n, mapping, workload_path, timing))
    if not tasks:
        raise KvsimError(f"{spec.name} fits no searched GPU at any searched tp: {'; '.join(skipped)}", field="--tp")
    return tasks, skipped, workload_path


def check_requests(tasks: list[PlanTask]) -> None:
    """The request stream read once before any deployment runs: a bad trace row or workload field is the
    command's error, naming the file and line, not every deployment's row error under --slo."""
    from kvsim.workload.requests import generate_requests
    from kvsim.workload.spec import workload_from_mapping

    for task in tasks:  # the first deployment the workload validates for (a field of one deployment is its row's)
        try:
            workload = workload_from_mapping(task.workload_mapping(), task.workload_path, sha256="plan")
        except KvsimError as exc:
            if (exc.field or "").startswith("requests"):
                raise
            continue
        generate_requests(workload)
        return


def check_clock(tasks: list[PlanTask], timing: str) -> None:
    """The kernels-db clock must cover every searched (model, GPU, tp): a plan on the roofline is refused
    unless asked for (--timing roofline), since the roofline bounds a step's time rather than predicting it."""
    if timing == "roofline":
        return
    from kvsim.clock.kernels_db import kernel_clock
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu
    from kvsim.size.kv_dtype import kv_cache_dtype

    seen = set()
    for task in tasks:
        if (task.gpu, task.tp) in seen:
            continue
        seen.add((task.gpu, task.tp))
        model = resolve_model(task.workload["model"])
        try:
            kernel_clock(model, get_gpu(task.gpu), kv_dtype=kv_cache_dtype(task.workload.get("kv_dtype") or "auto", model),
                         tp=task.tp)
        except KvsimError as exc:
            raise KvsimError(f"the kernels-db clock does not cover {model.name} on {task.gpu} at tp {task.tp} ({exc}); "
                             "plan on the roofline only if you mean it (--timing roofline: a bound, not a latency)",
                             field="--gpu") from None


def run_plan(tasks: list[PlanTask], slo: Slo, *, workers: int | None, ray: str | None, skipped=(), on_row=None,
             exhaustive: bool = False) -> Plan:
    """Search the deployments through the sweep's runners (`plan_search.search_plan`); the `Plan` of their
    rows. `exhaustive` replays every deployment to its end."""
    from kvsim.deployment.plan_search import search_plan
    from kvsim.sweep.runners import open_pool

    pool = open_pool(workers, ray, run_plan_task)
    rows, pruned = search_plan(tasks, slo, pool, exhaustive=exhaustive, on_row=on_row)
    return Plan(slo, rows, list(skipped), pruned)


def _dur(value, ms_digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * 1e3:.{ms_digits}f} ms" if value < 1 else f"{value:.2f} s"
