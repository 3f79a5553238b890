"""A fleet's replay time against one replica's on the same traffic (accounting only), and `kvsim plan`'s wall time.

    PYTHONPATH=$PWD python3 scripts/bench_fleet.py fleet workloads/fleet-shared-prefix.yaml --replicas 8 --router round-robin
    PYTHONPATH=$PWD python3 scripts/bench_fleet.py fleet workloads/fleet-mooncake.yaml --trace ../shared/traces/mooncake/conversation_trace.jsonl --replicas 8
    PYTHONPATH=$PWD python3 scripts/bench_fleet.py plan --trace ../shared/traces/mooncake/conversation_trace.jsonl [--exhaustive]

`fleet` replays the workload on 1 replica and on N (best of --repeat each; CPU seconds of this process and wall
seconds) and prints the ratio; `plan` times `kvsim plan` over 5 replica counts x 3 tp x 2 GPUs = 30 deployments
with 2 workers (wall, and CPU of every process) and counts how many it replayed, cut short and did not replay.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bench_fleet(args) -> None:
    from kvsim.deployment.fleet import replay_fleet
    from kvsim.replay.options import ReplayOptions
    from kvsim.workload.spec import Router, load_workload

    workload = load_workload(args.workload, trace=args.trace)
    times = {}
    for n in (1, args.replicas):
        best = None
        for _ in range(args.repeat):
            wall, cpu = time.perf_counter(), _cpu()
            replay_fleet(workload, ReplayOptions(tensors=False, timing=args.timing), replicas=n, router=Router(policy=args.router))
            sample = (time.perf_counter() - wall, _cpu() - cpu)
            best = sample if best is None or sample[1] < best[1] else best
        times[n] = best
        print(f"{n} replica(s): {best[0]:.1f} s wall, {best[1]:.1f} s CPU", flush=True)
    print(f"ratio {args.replicas} / 1: {times[args.replicas][1] / times[1][1]:.2f}x CPU, "
          f"{times[args.replicas][0] / times[1][0]:.2f}x wall (load average {os.getloadavg()[0]:.1f})")


def bench_plan(args) -> None:
    out = "/tmp/kvsim-bench-plan"
    command = [sys.executable, "-m", "kvsim", "plan", args.trace or "../shared/traces/mooncake/conversation_trace.jsonl",
               "--model", "llama-3.1-8b", "--gpu", "h100,h200", "--tp", "1,2,4", "--replicas", "1,2,4,6,8",
               "--slo", "ttft_p99=10s,tpot_p99=100ms", "--workers", "2", "--out", out, "-q"]
    if args.exhaustive:
        command.append("--exhaustive")
    start, cpu = time.perf_counter(), _children_cpu()
    done = subprocess.run(command, capture_output=True, text=True)
    print(" ".join(command[1:]))
    print(done.stdout + done.stderr)
    plan = json.loads((Path(out) / "plan.json").read_text())
    statuses = Counter(p["status"] for p in plan["plans"])
    print(f"{len(plan['plans']) + len(plan['pruned'])} deployments: " + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()))
          + f", {len(plan['pruned'])} not replayed (more GPUs than a plan found)")
    print(f"kvsim plan: {time.perf_counter() - start:.0f} s wall, {_children_cpu() - cpu:.0f} s CPU (workers included), "
          f"exit {done.returncode} (load average {os.getloadavg()[0]:.1f})")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("fleet", "plan"))
    parser.add_argument("workload", nargs="?")
    parser.add_argument("--trace")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--router", default="round-robin")
    parser.add_argument("--timing", default="kernels-db")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--exhaustive", action="store_true", help="plan: replay every deployment to its end")
    args = parser.parse_args()
    bench_fleet(args) if args.what == "fleet" else bench_plan(args)


if __name__ == "__main__":
    main()
