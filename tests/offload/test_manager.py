"""kvsim.offload: the CPU tier's manager and its LRU and ARC policies, rule by rule, on hand-made sequences."""

from __future__ import annotations

import pytest

from kvsim.errors import KvsimError
from kvsim.offload.manager import CPUOffloadingManager, LookupResult
from kvsim.offload.request_context import ReqContext, make_offload_key, offload_group_idx


def keys(name: str, n: int, group: int = 0) -> list[bytes]:
    return [make_offload_key(f"{name}{i}".encode(), group) for i in range(n)]


def request(req_id: str, *key_lists: list[bytes]) -> ReqContext:
    ctx = ReqContext(req_id)
    for ks in key_lists:
        for i, k in enumerate(ks):
            ctx.set_offload_key_position(k, (i + 1) * 16)
    return ctx


def stored(m: CPUOffloadingManager, ks: list[bytes], ctx: ReqContext) -> None:
    out = m.prepare_store(ks, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)


def test_key_carries_its_group():
    k = make_offload_key(b"\x01\x02", 7)
    assert k == b"\x01\x02\x00\x00\x00\x07" and offload_group_idx(k) == 7


def test_a_chunk_is_pending_until_its_store_completes_then_ready_and_loads_pin_it():
    m = CPUOffloadingManager(4)
    a = keys("a", 2)
    ctx = request("r", a)
    out = m.prepare_store(a, ctx)
    assert (out.keys_to_store, out.chunk_ids, out.evicted_keys) == (a, [0, 1], [])
    assert m.lookup(a[0], ctx) is LookupResult.HIT_PENDING
    m.complete_store(a, ctx)
    assert m.lookup(a[0], ctx) is LookupResult.HIT and m.num_evictable == 2
    assert m.prepare_load(a[:1], ctx) == [0]
    assert m.num_evictable == 1  # pinned by the load
    m.complete_load(a[:1], ctx)
    assert m.num_evictable == 2


def test_a_store_is_all_or_nothing_and_offered_keys_are_never_evicted():
    m = CPUOffloadingManager(3)
    a, b = keys("a", 2), keys("b", 3)
    stored(m, a, request("r1", a))
    # b needs 3 slots: 1 free + 2 evictable, but a[0] is offered with b, so only a[1] may go: refused
    assert m.prepare_store([a[0], *b], request("r2", [a[0], *b])) is None
    assert m.lookup(b[0], request("x")) is LookupResult.MISS and m.num_free_chunks == 1
    out = m.prepare_store(b[:2], request("r3", b))
    assert out.evicted_keys == [a[1]] and sorted(out.chunk_ids) == [1, 2]  # the freed slot 1, the fresh slot 2


def test_a_pending_chunk_is_not_evictable_and_a_failed_store_frees_its_slot():
    m = CPUOffloadingManager(2)
    a, b = keys("a", 2), keys("b", 1)
    ctx = request("r", a)
    m.prepare_store(a, ctx)  # both pending
    assert m.prepare_store(b, request("s", b)) is None
    m.complete_store(a[1:], ctx, success=False)
    assert m.lookup(a[1], ctx) is LookupResult.MISS and m.num_free_chunks == 1
    assert m.prepare_store(b, request("s", b)).chunk_ids == [1]


def test_lru_evicts_the_tail_of_a_finished_request_first():
    m = CPUOffloadingManager(4, "lru")
    a = keys("a", 4)
    ctx = request("r", a)
    stored(m, a, ctx)
    m.on_request_finished(ctx)  # head most recent: a0 > a1 > a2 > a3
    b = keys("b", 2)
    assert m.prepare_store(b, request("s", b)).evicted_keys == [a[3], a[2]]


def test_lru_a_reused_prefix_outlives_a_newer_stranger():
    m = CPUOffloadingManager(4, "lru")
    a, b, c = keys("a", 2), keys("b", 2), keys("c", 2)
    r1, r2 = request("r1", a), request("r2", b)
    stored(m, a, r1)
    m.on_request_finished(r1)
    stored(m, b, r2)
    m.on_request_finished(r2)
    r3 = request("r3", a)  # reads a again
    m.prepare_load(a, r3)
    m.complete_load(a, r3)
    m.on_request_finished(r3)
    assert m.prepare_store(c, request("r4", c)).evicted_keys == [b[1], b[0]]


