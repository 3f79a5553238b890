"""Flat slab allocators: reserve policies, byte breakdown by hand, external fragmentation, state slots."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.engine.factory import AllocatorConfig, make_allocator
from kvsim.engine.flat.flat_allocator import FlatAllocator
from kvsim.size.kv_cache_spec import KVCacheGroupSpec, KVCacheSpec
from kvsim.engine.sequence import Sequence

# 2 (K,V) * 1 layer * 1 head * 4 dims * 2 bytes = 16 bytes per token
SPEC = KVCacheSpec.uniform(num_layers=1, num_kv_heads=1, head_dim=4, dtype_bytes=2)
BPT = 16


def make_flat(num_slots: int, *, extra_bytes: int = 0, max_model_len: int = 64, **kwargs) -> FlatAllocator:
    return FlatAllocator(SPEC, num_slots * BPT + extra_bytes, max_model_len=max_model_len, **kwargs)


def seq(seq_id: int, prompt: int, output: int) -> Sequence:
    return Sequence(seq_id, prompt, output)


@pytest.mark.parametrize(
    ("reserve", "prompt", "output", "expected"),
    [
        ("max", 10, 7, 64),
        ("pow2", 10, 8, 32),  # 10 + 8 - 1 = 17 tokens of KV -> 32
        ("pow2", 10, 7, 16),  # 10 + 7 - 1 = 16 is already a power of two
        ("pow2", 40, 20, 64),  # 40 + 20 - 1 = 59 -> 64 = next power of two, also the cap
        ("oracle", 10, 7, 16),  # 10 + 7 - 1: the last sampled token's KV is never written
    ],
)
def test_reserve_policies(reserve, prompt, output, expected):
    alloc = make_flat(200, reserve=reserve)
    s = seq(1, prompt, output)
    assert alloc.reserved_tokens(s) == expected
    assert alloc.allocate(s, prompt) == 0
    assert alloc.slab(s) == (0, expected)


def test_pow2_is_capped_at_max_model_len():
    alloc = make_flat(200, reserve="pow2", max_model_len=48)
    assert alloc.reserved_tokens(seq(1, 30, 10)) == 48  # 30 + 10 - 1 = 39: next power of two would be 64
    # 40 + 9 - 1 = 48 tokens of KV fit max_model_len 48; 40 + 10 - 1 = 49 do not
    assert alloc.can_ever_fit(seq(2, 40, 9)) and not alloc.can_ever_fit(seq(3, 40, 10))


def test_breakdown_by_hand_with_remainder_bytes():
    # 100 slots + 5 stray bytes; pow2: a 10-token prompt sampling 8 holds 10 + 8 - 1 = 17 tokens of KV, reserves 32 slots.
    alloc = make_flat(100, extra_bytes=5, reserve="pow2")
    assert alloc.num_slots == 100
    s = seq(1, 10, 8)
    assert alloc.allocate(s, 10) == 0
    b = alloc.breakdown()
    assert (b.token_states_bytes, b.reservation_bytes) == (0, 17 * BPT)
    s.num_computed_tokens = 10
    b = alloc.breakdown()
    assert b.budget_bytes == 1605
    assert b.token_states_bytes == 10 * BPT
    assert b.reservation_bytes == 7 * BPT
    assert b.internal_fragmentation_bytes == (32 - 17) * BPT + 5
    assert b.external_fragmentation_bytes == 0
    assert b.free_bytes == 68 * BPT
    alloc.free(s)
    b = alloc.breakdown()
    assert (b.token_states_bytes, b.reservation_bytes, b.internal_fragmentation_bytes) == (0, 0, 5)
    assert b.free_bytes == 100 * BPT


def test_no_growth_past_the_slab_and_decode_batch():
    alloc = make_flat(100, reserve="oracle")
    a, b = seq(1, 4, 2), seq(2, 3, 5)  # slabs of 4 + 2 - 1 = 5 and 3 + 5 - 1 = 7 tokens
    assert alloc.allocate(a, 4) == 0 and alloc.allocate(b, 3) == 0
    a.num_computed_tokens, b.num_computed_tokens = 4, 3
    assert alloc.append_slots(a, 1) and not alloc.append_slots(a, 2)
    a.num_computed_tokens = 5  # a has written its last KV (its 2nd sampled token's is never written)
    assert alloc.append_decode_in_order([a, b]) == 0
    assert alloc.append_slots(b, 4) and not alloc.append_slots(b, 5)


def test_allocate_refuses_more_than_the_slab_and_too_long_requests():
    alloc = make_flat(500, reserve="oracle", max_model_len=64)
    assert alloc.allocate(seq(1, 10, 5), 15) is None  # more than its 10 + 5 - 1 = 14 tokens of KV
    too_long = seq(2, 60, 6)  # 60 + 6 - 1 = 65 > max_model_len 64
    assert not alloc.can_ever_fit(too_long) and alloc.allocate(too_long, 60) is None
    assert alloc.num_live == 0 and alloc.arena.free_total == 500


def test_external_fragmentation_counts_all_free_bytes_for_the_waiting_head():
    # four oracle slabs of 5 + 5 - 1 = 9 in 40 slots, at 0, 9, 18, 27; free the 1st and 3rd:
    # holes [0, 9), [18, 27), [36, 40): 9 + 9 + 4 = 22 free, largest hole 9.
    alloc = make_flat(40, reserve="oracle")
    seqs = [seq(i, 5, 5) for i in range(4)]
    for s in seqs:
        assert alloc.allocate(s, 5) == 0
    alloc.free(seqs[0])
    alloc.free(seqs[2])
    head = seq(9, 10, 5)  # needs 10 + 5 - 1 = 14 > largest hole 9, <= free total 22
    assert alloc.allocate(head, 10) is None
    b = alloc.breakdown(head)
    assert b.external_fragmentation_bytes == 22 * BPT and b.free_bytes == 0
    assert b.reservation_bytes == 18 * BPT  # two live slabs of 9, nothing computed yet
    small = seq(10, 5, 5)  # 9 fits a hole: no external fragmentation
    assert alloc.breakdown(small).external_fragmentation_bytes == 0
    big = seq(11, 20, 5)  # 20 + 5 - 1 = 24 > free total 22: not fragmentation, just full
    b = alloc.breakdown(big)
    assert b.external_fragmentation_bytes == 0 and b.free_bytes == 22 * BPT


def test_buddy_rounding_is_internal_fragmentation():
    alloc = make_flat(64, reserve="oracle", placement="buddy")
    s = seq(1, 10, 8)  # 10 + 8 - 1 = 17 tokens of KV -> a 32-slot buddy block
    assert alloc.allocate(s, 10) == 0
    assert alloc.slab(s) == (0, 17)
    b = alloc.breakdown()
    assert b.internal_fragmentation_bytes == 15 * BPT and b.free_bytes == 32 * BPT
    head = seq(2, 20, 0)  # 20 -> 32: fits the other half
    assert alloc.breakdown(head).external_fragmentation_bytes == 0


def test_buddy_external_fragmentation_uses_block_footprint():
    alloc = make_flat(64, reserve="oracle", placement="buddy")
    seqs = [seq(i, 16, 0) for i in range(4)]
    for s in seqs:
        alloc.allocate(s, 16)
    alloc.free(seqs[1])
    alloc.free(seqs[2])  # [16,32) and [32,48) free but not buddies
    b = alloc.breakdown(seq(9, 20, 0))  # needs a 32 block; 32 free in two 16s
    assert b.external_fragmentation_bytes == 32 * BPT and b.free_bytes == 0
    b = alloc.breakdown(seq(10, 33, 0))  # needs 64 > 32 free: just full
    assert b.external_fragmentation_bytes == 0


def test_slot_mapping_is_the_slab_slice():
    alloc = make_flat(100, reserve="oracle")
    a, b = seq(1, 4, 2), seq(2, 3, 5)
    alloc.allocate(a, 4)
    alloc.allocate(b, 3)
    assert alloc.slab(b) == (5, 7)  # after a's 4 + 2 - 1 = 5 slots, b's 3 + 5 - 1 = 7
    m = alloc.slot_mapping(b, 2, 5)
    assert m.dtype == np.int64 and m.tolist() == [7, 8, 9]  # 5 + 2 .. 5 + 4
    assert alloc.slot_mapping(a, 0, 0).shape == (0,)


def test_state_layers_reserve_state_slots_per_request():
    spec = KVCacheSpec(
        groups=(
            KVCacheGroupSpec("full", 1, bytes_per_token=16),
            KVCacheGroupSpec("state", 2, state_bytes=40),
        ),
        block_size=16,
        dtype="bf16",
        dtype_bytes=2,
        num_kv_heads=1,
        head_dim=4,
        num_attention_layers=1,
    )
    alloc = FlatAllocator(spec, 100 * 16, max_model_len=64, reserve="oracle")
    assert alloc.num_state_slots == 3 and alloc.state_padding_bytes == 8
    s = seq(1, 10, 5)
    alloc.allocate(s, 10)
    assert alloc.slab(s) == (0, 17)  # 10 + 5 - 1 = 14 token slots + 3 state slots
    s.num_computed_tokens = 10
    b = alloc.breakdown()
    assert b.token_states_bytes == 10 * 16 + 40
    assert b.reservation_bytes == 4 * 16  # 14 - 10
    assert b.internal_fragmentation_bytes == 8
    assert b.free_bytes == 83 * 16  # 100 - 17


def test_sliding_layers_keep_every_token():
    spec = KVCacheSpec(
        groups=(
            KVCacheGroupSpec("full", 1, bytes_per_token=16),
            KVCacheGroupSpec("sliding", 1, bytes_per_token=16, window=4),
        ),
        block_size=16,
        dtype="bf16",
        dtype_bytes=2,
        num_kv_heads=1,
        head_dim=4,
        num_attention_layers=2,
    )
    alloc = FlatAllocator(spec, 1000, max_model_len=64, reserve="oracle")
    assert alloc.num_slots == 1000 // 32 and alloc.num_state_slots == 0


def test_factory_builds_flat_with_config():
    cfg = AllocatorConfig("flat", reserve="pow2", placement="best-fit")
    alloc = make_allocator(cfg, SPEC, 100 * BPT, max_model_len=64)
    assert isinstance(alloc, FlatAllocator)
    assert (alloc.reserve, alloc.placement, alloc.arena.placement) == ("pow2", "best-fit", "best-fit")
    assert cfg.label == "flat-pow2-best-fit"


def test_labels_tell_every_configuration_apart():
    # Two paged allocators that differ only in watermark are two configurations (a workload may compare them).
    configs = [
        AllocatorConfig("paged", block_size=16),
        AllocatorConfig("paged", block_size=16, watermark=0.05),
        AllocatorConfig("paged", block_size=16, watermark=0.01, prefix_caching=True),
        AllocatorConfig("paged", block_size=16, prefix_caching=True),
    ]
    # the default watermark is vLLM's, 0
    assert [c.label for c in configs] == ["paged-16", "paged-16-wm0.05", "paged-16-wm0.01+prefix", "paged-16+prefix"]
