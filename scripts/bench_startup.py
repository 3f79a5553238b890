"""`kvsim size`'s start-up time beside a two-command typer app (issue 21: under 1.3x).

Both run as fresh interpreters, one after the other, `--runs` times each; the minimum of each is printed with
their ratio (the minimum: the machine's other load only ever adds time). The typer app is the smallest CLI with
the same framework: two commands, one option each, printing one line, so the ratio is kvsim's own cost over
the interpreter's and typer's (typer 0.29 imports pydantic for its options; both pay it).

    python3 scripts/bench_startup.py            # kvsim size -m llama-3.1-8b --gpu h100-80gb, min of 9
    python3 scripts/bench_startup.py --runs 21 -- size -m qwen3-0.6b --json
    python3 scripts/bench_startup.py --against /tmp/old   # also another checkout's kvsim (git archive REV), interleaved
    python3 scripts/bench_startup.py --instructions       # instructions executed (valgrind), not time: the same
                                                          # on a loaded machine, ~10 s a run
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

TYPER_APP = '''\
import typer

app = typer.Typer()


@app.command()
def hello(name: str = typer.Option("world", help="Who to greet.")) -> None:
    """Say hello."""
    print(f"hello {name}")


@app.command()
def bye(name: str = typer.Option("world", help="Who to leave.")) -> None:
    """Say goodbye."""
    print(f"bye {name}")


if __name__ == "__main__":
    app()
'''


def timed(cmd: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    """Wall seconds of one run of `cmd`, start to exit, and its CPU seconds (user + system: less moved by the
    machine's other load); a failing run is an error, not a time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-500:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def instructions(cmd: list[str], env: dict[str, str], cwd: str) -> int:
    """Instructions one run of `cmd` executes (callgrind's total), deterministic where time is not."""
    proc = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd], env=env, cwd=cwd,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"valgrind {' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-500:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="runs of each command; the minimum is kept")
    parser.add_argument("--no-bytecode-cache", action="store_true",
                        help="compile kvsim's modules at every run (PYTHONDONTWRITEBYTECODE=1 with no cache yet), "
                        "as a fresh source tree does; by default their bytecode is cached once, as pip install does")
    parser.add_argument("--no-data-cache", action="store_true",
                        help="kvsim's parsed cache of its data files off (KVSIM_DATA_CACHE=off): PyYAML parses at every run")
    parser.add_argument("--instructions", action="store_true",
                        help="count the instructions each command executes under valgrind (callgrind) instead of timing it")
    parser.add_argument("--against", type=Path, help="another checkout of kvsim to time in the same runs")
    parser.add_argument("kvsim_args", nargs="*", default=["size", "-m", "llama-3.1-8b", "--gpu", "h100-80gb"])
    args = parser.parse_args()

    def env_for(repo: Path) -> dict[str, str]:
        return dict(env, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        if args.no_bytecode_cache:  # the libraries keep their installed bytecode; kvsim's is compiled each run
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        else:  # kvsim's bytecode written once, outside the tree, gone afterwards (the libraries' cached there too)
            env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
            env.pop("PYTHONDONTWRITEBYTECODE", None)
        # the data files' parsed cache (kvsim.models.parsed_cache) filled by the warm-up run, as by a user's first;
        # --no-data-cache: off, every run parses with PyYAML
        env["KVSIM_DATA_CACHE"] = "off" if args.no_data_cache else str(Path(tmp) / "data-cache")
        app = Path(tmp) / "two_commands.py"
        app.write_text(TYPER_APP)
        kvsim_cmd = [sys.executable, "-m", "kvsim", *args.kvsim_args]
        label = "kvsim " + " ".join(args.kvsim_args)
        # every run in the temporary folder: `python -m kvsim` looks in the current folder before PYTHONPATH
        cases = {label: (kvsim_cmd, env_for(REPO))}
        if args.against:
            cases[f"the same, {args.against}"] = (kvsim_cmd, env_for(args.against.resolve()))
        cases["two-command typer app"] = ([sys.executable, str(app), "hello", "--name", "kvsim"], env)
        for cmd, cmd_env in cases.values():  # warm the file cache and the bytecode once
            timed(cmd, cmd_env, tmp)
        if args.instructions:
            counts = {name: instructions(cmd, dict(cmd_env, PYTHONHASHSEED="0"), tmp) for name, (cmd, cmd_env) in cases.items()}
            width = max(len(name) for name in cases) + 2
            base = counts["two-command typer app"]
            print(f"instructions executed (valgrind --tool=callgrind), {'bytecode cached' if not args.no_bytecode_cache else 'kvsim compiled'}")
            for name, count in counts.items():
                print(f"{name:{width}} {count / 1e6:9.1f} M {count / base:5.2f}x")
            return
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        for _ in range(args.runs):  # interleaved: a burst of load hits each alike
            for name, (cmd, cmd_env) in cases.items():
                runs[name].append(timed(cmd, cmd_env, tmp))

    cache = "kvsim compiled at every run" if args.no_bytecode_cache else "bytecode cached"
    print(f"min of {args.runs} runs each, {cache}; load average {os.getloadavg()[0]:.2f}")
    width = max(len(name) for name in cases) + 2
    print(f"{'':{width}} {'wall s':>7} {'CPU s':>7} {'ratio':>6} {'ratio':>6}")
    best = {name: [min(run[i] for run in times) for i in (0, 1)] for name, times in runs.items()}
    base = best["two-command typer app"]
    for name, (w, c) in best.items():
        print(f"{name:{width}} {w:7.3f} {c:7.3f} {w / base[0]:5.2f}x {c / base[1]:5.2f}x")


if __name__ == "__main__":
    main()
