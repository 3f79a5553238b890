"""Benchmark: where one replay's time goes, as calls and seconds inside named functions (a `time.perf_counter`
accumulator around each: no profiler, whose per-call cost inflates short calls 2-3x).

    python3 scripts/bench_calls.py [--uncached] [--trace PATH] [--runs 1] [--time-only] [FUNCTION ...]

The replay is `scripts/bench_speed.py`'s item 1: workloads/mooncake-conversation.yaml with the whole Mooncake
conversation trace (`--trace`, default ../shared/traces/mooncake/conversation_trace.jsonl), one paged-16 allocator
with prefix caching (`--uncached`: the one without), accounting only, async scheduling. FUNCTION is a dotted
path to a function or a method, e.g. `kvsim.engine.paged.block_pool.BlockPool.cache_full_blocks`; the default is
the cached path's functions. Seconds include the accumulator's own cost (~0.5 µs a call), and a function called
inside another counts in both. The replay's CPU seconds are printed first (each run; the table is the last run's).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_speed  # noqa: E402  (this directory's: the replay and its workload)

DEFAULT = [
    "kvsim.engine.paged.unitary_kv_cache_manager.PagedAllocator.allocate",
    "kvsim.engine.paged.block_pool.BlockPool.cache_full_blocks",
    "kvsim.engine.paged.block_pool.BlockPool._purge",
    "kvsim.engine.paged.unitary_kv_cache_manager.PagedAllocator.append_slots",
    "kvsim.engine.paged.kv_cache_utils.RequestBlockKeys.get",
    "kvsim.engine.paged.unitary_kv_cache_manager.PagedAllocator._find_longest_cache_hit",
    "kvsim.engine.paged.unitary_kv_cache_manager.PagedAllocator.free",
]


def resolve(path: str) -> tuple[object, str]:
    """The object holding the function at dotted `path` (a module or a class) and the function's name."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        getattr(owner, parts[-1])  # (an unknown name fails here)
        return owner, parts[-1]
    raise SystemExit(f"bench_calls: no module in {path!r}")


def wrap(owner: object, name: str, label: str, spent: dict) -> None:
    """Replace `owner.name` by the same function counting its calls and seconds into `spent[label]`."""
    fn = getattr(owner, name)
    clock = time.perf_counter

    def counted(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = spent[label]
            entry[0] += 1
            entry[1] += clock() - start

    setattr(owner, name, counted)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("functions", nargs="*", default=DEFAULT)
    parser.add_argument("--uncached", action="store_true", help="the paged-16 allocator without prefix caching")
    parser.add_argument("--trace", type=Path, default=bench_speed.DEFAULT_TRACE)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--time-only", action="store_true", help="no wrappers: the replay's CPU seconds alone")
    args = parser.parse_args()
    if args.time_only:
        args.functions = []
    if not args.trace.is_file():
        raise SystemExit(f"bench_calls: no trace at {args.trace} (--trace)")
    workload = bench_speed._workload("mooncake-conversation.yaml", args.trace)
    index = [a.kind == "paged" and a.block_size == 16 and bool(a.prefix_caching) != args.uncached
             for a in workload.allocators].index(True)
    one = bench_speed.one_allocator(workload, index)
    spent: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for path in args.functions:
        owner, name = resolve(path)
        wrap(owner, name, ".".join(path.split(".")[-2:]), spent)
    print(f"bench_calls: {'uncached' if args.uncached else 'cached'} replay of the whole trace; load "
          + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    for _ in range(args.runs):
        spent.clear()
        result = bench_speed.time_replay(one, tensors=False)
        print(f"replay: {result['cpu_s']:.3f} CPU s, {result['rows']:,} rows, hit tokens {result['hit_tokens']:,}")
    width = max(len(label) for label in spent) if spent else 8
    for label, (calls, seconds) in sorted(spent.items(), key=lambda item: -item[1][1]):
        print(f"  {label:<{width}}  {calls:>9,} calls  {seconds:7.3f} s  {seconds / calls * 1e6:7.2f} µs a call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
