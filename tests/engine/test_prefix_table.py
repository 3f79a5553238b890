"""The prefix table in chunks (`prefix_table.PrefixTable`, `key_runs`) and the pool's run-at-a-time caching and
the allocator's run-at-a-time lookup over it: the same answers as a table of one entry per key, runs split
across calls, started mid-chunk or inserted out of order, duplicates, stale entries, groups and keys without
runs (chained hashes) included."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.engine.paged.block_pool import BlockPool
from kvsim.engine.paged.prefix_table import EMPTY, NUM_SLOTS, PrefixTable, key_runs
from kvsim.engine.paged.unitary_kv_cache_manager import PagedAllocator
from .test_block_pool_vs_vllm import ReferencePool


def stream_keys(stream: int, first: int, stop: int) -> np.ndarray:
    """A replay's block keys of blocks `first` .. `stop - 1` of `stream` (tag 0): stream << 21 | j."""
    return (np.int64(stream) << 21) | np.arange(first, stop, dtype=np.int64)


def allocator_over(pool: BlockPool) -> PagedAllocator:
    """A `PagedAllocator` with only `pool` (what its lookup reads)."""
    alloc = PagedAllocator.__new__(PagedAllocator)
    alloc.pool, alloc._last_hit = pool, None
    return alloc


def lookup(pool: BlockPool, keys: np.ndarray, max_blocks: int | None = None) -> list[int]:
    """The allocator's lookup (`PagedAllocator._find_longest_cache_hit`) over `pool`."""
    hits, _ = allocator_over(pool)._find_longest_cache_hit((keys, key_runs(keys)), len(keys) if max_blocks is None
                                                           else max_blocks)
    return hits if type(hits) is list else hits.tolist()  # (an int64 array past a few hits)


def lookup_answer(alloc: PagedAllocator, keys: tuple, max_blocks: int) -> tuple[list[int], int]:
    """`alloc`'s lookup with `count_free`: its hits as a list, and how many of them are free."""
    hits, num_free = alloc._find_longest_cache_hit(keys, max_blocks, count_free=True)
    return (hits if type(hits) is list else hits.tolist()), num_free


def lookup_by_key(pool: BlockPool, keys: np.ndarray, max_blocks: int | None = None) -> list[int]:
    """The same, one key at a time (vLLM's `find_longest_cache_hit`)."""
    hits = []
    for key in keys.tolist()[:max_blocks]:
        block = pool.get_cached_block(key)
        if block is None:
            break
        hits.append(block)
    return hits


def cache(pool: BlockPool, blocks: list[int], keys: np.ndarray) -> None:
    pool.cache_full_blocks(blocks, keys, key_runs(keys), 0)


def test_runs_are_consecutive_keys_within_a_chunk():
    keys = np.concatenate([stream_keys(7, 30, 70), stream_keys(9, 70, 75)])  # (45,)
    # 30, 31 | 32 .. 63 | 64 .. 69 (chunk boundaries) | stream 9 from 70
    assert key_runs(keys) == [0, 2, 34, 40, 45]
    assert key_runs(np.array([5, 9, 10, 3], dtype=np.int64)) == [0, 1, 3, 4]  # 9, 10: one run
    assert key_runs(np.array([-3, -2, -1, 0], dtype=np.int64)) == [0, 3, 4]  # -1 | 0: a chunk boundary
    assert key_runs(np.empty(0, dtype=np.int64)) == [0] and key_runs(np.array([4], dtype=np.int64)) == [0, 1]


def test_runs_of_few_and_of_many_keys_by_their_definition():
    rng = np.random.default_rng(3)
    for n in range(60):  # both sides of the one-at-a-time threshold
        keys = (np.cumsum(rng.choice([1, 1, 1, 2, -40], size=n)) + int(rng.integers(-64, 64))).astype(np.int64)
        ks = keys.tolist()
        cuts = [i for i in range(1, n) if ks[i] != ks[i - 1] + 1 or ks[i] % NUM_SLOTS == 0]
        assert key_runs(keys) == ([0, *cuts, n] if n else [0]), ks


def test_chained_hashes_are_runs_of_one_and_work_as_keys():
    rng = np.random.default_rng(0)
    keys = rng.integers(-(2**63), 2**63 - 1, size=40, dtype=np.int64)  # what hash() gives: any int64
    assert key_runs(keys) == list(range(41))
    pool = BlockPool(64, enable_caching=True)
    blocks = pool.get_new_blocks(40)
    cache(pool, blocks, keys)
    assert lookup(pool, keys) == lookup_by_key(pool, keys) == blocks
    assert [pool.get_cached_block(k) for k in keys.tolist()] == blocks


