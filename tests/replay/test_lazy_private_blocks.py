"""The paged allocator caches a request's private blocks (keyed by streams no other request has: past its prompt,
and on a first admission past its shareable tokens) when its blocks are freed, and a finished request never
preempted leaves them uncached: against the same streams with every block cached as it fills (vLLM's eager
caching), the same rows, block tables, free queue, prefix hits and, once every request is done, the same prefix
table but for those requests' own keys, under sync and async scheduling, preemption for recompute and swap,
decode runs, shared prefixes and parallel sampling."""

from __future__ import annotations

import random
from functools import partial

import pytest

from kvsim.clock.roofline import Roofline
from kvsim.engine.factory import AllocatorConfig, make_allocator
from kvsim.engine.paged.unitary_kv_cache_manager import PagedAllocator
from kvsim.replay.sched.output import SchedSeq
from kvsim.replay.sched.scheduler import Scheduler
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.workload.requests import RequestSpec, make_block_key_runs, make_block_keys, num_shareable_tokens


def _roofline() -> Roofline:
    return Roofline(weight_bytes=1e9, num_params=5e8, kv_bytes_per_token=4, attn_flops_per_ctx=0.0,
                    hbm_bandwidth_bytes_per_s=1e12, peak_flops=1e15)


def _specs(rng: random.Random, block_size: int) -> list[tuple[int, RequestSpec]]:
    """(arrival step, request): own prompts, shared-prefix groups and parallel samples of one prompt."""
    specs: list[tuple[int, RequestSpec]] = []
    step = 0
    while len(specs) < rng.randint(6, 16):
        step += rng.choice((0, 0, 1, 2, 5))
        i = len(specs)
        prompt, out = rng.randint(1, 10 * block_size), rng.randint(1, 12 * block_size)
        kind = rng.random()
        if kind < 0.35:
            prefix = min(prompt, rng.choice((block_size, 2 * block_size, 3 * block_size + 1)))
            specs.append((step, RequestSpec(i, 0.0, prompt, out, prefix_group=rng.randint(0, 1), num_prefix_tokens=prefix)))
        elif kind < 0.55:
            n = rng.randint(2, 3)
            for j in range(n):  # parallel sampling: n requests of one prompt, their own outputs
                out = rng.randint(1, 12 * block_size)
                specs.append((step, RequestSpec(i + j, 0.0, prompt, out, prompt_of=i if j else None)))
        else:
            specs.append((step, RequestSpec(i, 0.0, prompt, out)))
    return specs


def _state(sched: Scheduler, unlisted: set[int]) -> tuple:
    """What laziness must leave as eager caching does while requests run: the running requests' block tables, the
    free queue in order and each free block's cache entry (a held block's may lag until its free; one whose key is
    in `unlisted`, a finished request's own, counts as none: laziness never lists it)."""
    alloc = sched.allocator
    pool = alloc.pool
    free = pool.free_queue.queued_ids().tolist()
    entries = []
    for b in free:
        cached = bool(pool.is_cached[b]) and int(pool.block_hash[b]) not in unlisted
        entries.append((b, cached, int(pool.block_hash[b]) if cached else None, cached and bool(pool.is_primary[b]),
                        cached and bool(pool.has_younger[b])))
    return ([(s.seq_id, alloc.block_table(s)) for s in sched.running], entries)


