"""Benchmark: a whole `kvsim replay` command's CPU seconds, and how much of them the replay loop takes.

    python3 scripts/bench_command.py [--runs 3] [--base DIR] -- replay WORKLOAD [flags...]

Each run starts the command in a child process (`kvsim.cli.main()`, as `python3 -m kvsim` does) with CPU clocks
around `run_replay_cli`, `resolve_replay`, `replay_allocator` and `write_reports`, and reads the child's rusage:
the whole command (user + sys, worker processes included) and its stages: start-up to the command (the
interpreter, typer's parse, the replay's modules, imported first), the workload file, the run resolved (model,
budget, the trace and its requests), the replay loops, the reports, the interpreter's teardown (where there is
one) and the rest. With worker processes the loops run in them, and only the whole is given. `--base DIR` alternates each run with the tree at DIR (e.g. `git archive <commit> | tar -x -C
DIR`), run from DIR with PYTHONPATH=DIR (its `kvsim.__file__` is printed: check it). The minimum of `--runs` runs
of each is printed, with the machine's load: CPU seconds of a shared machine are comparable only run beside run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import atexit, json, sys, time
import kvsim, kvsim.replay.reports as reports, kvsim.replay.run as run, kvsim.replay.view as view
marks = {}
def clocked(module, name, key):
    fn = getattr(module, name)
    def timed(*args, **kwargs):
        marks.setdefault(key + "_start", time.process_time())
        try:
            return fn(*args, **kwargs)
        finally:
            marks[key + "_end"] = time.process_time()
    setattr(module, name, timed)
clocked(view, "run_replay_cli", "command")
clocked(run, "resolve_replay", "resolve")
clocked(run, "replay_allocator", "loops")
clocked(reports, "write_reports", "reports")
atexit.register(lambda: print("BENCH " + json.dumps({"file": kvsim.__file__, "exit": time.process_time(), **marks}), file=sys.stderr))
sys.argv = ["kvsim", *sys.argv[1:]]
from kvsim.cli import main
main()
"""


def one_run(root: Path, args: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(args)} failed ({proc.returncode}) in {root}: {proc.stderr[-2000:]}")
    line = next(x for x in proc.stderr.splitlines() if x.startswith("BENCH "))
    marks = json.loads(line[len("BENCH "):])
    whole = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row = {"whole": whole, "file": marks["file"]}
    if "loops_start" in marks:  # the loops ran in this process
        row.update(
            startup=marks["command_start"],  # the interpreter, typer's parse, the replay's modules (imported first here)
            imports=marks["resolve_start"] - marks["command_start"],  # the workload file read and checked
            resolve=marks["resolve_end"] - marks["resolve_start"],  # model, budget, the trace and the request stream
            replay=marks["loops_end"] - marks["loops_start"],
            reports=marks["reports_end"] - marks["reports_start"],
            teardown=whole - marks["exit"],
        )
        row["other"] = row["whole"] - sum(row[k] for k in ("startup", "imports", "resolve", "replay", "reports", "teardown"))
        row["beside"] = whole - row["replay"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--base", type=Path, help="another tree to alternate with (e.g. an export of a commit)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- replay WORKLOAD [flags...]")
    ns = parser.parse_args()
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    trees = {"base": ns.base.resolve(), "this tree": REPO} if ns.base else {"this tree": REPO}
    rows: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(ns.runs):
        for name, root in trees.items():
            rows[name].append(one_run(root, args))
    print(f"kvsim {' '.join(args)}  [load {', '.join(f'{x:.2f}' for x in os.getloadavg())}]")
    for name, runs in rows.items():
        best = min(runs, key=lambda r: r["whole"])
        text = f"  {name} ({best['file']}): whole {best['whole']:.2f} CPU s"
        if "replay" in best:
            text += (f" = start-up and imports {best['startup']:.2f} + workload file {best['imports']:.2f} + resolve (trace, "
                     f"requests) {best['resolve']:.2f} + loops {best['replay']:.2f} + reports {best['reports']:.2f} + "
                     f"teardown {best['teardown']:.2f} + other {best['other']:.2f}; beside the loops "
                     f"{min(r['beside'] for r in runs):.2f}")
        wholes = ", ".join(f"{r['whole']:.2f}" for r in runs)
        print(f"{text}  (runs: {wholes})")


if __name__ == "__main__":
    main()
