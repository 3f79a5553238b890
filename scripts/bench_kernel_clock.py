"""Benchmark: an accounting replay on the kernels-db clock against the same replay on the roofline.

    python3 scripts/bench_kernel_clock.py [--workload workloads/poisson.yaml] [--repeat 3]

Prints the best of `--repeat` wall times of `run_replay` (one process, every allocator in turn) per clock, the
ratio (target: kernels-db <= 2x roofline), and, apart, the one-off cost of building the clock (loading the
database and compiling the model's op lists), which a replay pays once per process.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", type=Path, default=REPO / "workloads" / "poisson.yaml")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from kvsim.clock import kernels_db as kernel_clock
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu
    from kvsim.replay.run import run_replay
    from kvsim.replay.options import ReplayOptions
    from kvsim.workload.spec import load_workload

    if not kernel_clock.available():
        print("aiconfigurator-core is not installed: pip install 'kvsim[perfdb]'", file=sys.stderr)
        return 2
    workload = load_workload(args.workload)
    t0 = time.perf_counter()
    kernel_clock.kernel_clock(resolve_model(workload.model), get_gpu(workload.hardware))  # cached for the replays
    build_s = time.perf_counter() - t0
    best = {}
    for timing in ("roofline", "kernels-db"):
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            result = run_replay(workload, ReplayOptions(tensors=False, timing=timing), workers=1)
            times.append(time.perf_counter() - t)
        best[timing] = min(times)
        rows = sum(len(run.steps["step"]) for run in result.runs)  # a slower clock schedules differently
        print(f"{timing:>10}: {best[timing]:.2f} s (best of {args.repeat}), {rows:,} step rows, "
              f"{best[timing] / rows * 1e6:.1f} us per row")
    print(f"     ratio: {best['kernels-db'] / best['roofline']:.2f}x (target <= 2x)")
    print(f"clock build: {build_s:.2f} s once per process (database load + op-list compile)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
