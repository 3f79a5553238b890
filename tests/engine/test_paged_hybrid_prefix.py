"""Prefix caching on a mixed model's KV cache groups, as vLLM's hybrid coordinator: hits by hand."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.engine.factory import AllocatorConfig, make_allocator
from kvsim.engine.paged.kv_cache_manager import HybridPagedAllocator
from kvsim.engine.paged.kv_cache_utils import block_hashes
from kvsim.engine.sequence import Sequence
from kvsim.errors import KvsimError
from kvsim.size.kv_cache_spec import PoolSpec, VllmGroup
from tests.engine.test_paged_hybrid import SPEC

# SPEC: 2 sliding groups (window 8) and 1 full group, block_size 4, a block id 64 B. A sliding hit needs
# cdiv(8 - 1, 4) = 2 contiguous cached blocks. Most tests hold vLLM's dense retention (every full block cached,
# `prefix_cache_retention_interval` None); the last ones its default 0.


def make(num_blocks: int = 17, retention: int | None = None) -> HybridPagedAllocator:
    return HybridPagedAllocator(SPEC, num_blocks * 64, max_model_len=64, enable_prefix_caching=True,
                                prefix_cache_retention_interval=retention)


def seq(seq_id: int, ids, prompt: int = 20) -> Sequence:
    return Sequence(seq_id, prompt, 0, token_ids=np.asarray(ids, dtype=np.int64))


def run_and_free(alloc, s) -> None:
    assert alloc.allocate(s, s.num_prompt_tokens, apply_watermark=False) == 0
    s.num_computed_tokens = s.num_prompt_tokens
    alloc.free(s)


def test_a_hit_is_every_full_block_and_the_window_before_it_the_rest_null_blocks():
    alloc = make()
    ids = np.arange(20)
    a = seq(0, ids)
    assert alloc.allocate(a, 20) == 0
    assert alloc.block_tables(a) == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    a.num_computed_tokens = 20
    alloc.free(a)  # every block cached; free queue: 16, then 5..1, 10..6, 15..11 (each table's tail first)
    b = seq(1, ids)
    # at most 19 tokens hit (the last is recomputed): 4 blocks. Full: 4 blocks; sliding: blocks 3 and 2 from
    # the right (2 contiguous), blocks 0 and 1 before the window of token 16 (16 - 8 + 1 = 9 skipped) are null.
    assert alloc.allocate(b, 20) == 16
    assert alloc.block_tables(b) == [[0, 0, 3, 4, 16], [0, 0, 8, 9, 5], [11, 12, 13, 14, 2]]
    # blocks taken: per sliding group 2 revived hits + 1 new, the full group 4 revived + 1 new
    assert alloc.num_free_blocks == 16 - (3 + 3 + 5)
    assert (alloc.prefix_query_tokens, alloc.prefix_hit_tokens) == (20 + 20, 16)  # both looked up their 20 tokens


def test_admission_counts_revived_hits_but_not_the_hit_blocks_before_the_window():
    ids = np.arange(20)
    alloc = HybridPagedAllocator(SPEC, 17 * 64, max_model_len=64, enable_prefix_caching=True, watermark=0.36,
                                 prefix_cache_retention_interval=None)
    run_and_free(alloc, seq(0, ids))  # alone: no watermark
    coordinator = alloc.coordinator
    hit_blocks, hit, _ = alloc.coordinator.find_longest_cache_hit(block_hashes(ids, 20, 4), 19)
    assert hit == 16 and [len(b) for b in hit_blocks] == [4, 4, 4]
    # per sliding group: 5 blocks - max(2 skipped, 4 hit) = 1 new + 2 revived; full: 1 new + 4 revived
    assert coordinator.get_num_blocks_to_allocate(coordinator.new_tables(), 20, False, hit_blocks, hit) == 11
    # 16 free less a watermark of int(0.36 * 17) = 6 blocks: 10 < 11, refused and nothing changed
    b = seq(1, ids)
    assert alloc.allocate(b, 20) is None
    assert alloc.num_free_blocks == 16 and len(alloc.pool.cached_keys()) == 15
    assert alloc.allocate(b, 20, apply_watermark=False) == 16
    assert alloc.num_free_blocks == 5


def test_a_sliding_group_missing_a_block_of_the_window_shortens_every_groups_hit():
    alloc = make()
    ids = np.arange(20)
    run_and_free(alloc, seq(0, ids))
    h = block_hashes(ids, 20, 4)
    cached = alloc.pool.cached_keys()
    block = cached[(h[3], 1)]  # the second sliding group lost block 3 (evicted)
    alloc.pool.is_cached[block] = alloc.pool.is_primary[block] = False
    b = seq(1, ids)
    # sliding: block 3 misses, blocks 2 and 1 hit: 12 tokens; the full group is truncated to 3 blocks
    assert alloc.allocate(b, 20) == 12
    tables = alloc.block_tables(b)
    assert tables[2][:3] == [11, 12, 13] and tables[0][:3] == [0, 2, 3] and tables[1][:3] == [0, 7, 8]
    assert [len(t) for t in tables] == [5, 5, 5]


def test_sliding_blocks_are_cached_before_they_become_null_blocks_and_stay_evictable():
    alloc = make(num_blocks=30)
    ids = np.arange(40)
    a = Sequence(0, 8, 32, token_ids=ids)
    assert alloc.allocate(a, 8) == 0
    a.num_computed_tokens = 8
    for _ in range(24):
        assert alloc.append_slots(a, 1)
        a.num_computed_tokens += 1
    tables = alloc.block_tables(a)
    # the last append saw 31 computed: 31 - 8 + 1 = 24 tokens (6 blocks) before the window are null blocks
    assert tables[0][:7] == [0] * 6 + [tables[0][6]] and tables[0][6] != 0
    h = block_hashes(ids, 40, 4)
    cached = alloc.pool.cached_keys()
    # every block filled by the scheduled tokens (31 computed + 1) is cached, the nulled ones included
    assert all((h[j], g) in cached for j in range(8) for g in range(3)) and (h[8], 0) not in cached
    assert alloc.pool.ref_count[cached[(h[0], 0)]] == 0 and alloc.pool.ref_count[cached[(h[0], 2)]] == 1  # nulled: free, still cached
    assert alloc.num_free_blocks == 29 - (2 + 2 + 8)  # 8 blocks a group, 6 of each sliding group null


def test_factory_enables_it_for_sliding_and_full_groups_and_refuses_mismatched_or_chunked_groups():
    """State groups take part in align mode, where they share the attention block size; a state group of
    max_model_len tokens (mamba_cache_mode none's) cannot, and chunked-local hits are not built."""
    alloc = make_allocator(AllocatorConfig("paged", block_size=4, prefix_caching=True), SPEC, 20 * 64, max_model_len=64)
    assert isinstance(alloc, HybridPagedAllocator) and alloc.enable_prefix_caching
    state = PoolSpec((VllmGroup("state", 1, 64, 64, 64, blocks_per_request=1), VllmGroup("full", 2, 4, 32, 32, blocks_per_request=16)), group_size=2, bytes_per_block=64)  # 16 = cdiv(64, 4); 2 x 32 B
    with pytest.raises(KvsimError, match="one block size"):
        HybridPagedAllocator(
            SPEC.__class__(**{**SPEC.__dict__, "pool": state}), 20 * 64, max_model_len=64, enable_prefix_caching=True
        )
    chunked = PoolSpec((VllmGroup("chunked", 1, 4, 32, 32, blocks_per_request=16, window=8), VllmGroup("full", 2, 4, 32, 32, blocks_per_request=16)), group_size=2, bytes_per_block=64)
    with pytest.raises(KvsimError, match="chunked"):
        HybridPagedAllocator(
            SPEC.__class__(**{**SPEC.__dict__, "pool": chunked}), 20 * 64, max_model_len=64, enable_prefix_caching=True
        )


def test_caching_a_steps_output_leaves_the_window_to_the_next_append():
    """Async scheduling: tokens in flight, blocks cached when a step's output returns (`cache_blocks`);
    every append still nulls exactly the blocks wholly before the window of the settled tokens."""
    alloc = make(num_blocks=30)
    a = Sequence(0, 8, 32, token_ids=np.arange(40))
    assert alloc.allocate(a, 8) == 0
    a.num_computed_tokens = 8
    a.num_in_flight_tokens = 2  # two steps in flight: a window's edge falls between the blocks' edges
    for _ in range(20):
        settled = a.num_computed_tokens - a.num_in_flight_tokens
        assert alloc.append_slots(a, 1)  # schedule the next step while the older ones run
        a.num_computed_tokens += 1  # one more in flight, and the oldest step's output returns:
        alloc.cache_blocks(a, a.num_computed_tokens - a.num_in_flight_tokens)  # its blocks are cached
        nulls = [sum(b == 0 for b in t) for t in alloc.block_tables(a)]
        assert nulls == [max(0, settled - 8 + 1) // 4] * 2 + [0], (settled, nulls)


def test_without_prefix_caching_cache_blocks_does_nothing():
    alloc = HybridPagedAllocator(SPEC, 20 * 64, max_model_len=64)
    a = Sequence(0, 8, 8, token_ids=np.arange(16))
    assert alloc.allocate(a, 8) == 0
    a.num_computed_tokens = 8
    alloc.cache_blocks(a, 8)
    assert alloc.pool.cached_keys() == {} and alloc.block_tables(a) == [[1, 2], [3, 4], [5, 6]]


# --- vLLM 0.33's default retention (`prefix_cache_retention_interval` 0) ----------------------------------------


def test_default_retention_caches_only_the_sliding_tail_before_the_prompts_last_token():
    """vLLM's `SlidingWindowManager.reachable_block_mask` with retention 0: a 20-token prompt is replayed from
    at most token 19, whose hit ends at block 19 // 4 = 4; its 2 sliding blocks before (2, 3) are cached, the
    full group's every block."""
    alloc = make(retention=0)
    ids = np.arange(20)
    run_and_free(alloc, seq(0, ids))
    h = block_hashes(ids, 20, 4)
    cached = alloc.pool.cached_keys()
    assert sorted(j for j in range(5) if (h[j], 0) in cached) == [2, 3] == sorted(j for j in range(5) if (h[j], 1) in cached)
    assert all((h[j], 2) in cached for j in range(5))
    b = seq(1, ids)
    assert alloc.allocate(b, 20) == 16  # the same hit as dense retention gives a resend
    # the uncached blocks went to the free queue's head, each group's tail first: 10, 7, 6, 5, 2, 1, 16, ...
    assert alloc.block_tables(b)[:2] == [[0, 0, 3, 4, 10], [0, 0, 8, 9, 7]]


def test_default_retention_a_shorter_prefix_misses_where_dense_retention_hits():
    """A request sharing only the first 12 tokens: dense retention caches sliding blocks 1 and 2 (its hit of
    12 tokens needs them); retention 0 cached only blocks 2 and 3, so the sliding groups miss and so does
    the whole hit."""
    ids = np.arange(20)
    other = np.concatenate([ids[:12], 100 + ids[:8]])
    for retention, hit in ((None, 12), (0, 0)):
        alloc = make(retention=retention)
        run_and_free(alloc, seq(0, ids))
        assert alloc.allocate(seq(1, other), 20) == hit, retention


def test_default_retention_keeps_the_tail_before_a_shared_prefix_junction():
    """vLLM's `shared_prefix_boundary`: the full group hits 12 tokens but the sliding groups do not (their
    tails were not kept), so the junction (12) is pinned: the new request caches the sliding blocks before
    it, and a third request sharing those 12 tokens hits them."""
    ids = np.arange(20)
    alloc = make(num_blocks=40, retention=0)
    run_and_free(alloc, seq(0, ids))
    b_ids = np.concatenate([ids[:12], 100 + ids[:8]])
    run_and_free(alloc, seq(1, b_ids))  # misses (previous test); pins 12: sliding blocks 1, 2 cached
    c_ids = np.concatenate([ids[:12], 200 + ids[:8]])
    assert alloc.allocate(seq(2, c_ids), 20) == 12


def test_a_positive_retention_interval_keeps_a_tail_per_segment_and_is_checked():
    """Interval 8 (2 blocks of 4): per segment the last `need` = 2 blocks, i.e. every block here (vLLM caches
    them all when need >= blocks per segment); the interval must be a multiple of the block size."""
    alloc = make(retention=8)
    run_and_free(alloc, seq(0, np.arange(20)))
    assert len(alloc.pool.cached_keys()) == 15
    with pytest.raises(KvsimError, match="multiple of the block size"):
        make(retention=6)
