"""A fleet replay's reports: summary.csv (one row per replica and one for the deployment, per allocator),
requests.csv (each request's replica), steps.parquet (each row's replica), meta.json, fleet.json.

The deployment row adds what only a fleet has: load imbalance (the busiest replica's computed tokens over the
mean), the fleet's prefix hit rate (prompt tokens served from cache at first admission / prompt tokens), and
beside it the exact LRU curve's hit rate at the fleet's total capacity (one cache of every replica's blocks:
what a router that loses nothing to splitting would reach) and with no capacity limit (no router beats it).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pandas as pd

from kvsim.deployment.fleet import FleetResult, FleetRun
from kvsim.errors import KvsimError
from kvsim.out_paths import output_dir
from kvsim.replay.records import STEP_COLUMNS
from kvsim.replay.reports import SUMMARY_FLOAT_FORMAT, jsonable, meta, requests_frame, summary_records


def fleet_records(fleet: FleetResult) -> list[dict]:
    """summary.csv's rows: per allocator, one per replica (replica 0..N-1) then the deployment's (`all`)."""
    result = fleet.result
    records = []
    for run in fleet.fleets:
        per_replica = summary_records(replace(result, runs=run.replicas), kernels=False)
        counts = np.bincount(run.replica_of, minlength=fleet.num_replicas)
        for k, rec in enumerate(per_replica):
            rec["allocator"] = run.label
            rec["num_requests"] = int(counts[k])
            records.append({"replica": str(k), **rec})
        (dep,) = summary_records(replace(result, runs=[run.deployment]), kernels=False)
        dep.update(fleet_metrics(fleet, run))
        records.append({"replica": "all", **dep})
    for rec in records:
        rec.update({"replicas": fleet.num_replicas, "gpus": fleet.num_gpus, "router": fleet.router.policy})
    return records


def fleet_metrics(fleet: FleetResult, run: FleetRun, *, bounds: bool = True) -> dict:
    """Load imbalance, the fleet's hit rate and the two bounds beside it (NaN without prefix caching, or when
    not `bounds`: the exact curve is a pass over every request's blocks, which `kvsim plan` does without)."""
    computed = np.array([float(r.steps["num_prefill_tokens"].sum() + r.steps["num_decode_tokens"].sum()) for r in run.replicas])
    imbalance = float(computed.max() / computed.mean()) if computed.mean() > 0 else math.nan
    prompt = fleet.result.num_prompt_tokens
    out = {"load_imbalance": imbalance, "fleet_hit_rate": math.nan, "hit_rate_bound": math.nan, "hit_rate_ideal": math.nan}
    config = run.deployment.config
    if config.prefix_caching:
        out["fleet_hit_rate"] = float(run.deployment.num_cached_tokens.sum() / max(prompt.sum(), 1))
    if config.prefix_caching and bounds:
        from kvsim.cache_curve.view import cache_curve_of

        bs = config.block_size
        curve = cache_curve_of(fleet.requests, block_size=bs)
        blocks = sum(max(r.budget_bytes // _block_bytes(fleet, bs), 1) - 1 for r in run.replicas)
        out["hit_rate_bound"] = float(curve.hit_rate(np.array([blocks * bs]))[0])
        out["hit_rate_ideal"] = float(curve.ideal_hit_rate)
    return out


def _block_bytes(fleet: FleetResult, block_size: int) -> int:
    return fleet.context.spec(block_size).bytes_per_token * block_size


def write_fleet_reports(fleet: FleetResult, out_dir, *, command: str | None = None) -> dict:
    """Write the fleet's reports under `out_dir`; returns {name: path} and the summary records."""
    out = output_dir(out_dir)
    result = fleet.result
    paths = {name: out / name for name in ("summary.csv", "requests.csv", "steps.parquet", "meta.json", "summary.json")}
    records = fleet_records(fleet)
    try:
        pd.DataFrame(records).to_csv(paths["summary.csv"], index=False, float_format=SUMMARY_FLOAT_FORMAT)
        paths["summary.json"].write_text(json.dumps(jsonable(records), indent=2) + "\n")
        frame = requests_frame(result)
        frame.insert(1, "replica", np.concatenate([run.replica_of for run in fleet.fleets]))
        frame.to_csv(paths["requests.csv"], index=False)
        steps_frame(fleet).to_parquet(paths["steps.parquet"], index=False)
        info = meta(result, command=command)
        info.update({"replicas": fleet.num_replicas, "gpus": fleet.num_gpus, "router": vars(fleet.router).copy()})
        paths["meta.json"].write_text(json.dumps(jsonable(info), indent=2) + "\n")
    except OSError as exc:
        raise KvsimError(f"cannot write {exc.filename or out}: {exc.strerror or exc}", field="--out") from None
    return {"paths": paths, "records": records, "out_dir": out}


def steps_frame(fleet: FleetResult) -> pd.DataFrame:
    """One row per scheduled row of every replica: allocator, replica, then the step columns."""
    frames = []
    for run in fleet.fleets:
        for k, rep in enumerate(run.replicas):
            frame = pd.DataFrame({name: rep.steps[name] for name, _ in STEP_COLUMNS})
            frame.insert(0, "replica", k)
            frame.insert(0, "allocator", run.label)
            frames.append(frame)
    return pd.concat(frames, ignore_index=True)
