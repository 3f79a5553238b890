"""The block pool: eviction order, removal from the middle of the free queue, ref counts, the prefix table and
its duplicates (vLLM's `BlockPool` / `FreeKVCacheBlockQueue`), with blocks as ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvsim.engine.paged.block_pool import BlockPool


def queued(pool: BlockPool) -> list[int]:
    return pool.free_queue.queued_ids().tolist()


def block_hash(pool: BlockPool, block: int) -> int | None:
    return pool.blocks[block].block_hash


def test_blocks_are_handed_out_in_id_order_at_start():
    pool = BlockPool(6)  # block 0 is the null block
    assert pool.free_queue.num_free_blocks == 5
    assert pool.get_new_blocks(2) == [1, 2] and pool.get_new_block() == 3
    assert queued(pool) == [4, 5]


@pytest.mark.parametrize("victim", [1, 3, 5])
def test_remove_from_head_middle_and_tail(victim):
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(5)
    for b in blocks:
        pool.cache_full_block(b, 100 + b)
    pool.free_blocks(blocks)
    pool.touch([victim])  # a hit on a free cached block takes it out of the queue
    assert queued(pool) == [i for i in range(1, 6) if i != victim]
    assert pool.get_new_blocks(4) == [i for i in range(1, 6) if i != victim]


def test_block_zero_is_the_null_block_and_never_handed_out():
    """vLLM's BlockPool keeps block 0 as its null block: num_blocks - 1 are usable."""
    pool = BlockPool(3)
    assert pool.null_block == 0 and pool.num_usable_blocks == pool.num_free_blocks == 2
    assert pool.get_new_blocks(2) == [1, 2] and pool.num_free_blocks == 0
    assert 0 not in queued(pool)


def test_uncached_reused_first_then_cached_in_lru_order():
    pool = BlockPool(5, enable_caching=True)  # blocks 1-4 usable
    b0, b1, b2, b3 = pool.get_new_blocks(4)
    pool.cache_full_block(b0, 100)
    pool.cache_full_block(b1, 101)
    assert pool.num_free_blocks == 0
    # Freed in this order: b1 (cached) first, then b3, b0 (cached), b2.
    pool.free_blocks([b1, b3, b0, b2])
    assert queued(pool) == [b3, b2, b1, b0]  # uncached in the order freed (vLLM's prepend_n)
    assert pool.get_cached_block(101) == b1
    assert pool.get_new_blocks(2) == [b3, b2]  # uncached before any cached prefix is evicted
    assert pool.get_cached_block(100) == b0 and pool.get_cached_block(101) == b1
    (evicted,) = pool.get_new_blocks(1)
    assert evicted == b1  # least recently freed cached block goes first
    assert block_hash(pool, evicted) is None and pool.get_cached_block(101) is None
    assert pool.get_cached_block(100) == b0


@pytest.mark.parametrize("num_left_free", [0, 1, 3])
def test_free_puts_uncached_at_the_head_and_cached_at_the_tail(num_left_free):
    """A request's tail-first free: uncached blocks reused first (first freed first, vLLM's prepend_n), cached
    ones evicted in the order freed, shared ones stay held; whatever was already free stays between them."""
    pool = BlockPool(9 + num_left_free, enable_caching=True)  # block 0: the null block
    blocks = pool.get_new_blocks(8)
    assert blocks == list(range(1, 9))
    already_free = [b - 1 for b in queued(pool)]  # as indices into blocks
    for i, b in enumerate(blocks[:5]):
        pool.cache_full_block(b, 300 + i)

    def ids(queue_blocks):  # indices into `blocks` (block ids - 1), so the orders below read as before
        return [b - 1 for b in queue_blocks]

    pool.touch([blocks[1], blocks[6]])  # shared: a free leaves them held
    pool.free_blocks(blocks[::-1])  # 7 6 5 4 3 2 1 0
    assert ids(queued(pool)) == [7, 5] + already_free + [4, 3, 2, 0]
    assert (pool.ref_count[blocks[1]], pool.ref_count[blocks[6]], pool.num_shared_refs) == (1, 1, 0)
    pool.free_blocks([blocks[6], blocks[1]])
    assert ids(queued(pool)) == [6, 7, 5] + already_free + [4, 3, 2, 0, 1]
    assert ids(pool.get_new_blocks(4 + num_left_free)) == [6, 7, 5] + already_free + [4]
    assert pool.get_cached_block(304) is None and block_hash(pool, blocks[4]) is None  # evicted
    assert pool.get_cached_block(303) == blocks[3]


def test_free_of_only_shared_or_only_one_kind():
    pool = BlockPool(5, enable_caching=True)  # blocks 1-4 usable
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_full_block(c, 1)
    pool.touch([a])
    pool.free_blocks([a])  # still held: nothing moves
    assert queued(pool) == [] and pool.num_free_blocks == 0
    pool.free_blocks([b, d])  # uncached only, into an empty queue: in the order freed
    assert queued(pool) == [b, d]
    pool.free_blocks([c])  # cached only
    assert queued(pool) == [b, d, c]


