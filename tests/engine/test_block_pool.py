"""BlockPool and FreeKVCacheBlockQueue: eviction order, O(1) removal, ref counts, the prefix-hash table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvsim.engine.paged.block_pool import Block, BlockPool, FreeKVCacheBlockQueue


def ids(blocks: list[Block]) -> list[int]:
    return [b.block_id for b in blocks]


def assert_links(queue: FreeKVCacheBlockQueue) -> None:
    """Forward and backward walks agree with the count."""
    forward = queue.blocks()
    backward, block = [], queue.tail.prev_free
    while block is not queue.head:
        backward.append(block)
        block = block.prev_free
    assert forward == backward[::-1]
    assert len(forward) == queue.num_free_blocks


def test_blocks_are_handed_out_in_id_order_at_start():
    pool = BlockPool(6)  # block 0 is the null block
    assert pool.free_queue.num_free_blocks == 5
    assert ids(pool.get_new_blocks(2)) == [1, 2] and pool.get_new_block().block_id == 3
    assert ids(pool.free_queue.blocks()) == [4, 5]
    assert_links(pool.free_queue)


@pytest.mark.parametrize("victim", [0, 2, 4])
def test_remove_from_head_middle_and_tail(victim):
    blocks = [Block(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[victim])
    assert ids(queue.blocks()) == [i for i in range(5) if i != victim]
    assert blocks[victim].prev_free is None and blocks[victim].next_free is None
    assert_links(queue)


def test_remove_touches_only_the_neighbours():
    """O(1): removing from the middle of a long queue relinks the two neighbours and nothing else."""
    blocks = [Block(i) for i in range(10_000)]
    queue = FreeKVCacheBlockQueue(blocks)
    before = [(b.prev_free, b.next_free) for b in blocks]
    queue.remove(blocks[5_000])
    changed = [i for i, b in enumerate(blocks) if (b.prev_free, b.next_free) != before[i]]
    assert changed == [4_999, 5_000, 5_001]
    assert blocks[4_999].next_free is blocks[5_001] and blocks[5_001].prev_free is blocks[4_999]


def test_block_zero_is_the_null_block_and_never_handed_out():
    """vLLM's BlockPool keeps block 0 as its null block: num_blocks - 1 are usable."""
    pool = BlockPool(3)
    assert pool.null_block is pool.blocks[0] and pool.num_usable_blocks == pool.num_free_blocks == 2
    assert ids(pool.get_new_blocks(2)) == [1, 2] and pool.num_free_blocks == 0
    assert 0 not in ids(pool.free_queue.blocks())


def test_uncached_reused_first_then_cached_in_lru_order():
    pool = BlockPool(5, enable_caching=True)  # blocks 1-4 usable
    b0, b1, b2, b3 = pool.get_new_blocks(4)
    pool.cache_full_block(b0, 100)
    pool.cache_full_block(b1, 101)
    assert pool.num_free_blocks == 0
    # Freed in this order: b1 (cached) first, then b3, b0 (cached), b2.
    pool.free_blocks([b1, b3, b0, b2])
    assert pool.free_queue.blocks() == [b3, b2, b1, b0]  # uncached in the order freed (vLLM's prepend_n)
    assert pool.get_cached_block(101) is b1
    first_two = pool.get_new_blocks(2)
    assert first_two == [b3, b2]  # uncached before any cached prefix is evicted
    assert pool.get_cached_block(100) is b0 and pool.get_cached_block(101) is b1
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is b1  # least recently freed cached block goes first
    assert evicted.block_hash is None and pool.get_cached_block(101) is None
    assert pool.get_cached_block(100) is b0


