"""The paged allocator for mixed models (vLLM's KV cache groups): tables, null blocks, admission, bytes by hand."""

from __future__ import annotations

import pytest

from kvsim.engine.factory import AllocatorConfig, make_allocator
from kvsim.size.kv_cache_spec import KVCacheGroupSpec, KVCacheSpec, PoolSpec, VllmGroup
from kvsim.engine.paged.kv_cache_manager import HybridPagedAllocator
from kvsim.engine.sequence import Sequence

# 3 sliding layers (window 8) and 2 full layers, 8 B per token per layer, block_size 4: every page 32 B.
# vLLM's grouping: group_size 2, so the sliding layers form 2 groups (2 layers, 1 layer + 1 padding layer)
# and the full layers 1 group; a block id spans 2 layer tensors: 64 B. A request of 64 tokens: cdiv(64, 4) = 16
# full blocks.
POOL = PoolSpec(
    (
        VllmGroup("sliding", 2, 4, 32, 32, blocks_per_request=5, window=8),
        VllmGroup("sliding", 1, 4, 32, 32, blocks_per_request=5, window=8),
        VllmGroup("full", 2, 4, 32, 32, blocks_per_request=16),
    ),
    group_size=2,
    bytes_per_block=64,  # 2 layers x 32 B
)
SPEC = KVCacheSpec(
    groups=(KVCacheGroupSpec("sliding", 3, bytes_per_token=24, window=8), KVCacheGroupSpec("full", 2, bytes_per_token=16)),
    block_size=4,
    dtype="bf16",
    dtype_bytes=2,
    num_kv_heads=1,
    head_dim=2,
    num_attention_layers=5,
    pool=POOL,
)
TOKEN_BYTES = 2 * 8 + 1 * 8 + 2 * 8  # one token across the three groups' real layers


def make(num_blocks: int = 20, extra: int = 10, **kwargs) -> HybridPagedAllocator:
    return HybridPagedAllocator(SPEC, num_blocks * 64 + extra, max_model_len=kwargs.pop("max_model_len", 64), **kwargs)


def decode(alloc, seq, steps: int) -> None:
    for _ in range(steps):
        assert alloc.append_slots(seq, 1)
        seq.num_computed_tokens += 1


def test_pool_is_budget_over_bytes_per_block_with_block_zero_null():
    alloc = make()
    assert (alloc.num_blocks, alloc.bytes_per_block, alloc.num_free_blocks) == (20, 64, 19)


def test_every_group_gets_its_own_table_and_blocks_leave_the_window_as_null_blocks():
    alloc = make()
    seq = Sequence(0, 10, 10)
    assert alloc.allocate(seq, 10) == 0
    assert alloc.block_tables(seq) == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert alloc.num_free_blocks == 10
    seq.num_computed_tokens = 10
    decode(alloc, seq, 6)  # the last append saw 15 computed: tokens 0-7 lie before the window of token 15
    tables = alloc.block_tables(seq)
    assert [t[:2] for t in tables] == [[0, 0], [0, 0], [7, 8]]
    assert [len(t) for t in tables] == [4, 4, 4]
    assert alloc.num_free_blocks == 19 - 4 - 4 - 2 - 2 + 4  # 12 held, 4 nulled and returned
    assert alloc.block_table(seq)[:2] == [None, None]
    assert list(alloc.slot_mapping(seq, 6, 10)) == [-1, -1, 3 * 4 + 0, 3 * 4 + 1]


def test_breakdown_by_hand_with_padding_named():
    alloc = make()
    seq = Sequence(0, 10, 10)
    alloc.allocate(seq, 10)
    b = alloc.breakdown()
    # 12 slots allocated per group, none computed, all before the final length 10 + 10 - 1 = 19: reservation
    assert b.reservation_bytes == 12 * TOKEN_BYTES == 480
    assert b.padding_bytes == 3 * 32  # the padding layer's page in each of group 1's 3 blocks
    assert b.internal_fragmentation_bytes == 96 + 64 + 10  # padding, the null block, the remainder
    assert b.free_bytes == 10 * 64
    seq.num_computed_tokens = 10
    decode(alloc, seq, 6)
    b = alloc.breakdown()
    # sliding groups hold tokens 8-15 (2 blocks), the full group tokens 0-15: all computed
    assert b.token_states_bytes == 8 * (16 + 8) + 16 * 16 == 448
    assert b.reservation_bytes == 0
    assert b.padding_bytes == 2 * 32
    alloc.free(seq)
    b = alloc.breakdown()
    assert (b.token_states_bytes, b.padding_bytes, b.free_bytes) == (0, 0, 19 * 64)


