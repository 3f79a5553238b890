"""The shipped workloads on the kernels-db clock, on every GPU it covers: which run, and what they yield.

    python3 scripts/kernel_clock_workloads.py [--limit 300] [--workloads poisson,bursty,...]

Each workload (accounting only, its first `--limit` requests) is replayed with its `hardware` replaced by each
GPU of `kvsim.clock.kernels_db.SYSTEMS`, on the kernels-db clock and on the roofline. A Markdown table on stdout:
the paged-16 allocator's (or the first allocator's) p50 TTFT, p50 TPOT and output tokens/s on both clocks, or
the one-line error that says what the database lacks. workloads/trace.yaml needs a trace file and is left out.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = "poisson,block-sizes,bursty,long-context,shared-prefix,alpaca-like,sharegpt-like,sliding-window"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=DEFAULT)
    parser.add_argument("--limit", type=int, default=300)
    args = parser.parse_args()

    from kvsim.errors import KvsimError
    from kvsim.clock.kernels_db import SYSTEMS
    from kvsim.replay.run import run_replay
    from kvsim.replay.options import ReplayOptions
    from kvsim.replay.reports import summary_records
    from kvsim.workload.spec import load_workload

    logging.disable(logging.WARNING)
    print("| workload | model | GPU | allocator | TTFT p50 s (kernels-db / roofline) | TPOT p50 ms | output tok/s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        workload = load_workload(REPO / "workloads" / f"{name}.yaml", limit=args.limit)
        for gpu in SYSTEMS:
            w = replace(workload, hardware=gpu)
            try:
                runs = [summary_records(run_replay(w, ReplayOptions(tensors=False, timing=t), workers=1))
                        for t in ("kernels-db", "roofline")]
            except KvsimError as exc:
                print(f"| {name} | {workload.model} | {gpu} | - | error: {exc} | | |")
                continue
            pick = next((j for j, r in enumerate(runs[0]) if r["allocator"] == "paged-16"), 0)
            k, r = runs[0][pick], runs[1][pick]
            print(f"| {name} | {workload.model} | {gpu} | {k['allocator']} | {k['ttft_p50_s']:.3f} / {r['ttft_p50_s']:.3f} "
                  f"| {k['tpot_p50_s'] * 1e3:.2f} / {r['tpot_p50_s'] * 1e3:.2f} "
                  f"| {k['throughput_tokens_per_s']:,.0f} / {r['throughput_tokens_per_s']:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
