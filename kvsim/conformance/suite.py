"""The conformance streams and the suite that runs them: one table row per stream, then the first differing
step of each stream that differs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvsim.conformance.compare import Comparison, compare
from kvsim.conformance.stream import STREAMS_DIR, Stream
from kvsim.errors import KvsimError


def _streams() -> tuple[Stream, ...]:
    sync = [
        "plenty", "max-num-seqs", "pressure", "pressure-heavy", "batch-200", "batch-200-pressure", "batch-200-prefix",
        "watermark", "whole-pool",
        "prefix", "prefix-pressure", "poisson-pressure", "poisson-prefix-pressure", "poisson-1000",
        "chunked-long", "max-model-len", "block-32", "block-256",
        "gpt-oss-pressure", "gemma3-pressure", "qwen3-next-pressure", "deepseek-v3-pressure",  # mixed models: vLLM's KV cache groups
        "gpt-oss-prefix-pressure", "gemma3-prefix-pressure",  # ... with prefix caching across the groups (vLLM's
        # default prefix_cache_retention_interval 0: sparse sliding-window blocks)
        "gpt-oss-prefix-dense", "gemma3-prefix-dense",  # ... the same under retention None (every block cached)
        "parallel-sampling", "gemma3-parallel-sampling",  # n samples a prompt: child requests sharing it by prefix caching
        # hybrid models as vllm serve runs them: prefix caching in mamba_cache_mode align (chunks end on block
        # boundaries, one cached state a hit, prefill checkpoints)
        "qwen3-next-prefix-pressure", "qwen3-next-prefix-dense", "qwen3-next-prefix-triton", "nemotron-h-prefix-pressure",
        "short-answers",  # requests finishing at their prefill beside decodes: the order one step's finishes free in
    ]
    as_written = ["block-32-long"]  # the file's own `scheduler: {async_scheduling: true}`, on both sides
    # Each stream twice: the synchronous loop (vLLM's Scheduler) and async scheduling (vllm serve's default).
    streams = [Stream(name, STREAMS_DIR / f"{name}.yaml", async_scheduling=False) for name in sync]
    streams += [Stream(f"{name}+async", STREAMS_DIR / f"{name}.yaml", async_scheduling=True) for name in sync]
    streams += [Stream(name, STREAMS_DIR / f"{name}.yaml") for name in as_written]
    # The CPU tier: vLLM's own OffloadingConnector (scheduler side) beside the replay's, its worker side simulated on
    # the replay's clock; loads, stores, flushes, completions, evictions and CPU hits compared at every step.
    offload = ["offload-lru", "offload-arc", "offload-chunks", "offload-gpu-pressure", "offload-fence", "offload-gemma3", "offload-gpt-oss", "offload-sync",
               "offload-qwen3-next", "offload-qwen3-next-repeat", "offload-nemotron-h"]
    streams += [Stream(name, STREAMS_DIR / f"{name}.yaml", async_scheduling=False) for name in offload]
    streams += [Stream(f"{name}+async", STREAMS_DIR / f"{name}.yaml", async_scheduling=True) for name in offload]
    # A fleet of 4 behind the precise prefix router: each replica's requests, replayed alone on both sides; the
    # file says async_scheduling: false, and +async routes and replays them with it on (both sides).
    fleet = STREAMS_DIR / "fleet-prefix-pressure.yaml"
    streams += [Stream(f"fleet-prefix-pressure/r{k}", fleet, async_scheduling=False, replica=k) for k in range(4)]
    streams += [Stream(f"fleet-prefix-pressure/r{k}+async", fleet, async_scheduling=True, replica=k) for k in range(4)]
    return tuple(streams)


STREAMS = _streams()


@dataclass(frozen=True)
class StreamResult:
    """One stream's comparison, or why it could not run on kvsim's side (`error`)."""

    stream: Stream
    comparison: Comparison | None
    error: str | None = None

    @property
    def differs(self) -> bool:
        return self.error is not None or self.comparison.differs


def run_stream(stream: Stream, progress: Callable[[str], None] | None = None) -> StreamResult:
    """Resolve `stream`, replay it in kvsim, run it through vLLM's scheduler, compare; `progress(text)` says
    which side runs and, every 1,024 steps, where it is."""
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.conformance.stream import resolve

    say = progress or (lambda text: None)
    try:
        rs = resolve(stream)
    except KvsimError as exc:
        return StreamResult(stream, None, error=str(exc))
    say("kvsim's replay")
    kvsim = run_kvsim(rs, progress)
    say("vLLM's scheduler")
    return StreamResult(stream, compare(kvsim, run_vllm(rs, progress)))


def select(names: list[str] | None) -> list[Stream]:
    """The streams named (all when None); an unknown name is a user error."""
    if not names:
        return list(STREAMS)
    by_name = {s.name: s for s in STREAMS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise KvsimError(f"unknown stream {unknown[0]!r} (streams: {', '.join(by_name)})", field="--stream")
    return [by_name[n] for n in names]


def run_suite(names: list[str] | None = None, echo: Callable[[str], None] = print,
              progress: Callable[[str], None] | None = None, workloads: list | None = None) -> int:
    """Run the streams (with `workloads`, paths of workload files: those, and only the streams `names` names),
    print the table and the first differing step of each differing stream.

    vLLM's modules are loaded first (a missing package, or the wheel that cannot be fetched, is one error before
    the table starts). `progress(text)` is told which stream runs and where it is; `progress("")` before each row.
    Returns the exit code: 0 when every stream has 0 differing steps, 1 otherwise.
    """
    from kvsim.conformance.vllm_import import install

    streams = select(names) if not workloads else [] if names is None else select(names)
    for path in map(Path, workloads or ()):  # a user's workload files, each run as its own `scheduler:` says
        if not path.is_file():
            raise KvsimError(f"{path}: no such workload file", field="WORKLOADS")
        streams.append(Stream(path.stem, path))
    install()
    header = f"{'stream':<30} {'steps kvsim / vLLM':>20} {'preemptions kvsim / vLLM':>26} {'differing steps':>16}"
    echo(header)
    echo("-" * len(header))
    results = []
    for k, stream in enumerate(streams, 1):
        say = None
        if progress is not None:
            say = lambda text, where=f"{stream.name} ({k} of {len(streams)})": progress(f"{where}: {text}")  # noqa: E731
        result = run_stream(stream, say)
        results.append(result)
        if progress is not None:
            progress("")
        echo(format_row(result))
    for result in results:
        if result.differs:
            echo("")
            echo(format_difference(result))
    differing = sum(r.differs for r in results)
    echo("")
    summary = f"{len(results) - differing} of {len(results)} streams conform (0 differing steps)"
    if differing:
        steps = sum(r.comparison.differing_steps for r in results if r.comparison is not None)
        summary += f"; {differing} with {steps:,} differing steps in all"
    echo(summary)
    return 1 if differing else 0


def format_row(result: StreamResult) -> str:
    name = result.stream.name
    if result.error is not None:
        return f"{name:<30} {'-':>20} {'-':>26} {'not run':>16}"
    c = result.comparison
    steps = f"{c.kvsim_steps:,} / {c.vllm_steps:,}"
    preemptions = f"{c.kvsim_preemptions:,} / {c.vllm_preemptions:,}"
    return f"{name:<30} {steps:>20} {preemptions:>26} {c.differing_steps:>16,}"


def format_difference(result: StreamResult) -> str:
    """Where a stream first differs, both sides' state there (or why kvsim could not run it)."""
    name = result.stream.name
    if result.error is not None:
        return f"{name}: not run: {result.error}"
    c = result.comparison
    lines = []
    if c.first_step is not None:
        lines += [
            f"{name}: first differing step {c.first_step}",
            f"  kvsim: {c.kvsim_state.describe()}",
            f"  vLLM:  {c.vllm_state.describe()}",
            *(f"  {line}" for line in c.schedule_difference),
        ]
    if c.blocks_kvsim != c.blocks_vllm:
        lines.append(f"{name}: GPU blocks: kvsim {c.blocks_kvsim:,}, vLLM {c.blocks_vllm:,}")
    if c.rejected_kvsim != c.rejected_vllm:
        lines.append(f"{name}: rejected at arrival: kvsim {list(c.rejected_kvsim)}, vLLM {list(c.rejected_vllm)}")
    return "\n".join(lines)
