"""Integrity mode end to end with the real allocators: every read holds what the reading request's tokens
wrote, across preemption (recompute), swap into other slots, shared prefix blocks;
and the check is live: it names the first token that is wrong."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.engine.tensors.cache import KVCache
from kvsim.engine.flat.flat_allocator import FlatAllocator
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.engine.paged.unitary_kv_cache_manager import PagedAllocator
from kvsim.engine.sequence import Sequence

BS = 4
SPEC = KVCacheSpec.uniform(num_layers=3, num_kv_heads=2, head_dim=8, block_size=BS, dtype="bf16", dtype_bytes=2)


def make_paged(num_blocks: int, *, prefix_caching: bool = False) -> PagedAllocator:
    """`num_blocks` usable blocks: the pool has one more, block 0, vLLM's null block."""
    return PagedAllocator(
        SPEC, (num_blocks + 1) * SPEC.block_bytes, max_model_len=256, enable_prefix_caching=prefix_caching, watermark=0.0
    )


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """Every scenario runs on the CPU, and again on CUDA where a GPU is present."""
    return request.param


def make_cache(alloc, device: str = "cpu") -> KVCache:
    return KVCache(SPEC, alloc.num_slots, device=device, num_layers=2, integrity=True)


def make_seq(seq_id: int, token_ids: np.ndarray, num_prompt_tokens: int, cache: KVCache | None = None) -> Sequence:
    """A request that writes the KV of every one of `token_ids`: it samples one token more, whose KV is never
    written (num_final_tokens = prompt + max_tokens - 1 = len(token_ids))."""
    seq = Sequence(seq_id, num_prompt_tokens, len(token_ids) - num_prompt_tokens + 1, token_ids=np.asarray(token_ids))
    assert seq.num_final_tokens == len(token_ids)
    if cache is not None:
        cache.register(seq_id, seq.token_ids)
    return seq


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32000, n, dtype=np.int64)


def compute(alloc, cache: KVCache, seq: Sequence, n: int) -> None:
    """The scheduler's part: write the next n tokens of `seq` through its slot mapping, then advance it."""
    start = seq.num_computed_tokens
    slots = alloc.slot_mapping(seq, start, start + n)
    cache.write(slots, np.full(n, seq.seq_id), np.arange(start, start + n))
    seq.num_computed_tokens += n


def admit(alloc, cache: KVCache, seq: Sequence, n: int) -> int:
    hit = alloc.allocate(seq, n)
    assert hit is not None
    seq.num_computed_tokens = hit
    compute(alloc, cache, seq, n)
    return hit


def decode(alloc, cache: KVCache, seq: Sequence, steps: int = 1) -> None:
    for _ in range(steps):
        assert alloc.append_slots(seq, 1)
        compute(alloc, cache, seq, 1)


def check_reads(alloc: PagedAllocator, cache: KVCache, seqs: list[Sequence]) -> None:
    """One batched paged read of every sequence's computed tokens, checked token by token."""
    tables = [np.asarray(alloc.block_table(s), dtype=np.int64) for s in seqs]
    cache.read_paged(tables, [s.num_computed_tokens for s in seqs], [s.seq_id for s in seqs])
    for s in seqs:  # and the pool itself, through the slot mapping
        cache.verify(s.seq_id, alloc.slot_mapping(s, 0, s.num_computed_tokens), np.arange(s.num_computed_tokens))


def test_detects_a_token_read_from_the_wrong_slot(device):
    alloc = make_paged(8)
    cache = make_cache(alloc, device)
    a = make_seq(1, tokens(1, 12), 10, cache)
    admit(alloc, cache, a, 10)
    slots = alloc.slot_mapping(a, 0, 10)
    cache.verify(1, slots, np.arange(10))
    swapped = slots.copy()
    swapped[[3, 6]] = swapped[[6, 3]]
    with pytest.raises(AssertionError, match=r"seq 1 position 3 \(slot \d+\) layer 0 K"):
        cache.verify(1, swapped, np.arange(10))
    with pytest.raises(AssertionError, match=rf"seq 1 position 1 \(slot {slots[0]}\)"):
        cache.verify(1, slots, np.arange(1, 11))  # positions shifted by one