@pytest.mark.parametrize("num_left_free", [0, 1, 3])
def test_free_splices_uncached_to_the_head_and_cached_to_the_tail(num_left_free):
    """A request's tail-first free: uncached blocks reused first (first freed first, vLLM's prepend_n), cached
    ones evicted in the order freed, shared ones stay held; whatever was already free stays between them."""
    pool = BlockPool(9 + num_left_free, enable_caching=True)  # block 0: the null block
    blocks = pool.get_new_blocks(8)
    assert [b.block_id for b in blocks] == list(range(1, 9))
    already_free = [b.block_id - 1 for b in pool.free_queue.blocks()]  # as indices into blocks + 1
    for i, b in enumerate(blocks[:5]):
        pool.cache_full_block(b, 300 + i)

    def ids(queue_blocks):  # indices into `blocks` (block ids - 1), so the orders below read as before
        return [b.block_id - 1 for b in queue_blocks]

    pool.touch([blocks[1], blocks[6]])  # shared: a free leaves them held
    pool.free_blocks(reversed(blocks))  # 7 6 5 4 3 2 1 0
    assert ids(pool.free_queue.blocks()) == [7, 5] + already_free + [4, 3, 2, 0]
    assert (blocks[1].ref_count, blocks[6].ref_count, pool.num_shared_refs) == (1, 1, 0)
    assert_links(pool.free_queue)
    assert mark_links_are_clear(pool)
    pool.free_blocks([blocks[6], blocks[1]])
    assert ids(pool.free_queue.blocks()) == [6, 7, 5] + already_free + [4, 3, 2, 0, 1]
    assert_links(pool.free_queue)
    assert ids(pool.get_new_blocks(4 + num_left_free)) == [6, 7, 5] + already_free + [4]
    assert pool.get_cached_block(304) is None and blocks[4].block_hash is None  # evicted
    assert pool.get_cached_block(303) is blocks[3]


def mark_links_are_clear(pool: BlockPool) -> bool:
    """free_blocks' scratch sentinels keep no block alive between calls."""
    marks = (pool._uncached_mark, pool._cached_mark)
    return all(m.prev_free is None and m.next_free is None for m in marks)


def test_free_of_only_shared_or_only_one_kind_keeps_the_links():
    pool = BlockPool(5, enable_caching=True)  # blocks 1-4 usable
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_full_block(c, 1)
    pool.touch([a])
    pool.free_blocks([a])  # still held: nothing moves
    assert pool.free_queue.blocks() == [] and pool.num_free_blocks == 0
    pool.free_blocks([b, d])  # uncached only, into an empty queue: in the order freed
    assert pool.free_queue.blocks() == [b, d]
    pool.free_blocks([c])  # cached only
    assert pool.free_queue.blocks() == [b, d, c]
    assert_links(pool.free_queue)
    assert mark_links_are_clear(pool)


def test_get_new_block_matches_get_new_blocks():
    twins = [BlockPool(4, enable_caching=True) for _ in range(2)]  # blocks 1-3 usable
    for pool in twins:
        held = pool.get_new_blocks(3)
        pool.cache_full_block(held[0], 10)
        pool.cache_full_block(held[2], 12)
        pool.free_blocks(held)
    taken = [[twins[0].get_new_block() for _ in range(3)], twins[1].get_new_blocks(3)]
    assert ids(taken[0]) == ids(taken[1]) == [2, 1, 3]
    for pool, blocks in zip(twins, taken):
        assert [(b.ref_count, b.block_hash) for b in blocks] == [(1, None)] * 3
        assert pool.num_free_blocks == 0 and pool.cached_block_hash_to_block == {} and pool.num_blocks_allocated == 6
        assert_links(pool.free_queue)


def test_touch_revives_a_free_cached_block_from_the_middle():
    pool = BlockPool(4, enable_caching=True)  # blocks 1-3 usable
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, 200 + i)
    pool.free_blocks(blocks)
    pool.touch([blocks[1]])
    assert blocks[1].ref_count == 1 and pool.num_free_blocks == 2
    assert pool.free_queue.blocks() == [blocks[0], blocks[2]]
    assert pool.num_shared_refs == 0  # a revived block is not shared


