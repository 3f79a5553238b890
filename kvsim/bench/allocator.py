"""`kvsim bench allocator`: the paged allocator's CPU cost per token on a synthetic serving trace.

A minimal admission loop (prefill the whole prompt, then one decode token per running request per step with
`append_decode_in_order`, as the replay's scheduler grows them, free at finish, recompute-preempt the newest
request when one cannot grow) drives the allocator; only the allocator
calls are timed, so the loop's own bookkeeping is not counted. Requests carry the exact block keys a replay gives
them (`make_block_keys`, made inside `allocate` as in a replay), or with `hash_token_ids` only their token ids,
whose blocks the allocator then hashes (the same hits and blocks: the same prefixes are equal). Each call is timed twice: wall clock
(perf_counter_ns) and this thread's CPU time (thread_time_ns), which stays meaningful on a busy machine.
"""

from __future__ import annotations

import csv
import time
from collections import deque
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np

from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.engine.paged.unitary_kv_cache_manager import PagedAllocator
from kvsim.engine.sequence import Sequence
from kvsim.errors import KvsimError
from kvsim.out_paths import output_file
from kvsim.workload.requests import RequestSpec, make_block_key_runs


@dataclass(frozen=True)
class AllocatorBenchResult:
    """What one benchmark run measured; times are the allocator's own, in microseconds."""

    num_requests: int
    max_running: int
    block_size: int
    prefix_caching: bool
    seed: int
    stream: str  # "random" (no two prompts share a block) or "shared-prefix" (SHARED_PREFIX_TOKENS from a few groups)
    block_identity: str  # "block keys" (a replay's: `make_block_keys`) or "token-id hashes"
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache
    prefill_tokens: int
    decode_tokens: int
    blocks_allocated: int
    preemptions: int
    prefill_us_per_token: float  # allocate() time / prompt tokens admitted
    decode_us_per_token: float  # append_decode_in_order() time / decode tokens
    free_us_per_request: float  # free() time / requests freed (finished or preempted)
    total_us_per_decode_token: float  # every allocator call / decode tokens
    blocks_per_s: float  # blocks handed out / total allocator time
    decode_cpu_us_per_token: float  # the same three, in thread CPU time instead of wall clock
    prefill_cpu_us_per_token: float
    total_cpu_us_per_decode_token: float

    def as_dict(self) -> dict:
        return asdict(self)


STREAMS = ("random", "shared-prefix")
SHARED_PREFIX_GROUPS, SHARED_PREFIX_TOKENS = 8, 512  # the shared-prefix stream: 8 system prompts of 512 tokens


def make_trace(num_requests: int, seed: int, stream: str = "random", *, block_keys: bool = True) -> list[Sequence]:
    """Requests with prompts U[64, 2048] and outputs U[16, 1024] tokens, random token ids (vocab 32k).

    Random ids never repeat a block, so prefix caching only keys and misses. The "shared-prefix" stream
    starts every prompt with one of SHARED_PREFIX_GROUPS system prompts (its first SHARED_PREFIX_TOKENS
    tokens, or the whole prompt if shorter), so admissions hit the cache as a chat service's do. With
    `block_keys` each request also carries a replay's exact block keys (a request's own stream, and its group's
    for the shared prefix), equal where the ids are built equal.
    """
    if stream not in STREAMS:
        raise KvsimError(f"unknown stream {stream!r} (choose {', '.join(STREAMS)})", field="--stream")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(64, 2048, size=num_requests, endpoint=True)
    outputs = rng.integers(16, 1024, size=num_requests, endpoint=True)
    prefixes = rng.integers(0, 32000, size=(SHARED_PREFIX_GROUPS, SHARED_PREFIX_TOKENS), dtype=np.int64)
    trace = []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        ids = rng.integers(0, 32000, size=int(p + o), dtype=np.int64)  # (prompt + output,)
        if stream == "shared-prefix":
            n = min(int(p), SHARED_PREFIX_TOKENS)
            ids[:n] = prefixes[i % SHARED_PREFIX_GROUPS, :n]
        seq = Sequence(i, int(p), int(o), token_ids=ids)
        if block_keys:
            group = stream == "shared-prefix"
            spec = RequestSpec(i, 0.0, int(p), int(o), prefix_group=i % SHARED_PREFIX_GROUPS if group else None,
                               num_prefix_tokens=min(int(p), SHARED_PREFIX_TOKENS) if group else 0)
            seq.block_keys = partial(make_block_key_runs, spec)
        trace.append(seq)
    return trace


