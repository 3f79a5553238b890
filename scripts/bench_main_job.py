"""Benchmark: the README's main job and every shipped workload, as a user runs them, with CPU time and peak memory.

    python3 scripts/bench_main_job.py                       # kvsim replay workloads/poisson.yaml (CPU tensors)
    python3 scripts/bench_main_job.py --all                 # + every workloads/*.yaml's peak RSS (CPU tensors)
    python3 scripts/bench_main_job.py --measured --limit 20 # + --timing measured against the roofline replay
    python3 scripts/bench_main_job.py --sync                # + the main job with the synchronous loop

Each case is one `python3 -m kvsim replay ... --quiet` child process; its wall seconds, CPU seconds (user +
sys of it and its worker processes: steadier than wall on a shared machine) and the largest peak RSS of any
of its processes (what `/usr/bin/time -v` calls maximum resident set size) are printed as a table.
Targets: the main job under 8 s wall on an idle 2-core machine; no workload above 2 GB resident.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_case(args: list[str]) -> dict:
    """Run `python3 -m kvsim replay <args> --quiet` in a fresh child; wall, CPU and peak RSS of it alone."""
    # A grandchild reporter: RUSAGE_CHILDREN of a fresh process counts this case's processes only.
    probe = (
        "import resource, subprocess, sys, time;"
        "t = time.perf_counter(); rc = subprocess.call(sys.argv[1:]);"
        "w = time.perf_counter() - t; r = resource.getrusage(resource.RUSAGE_CHILDREN);"
        "print(rc, w, r.ru_utime + r.ru_stime, r.ru_maxrss)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "kvsim", "replay", *args, "--quiet"]
    done = subprocess.run([sys.executable, "-c", probe, *cmd], cwd=REPO, env=env, capture_output=True, text=True)
    rc, wall, cpu, maxrss_kb = done.stdout.split()[-4:]
    return {"command": "kvsim replay " + " ".join(args), "rc": int(rc), "wall_s": float(wall), "cpu_s": float(cpu),
            "max_rss_gb": int(maxrss_kb) * 1024 / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="Also every shipped workload (peak RSS; slow).")
    parser.add_argument("--measured", action="store_true", help="Also --timing measured vs roofline on --limit requests.")
    parser.add_argument("--limit", type=int, default=20, help="Requests for the --measured comparison.")
    parser.add_argument("--sync", action="store_true", help="Also the main job with --no-async-scheduling.")
    opts = parser.parse_args()
    cases = [["workloads/poisson.yaml"]]
    if opts.sync:
        cases += [["workloads/poisson.yaml", "--no-async-scheduling"]]
    if opts.all:
        cases += [[str(p.relative_to(REPO))] for p in sorted((REPO / "workloads").glob("*.yaml")) if p.name != "poisson.yaml"]
    if opts.measured:
        lim = ["--limit", str(opts.limit)]
        cases += [["workloads/poisson.yaml", *lim], ["workloads/poisson.yaml", *lim, "--timing", "measured"]]
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (times on a busy machine run long)")
    print(f"{'wall s':>8} {'CPU s':>8} {'max RSS GB':>11} {'rc':>3}  command")
    with tempfile.TemporaryDirectory() as tmp:
        for i, args in enumerate(cases):
            r = run_case([*args, "--out", str(Path(tmp) / str(i))])
            print(f"{r['wall_s']:8.1f} {r['cpu_s']:8.1f} {r['max_rss_gb']:11.2f} {r['rc']:3d}  {r['command']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