def test_get_new_block_matches_get_new_blocks():
    twins = [BlockPool(4, enable_caching=True) for _ in range(2)]  # blocks 1-3 usable
    for pool in twins:
        held = pool.get_new_blocks(3)
        pool.cache_full_block(held[0], 10)
        pool.cache_full_block(held[2], 12)
        pool.free_blocks(held)
    taken = [[twins[0].get_new_block() for _ in range(3)], twins[1].get_new_blocks(3)]
    assert taken[0] == taken[1] == [2, 1, 3]
    for pool, blocks in zip(twins, taken):
        assert [(pool.blocks[b].ref_count, pool.blocks[b].block_hash) for b in blocks] == [(1, None)] * 3
        assert pool.num_free_blocks == 0 and len(pool.cached_hashes()) == 0 and pool.num_blocks_allocated == 6


def test_touch_revives_a_free_cached_block_from_the_middle():
    pool = BlockPool(4, enable_caching=True)  # blocks 1-3 usable
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, 200 + i)
    pool.free_blocks(blocks)
    pool.touch([blocks[1]])
    assert pool.ref_count[blocks[1]] == 1 and pool.num_free_blocks == 2
    assert queued(pool) == [blocks[0], blocks[2]]
    assert pool.num_shared_refs == 0  # a revived block is not shared


def test_ref_counts_and_shared_refs():
    pool = BlockPool(3)  # blocks 1-2 usable
    a, b = pool.get_new_blocks(2)
    refs = lambda: (int(pool.ref_count[a]), int(pool.ref_count[b]))  # noqa: E731
    assert refs() == (1, 1)
    pool.touch([a, b])  # two requests' hits (a request's blocks are distinct)
    pool.touch([a])
    assert refs() == (3, 2) and pool.num_shared_refs == 3
    pool.free_blocks([a, b])
    assert refs() == (2, 1) and pool.num_shared_refs == 1 and pool.num_free_blocks == 0
    pool.free_blocks([a, b])
    pool.free_blocks([a])
    assert refs() == (0, 0) and pool.num_shared_refs == 0 and pool.num_free_blocks == 2


def make_duplicates(num_copies: int, key: int = 7) -> tuple[BlockPool, list[int]]:
    """A pool whose first `num_copies` blocks each cached the same prefix (computed again by each request)."""
    pool = BlockPool(num_copies + 3, enable_caching=True)  # block 0: the null block; 2 blocks to spare
    copies = pool.get_new_blocks(num_copies)
    for block in copies:
        pool.cache_full_block(block, key)
    return pool, copies


def cached_under(pool: BlockPool, key: int) -> list[int]:
    """Every block cached under `key`, the one a lookup returns first."""
    first = pool.get_cached_block(key)
    return ([] if first is None else [first]) + pool.cached_duplicates.get(key, [])


def test_a_duplicate_block_is_cached_too():
    """vLLM's BlockHashToBlockMap does not de-duplicate: both blocks hold the key, a lookup gets the first."""
    pool, (a, b) = make_duplicates(2)
    assert (block_hash(pool, a), block_hash(pool, b)) == (7, 7)
    assert pool.get_cached_block(7) == a and cached_under(pool, 7) == [a, b]
    assert pool.num_blocks_allocated == 2


def test_a_freed_duplicate_goes_to_the_tail_like_any_cached_block():
    pool, (a, b) = make_duplicates(2)
    c = pool.get_new_block()  # uncached
    pool.free_blocks([a, c, b])
    assert queued(pool)[0] == c  # uncached: reused first
    assert queued(pool)[-2:] == [a, b]  # both cached: evicted last, in the order freed


@pytest.mark.parametrize("evicted_first", [0, 1, 2])
def test_evicting_a_duplicate_removes_that_block_only(evicted_first):
    """Eviction drops the evicted block from the table; a lookup returns the oldest block still cached."""
    pool, copies = make_duplicates(3)
    order = [copies[evicted_first]] + [b for b in copies if b != copies[evicted_first]]
    pool.free_blocks(order)
    spare = pool.get_new_blocks(2)  # the two never-used blocks at the head go first
    assert all(b > 3 for b in spare)
    left = list(copies)
    for victim in order:
        assert pool.get_new_block() == victim and block_hash(pool, victim) is None
        left.remove(victim)
        assert cached_under(pool, 7) == left
        assert pool.get_cached_block(7) == (left[0] if left else None)
    assert len(pool.cached_hashes()) == 0 and pool.cached_duplicates == {}


def test_a_hit_on_the_oldest_copy_keeps_the_younger_one_evictable():
    """The oldest copy evicted, a younger one answers lookups; a new copy queues behind it."""
    pool, (a, b) = make_duplicates(2)
    pool.free_blocks([a, b])
    pool.get_new_blocks(2)  # the spare blocks
    assert pool.get_new_block() == a  # a evicted: b now answers
    assert pool.get_cached_block(7) == b
    pool.cache_full_block(a, 7)  # a computes the prefix again: behind b
    assert cached_under(pool, 7) == [b, a]
    pool.touch([pool.get_cached_block(7)])
    assert pool.ref_count[b] == 1 and queued(pool) == []


