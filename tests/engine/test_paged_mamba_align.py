"""mamba_cache_mode align (a hybrid model with prefix caching, as vllm serve runs it): state tables, hits,
checkpoints and frees by hand, as vLLM 0.33's `MambaManager`."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.engine.paged.kv_cache_manager import HybridPagedAllocator
from kvsim.engine.paged.kv_cache_utils import block_hashes
from kvsim.engine.paged.single_type_kv_cache_manager import (
    is_mamba_prefill_checkpoint_valid,
    mamba_prefill_checkpoint_position,
)
from kvsim.engine.sequence import Sequence
from kvsim.size.kv_cache_spec import KVCacheGroupSpec, KVCacheSpec, PoolSpec, VllmGroup
from .pool_invariants import assert_pool_matches

# 2 state layers and 2 full layers, block_size 4 (align mode: the state groups take the attention block size),
# every page 32 B, group_size 2: one state group (block i holds the state after 4 (i + 1) tokens) and one full
# group, a block id 64 B. Group order: state, then full (as vLLM lists qwen3-next's groups).
# blocks_per_request at max_model_len 64: cdiv(64, 4) = 16 for the full group; 2 for a state group in align mode
# (a running state and a checkpoint); neither group is capped at admission, so only the size report reads them.
POOL = PoolSpec((VllmGroup("state", 2, 4, 32, 32, blocks_per_request=2), VllmGroup("full", 2, 4, 32, 32, blocks_per_request=16)),
                group_size=2, bytes_per_block=64)
SPEC = KVCacheSpec(
    groups=(KVCacheGroupSpec("state", 2, state_bytes=64), KVCacheGroupSpec("full", 2, bytes_per_token=16)),
    block_size=4,
    dtype="bf16",
    dtype_bytes=2,
    num_kv_heads=1,
    head_dim=2,
    num_attention_layers=2,
    pool=POOL,
)


def make(alignment: int = 2, num_blocks: int = 17, retention: int | None = 0) -> HybridPagedAllocator:
    return HybridPagedAllocator(SPEC, num_blocks * 64, max_model_len=64, enable_prefix_caching=True,
                                prefix_cache_retention_interval=retention, mamba_checkpoint_alignment=alignment)


def seq(seq_id: int, prompt: int = 10, max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id, prompt, max_tokens, token_ids=np.arange(prompt + max_tokens, dtype=np.int64))


def test_checkpoint_position_and_validity_by_hand():
    assert mamba_prefill_checkpoint_position(10, 4) == 8  # the last boundary strictly below the end
    assert mamba_prefill_checkpoint_position(8, 4) == 4  # the last token is recomputed for its logits
    assert mamba_prefill_checkpoint_position(1, 4) == 0
    assert is_mamba_prefill_checkpoint_valid(0, 10, 8, 4, 2)  # 8 is inside [0, 10), 2 blocks on, 8 % 2 == 0
    assert not is_mamba_prefill_checkpoint_valid(0, 10, 8, 4, 3)  # 8 is no multiple of the kernel's 3
    assert not is_mamba_prefill_checkpoint_valid(0, 10, 8, 4, 0)  # the layers export no checkpoints
    assert not is_mamba_prefill_checkpoint_valid(8, 10, 8, 4, 2)  # the chunk starts at the checkpoint
    assert not is_mamba_prefill_checkpoint_valid(2, 10, 8, 4, 2)  # a chunk starting mid-block


def test_a_prefill_holds_its_checkpoint_and_running_state_and_caches_the_checkpoint():
    alloc = make()
    a = seq(0)
    assert alloc.mamba_block_size == 4 and alloc.mamba_checkpoint_alignment == 2
    assert alloc.allocate(a, 10) == 0
    # state: cdiv(10, 4) = 3 blocks; block 0 is never needed (null), block 1 the checkpoint (state after 8),
    # block 2 the running state (after 10): 2 new. Full attention: 3 new. 16 usable - 5 = 11 free.
    assert alloc.block_tables(a) == [[0, 1, 2], [3, 4, 5]]
    assert alloc.num_free_blocks == 11
    # cached within the scheduled 10 tokens: the full group's blocks 0 and 1; the state group only the one
    # ending on the prompt's reachable boundary (10 - 1 = 9 -> block 9 // 4 - 1 = 1), under retention 0
    h = block_hashes(a.token_ids, 18, 4)
    cached = alloc.pool.cached_keys()
    assert cached[(h[0], 1)] == 3 and cached[(h[1], 1)] == 4
    assert cached[(h[1], 0)] == 1 and (h[0], 0) not in cached
    # the first decode step: the checkpoint (before the last computed token's block) is freed, still cached
    a.num_computed_tokens = 10
    assert alloc.append_slots(a, 1)
    assert alloc.block_tables(a) == [[0, 0, 2], [3, 4, 5]]
    assert alloc.num_free_blocks == 12 and alloc.pool.ref_count[cached[(h[1], 0)]] == 0
    assert alloc.breakdown().token_states_bytes == 64 + 10 * 16  # one state block, 10 tokens of full attention


def test_without_checkpoints_a_chunk_holds_only_its_running_state():
    alloc = make(alignment=0)
    a = seq(0)
    assert alloc.allocate(a, 8) == 0  # the scheduler stops the chunk at 8 (the last boundary before 10)
    assert alloc.block_tables(a) == [[0, 1], [2, 3]]  # state after 8 only: 1 new state block
    a.num_computed_tokens = 8
    assert alloc.append_slots(a, 2)  # the rest of the prompt: a new running state, block 1 kept until settled
    assert alloc.block_tables(a) == [[0, 1, 4], [2, 3, 5]]
    a.num_computed_tokens = 10
    assert alloc.append_slots(a, 1)  # settled past 8 + 1: the state after 8 is freed (it stays cached)
    assert alloc.block_tables(a) == [[0, 0, 4], [2, 3, 5]]


def test_a_hit_is_one_cached_state_after_null_blocks_and_waits_a_step_when_cached_in_this_one():
    alloc = make()
    a, b = seq(0), seq(1)
    assert alloc.allocate(a, 10) == 0
    a.num_computed_tokens = 10
    assert alloc.append_slots(a, 1)  # frees the checkpoint, block 1 (cached)
    # b's 10-token prompt hits 8 tokens: full blocks 3, 4 and the state after 8, block 1. It was cached in this
    # step (by a's allocation), which a new request cannot rely on: no allocation, nothing changed.
    assert alloc.allocate(b, 10) is None
    assert alloc.num_free_blocks == 12
    alloc.new_step_starts()
    assert alloc.allocate(b, 10) == 8
    # state: [null, hit] + 1 new running state (no checkpoint: the chunk starts at 8); full: 3, 4 + 1 new
    assert alloc.block_tables(b) == [[0, 1, 6], [3, 4, 7]]
    assert alloc.pool.blocks[1].ref_count == 1 and alloc.pool.blocks[3].ref_count == 2
    assert alloc.num_free_blocks == 12 - 3  # block 1 revived, 6 and 7 new
    b.num_computed_tokens = 10
    assert alloc.append_slots(b, 1)  # the hit state is behind the settled token's block: freed again
    assert alloc.block_tables(b) == [[0, 0, 6], [3, 4, 7]]
    alloc.free(a)
    alloc.free(b)
    assert alloc.num_free_blocks == 16


def test_decode_moves_the_running_state_to_a_new_block_and_frees_the_old_one_a_step_later():
    alloc = make(alignment=0)
    a = seq(0, prompt=3, max_tokens=12)
    assert alloc.allocate(a, 3) == 0
    a.num_computed_tokens = 3
    tables = []
    for _ in range(4):  # decode tokens 3 .. 6
        assert alloc.append_slots(a, 1)
        tables.append(alloc.block_tables(a)[0])
        a.num_computed_tokens += 1
    # at 4 computed + 1: a new block for the state after 5 tokens; at 5 settled, the state after 4 (block 1)
    # is behind the last token's block: freed and nulled
    assert tables == [[1], [1, 3], [0, 3], [0, 3]]


def test_dense_retention_caches_every_block_boundary_state():
    alloc = make(alignment=0, retention=None)
    a = seq(0, prompt=13)
    assert alloc.allocate(a, 4) == 0
    a.num_computed_tokens = 4
    assert alloc.append_slots(a, 4)
    h = block_hashes(a.token_ids, 21, 4)
    cached = alloc.pool.cached_keys()
    assert (h[0], 0) in cached and (h[1], 0) in cached  # the states after 4 and 8
    retained = make(alignment=0)
    r = seq(0, prompt=13)
    assert retained.allocate(r, 4) == 0
    r.num_computed_tokens = 4
    assert retained.append_slots(r, 4)
    assert (h[0], 0) not in retained.pool.cached_keys()  # retention 0: only the prompt's 12
    assert (h[1], 0) not in retained.pool.cached_keys()


def test_align_mode_runs_no_decode_runs():
    assert make().max_decode_run(1) == 1 and make().decode_frees_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_the_state_group_block_follows_the_mode(caching):
    alloc = HybridPagedAllocator(SPEC, 17 * 64, max_model_len=64, enable_prefix_caching=caching)
    assert alloc.mamba_block_size == (4 if caching else 0)


# Two state groups and a full group, as a random sequence of admissions (with shared prefixes), chunks of any
# length (the allocator's side of align mode takes them all), settled steps and frees.
POOL3 = PoolSpec((VllmGroup("state", 2, 4, 32, 32, blocks_per_request=2), VllmGroup("state", 2, 4, 32, 32, blocks_per_request=2),
                  VllmGroup("full", 2, 4, 32, 32, blocks_per_request=16)), group_size=2, bytes_per_block=64)
SPEC3 = KVCacheSpec(
    groups=(KVCacheGroupSpec("state", 4, state_bytes=128), KVCacheGroupSpec("full", 2, bytes_per_token=16)),
    block_size=4, dtype="bf16", dtype_bytes=2, num_kv_heads=1, head_dim=2, num_attention_layers=2, pool=POOL3,
)


def run_random_ops(alloc: HybridPagedAllocator, ops, check, *, hit_multiple: int = 1,
                   computed_below_hit: bool = False) -> dict[int, Sequence]:
    """`ops` as (op, a, c) on `alloc`, `check(live)` after each: op 0 admits a prompt of `a` tokens sharing up to
    4 * (c % 7) of one of 3 prefixes (a step begins first half the time; its hit a multiple of `hit_multiple`, short
    of the prompt), 1 and 2 compute a chunk of up to `a` tokens with one step in flight half the time (freed if it
    cannot grow), 3 frees one; finished requests are freed first. `computed_below_hit`: every fifth admission keeps
    its computed tokens at 0, below its hit (a caller that has not set them yet). Returns the requests still live."""
    live: dict[int, Sequence] = {}
    for i, (op, a, c) in enumerate(ops):
        for s in [s for s in live.values() if s.num_computed_tokens >= s.num_final_tokens]:
            alloc.free(live.pop(s.seq_id))
        if op == 0:
            output = c % 16
            ids = 10_000 * (i + 1) + np.arange(a + output, dtype=np.int64)
            shared = min(a, 4 * (c % 7))
            ids[:shared] = 1_000 * (c % 3 + 1) + np.arange(shared)
            s = Sequence(i, a, output, token_ids=ids)
            if c % 2:  # a step begins: states cached in the last one may be hit (align mode)
                alloc.new_step_starts()
            hit = alloc.allocate(s, 1 + c % a)
            if hit is not None:
                assert hit % hit_multiple == 0 and hit < a, hit
                live[i] = s
                if not computed_below_hit or c % 5:
                    s.num_computed_tokens = hit + min(1 + c % a, a - hit)
        elif op in (1, 2) and live:
            s = live[sorted(live)[c % len(live)]]
            n = max(1, min(a, s.num_final_tokens - s.num_computed_tokens))
            s.num_in_flight_tokens = c % 2
            if alloc.append_slots(s, n):
                s.num_computed_tokens += n
                alloc.cache_blocks(s, s.num_computed_tokens - s.num_in_flight_tokens)
            else:
                alloc.free(live.pop(s.seq_id))
        elif op == 3 and live:
            alloc.free(live.pop(sorted(live)[c % len(live)]))
        check(live)
    return live


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(6, 60),
    alignment=st.sampled_from([0, 1, 2, 4]),
    retention=st.sampled_from([0, None]),
    ops=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 24), st.integers(0, 9999)), min_size=1, max_size=30),
)
def test_random_operations_keep_ref_counts_free_counts_cache_keys_and_bytes(num_blocks, alignment, retention, ops):
    """A block is held by exactly the table entries that name it (its ref count), the free count is the rest,
    every cached block is under its own key, a request's held count is its real blocks, a state table holds at
    most a hit, a checkpoint, the previous and the new running state, and everything comes back at the end."""
    alloc = HybridPagedAllocator(SPEC3, num_blocks * 64, max_model_len=48, enable_prefix_caching=True,
                                 prefix_cache_retention_interval=retention, mamba_checkpoint_alignment=alignment)
    null = alloc.pool.null_block

    def check(live: dict[int, Sequence]) -> None:
        held = {}
        for s in live.values():
            req = alloc._reqs[s]
            for g, table in enumerate(req.tables):
                real = [b for b in table if b != null]
                assert req.held[g] == len(real)
                if POOL3.groups[g].kind == "state":
                    assert len(real) <= 4, table
                for b in real:
                    held[b] = held.get(b, 0) + 1
        assert_pool_matches(alloc, held)
        b = alloc.breakdown()
        assert b.free_bytes >= 0 and min(b.token_states_bytes, b.reservation_bytes) >= 0

    live = run_random_ops(alloc, ops, check, hit_multiple=4)
    for s in list(live.values()):
        alloc.free(s)
    assert alloc.num_free_blocks == alloc.pool.num_usable_blocks
    assert all(b.ref_count == 0 for b in alloc.pool.blocks[1:])
