"""`can_ever_fit` agrees with running the request alone, for random paged and flat configurations.

A request it accepts must be admittable and run to its final length on an empty allocator (else the scheduler
would wait for it forever), and one it refuses must fail there (else it would be rejected for nothing).
"""

from __future__ import annotations

import random

import pytest

from kvsim.engine.allocator import KVAllocator
from kvsim.engine.flat.flat_allocator import FlatAllocator
from kvsim.size.kv_cache_spec import KVCacheGroupSpec, KVCacheSpec, PoolSpec, VllmGroup
from kvsim.engine.paged.unitary_kv_cache_manager import PagedAllocator
from kvsim.engine.paged.kv_cache_manager import HybridPagedAllocator
from kvsim.engine.sequence import Sequence


def runs_alone(alloc: KVAllocator, seq: Sequence) -> bool:
    """Admit the whole prompt, decode one token a step to the final length, free; False at the first refusal.
    Alone, nothing else runs: the watermark does not apply (vLLM)."""
    if alloc.allocate(seq, seq.num_prompt_tokens, apply_watermark=False) is None:
        return False
    seq.num_computed_tokens = seq.num_prompt_tokens
    while seq.num_computed_tokens < seq.num_final_tokens:
        if not alloc.append_slots(seq, 1):
            alloc.free(seq)
            return False
        seq.num_computed_tokens += 1
    alloc.free(seq)
    return True


def random_paged(rng: random.Random) -> PagedAllocator:
    """One KV cache group (a mixed model's groups are HybridPagedAllocator's, tested in test_paged_hybrid)."""
    spec = KVCacheSpec.uniform(num_layers=1, num_kv_heads=1, head_dim=rng.choice([2, 4, 6]), block_size=rng.choice([1, 2, 4, 16]))
    watermark = rng.choice([0.0, 0.01, 0.1, 0.3])
    return PagedAllocator(spec, rng.randint(200, 3000), max_model_len=140, watermark=watermark)


def random_flat(rng: random.Random) -> FlatAllocator:
    groups = (KVCacheGroupSpec("full", 1, bytes_per_token=rng.choice([8, 16])),)
    if rng.random() < 0.3:
        groups += (KVCacheGroupSpec("state", 1, state_bytes=rng.randint(1, 50)),)
    spec = KVCacheSpec(groups, 16, "bf16", 2, 1, 4, 1)
    return FlatAllocator(
        spec,
        rng.randint(0, 2000),
        max_model_len=rng.randint(1, 150),
        reserve=rng.choice(["max", "pow2", "oracle"]),
        placement=rng.choice(["first-fit", "best-fit", "buddy"]),
    )


@pytest.mark.parametrize("make", [random_paged, random_flat], ids=["paged", "flat"])
def test_can_ever_fit_is_running_alone(make):
    rng = random.Random(3)
    verdicts = set()
    for case in range(2000):
        alloc = make(rng)
        seq = Sequence(case, rng.randint(1, 70), rng.randint(0, 70))
        fits = alloc.can_ever_fit(seq)
        assert fits == runs_alone(alloc, seq), (case, alloc.spec.groups, alloc.budget_bytes, seq)
        verdicts.add(fits)
    assert verdicts == {True, False}  # both answers were exercised


# Every layer slides (Mistral-7B-v0.1 style): vLLM's one sliding group, window 5, block size 4, 64-byte blocks.
SLIDING = KVCacheSpec(
    (KVCacheGroupSpec("sliding", 1, bytes_per_token=16, window=5),), 4, "bf16", 2, 1, 4, 1,
    pool=PoolSpec((VllmGroup("sliding", 1, 4, 64, 64, blocks_per_request=3, window=5),), 1, 64),
)


def test_sliding_window_only_model_frees_blocks_outside_the_window():
    alloc = HybridPagedAllocator(SLIDING, 8 * 64, max_model_len=200, watermark=0.0)  # 8 blocks: 7 usable, 0 is null
    seq = Sequence(0, 16, 41)  # KV for 16 + 41 - 1 = 56 tokens: 40 decodes
    assert alloc.allocate(seq, 16) == 0 and alloc.num_free_blocks == 3
    seq.num_computed_tokens = 16
    held = []
    for _ in range(40):
        assert alloc.append_slots(seq, 1)
        seq.num_computed_tokens += 1
        held.append(7 - alloc.num_free_blocks)
    # Writing token c needs tokens [c - 4, c]: block j goes once (j + 1) * 4 <= c - 4 + 1, which always leaves
    # 2 blocks, never the 14 that 56 tokens take; the first 12 are gone at the end.
    assert held == [2] * 40
    assert alloc.block_table(seq)[:12] == [None] * 12 and None not in alloc.block_table(seq)[12:]
    alloc.free(seq)
    assert alloc.num_free_blocks == 7


def test_slot_mapping_marks_positions_the_window_freed():
    alloc = HybridPagedAllocator(SLIDING, 8 * 64, max_model_len=200, watermark=0.0)
    seq = Sequence(0, 8, 8)
    alloc.allocate(seq, 8)
    seq.num_computed_tokens = 8
    for _ in range(4):
        assert alloc.append_slots(seq, 1)
        seq.num_computed_tokens += 1
    # blocks 0, 1 at admission, block 2 for tokens 8-11; writing token 11 frees block 0 ((0 + 1) * 4 <= 11 - 4)
    table = alloc.block_table(seq)
    assert table[0] is None
    assert alloc.slot_mapping(seq, 2, 10).tolist() == [-1, -1] + [table[1] * 4 + i for i in range(4)] + [table[2] * 4, table[2] * 4 + 1]
