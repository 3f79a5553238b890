"""BlockArrayPool (blocks as ints in arrays) against BlockPool (blocks as objects): the same operations give the
same blocks, free queue order, ref counts and prefix-table answers, duplicates and stale entries included."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.engine.paged.block_array_pool import BlockArrayPool
from kvsim.engine.paged.block_pool import BlockPool


@pytest.mark.parametrize("seed", range(12))
def test_same_behaviour_as_block_pool(seed):
    rng = np.random.default_rng(seed)
    num_blocks, num_keys = 24, 10  # few keys: duplicates and keys cached again after eviction are common
    ref, arr = BlockPool(num_blocks, enable_caching=True), BlockArrayPool(num_blocks, enable_caching=True)
    arr._table_limit = 12  # purge often
    held: list[list[int]] = []  # block ids of each live "request", in allocation order
    for _ in range(400):
        op = rng.integers(4)
        if op == 0 and ref.free_queue.num_free_blocks:  # a request: hits on cached keys, then new blocks
            keys = [int(k) for k in rng.integers(0, num_keys, size=int(rng.integers(1, 4)))]
            hits = [h for h in (arr.get_cached_block(k) for k in keys[:1]) if h is not None]
            assert [b.block_id for b in (ref.get_cached_block(k) for k in keys[:1]) if b is not None] == hits
            n = min(int(rng.integers(1, 5)), ref.free_queue.num_free_blocks - sum(ref.blocks[h].ref_count == 0 for h in hits))
            if n <= 0:
                continue
            ref.touch([ref.blocks[h] for h in hits])
            arr.touch(hits)
            new_ref = [b.block_id for b in ref.get_new_blocks(n)] if n > 1 or rng.random() < 0.5 else [ref.get_new_block().block_id]
            new_arr = arr.get_new_blocks(n) if len(new_ref) > 1 or n > 1 else [arr.get_new_block()]
            assert new_ref == new_arr
            cache = [int(k) for k in rng.integers(0, num_keys, size=len(new_arr))]
            if len(set(cache)) == len(cache):  # a request's keys are distinct
                for b, k in zip(new_arr, cache):
                    ref.cache_full_block(ref.blocks[b], k)
                if len(new_arr) == 1:
                    arr.cache_full_block(new_arr[0], cache[0])
                else:
                    arr.cache_full_blocks(new_arr, cache, np.array(cache, dtype=np.int64))
            held.append(hits + new_arr)
        elif held:  # a request finishes: its blocks back, tail first
            blocks = held.pop(int(rng.integers(len(held))))[::-1]
            ref.free_blocks([ref.blocks[b] for b in blocks])
            arr.free_blocks(blocks)
        assert [b.block_id for b in ref.free_queue.blocks()] == arr.free_queue.queued_ids().tolist()
        assert [b.ref_count for b in ref.blocks] == arr.ref_count.tolist()
        assert ref.num_shared_refs == arr.num_shared_refs
        for k in range(num_keys):
            b = ref.get_cached_block(k)
            assert (None if b is None else b.block_id) == arr.get_cached_block(k), k
        assert {h: [b.block_id for b in bs] for h, bs in ref.cached_duplicates.items()} == arr.cached_duplicates
        assert [b.block_hash for b in ref.blocks] == [v.block_hash for v in arr.blocks]
