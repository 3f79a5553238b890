"""Benchmark: `kvsim cache-curve` on the Mooncake conversation trace at block sizes 16 and 512.

    python3 scripts/bench_cache_curve.py [--trace ../shared/traces/mooncake/conversation_trace.jsonl]
        [--block-sizes 16,512] [--repeat 3]

Measures, per block size, the wall seconds of reading the trace and of the one-pass curve (the best of
--repeat runs), the distinct blocks and the runs the recency tree holds, and the process's peak RSS.
Targets on a 2-core machine: under 20 s at block size 16 and under 3 s at 512, read included.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--block-sizes", default="16,512")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if not args.trace.is_file():
        print(f"no trace at {args.trace}", file=sys.stderr)
        return 2

    from kvsim.cache_curve.view import cache_curve_of
    from kvsim.cache_curve.blocks import prompt_block_units
    from kvsim.workload.requests import trace_requests
    from kvsim.workload.traces import read_trace

    for block_size in (int(b) for b in args.block_sizes.split(",")):
        best_read = best_curve = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            requests = trace_requests(read_trace(args.trace))
            t1 = time.perf_counter()
            curve = cache_curve_of(requests, block_size=block_size)
            t2 = time.perf_counter()
            best_read, best_curve = min(best_read, t1 - t0), min(best_curve, t2 - t1)
        units = [prompt_block_units(r, block_size) for r in requests]
        accesses = sum(n for u in units for _, n in u)
        distinct = sum(dict(p for u in units for p in u).values())
        print(f"block size {block_size}: {len(requests):,} requests, {curve.prompt_tokens:,} prompt tokens, "
              f"{accesses:,} block uses, {distinct:,} distinct blocks; read {best_read:.2f} s + curve {best_curve:.2f} s "
              f"= {best_read + best_curve:.2f} s; ideal hit rate {curve.ideal_hit_rate:.4f}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
