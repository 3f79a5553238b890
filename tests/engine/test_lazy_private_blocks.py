"""`PagedAllocator` caches a request's private blocks (keyed by streams no other request has: past its prompt,
and on a first admission past its shareable tokens) just before its blocks are freed: the pool is then as vLLM's
eager caching leaves it (cached set, oldest copy answering, younger copies, free-queue order), whatever was
evicted meanwhile; but a finished request never freed before leaves its private blocks uncached, queued where
cached ones go (nobody looks them up): their entries are the one difference."""

from __future__ import annotations

import random
from functools import partial

import pytest

from kvsim.engine.paged.unitary_kv_cache_manager import PagedAllocator
from kvsim.engine.sequence import Sequence
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.workload.requests import RequestSpec, make_block_key_runs, make_block_keys, num_shareable_tokens

BS = 4
SPEC = KVCacheSpec.uniform(num_layers=1, num_kv_heads=1, head_dim=1, block_size=BS)


def _alloc(num_blocks: int, lazy: bool) -> PagedAllocator:
    alloc = PagedAllocator(SPEC, num_blocks * SPEC.block_bytes, max_model_len=4096, enable_prefix_caching=True)
    alloc.lazy_private_blocks = lazy
    return alloc


def _seq(r: RequestSpec, shareable: int | None = None) -> Sequence:
    seq = Sequence(r.request_id, r.num_prompt_tokens, r.max_tokens)
    seq.block_keys = partial(make_block_key_runs, r)
    seq.num_shareable_tokens = shareable
    return seq


def _pool_state(alloc: PagedAllocator, unlisted: set[int] = frozenset()) -> tuple:
    """The free queue in order and each free block's cache entry; an entry whose key is in `unlisted` (a
    finished request's own keys, which lazy caching never lists) counts as none."""
    pool = alloc.pool
    free = pool.free_queue.queued_ids().tolist()
    entries = []
    for b in free:
        cached = bool(pool.is_cached[b]) and int(pool.block_hash[b]) not in unlisted
        entries.append((b, cached, int(pool.block_hash[b]) if cached else None, cached and bool(pool.is_primary[b])))
    return free, entries


def _listed(cached_keys: dict, unlisted: set[int]) -> dict:
    """`BlockPool.cached_keys()` less the keys in `unlisted`."""
    return {k: b for k, b in cached_keys.items() if k[0] not in unlisted}