SCENARIO = """
import json, numpy as np
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.engine.paged.unitary_kv_cache_manager import PagedAllocator
from kvsim.engine.sequence import Sequence
spec = KVCacheSpec.uniform(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4)
alloc = PagedAllocator(spec, 24 * 64, max_model_len=256, enable_prefix_caching=True, watermark=0.0)
rng = np.random.default_rng(0)
out, live = [], []
for i in range(60):
    if len(live) > 3:
        alloc.free(live.pop(int(rng.integers(len(live)))))
    prompt = int(rng.integers(4, 30))
    ids = np.concatenate([np.arange(16) + 100 * int(rng.integers(3)), rng.integers(0, 50, prompt)])
    seq = Sequence(i, prompt, 0, token_ids=ids)
    hit = alloc.allocate(seq, prompt)
    if hit is not None:
        seq.num_computed_tokens = prompt
        live.append(seq)
        out.append([hit, alloc.block_table(seq)])
out.append(alloc.pool.free_queue.queued_ids().tolist())
out.append(alloc.breakdown().as_dict())
print(json.dumps(out))
"""


def test_prefix_cache_decisions_do_not_depend_on_the_hash_seed():
    # Block hashes come from Python's hash(), salted per process: hits, evictions, block tables and the
    # breakdown must depend on which hashes are equal, never on their values (no ordering by hash).
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        runs.append(subprocess.run([sys.executable, "-c", SCENARIO], env=env, capture_output=True, text=True, check=True).stdout)
    assert runs[0] == runs[1] and '"shared_saved_bytes"' in runs[0]
    assert any(hit > 0 for hit, _ in json.loads(runs[0])[:-2])  # prefix hits happened


@pytest.mark.parametrize("seed", range(6))
def test_many_blocks_and_a_few_give_the_same_as_vllms_pool(seed):
    """Calls of many blocks (array operations) and of a few (one block at a time) in any mix: requests of up to 60
    new blocks behind prefix hits of up to 60 (held, or free and taken out of the middle of the free queue, which
    leaves stale entries), decode steps opening one block, frees of whole requests; queue segments pushed as
    lists and as arrays are taken across, and compacted. The same blocks, queue, ref counts and cache answers as
    vLLM's pool written plainly."""
    import numpy as np

    from tests.engine.test_block_pool_vs_vllm import ReferencePool

    rng = np.random.default_rng(seed)
    num_blocks = 400
    ref, pool = ReferencePool(num_blocks), BlockPool(num_blocks, enable_caching=True)
    pool.free_queue._limit = num_blocks  # compact often
    held: list[list[int]] = []  # each live request's block table
    keys_of: list[list[int]] = []  # each request's cached keys, in block order (finished requests' too)
    next_key = 1
    for _ in range(300):
        if rng.random() < 0.6 and ref.queue:  # a request: a prefix of an earlier one's keys, then new blocks
            hits: list[int] = []
            if keys_of and rng.random() < 0.7:
                for key in keys_of[int(rng.integers(len(keys_of)))]:
                    block = pool.get_cached_block(key)
                    assert block == ref.get_cached_block(key, 0)
                    if block is None:
                        break
                    hits.append(block)
            revived = sum(ref.ref_count[b] == 0 for b in hits)
            n = min(int(rng.choice([1, 3, 8, 20, 30, 60])), len(ref.queue) - revived)
            if n <= 0:
                continue
            assert pool.num_evictable(hits) == revived
            ref.touch(hits)
            if hits and rng.random() < 0.5:  # as an admission touches a lookup's hit array: with its ref counts
                arr = np.array(hits, dtype=np.int64)
                refs = pool.ref_count[arr]
                pool.touch_hit(arr, refs, refs == 0, revived)
            else:
                pool.touch(hits)
            new = pool.get_new_blocks(n) if n > 1 or rng.random() < 0.5 else [pool.get_new_block()]
            assert new == ref.get_new_blocks(n)
            keys = [ref.key[b][0] for b in hits]
            for b in new[: n - int(rng.integers(2))]:  # the last block partly filled (uncached) or not
                pool.cache_full_block(b, next_key)
                ref.cache_full_block(b, next_key, 0)
                keys.append(next_key)
                next_key += 1
            keys_of.append(keys)
            held.append(hits + new)
        elif held:  # a request finishes: its blocks back, tail first
            blocks = held.pop(int(rng.integers(len(held))))[::-1]
            ref.free_blocks(blocks)
            pool.free_blocks(blocks)
        assert pool.free_queue.queued_ids().tolist() == ref.queue
        assert pool.num_free_blocks == len(ref.queue)
        assert pool.ref_count.tolist() == ref.ref_count and pool.num_shared_refs == ref.num_shared_refs
