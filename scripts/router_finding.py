"""Round robin vs least loaded vs prefix routing on 4 and 8 replicas (docs/deployment.md's finding table).

    PYTHONPATH=$PWD python3 scripts/router_finding.py workloads/fleet-mooncake.yaml --trace ../shared/traces/mooncake/conversation_trace.jsonl
    PYTHONPATH=$PWD python3 scripts/router_finding.py workloads/fleet-shared-prefix.yaml

Each row is one fleet replay (accounting only, the kernels-db clock): the deployment's TTFT p50/p99, output
tokens per second, the fleet's prefix hit rate beside the exact LRU curve at the fleet's capacity and with
none, and the load imbalance (the busiest replica's computed tokens over the mean).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from kvsim.deployment.fleet import replay_fleet
from kvsim.deployment.reports import fleet_records
from kvsim.replay.options import ReplayOptions
from kvsim.workload.spec import Router, load_workload

ROUTERS = [
    ("random", Router(policy="random")),
    ("round-robin", Router(policy="round-robin")),
    ("least-loaded (requests)", Router(policy="least-loaded")),
    ("least-loaded (kv_usage)", Router(policy="least-loaded", load="kv_usage")),
    ("prefix-approx (dynamo)", Router(policy="prefix-approx")),
    ("prefix-precise (dynamo)", Router(policy="prefix-precise")),
    ("prefix-precise (llm-d 2/1/1)", Router(policy="prefix-precise", scorer="llm-d")),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload")
    parser.add_argument("--trace")
    parser.add_argument("--replicas", default="4,8")
    parser.add_argument("--timing", default="kernels-db")
    parser.add_argument("--routers", help="Only the routers whose name contains one of these (comma-separated).")
    args = parser.parse_args()
    workload = load_workload(args.workload, trace=args.trace)
    print(f"{workload.name}: {workload.model} on {workload.hardware} x tp {workload.deployment.tp}, timing {args.timing}")
    print("| replicas | router | TTFT p50 | TTFT p99 | output tok/s | hit rate | LRU at fleet capacity | unbounded | imbalance | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in (int(v) for v in args.replicas.split(",")):
        for name, router in ROUTERS:
            if args.routers and not any(part in name for part in args.routers.split(",")):
                continue
            start = time.perf_counter()
            fleet = replay_fleet(workload, ReplayOptions(tensors=False, timing=args.timing), replicas=n,
                                 router=replace(router, seed=workload.seed))
            wall = time.perf_counter() - start
            dep = next(r for r in fleet_records(fleet) if r["replica"] == "all")
            print(f"| {n} | {name} | {dep['ttft_p50_s']:.3f} s | {dep['ttft_p99_s']:.2f} s | {dep['throughput_tokens_per_s']:,.0f} "
                  f"| {dep['fleet_hit_rate']:.1%} | {dep['hit_rate_bound']:.1%} | {dep['hit_rate_ideal']:.1%} "
                  f"| {dep['load_imbalance']:.2f} | {wall:.0f} |", flush=True)


if __name__ == "__main__":
    main()