def run_allocator_bench(
    *, num_requests: int = 2000, max_running: int = 256, block_size: int = 16, prefix_caching: bool = True, seed: int = 0,
    stream: str = "random", hash_token_ids: bool = False,
) -> AllocatorBenchResult:
    """Drive a PagedAllocator through the trace; the budget holds `max_running` requests of the longest length."""
    if num_requests <= 0 or max_running <= 0 or block_size <= 0:
        raise KvsimError("--num-requests, --max-running and --block-size must be positive", field="bench allocator")
    if seed < 0:  # numpy's generators take seeds >= 0 only
        raise KvsimError(f"must be a whole number >= 0, got {seed}", field="--seed")
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

    waiting = deque(make_trace(num_requests, seed, stream, block_keys=not hash_token_ids))
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
        i = 0  # the replay's running loop: grow in order; at the first failure preempt the newest, retry
        while i < len(running):
            i += timed("decode", alloc.append_decode_in_order, running[i:] if i else running)
            if i < len(running):
                victim = running.pop()
                timed("free", alloc.free, victim)
                victim.num_computed_tokens = 0
                waiting.appendleft(victim)
                preemptions += 1
                frees += 1
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
        stream=stream,
        block_identity="token-id hashes" if hash_token_ids else "block keys",
        prefix_hit_tokens=alloc.prefix_hit_tokens,
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


def write_csv(results: list[AllocatorBenchResult], path: Path) -> None:
    """One header row and a row per result."""
    with output_file(path).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0].as_dict()))
        writer.writeheader()
        for result in results:
            writer.writerow(result.as_dict())


def show_allocator_bench(
    *, num_requests: int, max_running: int, block_size: int, prefix_caching: bool, seed: int, as_json: bool, out: Path | None,
    hash_token_ids: bool = False,
) -> list[AllocatorBenchResult]:
    """Run the benchmark, print it (a rich table or a JSON list) and write `out` as CSV if given.

    With prefix caching both streams run: random prompts (every block hashed, none hit: the caching cost
    alone) and shared prefixes (admissions that hit: the cached path).
    """
    import json

    if out is not None:  # checked before the run, not after it
        output_file(out)
    streams = STREAMS if prefix_caching else STREAMS[:1]
    results = [
        run_allocator_bench(num_requests=num_requests, max_running=max_running, block_size=block_size,
                            prefix_caching=prefix_caching, seed=seed, stream=stream, hash_token_ids=hash_token_ids)
        for stream in streams
    ]  # fmt: skip
    if out is not None:
        write_csv(results, out)
    if as_json:
        print(json.dumps([r.as_dict() for r in results]))
        return results
    from rich.console import Console
    from rich.table import Table

    identity = f" ({results[0].block_identity})" if prefix_caching else ""
    table = Table(title=f"paged allocator, block size {block_size}, prefix caching {'on' if prefix_caching else 'off'}"
                        f"{identity}: µs as wall clock / thread CPU")  # fmt: skip
    table.add_column("measure", no_wrap=True)
    for r in results:
        table.add_column(f"{r.stream} stream", justify="right", no_wrap=True)

    def row(label: str, cell) -> None:
        table.add_row(label, *(cell(r) for r in results))

    row("requests / max running", lambda r: f"{r.num_requests} / {r.max_running}")
    row("prefill / decode tokens", lambda r: f"{r.prefill_tokens:,} / {r.decode_tokens:,}")
    row("prompt tokens hit in the cache", lambda r: f"{r.prefix_hit_tokens:,} ({r.prefix_hit_tokens / max(r.prefill_tokens, 1):.0%})")
    row("µs / decode token (append_decode_in_order)", lambda r: f"{r.decode_us_per_token:.3f} / {r.decode_cpu_us_per_token:.3f}")
    row("µs / prefill token (allocate)", lambda r: f"{r.prefill_us_per_token:.3f} / {r.prefill_cpu_us_per_token:.3f}")
    row("µs / decode token (all calls)", lambda r: f"{r.total_us_per_decode_token:.3f} / {r.total_cpu_us_per_decode_token:.3f}")
    row("µs / request freed (free)", lambda r: f"{r.free_us_per_request:.2f}")
    row("blocks allocated / s", lambda r: f"{r.blocks_per_s:,.0f}")
    row("preemptions", lambda r: str(r.preemptions))
    Console().print(table)
    return results