def test_arc_promotes_a_reused_chunk_to_t2_and_adapts_on_a_ghost_hit():
    m = CPUOffloadingManager(2, "arc")
    a, b = keys("a", 1), keys("b", 2)
    r1 = request("r1", a)
    stored(m, a, r1)
    m.on_request_finished(r1)
    assert list(m.policy.t1) == a
    r2 = request("r2", a)
    m.prepare_load(a, r2)
    m.complete_load(a, r2)
    m.on_request_finished(r2)
    assert list(m.policy.t2) == a and not m.policy.t1
    r3 = request("r3", b)
    out = m.prepare_store(b, r3)  # 1 free slot, t1 empty (0 >= target 0 but no t1 chunk): t2's a goes to b2
    assert out.evicted_keys == a and list(m.policy.b2) == a
    m.complete_store(b, r3)
    m.on_request_finished(r3)
    r4 = request("r4", a)  # a offered again: a b2 ghost hit lowers the t1 target (already 0)
    m.prepare_store(a, r4)
    assert m.policy.target_t1_size == 0 and not m.policy.b2


def test_arc_store_miss_in_b1_raises_the_t1_target():
    m = CPUOffloadingManager(1, "arc")
    a, b = keys("a", 1), keys("b", 1)
    stored(m, a, request("r1", a))
    stored(m, b, request("r2", b))  # evicts a from t1 -> b1
    assert list(m.policy.b1) == a
    m.prepare_store(a, request("r3", a))  # a wanted again: target + max(1, |b2|/|b1|) = 1
    assert m.policy.target_t1_size == 1


def test_store_threshold_stores_a_key_on_its_second_offer():
    m = CPUOffloadingManager(4, store_threshold=2)
    a = keys("a", 1)
    assert m.prepare_store(a, request("r1", a)).keys_to_store == []
    assert m.prepare_store(a, request("r2", a)).keys_to_store == a


def test_unknown_policy_names_the_field():
    with pytest.raises(KvsimError) as exc:
        CPUOffloadingManager(4, "fifo")
    assert exc.value.field == "policy"


def test_lru_evicts_the_idle_chunks_of_lowest_rank_as_a_scan_of_every_idle_chunk_would():
    """The LRU policy's lazy heap against a scan: random inserts, accesses, finishes, pins and evictions with
    protected keys; every eviction takes the n idle, unprotected chunks of lowest (rank, key), or nothing."""
    import heapq
    import random

    from kvsim.offload.chunk import ChunkStatus
    from kvsim.offload.lru import LRUCachePolicy

    rng = random.Random(7)
    policy = LRUCachePolicy(10_000)
    pool = keys("k", 60)
    contexts = [request(f"r{i}", rng.sample(pool, 12)) for i in range(6)]
    evictions = 0
    for _ in range(3_000):
        op = rng.random()
        ctx = rng.choice(contexts)
        if op < 0.3:
            key = rng.choice(pool)
            if policy.get(key) is None:
                policy.insert(key, ChunkStatus(0, ref_cnt=rng.choice([0, 0, 1])), ctx)
        elif op < 0.45:
            policy.on_request_access(rng.sample(pool, 5), ctx)
        elif op < 0.55:
            policy.touch([k for k in rng.sample(pool, 4) if policy.get(k) is not None], ctx)
        elif op < 0.65:
            policy.on_request_finished([rng.sample(pool, 6)], set(), set(), ctx)
        elif op < 0.8:  # pin or unpin an idle or pinned chunk
            key = rng.choice(pool)
            chunk = policy.get(key)
            if chunk is not None:
                if key in policy.evictable:
                    chunk.ref_cnt = 1
                    policy.mark_non_evictable(key)
                else:
                    chunk.ref_cnt = 0
                    policy.mark_evictable(key)
        else:
            n = rng.randint(1, 4)
            protected = set(rng.sample(pool, 10))
            idle = [(policy.ranks[k], k) for k in policy.evictable if k not in protected]
            expected = [k for _, k in heapq.nsmallest(n, idle)] if len(idle) >= n else None
            got = policy.evict(n, protected)
            assert (None if got is None else [k for k, _ in got]) == expected
            evictions += got is not None
    assert evictions > 50
