"""Benchmark: the full Azure conversation trace through one flat and one paged allocator, accounting only.

    python3 scripts/bench_replay.py [--trace ../shared/traces/azure-conv-2023.csv] [--model llama-3.1-8b]
        [--limit N] [--profile]

Measures what `kvsim replay --no-tensors` costs on this host: wall seconds of the replay loop and of writing
the reports (steps.parquet), and the process's peak RSS. Target: < 10 s and < 1 GB for the 19,366 requests.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "azure-conv-2023.csv"

WORKLOAD = """\
name: bench-azure-conv
seed: 0
model: {model}
kv_dtype: bf16
hardware: {hardware}
gpu_memory_utilization: 0.9
max_model_len: {max_model_len}
requests: {{trace: {trace}, time_scale: {time_scale}}}
allocators:
  - {{kind: flat, reserve: max}}
  - {{kind: paged, block_size: 16}}
scheduler: {{max_num_seqs: 256, max_num_batched_tokens: 8192, preemption: recompute}}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--hardware", default="h100-80gb")
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--time-scale", type=float, default=1.0, help="arrival times x this (0.25: 4x the load)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: one per allocator, up to CPUs)")
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile of the replay")
    args = parser.parse_args()
    if not args.trace.is_file():
        print(f"trace not found: {args.trace}", file=sys.stderr)
        return 2

    t_import = time.perf_counter()
    from kvsim.replay.run import run_replay
    from kvsim.replay.options import ReplayOptions
    from kvsim.replay.reports import summary_records, write_reports
    from kvsim.workload.spec import load_workload

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(
            WORKLOAD.format(
                model=args.model, hardware=args.hardware, max_model_len=args.max_model_len, trace=args.trace.resolve(),
                time_scale=args.time_scale,
            )
        )
        workload = load_workload(path, limit=args.limit)
        options = ReplayOptions(tensors=False)
        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            result = profiler.runcall(run_replay, workload, options, workers=1)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
        else:
            result = run_replay(workload, options, workers=args.workers)
        t1 = time.perf_counter()
        write_reports(result, Path(tmp) / "out", command="scripts/bench_replay.py")
        t2 = time.perf_counter()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    worker_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # largest worker process
    cpu = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    print(f"requests: {len(result.arrival_s):,}   model: {result.model_name}   budget: {result.budget_bytes / 2**30:.1f} GiB")
    for rec in summary_records(result):
        rows = len(next(r for r in result.runs if r.label == rec["allocator"]).steps["step"])
        print(
            f"  {rec['allocator']:<10} steps {rec['num_steps']:>9,}  rows {rows:>8,}  sim {rec['sim_time_s']:8.1f} s  "
            f"running avg {rec['mean_running']:6.1f}  preemptions {rec['preemptions']:>6,}  rejected {rec['rejected']}"
        )
    print(f"imports {t0 - t_import:.2f} s   replay {t1 - t0:.2f} s   reports {t2 - t1:.2f} s   total {t2 - t_import:.2f} s")
    print(f"cpu (user + sys, workers included) {cpu:.2f} s")
    print(f"peak RSS {peak_rss / 2**20:.0f} MiB (main process), {worker_rss / 2**20:.0f} MiB (largest child process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