def test_table_get_set_items_rebuild():
    table = PrefixTable()
    assert table.get(5) == EMPTY and len(table) == 0
    table.set(5, 11)
    table.set(-1, 12)  # another chunk: -32 .. -1
    table.set(31, 13)  # 5's chunk
    assert (table.get(5), table.get(-1), table.get(31), table.get(4)) == (11, 12, 13, EMPTY)
    assert len(table) == 2 and not table.slots[2 * NUM_SLOTS :].any()
    assert sorted(table.items()) == [(-1, 12), (5, 11), (31, 13)]
    table.rebuild(np.array([31, 1 << 40], dtype=np.int64), np.array([13, 14], dtype=np.int64))
    assert sorted(table.items()) == [(31, 13), (1 << 40, 14)] and table.get(5) == EMPTY


def test_the_slots_grow_keeping_every_entry_and_a_rebuild_clears_the_rest():
    """The slots array starts with room for 64 chunks: past it, it grows (a new array and a new memoryview) and
    keeps what it held; a purge's rebuild leaves every slot past the live chunks empty."""
    table = PrefixTable()
    capacity = len(table.slots)
    keys = [(c << 5) | (c % NUM_SLOTS) for c in range(3 * capacity // NUM_SLOTS)]  # one key in each of 192 chunks
    for block, key in enumerate(keys, 1):
        table.set(key, block)
    assert len(table.slots) > capacity and len(table) == len(keys)
    assert [table.get(key) for key in keys] == list(range(1, len(keys) + 1))  # through the new memoryview
    assert not table.slots[len(keys) * NUM_SLOTS :].any()
    live = np.array(keys[5:8], dtype=np.int64)
    table.rebuild(live, np.array([6, 7, 8], dtype=np.int64))
    assert sorted(table.items()) == list(zip(keys[5:8], [6, 7, 8])) and table.get(keys[0]) == EMPTY
    assert not table.slots[3 * NUM_SLOTS :].any()


def test_one_call_whose_new_chunks_outgrow_the_slots():
    """300 chained hashes (a run and a new chunk each) cached in one call: the table grows inside the call, and
    every key answers; the same again over their stale entries once all of them are evicted."""
    rng = np.random.default_rng(5)
    keys = rng.integers(-(2**63), 2**63 - 1, size=300, dtype=np.int64)
    pool = BlockPool(301, enable_caching=True)  # 300 usable blocks
    blocks = pool.get_new_blocks(300)
    cache(pool, blocks, keys)
    assert len(pool.tables[0]) == 300 and lookup(pool, keys) == lookup_by_key(pool, keys) == blocks
    pool.free_blocks(blocks[::-1])
    again = pool.get_new_blocks(300)  # every cached block evicted: their entries stale
    assert lookup(pool, keys) == []
    cache(pool, again, keys)
    assert lookup(pool, keys) == lookup_by_key(pool, keys) == again


def test_a_run_split_across_calls_and_one_started_mid_chunk():
    pool = BlockPool(128, enable_caching=True)
    keys = stream_keys(3, 0, 70)  # chunks: 0-31, 32-63, 64-69
    runs = key_runs(keys)
    blocks = pool.get_new_blocks(70)
    pool.cache_full_blocks(blocks[:13], keys, runs, 0)  # 0 .. 12
    pool.cache_full_blocks(blocks[13:45], keys, runs, 13)  # 13 .. 44: the rest of chunk 0, then into chunk 1
    assert lookup(pool, keys) == blocks[:45]
    for j in range(45, 70):  # a decode step at a time
        pool.cache_full_block(blocks[j], int(keys[j]))
    assert lookup(pool, keys) == lookup_by_key(pool, keys) == blocks
    assert lookup(pool, keys, 40) == blocks[:40]
    assert lookup(pool, keys[5:]) == blocks[5:]  # a key sequence that starts mid-chunk


def test_a_stream_inserted_out_of_order():
    """Later blocks of a stream cached before earlier ones (another request's longer prefix first): a lookup
    finds nothing until the leading blocks are cached, then all of them."""
    pool = BlockPool(128, enable_caching=True)
    keys = stream_keys(5, 0, 64)
    runs = key_runs(keys)
    late = pool.get_new_blocks(44)
    pool.cache_full_blocks(late, keys, runs, 20)  # blocks 20 .. 63
    assert lookup(pool, keys) == []
    early = pool.get_new_blocks(20)
    pool.cache_full_blocks(early, keys, runs, 0)
    assert lookup(pool, keys) == lookup_by_key(pool, keys) == early + late


def test_duplicates_queue_behind_the_oldest_copy_in_runs():
    """Two requests compute the same 40 blocks (the second admitted before the first cached them): the first
    copy answers; its eviction hands each key to the second copy, in vLLM's order."""
    pool = BlockPool(100, enable_caching=True)
    keys = stream_keys(1, 0, 40)
    first, second = pool.get_new_blocks(40), pool.get_new_blocks(40)
    cache(pool, first, keys)
    cache(pool, second, keys)
    assert lookup(pool, keys) == first
    assert all(pool.duplicates[0][k] == [b] for k, b in zip(keys.tolist(), second))
    pool.free_blocks(first[::-1])
    pool.get_new_blocks(pool.num_free_blocks)  # the free uncached blocks, then `first`: all evicted
    assert lookup(pool, keys) == lookup_by_key(pool, keys) == second and pool.duplicates[0] == {}


def test_stale_entries_never_answer_and_are_replaced():
    pool = BlockPool(50, enable_caching=True)  # 49 usable blocks
    keys = stream_keys(2, 0, 40)
    blocks = pool.get_new_blocks(40)
    cache(pool, blocks, keys)
    pool.free_blocks(blocks[::-1])  # the tail first: it is evicted first
    reused = pool.get_new_blocks(9 + 10)  # 9 never used, then blocks 39 .. 30 evicted
    assert reused[9:] == blocks[39:29:-1]
    assert lookup(pool, keys) == lookup_by_key(pool, keys) == blocks[:30]  # stale entries of 30 .. 39: misses
    assert pool.get_cached_block(int(keys[35])) is None
    cache(pool, reused[9:][::-1], keys[30:])  # the same keys on the same blocks (the slot's own stale entry)
    assert lookup(pool, keys) == blocks
    assert len(pool.tables[0]) == 2  # chunks 0-31 and 32-63 of the stream
    pool._purge()  # stale entries dropped, live ones kept
    assert lookup(pool, keys) == blocks and len(pool.tables[0]) == 2
    assert all(pool.get_cached_block(k, g) == b for (k, g), b in pool.cached_keys().items())


def test_groups_keep_their_own_tables():
    pool = BlockPool(40, enable_caching=True, num_groups=2)
    keys = stream_keys(6, 0, 10).tolist()
    a, b = pool.get_new_blocks(10), pool.get_new_blocks(10)
    for block, key in zip(a, keys):
        pool.cache_full_block(block, key, 0)
    for block, key in zip(b, keys):
        pool.cache_full_block(block, key, 1)
    assert [pool.get_cached_block(k, 0) for k in keys] == a and [pool.get_cached_block(k, 1) for k in keys] == b
    assert pool.duplicates == [{}, {}]  # one key in two groups is two keys
    assert sorted(pool.tables[1].items()) == sorted(zip(keys, b))


@pytest.mark.parametrize("seed", range(10))
def test_runs_behave_as_vllms_pool_over_random_operations(seed):
    """Requests walk prefixes of a few streams (so keys come in runs, shared, evicted and cached again), are
    admitted through the lookup, and cache their new blocks in one or more calls; the pool, its duplicates and
    the lookup agree with vLLM's pool written plainly after every operation."""
    rng = np.random.default_rng(seed)
    num_blocks = 90
    ref, pool = ReferencePool(num_blocks), BlockPool(num_blocks, enable_caching=True)
    pool._table_limit = 3  # purge often
    held: list[list[int]] = []
    retried = allocator_over(pool)  # looks the same waiting requests up again and again, as refused admissions
    waiting = [(k, key_runs(k)) for k in (stream_keys(s, 0, 45) for s in range(3))]
    for _ in range(300):
        for keys in waiting:
            max_blocks = int(rng.integers(0, 46))
            assert lookup_answer(retried, keys, max_blocks) == lookup_answer(allocator_over(pool), keys, max_blocks)
        if rng.random() < 0.55 and ref.queue:
            stream = int(rng.integers(3))
            first = int(rng.integers(0, 8)) * int(rng.integers(0, 2))  # most from block 0
            keys = stream_keys(stream, first, first + int(rng.integers(1, 50)))
            hits = lookup(pool, keys)
            assert hits == lookup_by_key(pool, keys) == [ref.get_cached_block(k, 0) for k in keys.tolist()[: len(hits)]]
            n = len(keys) - len(hits)
            if n > len(ref.queue) - sum(ref.ref_count[h] == 0 for h in hits):
                continue
            ref.touch(hits)
            pool.touch(hits)
            new = ref.get_new_blocks(n)
            assert pool.get_new_blocks(n) == new
            runs, j = key_runs(keys), len(hits)
            while j < len(keys):  # in pieces, as chunked prefills and decode steps cache them
                end = min(len(keys), j + int(rng.integers(1, 20)))
                for b, k in zip(new[j - len(hits) : end - len(hits)], keys[j:end].tolist()):
                    ref.cache_full_block(b, k, 0)
                pool.cache_full_blocks(new[j - len(hits) : end - len(hits)], keys, runs, j)
                j = end
            held.append(hits + new)
        elif held:
            blocks = held.pop(int(rng.integers(len(held))))[::-1]
            ref.free_blocks(blocks)
            pool.free_blocks(blocks)
        assert ref.queue == pool.free_queue.queued_ids().tolist()
        assert ref.ref_count == pool.ref_count.tolist()
        for (key, group), blocks in ref.cached.items():
            assert pool.get_cached_block(key, group) == blocks[0]
            assert pool.duplicates[group].get(key, []) == blocks[1:]
        assert pool.cached_keys() == {kg: blocks[0] for kg, blocks in ref.cached.items()}
