"""Benchmark `kvsim sweep`: a 100-point sweep of workloads/poisson.yaml (seeds 0..99, every allocator of the
file, accounting only) with 1 and 2 local workers and on a local Ray instance; wall times, the speed-up, and
the Ray backend's overhead per task beside the 2-worker local run. The three tables must be byte-identical.

`--tiny` replays one request per point instead of 2,000, so a task's wall time is almost all backend overhead
(process hand-off, pickling, Ray's scheduling): the overhead per task, free of the machine's load on replays.

    PYTHONPATH=$PWD python3 scripts/bench_sweep.py [--points 100] [--ray-cpus 2] [--no-ray] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100, help="Points (seeds) in the sweep.")
    parser.add_argument("--ray-cpus", type=int, default=2, help="CPUs of the local Ray instance.")
    parser.add_argument("--no-ray", action="store_true", help="Skip the Ray backend.")
    parser.add_argument("--tiny", action="store_true", help="One request per point: measures the backends' overhead.")
    args = parser.parse_args()

    from kvsim.sweep.view import run_sweep

    tmp = Path(tempfile.mkdtemp(prefix="kvsim-bench-sweep-"))
    sweep = tmp / "sweep.yaml"
    fields = {"name": "bench", "base": str(REPO / "workloads" / "poisson.yaml"), "axes": {"seed": list(range(args.points))}}
    if args.tiny:
        fields["set"] = {"requests.count": 1}
    sweep.write_text(yaml.safe_dump(fields))
    results = {}

    def timed(name: str, **kwargs) -> None:
        start = time.perf_counter()
        outcome = run_sweep(sweep, out=tmp / name, **kwargs)
        results[name] = {"wall_s": time.perf_counter() - start, "rows": outcome.num_rows, "failed": outcome.num_failed}
        print(f"{name:>10}: {results[name]['wall_s']:7.2f} s for {outcome.num_rows} rows", flush=True)

    timed("local-1", workers=1)
    timed("local-2", workers=2)
    if not args.no_ray:
        import ray

        start = time.perf_counter()
        ray.init(num_cpus=args.ray_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        results["ray_init_s"] = time.perf_counter() - start
        print(f"  ray.init: {results['ray_init_s']:7.2f} s", flush=True)
        timed("ray", ray="auto")
        ray.shutdown()
    tables = {name: (tmp / name / "results.parquet").read_bytes() for name in ("local-1", "local-2", "ray") if name in results}
    rows = results["local-1"]["rows"]
    summary = {
        "points": args.points,
        "tiny": args.tiny,
        "rows": rows,
        "speedup_2_workers": results["local-1"]["wall_s"] / results["local-2"]["wall_s"],
        "tables_identical": len(set(tables.values())) == 1,
        **results,
    }
    summary["local_2_ms_per_task"] = 1e3 * results["local-2"]["wall_s"] / rows
    summary["local_1_ms_per_task"] = 1e3 * results["local-1"]["wall_s"] / rows
    if "ray" in results:
        summary["ray_ms_per_task"] = 1e3 * results["ray"]["wall_s"] / rows
        summary["ray_overhead_per_task_ms"] = 1e3 * (results["ray"]["wall_s"] - results["local-2"]["wall_s"]) / rows
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