def _replay(specs, *, lazy: bool, async_scheduling: bool, preemption: str, allow_runs: bool, block_size: int,
            budget_blocks: int, counts: dict | None = None):
    spec = KVCacheSpec.uniform(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size)
    alloc = make_allocator(AllocatorConfig("paged", block_size=block_size, prefix_caching=True), spec,
                           budget_blocks * spec.block_bytes, max_model_len=1024)
    assert isinstance(alloc, PagedAllocator)
    alloc.lazy_private_blocks = lazy
    sched = Scheduler(alloc, max_num_seqs=6, max_num_batched_tokens=3 * block_size + 1, max_model_len=1024,
                      preemption=preemption, swap_space_bytes=40 * spec.block_bytes, async_scheduling=async_scheduling,
                      roofline=_roofline(), allow_runs=allow_runs)
    flush, cache_blocks, preempt = alloc._cache_private_blocks, alloc.cache_blocks, sched._preempt
    preempting = []

    def counting_flush(req, **kwargs):
        before = req.num_hashed
        end = flush(req, **kwargs)
        if counts is not None:
            counts["flushed"] += req.num_hashed - before
        return end

    def checked_cache_blocks(seq, num_tokens):
        before = alloc._reqs[seq].num_hashed
        cache_blocks(seq, num_tokens)
        cached = alloc._reqs[seq].num_hashed > before
        # eager caching has cached by now whatever a preemption asks for: vLLM caches nothing when it preempts
        assert lazy or not (preempting and cached), "a preemption cached what eager caching had not"
        if counts is not None:
            counts["cache_blocks"] += 1
            counts["cached"] += cached

    def marked_preempt(seq, out):
        preempting.append(seq)
        preempt(seq, out)
        preempting.pop()

    allocate = alloc.allocate

    def counting_allocate(seq, *args, **kwargs):
        hit = allocate(seq, *args, **kwargs)
        if counts is not None and hit is not None and hit > seq.num_prompt_tokens // block_size * block_size:
            counts["own_hits"] += 1  # a re-admission hit its own decode blocks
        if counts is not None and hit is not None and alloc._reqs[seq].lazy_from < seq.num_prompt_tokens // block_size:
            counts["lazy_prompts"] += 1  # its own prompt blocks wait for the free
        return hit

    alloc._cache_private_blocks, alloc.cache_blocks, sched._preempt = counting_flush, checked_cache_blocks, marked_preempt
    alloc.allocate = counting_allocate
    seqs = {}
    pending = list(specs)
    shareable = num_shareable_tokens([r for _, r in specs])  # (lazy: a prompt's own blocks wait too)
    own = {r.request_id: set(make_block_keys(r, block_size, r.num_prompt_tokens + r.max_tokens)
                             [shareable[r.request_id] // block_size :].tolist()) for _, r in specs}
    unlisted: set[int] = set()  # own keys of the requests that finished never preempted
    rows, step = [], 0
    while pending or sched.has_work:
        while pending and pending[0][0] <= step:
            _, r = pending.pop(0)
            seq = seqs[r.request_id] = SchedSeq(r.request_id, r.num_prompt_tokens, r.max_tokens, index=r.request_id)
            seq.block_keys = partial(make_block_key_runs, r)
            seq.num_shareable_tokens = shareable[r.request_id]
            assert sched.add_request(seq) is None
        out, rejected = sched.schedule(0.0 if pending else float("inf"))
        assert not rejected
        if out.prefills or out.decodes:
            finished = sched.postprocess(out)
        else:
            finished = sched.flush() if sched.has_in_flight else []
        for s in finished:
            if s.num_preemptions == 0:
                unlisted |= own[s.seq_id]
                if lazy and counts is not None:  # its own full blocks, left uncached
                    counts["unlisted"] += max(0, (s.num_final_tokens // block_size) - shareable[s.seq_id] // block_size)
        rows.append(([(s.seq_id, a, n) for s, a, n in out.prefills], [s.seq_id for s in out.decodes],
                     [s.seq_id for s in out.preempted], out.num_steps, [s.seq_id for s in finished],
                     _state(sched, unlisted)))
        if counts is not None and alloc.pool.cached_duplicates:
            counts["duplicates"] += 1  # rows with younger copies of a key (a re-admission's, behind its old block)
        step += 1
        assert step < 5000
    pool = alloc.pool
    cached_keys = pool.block_hash[pool.is_cached].tolist()
    if lazy:  # a finished request never preempted left its own blocks uncached
        assert not unlisted.intersection(cached_keys)
    final = ({k: b for k, b in pool.cached_keys().items() if k[0] not in unlisted},
             {k: list(v) for k, v in pool.cached_duplicates.items()},
             pool.free_queue.queued_ids().tolist(), [k for k in cached_keys if k not in unlisted])
    per_seq = [(s.num_preemptions, s.num_cached_tokens, s.num_output_tokens) for s in seqs.values()]
    return rows, final, alloc.prefix_hit_tokens, per_seq


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("allow_runs", [False, True])
def test_lazy_private_blocks_equal_eager_caching(async_scheduling, preemption, allow_runs):
    rng = random.Random(f"{async_scheduling} {preemption} {allow_runs}")
    counts = {"flushed": 0, "cache_blocks": 0, "cached": 0, "own_hits": 0, "duplicates": 0, "unlisted": 0,
              "lazy_prompts": 0}
    preempted = hits = 0
    for _ in range(25):
        block_size = rng.choice((2, 4))
        specs = _specs(rng, block_size)
        budget = rng.randint(25, 60)
        kwargs = dict(async_scheduling=async_scheduling, preemption=preemption, allow_runs=allow_runs,
                      block_size=block_size, budget_blocks=budget)
        eager = _replay(specs, lazy=False, **kwargs)
        lazy = _replay(specs, lazy=True, counts=counts, **kwargs)
        for step, (a, b) in enumerate(zip(eager[0], lazy[0])):
            assert a == b, (step, specs, budget)
        assert eager == lazy, (specs, budget)
        preempted += any(row[2] for row in eager[0])
        hits += eager[2] > 0
    # preemptions, hits, re-admissions hitting their own decode blocks, younger copies and deferred blocks met
    assert preempted >= 8 and hits >= 15 and counts["own_hits"] >= 5 and counts["duplicates"] and counts["flushed"] > 100
    # first admissions whose own prompt blocks waited, finished requests' blocks cached without table entries
    assert counts["lazy_prompts"] >= 40 and counts["unlisted"] >= 200


def test_lazy_requests_skip_cache_blocks_under_async_scheduling():
    """Async scheduling asks the allocator to cache settled blocks only while some request caches eagerly; the
    skipped calls are where the time went (a call for each decode block)."""
    rng = random.Random(7)
    specs = _specs(rng, 4)
    counts_eager = {"flushed": 0, "cache_blocks": 0, "cached": 0, "own_hits": 0, "duplicates": 0, "unlisted": 0,
                    "lazy_prompts": 0}
    counts_lazy = dict(counts_eager)
    kwargs = dict(async_scheduling=True, preemption="recompute", allow_runs=False, block_size=4, budget_blocks=200)
    assert _replay(specs, lazy=False, counts=counts_eager, **kwargs) == _replay(specs, lazy=True, counts=counts_lazy, **kwargs)
    assert counts_eager["cache_blocks"] > 20 and counts_lazy["cache_blocks"] == 0 and counts_lazy["unlisted"] > 20