def test_preemption_by_recompute_rewrites_the_same_values(device):
    alloc = make_paged(8)
    cache = make_cache(alloc, device)
    a = make_seq(1, tokens(1, 16), 10, cache)
    admit(alloc, cache, a, 10)
    decode(alloc, cache, a, 2)
    old_slots = alloc.slot_mapping(a, 0, 12)
    check_reads(alloc, cache, [a])

    alloc.free(a)  # preempted: its blocks go to b, which overwrites all of them
    a.num_computed_tokens = 0
    b = make_seq(2, tokens(2, 33), 32, cache)
    admit(alloc, cache, b, 32)
    with pytest.raises(AssertionError, match="seq 1"):
        cache.verify(1, old_slots, np.arange(12))  # a's old slots now hold b's tokens
    alloc.free(b)

    admit(alloc, cache, a, 12)  # recompute prompt and the two generated tokens
    decode(alloc, cache, a, 1)
    check_reads(alloc, cache, [a])


def test_swap_out_and_back_into_other_blocks(device):
    alloc = make_paged(8)
    cache = make_cache(alloc, device)
    a = make_seq(1, tokens(1, 16), 10, cache)
    admit(alloc, cache, a, 10)
    old_slots = alloc.slot_mapping(a, 0, 10)
    handle = cache.swap_out(old_slots)
    alloc.free(a)
    a.num_computed_tokens = 0

    filler = make_seq(2, tokens(2, 8), 8, cache)  # takes some blocks first, so a lands elsewhere
    admit(alloc, cache, filler, 8)
    b = make_seq(3, tokens(3, 24), 24, cache)
    admit(alloc, cache, b, 24)  # overwrites every other block, a's old ones included
    alloc.free(b)

    assert alloc.allocate(a, 10) == 0
    new_slots = alloc.slot_mapping(a, 0, 10)
    assert not np.array_equal(new_slots, old_slots)
    cache.swap_in(handle, new_slots)
    a.num_computed_tokens = 10
    decode(alloc, cache, a, 3)
    check_reads(alloc, cache, [a, filler])


@pytest.mark.parametrize("free_first", [False, True])  # a still running, or finished with its blocks cached
def test_shared_prefix_blocks_read_the_sharers_values(free_first, device):
    alloc = make_paged(16, prefix_caching=True)
    cache = make_cache(alloc, device)
    prefix = tokens(7, 8)  # two full blocks
    a = make_seq(1, np.concatenate([prefix, tokens(1, 5)]), 11, cache)
    b = make_seq(2, np.concatenate([prefix, tokens(2, 7)]), 13, cache)
    admit(alloc, cache, a, 11)
    a_blocks = alloc.block_table(a)
    if free_first:
        alloc.free(a)
        cache.forget(1)
    assert admit(alloc, cache, b, 5) == 8  # hit: a's two prefix blocks, never written by b
    assert alloc.block_table(b)[:2] == a_blocks[:2]
    decode(alloc, cache, b, 2)
    check_reads(alloc, cache, [b] if free_first else [a, b])


def test_shared_prefix_values_must_follow_token_content(device):
    """A request whose values were keyed by its id alone would (rightly) fail on blocks another wrote."""
    alloc = make_paged(16, prefix_caching=True)
    cache = make_cache(alloc, device)
    prefix = tokens(7, 8)
    a = make_seq(1, np.concatenate([prefix, tokens(1, 3)]), 11, cache)
    b = make_seq(2, np.concatenate([prefix, tokens(2, 3)]), 11)  # not registered
    admit(alloc, cache, a, 11)
    assert admit(alloc, cache, b, 3) == 8
    with pytest.raises(AssertionError, match="seq 2 position 0 .read."):
        check_reads(alloc, cache, [b])


