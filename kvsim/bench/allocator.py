"""`kvsim bench allocator`: the paged allocator's CPU cost per token on a synthetic serving trace.

A minimal admission loop (prefill the whole prompt, then one decode token per running request per step,
free at finish, recompute-preempt a request whose growth fails) drives the allocator; only the allocator
calls are timed, so the loop's own bookkeeping is not counted. Each call is timed twice: wall clock
(perf_counter_ns) and this thread's CPU time (thread_time_ns), which stays meaningful on a busy machine.
"""

from __future__ import annotations

import csv
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvsim.engine.kv_cache_spec import KVCacheSpec
from kvsim.engine.paged import PagedAllocator
from kvsim.engine.sequence import Sequence
from kvsim.errors import KvsimError


@dataclass(frozen=True)
class AllocatorBenchResult:
    """What one benchmark run measured; times are the allocator's own, in microseconds."""

    num_requests: int
    max_running: int
    block_size: int
    prefix_caching: bool
    seed: int
    prefill_tokens: int
    decode_tokens: int
    blocks_allocated: int
    preemptions: int
    prefill_us_per_token: float  # allocate() time / prompt tokens admitted
    decode_us_per_token: float  # append_decode() time / decode tokens
    free_us_per_request: float  # free() time / requests freed (finished or preempted)
    total_us_per_decode_token: float  # every allocator call / decode tokens
    blocks_per_s: float  # blocks handed out / total allocator time
    decode_cpu_us_per_token: float  # the same three, in thread CPU time instead of wall clock
    prefill_cpu_us_per_token: float
    total_cpu_us_per_decode_token: float

    def as_dict(self) -> dict:
        return asdict(self)


def make_trace(num_requests: int, seed: int) -> list[Sequence]:
    """Requests with prompts U[64, 2048] and outputs U[16, 1024] tokens, random token ids (vocab 32k)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(64, 2048, size=num_requests, endpoint=True)
    outputs = rng.integers(16, 1024, size=num_requests, endpoint=True)
    return [
        Sequence(i, int(p), int(o), token_ids=rng.integers(0, 32000, size=int(p + o), dtype=np.int64))
        for i, (p, o) in enumerate(zip(prompts, outputs))
    ]


def run_allocator_bench(
    *, num_requests: int = 2000, max_running: int = 256, block_size: int = 16, prefix_caching: bool = True, seed: int = 0
) -> AllocatorBenchResult:
    """Drive a PagedAllocator through the trace; the budget holds `max_running` requests of the longest length."""
    if num_requests <= 0 or max_running <= 0 or block_size <= 0:
        raise KvsimError("--num-requests, --max-running and --block-size must be positive", field="bench allocator")
    spec = KVCacheSpec.uniform(num_layers=32, num_kv_heads=8, head_dim=128, block_size=block_size)  # Llama-3-8B
    max_len = 2048 + 1024
    budget = max_running * -(-max_len // block_size) * spec.block_bytes
    alloc = PagedAllocator(spec, budget, max_model_len=max_len, enable_prefix_caching=prefix_caching)
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    spent = {"prefill": [0, 0], "decode": [0, 0], "free": [0, 0]}  # [wall ns, cpu ns]

    def timed(kind: str, fn, *args):
        w0, c0 = wall(), cpu()
        out = fn(*args)
        c1, w1 = cpu(), wall()
        spent[kind][0] += w1 - w0
        spent[kind][1] += c1 - c0
        return out

    waiting = deque(make_trace(num_requests, seed))
    running: list[Sequence] = []
    prefill_tokens = decode_tokens = frees = preemptions = 0
    while waiting or running:
        while waiting and len(running) < max_running:
            seq = waiting[0]
            hit = timed("prefill", alloc.allocate, seq, seq.num_prompt_tokens)
            if hit is None:
                break
            waiting.popleft()
            seq.num_computed_tokens = seq.num_prompt_tokens  # hit from the cache, the rest computed
            prefill_tokens += seq.num_prompt_tokens
            running.append(seq)
        failed = timed("decode", alloc.append_decode, running)
        if failed:  # recompute-preempt the requests that could not grow
            for seq in failed:
                timed("free", alloc.free, seq)
                seq.num_computed_tokens = 0
                waiting.appendleft(seq)
                preemptions += 1
                frees += 1
            gone = set(map(id, failed))
            running = [s for s in running if id(s) not in gone]
        decode_tokens += len(running)
        still = []
        for seq in running:
            seq.num_computed_tokens += 1
            if seq.num_computed_tokens >= seq.num_final_tokens:
                timed("free", alloc.free, seq)
                frees += 1
            else:
                still.append(seq)
        running = still
    assert alloc.num_free_blocks == alloc.pool.num_usable_blocks, "blocks leaked"
    (prefill_ns, prefill_cpu), (decode_ns, decode_cpu), (free_ns, free_cpu) = spent.values()
    total_ns = prefill_ns + decode_ns + free_ns
    decode_tokens = max(decode_tokens, 1)
    return AllocatorBenchResult(
        num_requests=num_requests,
        max_running=max_running,
        block_size=block_size,
        prefix_caching=prefix_caching,
        seed=seed,
        prefill_tokens=prefill_tokens,
        decode_tokens=decode_tokens,
        blocks_allocated=alloc.pool.num_blocks_allocated,
        preemptions=preemptions,
        prefill_us_per_token=prefill_ns / 1e3 / max(prefill_tokens, 1),
        decode_us_per_token=decode_ns / 1e3 / decode_tokens,
        free_us_per_request=free_ns / 1e3 / max(frees, 1),
        total_us_per_decode_token=total_ns / 1e3 / decode_tokens,
        blocks_per_s=alloc.pool.num_blocks_allocated / max(total_ns / 1e9, 1e-9),
        decode_cpu_us_per_token=decode_cpu / 1e3 / decode_tokens,
        prefill_cpu_us_per_token=prefill_cpu / 1e3 / max(prefill_tokens, 1),
        total_cpu_us_per_decode_token=(prefill_cpu + decode_cpu + free_cpu) / 1e3 / decode_tokens,
    )


def write_csv(result: AllocatorBenchResult, path: Path) -> None:
    """One header row and one result row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(result.as_dict()))
        writer.writeheader()
        writer.writerow(result.as_dict())