def test_ref_counts_and_shared_refs():
    pool = BlockPool(3)  # blocks 1-2 usable
    a, b = pool.get_new_blocks(2)
    assert (a.ref_count, b.ref_count) == (1, 1)
    pool.touch([a, a, b])
    assert (a.ref_count, b.ref_count, pool.num_shared_refs) == (3, 2, 3)
    pool.free_blocks([a, b])
    assert (a.ref_count, b.ref_count, pool.num_shared_refs) == (2, 1, 1)
    assert pool.num_free_blocks == 0
    pool.free_blocks([a, a, b])
    assert (a.ref_count, b.ref_count, pool.num_shared_refs) == (0, 0, 0)
    assert pool.num_free_blocks == 2


def make_duplicates(num_copies: int, block_hash: int = 7) -> tuple[BlockPool, list[Block]]:
    """A pool whose first `num_copies` blocks each cached the same prefix (computed again by each request)."""
    pool = BlockPool(num_copies + 3, enable_caching=True)  # block 0: the null block; 2 blocks to spare
    copies = pool.get_new_blocks(num_copies)
    for block in copies:
        pool.cache_full_block(block, block_hash)
    return pool, copies


def cached_under(pool: BlockPool, block_hash: int) -> list[Block]:
    """Every block cached under `block_hash`, the one a lookup returns first."""
    first = pool.get_cached_block(block_hash)
    return ([] if first is None else [first]) + pool.cached_duplicates.get(block_hash, [])


def test_a_duplicate_block_is_cached_too():
    """vLLM's BlockHashToBlockMap does not de-duplicate: both blocks hold the hash, a lookup gets the first."""
    pool, (a, b) = make_duplicates(2)
    assert (a.block_hash, b.block_hash) == (7, 7)
    assert pool.get_cached_block(7) is a and cached_under(pool, 7) == [a, b]
    pool.cache_full_block(b, 7)  # registering a block again changes nothing
    assert cached_under(pool, 7) == [a, b]
    assert pool.num_blocks_allocated == 2


def test_a_freed_duplicate_goes_to_the_tail_like_any_cached_block():
    pool, (a, b) = make_duplicates(2)
    c = pool.get_new_block()  # uncached
    pool.free_blocks([a, c, b])
    assert pool.free_queue.blocks()[0] is c  # uncached: reused first
    assert pool.free_queue.blocks()[-2:] == [a, b]  # both cached: evicted last, in the order freed
    assert_links(pool.free_queue)


@pytest.mark.parametrize("evicted_first", [0, 1, 2])
def test_evicting_a_duplicate_removes_that_block_only(evicted_first):
    """Eviction drops the evicted block from the table; a lookup returns the oldest block still cached."""
    pool, copies = make_duplicates(3)
    order = [copies[evicted_first]] + [b for b in copies if b is not copies[evicted_first]]
    pool.free_blocks(order)
    spare = pool.get_new_blocks(2)  # the two never-used blocks at the head go first
    assert all(b.block_id > 3 for b in spare)
    left = list(copies)
    for victim in order:
        assert pool.get_new_block() is victim and victim.block_hash is None
        left.remove(victim)
        assert cached_under(pool, 7) == left
        assert pool.get_cached_block(7) is (left[0] if left else None)
    assert pool.cached_block_hash_to_block == {} and pool.cached_duplicates == {}


def test_a_hit_on_the_oldest_copy_keeps_the_younger_one_evictable():
    """The oldest copy evicted, a younger one answers lookups; a new copy queues behind it."""
    pool, (a, b) = make_duplicates(2)
    pool.free_blocks([a, b])
    pool.get_new_blocks(2)  # the spare blocks
    assert pool.get_new_block() is a  # a evicted: b now answers
    assert pool.get_cached_block(7) is b
    pool.cache_full_block(a, 7)  # a computes the prefix again: behind b
    assert cached_under(pool, 7) == [b, a]
    pool.touch([pool.get_cached_block(7)])
    assert b.ref_count == 1 and pool.free_queue.blocks() == []


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
