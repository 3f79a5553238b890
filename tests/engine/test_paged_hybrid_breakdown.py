"""A mixed model's memory breakdown against the same figures counted slot by slot and block by block, over random
admissions with shared prefixes (hits held by several requests at once), windows, state groups and frees."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.engine.allocator import MemoryBreakdown
from kvsim.engine.paged.kv_cache_manager import HybridPagedAllocator
from kvsim.engine.sequence import Sequence
from tests.engine.test_paged_hybrid import SPEC
from tests.engine.test_paged_mamba_align import SPEC3, run_random_ops


def plain_breakdown(alloc: HybridPagedAllocator) -> MemoryBreakdown:
    """`breakdown()` written plainly: each group's slots of each request, then each shared block once, in the
    order the requests and their groups hold them."""
    groups, bpb = alloc.groups, alloc.bytes_per_block
    token_bytes, pad_bytes = alloc._token_bytes, alloc._pad_bytes
    token = reservation = internal = padding = 0
    for req in alloc._reqs.values():
        c, final = max(req.seq.num_computed_tokens, req.hit), req.seq.num_final_tokens
        for g, table in enumerate(req.tables):
            held = req.held[g]
            if not held:
                continue
            padding += held * pad_bytes[g]
            if groups[g].kind == "state":
                token += held * (bpb - pad_bytes[g])
                continue
            bs = groups[g].block_size
            cap, lo = len(table) * bs, (len(table) - held) * bs
            cc = min(max(c, lo), cap)
            used = max(min(cap, final), cc)
            token += (cc - lo) * token_bytes[g]
            reservation += (used - cc) * token_bytes[g]
            internal += (cap - used) * token_bytes[g]
    saved = 0
    seen: set[int] = set()
    ref_count = alloc.pool.ref_count
    for req in alloc._reqs.values():
        for g, table in enumerate(req.tables):
            for b in table:
                if ref_count[b] > 1 and b not in seen:
                    seen.add(b)
                    extra = int(ref_count[b]) - 1
                    kept = bpb - pad_bytes[g] if groups[g].kind == "state" else groups[g].block_size * token_bytes[g]
                    token -= extra * kept
                    padding -= extra * pad_bytes[g]
                    saved += extra * bpb
    unusable = alloc.budget_bytes - alloc.pool.num_usable_blocks * bpb
    return MemoryBreakdown(alloc.budget_bytes, token, reservation, internal + padding + unusable, 0,
                           alloc.num_free_blocks * bpb, saved, padding)


def run_ops(alloc: HybridPagedAllocator, ops) -> int:
    """`run_random_ops` (admissions sharing one of 3 prefixes, some computed below their hit, chunks, frees), the
    breakdown compared after each. Returns how many comparisons found blocks held by several requests."""
    shared = 0

    def check(live) -> None:
        nonlocal shared
        shared += alloc.pool.num_shared_refs > 0
        assert alloc.breakdown() == plain_breakdown(alloc)

    run_random_ops(alloc, ops, check, computed_below_hit=True)
    return shared


OPS = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 24), st.integers(0, 9999)), min_size=1, max_size=30)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(6, 60), retention=st.sampled_from([0, None]), ops=OPS)
def test_sliding_and_full_groups_with_shared_hits(num_blocks, retention, ops):
    alloc = HybridPagedAllocator(SPEC, num_blocks * 64 + 10, max_model_len=64, enable_prefix_caching=True,
                                 prefix_cache_retention_interval=retention)
    run_ops(alloc, ops)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(6, 60), alignment=st.sampled_from([0, 2]), ops=OPS)
def test_state_groups_with_shared_hits(num_blocks, alignment, ops):
    alloc = HybridPagedAllocator(SPEC3, num_blocks * 64, max_model_len=48, enable_prefix_caching=True,
                                 mamba_checkpoint_alignment=alignment)
    run_ops(alloc, ops)


def test_shared_hits_are_counted_once():
    """Requests admitted one after another on one prefix hold its cached blocks together."""
    alloc = HybridPagedAllocator(SPEC, 60 * 64, max_model_len=64, enable_prefix_caching=True,
                                 prefix_cache_retention_interval=None)
    ops = [(0, 20, 7 * 3 * k + 6) for k in range(4)] + [(1, 3, 1), (2, 5, 2), (3, 1, 0), (0, 24, 27)]
    assert run_ops(alloc, ops) >= 3
    assert alloc.breakdown().shared_saved_bytes > 0


def test_a_shared_hit_with_state_groups_is_counted_once():
    """Align mode: a request hitting another's prompt holds its full-attention blocks with it."""
    alloc = HybridPagedAllocator(SPEC3, 17 * 64, max_model_len=48, enable_prefix_caching=True,
                                 mamba_checkpoint_alignment=2)
    a, b = (Sequence(i, 10, 8, token_ids=np.arange(18, dtype=np.int64)) for i in (0, 1))
    assert alloc.allocate(a, 10) == 0
    a.num_computed_tokens = 10
    assert alloc.append_slots(a, 1)
    alloc.new_step_starts()
    assert alloc.allocate(b, 10) == 8
    assert alloc.pool.num_shared_refs > 0
    assert alloc.breakdown() == plain_breakdown(alloc)
    b.num_computed_tokens = 10
    assert alloc.breakdown() == plain_breakdown(alloc)