def test_flat_slabs_round_trip(device):
    alloc = FlatAllocator(SPEC, 50 * SPEC.bytes_per_token, max_model_len=16, reserve="oracle")
    cache = make_cache(alloc, device)
    assert cache.num_slots == 50 and cache.num_blocks == 13
    parent = make_seq(1, tokens(1, 12), 7, cache)
    child = make_seq(2, np.concatenate([tokens(1, 12)[:7], tokens(2, 5)]), 7, cache)
    other = make_seq(3, tokens(3, 10), 9, cache)
    admit(alloc, cache, other, 9)
    admit(alloc, cache, parent, 7)
    admit(alloc, cache, child, 7)  # a flat engine cannot share: the same prompt is written twice
    for seq in (parent, child, other):
        decode(alloc, cache, seq, 1)
    seqs = [parent, child, other]
    starts = [alloc.slab(s)[0] for s in seqs]
    cache.read_flat(starts, [s.num_computed_tokens for s in seqs], [s.seq_id for s in seqs])
    with pytest.raises(AssertionError, match="seq 1 position 0 .read."):
        cache.read_flat(starts[::-1], [s.num_computed_tokens for s in seqs], [s.seq_id for s in seqs])


OPS = st.lists(st.tuples(st.sampled_from("admit decode preempt resume swap unswap finish".split()),
                         st.integers(0, 99), st.integers(1, 14)), min_size=1, max_size=30)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(ops=OPS)
def test_random_schedules_keep_every_read_intact(ops):
    """Random admissions (with shared prefixes), decodes, preemptions, swaps and finishes on a tight
    paged pool with prefix caching: after every operation each running request reads exactly its tokens."""
    alloc = make_paged(12, prefix_caching=True)
    cache = KVCache(SPEC, alloc.num_slots, device="cpu", num_layers=1, integrity=True)
    prefixes = [tokens(100, 24), tokens(101, 24)]
    running: list[Sequence] = []
    preempted: list[tuple[Sequence, int]] = []  # (request, tokens to recompute)
    swapped: list[tuple[Sequence, int, object]] = []  # (request, tokens swapped out, handle)
    next_id = iter(range(1000))

    def grow(seq: Sequence) -> bool:
        if seq.num_computed_tokens >= seq.num_final_tokens or not alloc.append_slots(seq, 1):
            return False
        compute(alloc, cache, seq, 1)
        return True

    for op, pick, size in ops:
        if op == "admit":
            shared = prefixes[pick % 2][: size + 2]
            seq = make_seq(next(next_id), np.concatenate([shared, tokens(pick, 6)]), len(shared) + 1, cache)
            hit = alloc.allocate(seq, seq.num_prompt_tokens)
            if hit is not None:
                seq.num_computed_tokens = hit
                compute(alloc, cache, seq, seq.num_prompt_tokens - hit)
                running.append(seq)
        elif op == "resume" and preempted:
            seq, n = preempted[pick % len(preempted)]
            hit = alloc.allocate(seq, n)
            if hit is not None:
                preempted.remove((seq, n))
                seq.num_computed_tokens = hit
                compute(alloc, cache, seq, n - hit)
                running.append(seq)
        elif op == "unswap" and swapped:
            seq, n, handle = entry = swapped[pick % len(swapped)]
            if alloc.allocate(seq, n) is not None:
                swapped.remove(entry)
                cache.swap_in(handle, alloc.slot_mapping(seq, 0, n))  # hit blocks get identical values
                seq.num_computed_tokens = n
                running.append(seq)
        elif not running:
            continue
        elif op == "decode":
            for seq in running:
                grow(seq)
        elif op in ("preempt", "swap", "finish"):
            seq = running.pop(pick % len(running))
            n = seq.num_computed_tokens
            if op == "swap":
                swapped.append((seq, n, cache.swap_out(alloc.slot_mapping(seq, 0, n))))
            alloc.free(seq)
            seq.num_computed_tokens = 0
            if op == "preempt":
                preempted.append((seq, n))
            elif op == "finish":
                cache.forget(seq.seq_id)
        if running:
            check_reads(alloc, cache, running)