def show_allocator_bench(
    *, num_requests: int, max_running: int, block_size: int, prefix_caching: bool, seed: int, as_json: bool, out: Path | None
) -> AllocatorBenchResult:
    """Run the benchmark, print it (a rich table or one JSON object) and write `out` as CSV if given."""
    import json

    result = run_allocator_bench(
        num_requests=num_requests, max_running=max_running, block_size=block_size, prefix_caching=prefix_caching, seed=seed
    )
    if out is not None:
        write_csv(result, out)
    if as_json:
        print(json.dumps(result.as_dict()))
        return result
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"paged allocator, block size {block_size}, prefix caching {'on' if prefix_caching else 'off'}")
    table.add_column("measure")
    table.add_column("wall clock", justify="right")
    table.add_column("thread CPU", justify="right")
    table.add_row("requests / max running", f"{num_requests} / {max_running}", "")
    table.add_row("prefill tokens / decode tokens", f"{result.prefill_tokens:,} / {result.decode_tokens:,}", "")
    table.add_row("us per decode token (append_decode)", f"{result.decode_us_per_token:.3f}", f"{result.decode_cpu_us_per_token:.3f}")
    table.add_row("us per prefill token (allocate)", f"{result.prefill_us_per_token:.3f}", f"{result.prefill_cpu_us_per_token:.3f}")
    table.add_row("us per request freed (free)", f"{result.free_us_per_request:.2f}", "")
    table.add_row(
        "us per decode token (all calls)", f"{result.total_us_per_decode_token:.3f}", f"{result.total_cpu_us_per_decode_token:.3f}"
    )
    table.add_row("blocks allocated / s", f"{result.blocks_per_s:,.0f}", "")
    table.add_row("preemptions", str(result.preemptions), "")
    Console().print(table)
    return result