def test_a_refused_growth_still_nulls_what_left_the_window():
    alloc = make(num_blocks=13)  # 12 usable
    seq = Sequence(0, 12, 20)
    assert alloc.allocate(seq, 12) == 0  # 3 groups x 3 blocks
    seq.num_computed_tokens = 12
    hog = Sequence(1, 4, 0)
    assert alloc.allocate(hog, 3) == 0  # 3 more: the pool is full
    assert alloc.num_free_blocks == 0
    # 12 computed: tokens 0-4 left the window, block 0 of each sliding group is nulled (2 back), but the
    # growth to 13 tokens needs 3 blocks
    assert not alloc.append_slots(seq, 1)
    assert [t[0] for t in alloc.block_tables(seq)] == [0, 0, 7]
    assert alloc.num_free_blocks == 2


def test_full_sequence_admission_caps_window_groups_at_max_admission_blocks():
    seq = Sequence(0, 40, 10)  # 40 tokens: 10 blocks a group uncapped (30), 5 + 5 + 10 = 20 capped
    alloc = make(num_blocks=21)  # 20 usable
    assert alloc.allocate(seq, 4, num_tokens=40, full_sequence_must_fit=True) == 0
    assert alloc.num_free_blocks == 20 - 3  # only the first chunk is allocated
    small = make(num_blocks=20)  # 19 usable
    assert small.allocate(seq, 4, num_tokens=40, full_sequence_must_fit=True) is None
    assert small.num_free_blocks == 19


def test_watermark_counts_blocks_of_the_pool():
    alloc = make(num_blocks=17, watermark=0.1)  # 16 usable, watermark int(1.7) = 1
    assert alloc.allocate(Sequence(0, 20, 0), 20) == 0  # 3 x 5 blocks + 1 <= 16
    alloc = make(num_blocks=16, watermark=0.1)  # 15 usable, watermark 1
    assert alloc.allocate(Sequence(0, 20, 0), 20) is None
    assert alloc.allocate(Sequence(0, 20, 0), 20, apply_watermark=False) == 0


def test_can_ever_fit_by_the_admission_bound_or_unchunked_peak():
    alloc = make(num_blocks=21, max_model_len=64)  # 20 usable
    assert alloc.can_ever_fit(Sequence(0, 8, 32))  # 8 + 32 - 1 = 39 tokens: 5 + 5 + cdiv(39, 4) = 10 capped
    assert not alloc.can_ever_fit(Sequence(0, 8, 58))  # 8 + 58 - 1 = 65 > max_model_len 64
    # 8 + 52 - 1 = 59 tokens: capped 5 + 5 + 15 = 25 blocks. Alone, unchunked: the prompt takes 3 x 2 blocks; the decode
    # peak is where a block opens, at 56 computed (room for 57): 15 full blocks + 2 x (15 - 49 // 4) = 21
    assert not alloc.can_ever_fit(Sequence(1, 8, 52))
    assert make(num_blocks=22, max_model_len=64).can_ever_fit(Sequence(1, 8, 52))  # 21 usable


def test_factory_builds_it_for_a_spec_with_vllm_groups():
    assert isinstance(make_allocator(AllocatorConfig("paged", block_size=4), SPEC, 20 * 64, max_model_len=64), HybridPagedAllocator)


@pytest.mark.parametrize("model", ["gemma-3-27b", "gpt-oss-120b", "gemma-2-9b", "qwen3-next-80b-a3b"])
def test_a_replayed_mixed_model_gets_vllm_num_gpu_blocks(model):
    """The replay's pool and `kvsim size`'s vLLM line come from the same arithmetic."""
    from kvsim.models.catalogue import resolve_model
    from kvsim.size.sizing import kv_cache_spec
    from kvsim.size.vllm import VllmSettings, vllm_layers, vllm_startup
    from kvsim.size.vllm_pool import with_pool

    m = resolve_model(model)
    spec = kv_cache_spec(m)
    settings = VllmSettings(async_scheduling=False)
    budget = 20 << 30
    alloc = make_allocator(AllocatorConfig("paged"), with_pool(m, spec, budget, 32768, settings), budget, max_model_len=32768)
    startup = vllm_startup(vllm_layers(m, spec), budget, 32768, 16, settings)
    assert alloc.num_blocks == startup.num_blocks
    assert [len(t) for t in alloc.coordinator.new_tables()] == [0] * startup.num_groups


def test_blocks_leave_the_window_against_settled_tokens_not_those_in_flight():
    """Async scheduling: a step in flight still reads its window, so the tokens it computes do not count
    (vLLM: `processed_computed_tokens` = computed - num_in_flight_tokens)."""
    alloc = make()
    seq = Sequence(0, 12, 20)
    alloc.allocate(seq, 12)
    seq.num_computed_tokens, seq.num_in_flight_tokens = 12, 12  # the prefill's output has not returned
    assert alloc.append_slots(seq, 1)
    assert [t[0] for t in alloc.block_tables(seq)] == [1, 4, 7]  # nothing nulled: 0 tokens settled
    seq.num_in_flight_tokens = 1  # the prefill returned; a decode is in flight
    assert alloc.append_slots(seq, 1)
    assert [t[0] for t in alloc.block_tables(seq)] == [0, 0, 7]  # 11 settled: tokens 0-3 left the window