def _own_keys(r: RequestSpec, shareable: int) -> set[int]:
    """The keys of `r`'s blocks no other request has: from its shareable tokens on."""
    return set(make_block_keys(r, BS, r.num_prompt_tokens + r.max_tokens)[shareable // BS :].tolist())


def _decode(alloc: PagedAllocator, seq: Sequence, n: int) -> None:
    for _ in range(n):
        assert alloc.append_decode_in_order([seq]) == 1
        seq.num_computed_tokens += 1


def test_private_blocks_wait_for_the_free_then_match_eager_caching():
    """Prompt 6 (block 0 full), 9 decode tokens: blocks 1..3 fill while it runs. Lazy: only block 0 is cached
    until the free; at the free, blocks 0..3 are, as eager caching has them, and go to the tail alike."""
    r = RequestSpec(0, 0.0, 6, 10)
    states, tables = [], []
    for lazy in (False, True):
        alloc = _alloc(10, lazy)
        seq = _seq(r)
        assert alloc.allocate(seq, 6) == 0
        seq.num_computed_tokens = 6
        _decode(alloc, seq, 9)  # 15 tokens: 3 full blocks and one of 3
        table = alloc.block_table(seq)
        cached = [bool(alloc.pool.is_cached[b]) for b in table]
        assert cached == ([True, True, True, False] if not lazy else [True, False, False, False])
        alloc.free(seq)
        assert [bool(alloc.pool.is_cached[b]) for b in table] == [True, True, True, False]
        states.append(_pool_state(alloc))
        tables.append(table)
    assert states[0] == states[1] and tables[0] == tables[1]
    free = states[1][0]
    assert free[0] == tables[1][3] and free[-3:] == tables[1][2::-1]  # uncached at the head, cached at the tail


def test_a_readmission_hits_its_own_decode_blocks():
    """Preempted for recompute after 11 tokens (prompt 5 + 6 outputs): its re-admission, with prompt + outputs
    to compute, hits the 2 full blocks, decode block 1 included, in both modes."""
    r = RequestSpec(0, 0.0, 5, 20)
    for lazy in (False, True):
        alloc = _alloc(12, lazy)
        seq = _seq(r)
        alloc.allocate(seq, 5)
        seq.num_computed_tokens = 5
        _decode(alloc, seq, 6)
        alloc.free(seq)  # preempted
        seq.num_computed_tokens = 0
        assert alloc.allocate(seq, 11, num_tokens=11) == 8, lazy
        assert alloc.prefix_hit_tokens == 8


@pytest.mark.parametrize("evict", [False, True])
def test_a_new_copy_waits_behind_an_older_copy_or_replaces_it_once_evicted(evict):
    """A (prompt 4) decodes to 24 tokens (6 full blocks) and is freed: all 6 cached. Re-admitted for recompute in
    chunks, its hit stops at 5 blocks (the last block is always computed), so its new block 5 fills in a later
    chunk while the old copy of key 5 is still cached: eager caching queues the new copy behind it, laziness
    waits. Then B takes every free block, the old copy last (`evict`), or stops short of it. Lazy or eager, the
    same pool after every step, and at the end the same table and younger copies."""
    a_spec, b_spec = RequestSpec(0, 0.0, 4, 40), RequestSpec(1, 0.0, 4, 40)
    states = []
    for lazy in (False, True):
        alloc = _alloc(20, lazy)
        a, b = _seq(a_spec), _seq(b_spec)
        alloc.allocate(a, 4)
        a.num_computed_tokens = 4
        _decode(alloc, a, 20)
        old = alloc.block_table(a)
        alloc.free(a)
        log = [_pool_state(alloc)]
        assert alloc.allocate(a, 2, num_tokens=24) == 20  # blocks 0-4 hit, 2 tokens of block 5
        a.num_computed_tokens = 22
        assert alloc.append_slots(a, 2)  # block 5 fills: a new copy of key 5
        a.num_computed_tokens = 24
        new5 = alloc.block_table(a)[5]
        assert new5 != old[5] and alloc.pool.is_cached[old[5]]
        assert bool(alloc.pool.is_cached[new5]) == (not lazy)
        log.append(_pool_state(alloc))
        alloc.allocate(b, 4)
        b.num_computed_tokens = 4
        _decode(alloc, b, 48 if evict else 40)  # 13 blocks: the 12 never used, then the old copy of key 5
        assert bool(alloc.pool.is_cached[old[5]]) == (not evict)
        log.append(_pool_state(alloc))
        alloc.free(a)
        pool = alloc.pool
        assert pool.get_cached_block(a.block_keys(BS, 24)[0].item(5)) == (new5 if evict else old[5])
        assert (new5 in pool.cached_duplicates.get(a.block_keys(BS, 24)[0].item(5), [])) == (not evict)
        log.append(_pool_state(alloc))  # (B's own decode blocks wait while it runs)
        alloc.free(b)
        log.append((_pool_state(alloc), pool.cached_keys(), {k: list(v) for k, v in pool.cached_duplicates.items()}))
        states.append(log)
    assert states[0] == states[1]


def test_random_operations_equal_eager_caching():
    """Random streams (own prompts, shared prefixes, parallel samples) through admissions, decodes, preemptions
    and finishes on a small pool, with the replay's bookkeeping of computed tokens (synchronous scheduling):
    after every operation the same free queue, entries and block tables; at the end the same table."""
    rng = random.Random(11)
    own_hits = lazy_prompts = unlisted = 0
    for trial in range(40):
        specs = []
        while len(specs) < 12:
            i = len(specs)
            prompt, out = rng.randint(1, 30), rng.randint(1, 40)
            if rng.random() < 0.3:
                specs.append(RequestSpec(i, 0.0, prompt, out, prefix_group=0, num_prefix_tokens=min(prompt, 9)))
            elif rng.random() < 0.3:
                specs += [RequestSpec(i + j, 0.0, prompt, rng.randint(1, 40), prompt_of=i if j else None) for j in range(2)]
            else:
                specs.append(RequestSpec(i, 0.0, prompt, out))
        num_blocks = rng.randint(20, 40)
        ops = [(rng.random(), rng.random()) for _ in range(2000)]  # (what to do, which request)
        runs = []
        for lazy in (False, True):
            alloc = _alloc(num_blocks, lazy)
            shareable = num_shareable_tokens(specs)
            waiting = [_seq(r, n) for r, n in zip(specs, shareable)]
            own = {seq: _own_keys(r, n) for seq, r, n in zip(waiting, specs, shareable)}
            freed: set[Sequence] = set()  # freed before they finished
            unlisted_keys: set[int] = set()  # own keys of requests that finished, never freed before
            running: list[Sequence] = []
            log = []
            for x, y in ops:
                if not waiting and not running:
                    break
                if waiting and (x < 0.3 or not running):
                    seq = waiting[0]
                    num_tokens = max(seq.num_prompt_tokens, seq.extra.get("computed", 0))  # a recompute's: all so far
                    hit = alloc.allocate(seq, num_tokens, num_tokens=num_tokens)
                    if hit is not None:
                        own_hits += lazy and hit > seq.num_prompt_tokens // BS * BS  # its own decode blocks
                        lazy_prompts += alloc._reqs[seq].lazy_from < seq.num_prompt_tokens // BS  # its own prompt blocks
                        waiting.pop(0)
                        seq.num_computed_tokens = num_tokens
                        running.append(seq)
                elif x < 0.9:
                    grown = alloc.append_decode_in_order(running)
                    for seq in running[:grown]:
                        seq.num_computed_tokens += 1
                    if grown < len(running):  # the newest is preempted for recompute
                        victim = running.pop()
                        victim.extra["computed"] = victim.num_computed_tokens
                        alloc.free(victim)
                        freed.add(victim)
                        victim.num_computed_tokens = 0
                        waiting.insert(0, victim)
                    for seq in [s for s in running if s.num_computed_tokens >= s.num_final_tokens]:
                        running.remove(seq)
                        table = alloc.block_table(seq)
                        alloc.free_finished(seq)
                        if lazy and seq not in freed:  # its own blocks left uncached
                            pool = alloc.pool
                            listed = [b for b in table if pool.is_cached[b] and int(pool.block_hash[b]) in own[seq]]
                            assert not listed, (trial, seq, listed)
                            unlisted += max(0, min(seq.num_computed_tokens, seq.num_final_tokens) // BS
                                            - seq.num_shareable_tokens // BS)  # full blocks of its own
                        if seq not in freed:
                            unlisted_keys |= own[seq]
                elif running:
                    victim = running.pop(int(y * len(running)))  # preempted for recompute, or swapped out
                    victim.extra["computed"] = victim.num_computed_tokens
                    alloc.free(victim)
                    freed.add(victim)
                    victim.num_computed_tokens = 0
                    waiting.append(victim)
                log.append((_pool_state(alloc, unlisted_keys), [alloc.block_table(s) for s in running],
                            alloc.prefix_hit_tokens))
            for seq in running:
                alloc.free(seq)
            pool = alloc.pool
            log.append((_pool_state(alloc, unlisted_keys), _listed(pool.cached_keys(), unlisted_keys),
                        {k: list(v) for k, v in pool.cached_duplicates.items()}))
            runs.append(log)
        for step, (a, b) in enumerate(zip(*runs)):
            assert a == b, (trial, step)
        assert runs[0] == runs[1]
    # re-admissions hitting their own decode blocks, first admissions whose own prompt blocks wait, blocks of
    # finished requests never freed before (their own blocks left unlisted)
    assert own_hits >= 20 and lazy_prompts >= 100 and unlisted >= 500, (own_hits, lazy_prompts, unlisted)


def test_a_freed_request_is_not_kept_alive_by_the_allocator():
    """The allocator remembers which requests were freed before they finished (their re-admission caches its
    prompt as it fills) without holding them: a caller that frees finished requests with `free` (the allocator
    benchmark, the profile stream) keeps no dead request, nor its token ids, alive."""
    import gc
    import weakref

    alloc = _alloc(10, True)
    seq = _seq(RequestSpec(0, 0.0, 6, 10), 0)
    alloc.allocate(seq, 6)
    alloc.free(seq)
    assert seq in alloc._returning
    gone = weakref.ref(seq)
    del seq
    gc.collect()
    assert gone() is None
