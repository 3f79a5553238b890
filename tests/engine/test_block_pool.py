"""BlockPool and FreeKVCacheBlockQueue: eviction order, O(1) removal, ref counts, the prefix-hash table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvsim.engine.block_pool import Block, BlockPool, FreeKVCacheBlockQueue


def ids(blocks: list[Block]) -> list[int]:
    return [b.block_id for b in blocks]


def assert_links(queue: FreeKVCacheBlockQueue) -> None:
    """Forward and backward walks agree with the count."""
    forward = queue.blocks()
    backward, block = [], queue._tail.prev_free
    while block is not queue._head:
        backward.append(block)
        block = block.prev_free
    assert forward == backward[::-1]
    assert len(forward) == queue.num_free_blocks


def test_queue_pops_in_id_order_at_start():
    blocks = [Block(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert [queue.popleft().block_id for _ in range(3)] == [0, 1, 2]
    assert ids(queue.blocks()) == [3, 4]
    assert_links(queue)


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


def test_append_and_appendleft():
    blocks = [Block(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.append(blocks[2])
    queue.appendleft(blocks[3])
    assert ids(queue.blocks()) == [3, 0, 1, 2]
    assert_links(queue)


def test_uncached_reused_first_then_cached_in_lru_order():
    pool = BlockPool(4, enable_caching=True)
    b0, b1, b2, b3 = pool.get_new_blocks(4)
    pool.cache_full_block(b0, 100)
    pool.cache_full_block(b1, 101)
    assert pool.num_free_blocks == 0
    # Freed in this order: b1 (cached) first, then b3, b0 (cached), b2.
    pool.free_blocks([b1, b3, b0, b2])
    assert ids(pool.free_queue.blocks()) == [2, 3, 1, 0]
    assert pool.get_cached_block(101) is b1
    first_two = pool.get_new_blocks(2)
    assert ids(first_two) == [2, 3]  # uncached before any cached prefix is evicted
    assert pool.get_cached_block(100) is b0 and pool.get_cached_block(101) is b1
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is b1  # least recently freed cached block goes first
    assert evicted.block_hash is None and pool.get_cached_block(101) is None
    assert pool.get_cached_block(100) is b0


def test_touch_revives_a_free_cached_block_from_the_middle():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, 200 + i)
    pool.free_blocks(blocks)
    pool.touch([blocks[1]])
    assert blocks[1].ref_count == 1 and pool.num_free_blocks == 2
    assert ids(pool.free_queue.blocks()) == [0, 2]
    assert pool.num_shared_refs == 0  # a revived block is not shared


def test_ref_counts_and_shared_refs():
    pool = BlockPool(2)
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


def test_a_hash_is_registered_once():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 7)
    pool.cache_full_block(b, 7)  # same prefix computed twice: the first block keeps the entry
    assert pool.get_cached_block(7) is a and b.block_hash is None
    assert pool.num_blocks_allocated == 2


SCENARIO = """
import json, numpy as np
from kvsim.engine.kv_cache_spec import KVCacheSpec
from kvsim.engine.paged import PagedAllocator
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
out.append([b.block_id for b in alloc.pool.free_queue.blocks()])
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
