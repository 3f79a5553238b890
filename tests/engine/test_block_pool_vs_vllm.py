"""BlockPool against vLLM's BlockPool written plainly (a list as the free queue, a list of blocks per
(key, group)): the same operations give the same blocks, free queue order, ref counts and prefix-table answers,
duplicates, stale entries and keys cached in several groups included."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.engine.paged.block_pool import BlockPool
from kvsim.engine.paged.prefix_table import key_runs


class ReferencePool:
    """vLLM 0.33.0's `BlockPool` step by step, without any of the array pool's shortcuts."""

    def __init__(self, num_blocks: int):
        self.ref_count = [0] * num_blocks
        self.key: list[tuple[int, int] | None] = [None] * num_blocks  # (key, group) a block is cached under
        self.queue = list(range(1, num_blocks))  # head first; block 0 is the null block
        self.cached: dict[tuple[int, int], list[int]] = {}  # (key, group) -> its blocks, oldest first
        self.num_shared_refs = 0

    def get_new_blocks(self, n: int) -> list[int]:
        out, self.queue = self.queue[:n], self.queue[n:]
        for b in out:
            if self.key[b] is not None:  # evicted
                blocks = self.cached[self.key[b]]
                blocks.remove(b)
                if not blocks:
                    del self.cached[self.key[b]]
                self.key[b] = None
            self.ref_count[b] = 1
        return out

    def cache_full_block(self, block: int, key: int, group: int) -> None:
        if self.key[block] is None:
            self.key[block] = (key, group)
            self.cached.setdefault((key, group), []).append(block)

    def get_cached_block(self, key: int, group: int) -> int | None:
        blocks = self.cached.get((key, group))
        return blocks[0] if blocks else None

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_count[b] == 0:
                self.queue.remove(b)
            else:
                self.num_shared_refs += 1
            self.ref_count[b] += 1

    def free_blocks(self, blocks: list[int]) -> None:
        uncached, cached = [], []
        for b in blocks:
            self.ref_count[b] -= 1
            if self.ref_count[b]:
                self.num_shared_refs -= 1
                continue
            (cached if self.key[b] is not None else uncached).append(b)
        self.queue = uncached + self.queue + cached  # vLLM's prepend_n / append_n


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("num_groups", [1, 3])
def test_same_behaviour_as_vllms_block_pool(seed, num_groups):
    rng = np.random.default_rng(seed)
    num_blocks, num_keys = 24, 10  # few keys: duplicates and keys cached again after eviction are common
    ref, arr = ReferencePool(num_blocks), BlockPool(num_blocks, enable_caching=True, num_groups=num_groups)
    arr._table_limit = 12  # purge often
    held: list[list[int]] = []  # block ids of each live "request", in allocation order
    for _ in range(400):
        op = rng.integers(4)
        if op == 0 and ref.queue:  # a request: hits on cached keys, then new blocks
            g = int(rng.integers(num_groups))
            keys = [int(k) for k in rng.integers(0, num_keys, size=int(rng.integers(1, 4)))]
            hits = [h for h in (arr.get_cached_block(k, g) for k in keys[:1]) if h is not None]
            assert [ref.get_cached_block(k, g) for k in keys[:1] if ref.get_cached_block(k, g) is not None] == hits
            n = min(int(rng.integers(1, 5)), len(ref.queue) - sum(ref.ref_count[h] == 0 for h in hits))
            if n <= 0:
                continue
            ref.touch(hits)
            arr.touch(hits)
            new_ref = ref.get_new_blocks(n)
            new_arr = arr.get_new_blocks(n) if n > 1 or rng.random() < 0.5 else [arr.get_new_block()]
            assert new_ref == new_arr
            cache = [int(k) for k in rng.integers(0, num_keys, size=len(new_arr))]
            if len(set(cache)) == len(cache):  # a request's keys are distinct
                for b, k in zip(new_arr, cache):
                    ref.cache_full_block(b, k, g)
                if len(new_arr) == 1 or g:
                    for b, k in zip(new_arr, cache):
                        arr.cache_full_block(b, k, g)
                else:
                    keys = np.array(cache, dtype=np.int64)
                    arr.cache_full_blocks(new_arr, keys, key_runs(keys), 0)
            held.append(hits + new_arr)
        elif held:  # a request finishes: its blocks back, tail first
            blocks = held.pop(int(rng.integers(len(held))))[::-1]
            ref.free_blocks(blocks)
            arr.free_blocks(blocks)
        assert ref.queue == arr.free_queue.queued_ids().tolist()
        assert ref.ref_count == arr.ref_count.tolist()
        assert ref.num_shared_refs == arr.num_shared_refs
        for g in range(num_groups):
            for k in range(num_keys):
                assert ref.get_cached_block(k, g) == arr.get_cached_block(k, g), (k, g)
                younger = ref.cached.get((k, g), [])[1:]
                assert arr.duplicates[g].get(k, []) == younger
        assert [None if k is None else k[0] for k in ref.key] == [v.block_hash for v in arr.blocks]


def test_a_stale_entry_does_not_answer_for_a_block_cached_again_in_another_group():
    """Block 1 cached under key 5 in group 0, evicted (its entry left stale), then cached under key 5 in group 1:
    group 0's lookup misses, group 1's finds it."""
    pool = BlockPool(2, enable_caching=True, num_groups=2)  # one usable block
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, 5, 0)
    assert pool.get_cached_block(5, 0) == b and pool.get_cached_block(5, 1) is None
    pool.free_blocks([b])
    assert pool.get_new_block() == b  # evicted: group 0's entry goes stale
    pool.cache_full_block(b, 5, 1)
    assert pool.get_cached_block(5, 0) is None and pool.get_cached_block(5, 1) == b
    assert (5, b) in pool.cached_block_hash_to_block.items()  # the stale entry is still there, and answers nothing
    assert 5 not in pool.cached_hashes()  # the router's view: group 0
