"""Random operation sequences (hypothesis) against a reference model, for every allocator configuration.

The model plays scheduler and cache: it admits requests (some sharing prefixes), grows them by prefill
chunks and batched decode, preempts, finishes, and writes each computed token's id into a numpy
"pool" at the slots the allocator gave. After every step it checks: slots in range and stable, a slot held
twice only when both holders hold the same token (a shared prefix), every live token reads back
intact (so prefix-cache hits are real), ref counts match the holders, the five byte
categories sum to the budget (exactly as predicted for flat), and at the end nothing is leaked.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.engine.factory import AllocatorConfig, make_allocator
from kvsim.size.kv_cache_spec import KVCacheGroupSpec, KVCacheSpec, PoolSpec, VllmGroup
from kvsim.engine.sequence import Sequence

from .test_allocator_contract import ALLOCATOR_CONFIGS, BLOCK_SIZE, BPT, MAX_MODEL_LEN, SPEC, build
from .pool_invariants import assert_pool_matches

NUM_EXAMPLES = 1000
OPS = ("admit", "admit", "step", "step", "step", "free")
FAMILY_PREFIX = 12  # requests of one family share up to this many leading tokens


class Model:
    """The scheduler and cache around one allocator, and the checks run after every step."""

    def __init__(self, config: AllocatorConfig, num_slots_hint: int, extra_bytes: int):
        self.config = config
        self.alloc = build(config, SPEC, num_slots_hint * BPT + extra_bytes)
        self.pool = np.full(self.alloc.num_slots, -1, dtype=np.int64)  # token id held by each slot
        self.live: dict[int, Sequence] = {}
        self.slots: dict[int, np.ndarray] = {}  # seq_id -> slots of its computed tokens, as last seen
        self.waiting_head: Sequence | None = None
        self.next_id = 0

    # --- operations -------------------------------------------------------------------------------------

    def admit(self, prompt: int, output: int, c: int) -> None:
        family, share = c % 3, c % (FAMILY_PREFIX + 1)
        ids = 10_000 * (self.next_id + 1) + np.arange(prompt + output, dtype=np.int64)
        k = min(share, len(ids))
        ids[:k] = 1_000 * (family + 1) + np.arange(k)  # the family's prefix
        seq = Sequence(self.next_id, prompt, output, token_ids=ids)
        self.next_id += 1
        chunk = 1 + (c // 7) % prompt
        before = self.alloc.breakdown()
        hit = self.alloc.allocate(seq, chunk)
        if hit is None:
            assert self.alloc.breakdown() == before, "a refused admission changed the allocator"
            self.check_flat_refusal(seq)
            self.waiting_head = seq
            return
        self.waiting_head = None
        assert 0 <= hit <= prompt - 1 and hit % BLOCK_SIZE == 0
        if not self.config.prefix_caching:
            assert hit == 0
        self.live[seq.seq_id] = seq
        seq.num_computed_tokens = hit
        self.slots[seq.seq_id] = self.alloc.slot_mapping(seq, 0, hit)
        self.compute(seq, min(chunk, prompt - hit))

    def step(self, a: int, c: int) -> None:
        if not self.live:
            return
        seq = self.live[sorted(self.live)[c % len(self.live)]]
        if seq.num_computed_tokens < seq.num_prompt_tokens:  # a prefill chunk
            n = min(a, seq.num_prompt_tokens - seq.num_computed_tokens)
            if not self.alloc.append_slots(seq, n):
                assert self.config.kind == "paged", "a flat allocator refused growth inside its slab"
                self.drop(seq)
                return
            self.sync(seq)
            self.compute(seq, n)
            return
        batch = [s for s in self.live.values() if s.num_computed_tokens < s.num_final_tokens]
        grown = self.alloc.append_decode_in_order(batch)
        assert self.config.kind == "paged" or grown == len(batch), "a flat allocator refused a decode token"
        failed = batch[grown:]  # the first that could not grow, and those not tried after it: preempted
        for s in batch:
            if s in failed:
                self.drop(s)
            else:
                self.sync(s)
        for s in batch:
            if s not in failed:
                self.compute(s, 1)

    def free(self, c: int) -> None:
        if self.live:
            self.drop(self.live[sorted(self.live)[c % len(self.live)]])

    def finish(self) -> None:
        for seq in [s for s in self.live.values() if s.num_computed_tokens == s.num_final_tokens]:
            self.drop(seq)

    # --- the scheduler and cache side ---------------------------------------------------------------------

    def compute(self, seq: Sequence, n: int) -> None:
        """Write the ids of tokens [computed, computed + n) at their slots and advance the request."""
        start = seq.num_computed_tokens
        new = self.alloc.slot_mapping(seq, start, start + n)
        self.pool[new] = seq.token_ids[start : start + n]
        seq.num_computed_tokens += n
        self.slots[seq.seq_id] = np.concatenate([self.slots[seq.seq_id], new])

    def sync(self, seq: Sequence) -> None:
        """After an allocator call on `seq`: its computed tokens never move."""
        old = self.slots[seq.seq_id]
        assert np.array_equal(self.alloc.slot_mapping(seq, 0, len(old)), old), seq

    def drop(self, seq: Sequence) -> None:
        self.alloc.free(seq)
        del self.live[seq.seq_id]
        del self.slots[seq.seq_id]

    # --- checks -------------------------------------------------------------------------------------------

    def check(self) -> None:
        alloc = self.alloc
        b = alloc.breakdown(self.waiting_head)
        parts = (b.token_states_bytes, b.reservation_bytes, b.internal_fragmentation_bytes,
                 b.external_fragmentation_bytes, b.free_bytes)
        assert min(parts) >= 0 and sum(parts) == alloc.budget_bytes == b.budget_bytes
        seqs = list(self.live.values())
        for s in seqs:  # stable: nothing moved behind the model's back
            assert np.array_equal(alloc.slot_mapping(s, 0, s.num_computed_tokens), self.slots[s.seq_id]), s
        slots = np.concatenate([self.slots[s.seq_id] for s in seqs] + [np.empty(0, np.int64)])
        tokens = np.concatenate([s.token_ids[: s.num_computed_tokens] for s in seqs] + [np.empty(0, np.int64)])
        assert slots.size == 0 or (slots.min() >= 0 and slots.max() < alloc.num_slots)
        assert np.array_equal(self.pool[slots], tokens), "a live token's KV was overwritten or never copied"
        distinct, first = np.unique(slots, return_index=True)
        if len(distinct) < len(slots):  # shared slots hold the same token for every holder
            assert self.config.kind == "paged"
            assert np.array_equal(tokens, tokens[first[np.searchsorted(distinct, slots)]])
        assert b.token_states_bytes == len(distinct) * BPT
        if self.config.kind == "flat":
            self.check_flat(b)
        else:
            self.check_paged(b)

    def check_flat(self, b) -> None:
        """The whole breakdown, predicted from the slabs the reserve policy and placement give."""
        alloc = self.alloc
        reserved = {sid: alloc.reserved_tokens(s) for sid, s in self.live.items()}
        footprint = sum(alloc.arena.footprint(r) for r in reserved.values())
        for sid, s in self.live.items():
            assert alloc.slab(s)[1] == reserved[sid] >= s.num_final_tokens
        self.check_disjoint_slabs()
        assert b.reservation_bytes == sum(s.num_final_tokens - s.num_computed_tokens for s in self.live.values()) * BPT
        remainder = alloc.budget_bytes - alloc.num_slots * BPT
        assert b.internal_fragmentation_bytes == (footprint - sum(s.num_final_tokens for s in self.live.values())) * BPT + remainder
        assert b.free_bytes + b.external_fragmentation_bytes == (alloc.num_slots - footprint) * BPT
        if b.external_fragmentation_bytes:
            head = self.waiting_head
            assert b.free_bytes == 0 and head is not None
            assert alloc.allocate(head, 1) is None  # truly refused while the free total would fit it
            assert alloc.arena.footprint(alloc.slab_size(head)) <= alloc.num_slots - footprint

    def check_disjoint_slabs(self) -> list[tuple[int, int]]:
        alloc = self.alloc
        slabs = sorted((alloc.slab(s)[0], alloc.arena.footprint(alloc.slab(s)[1])) for s in self.live.values())
        end = 0
        for start, size in slabs:
            assert start >= end and start + size <= alloc.num_slots, slabs
            end = start + size
        return slabs

    def check_flat_refusal(self, seq: Sequence) -> None:
        """A flat refusal means no hole fits the slab (first/best-fit: computed from the live slabs here)."""
        alloc = self.alloc
        if self.config.kind != "flat" or alloc.placement == "buddy" or seq.num_final_tokens > alloc.max_model_len:
            return
        bounds = [(0, 0)] + self.check_disjoint_slabs() + [(alloc.num_slots, 0)]
        largest = max(nxt[0] - (cur[0] + cur[1]) for cur, nxt in zip(bounds, bounds[1:]))
        assert largest < alloc.slab_size(seq), "refused although a hole would fit the slab"

    def check_paged(self, b) -> None:
        """Ref counts equal the number of live holders; free blocks are exactly the unheld ones."""
        alloc = self.alloc
        assert b.external_fragmentation_bytes == 0
        holders = Counter(bid for s in self.live.values() for bid in alloc.block_table(s) if bid is not None)
        for block in alloc.pool.blocks:
            assert block.ref_count == holders.get(block.block_id, 0) >= 0, block
        assert 0 not in holders  # block 0 is the null block: never handed out
        assert alloc.num_free_blocks == alloc.pool.num_blocks - 1 - len(holders)
        assert b.free_bytes == alloc.num_free_blocks * alloc.bytes_per_block

    def finish_all(self) -> None:
        for seq in list(self.live.values()):
            self.drop(seq)
        b = self.alloc.breakdown()
        assert (b.token_states_bytes, b.reservation_bytes, b.external_fragmentation_bytes) == (0, 0, 0)
        null_bytes = self.alloc.bytes_per_block if self.config.kind == "paged" else 0  # the null block
        assert b.internal_fragmentation_bytes == self.alloc.budget_bytes - self.alloc.num_slots * BPT + null_bytes
        assert b.free_bytes == self.alloc.num_slots * BPT - null_bytes, "bytes leaked after every request finished"
        if self.config.kind == "paged":
            assert all(block.ref_count == 0 for block in self.alloc.pool.blocks)


def decode(word: int) -> tuple[str, int, int, int]:
    """One drawn integer -> (operation, prompt length or chunk 1..24, output length 0..16, selector 0..9999).

    One draw per operation instead of four keeps hypothesis' own cost per example low.
    """
    return OPS[word % len(OPS)], 1 + (word >> 3) % 24, (word >> 8) % (MAX_MODEL_LEN - 23), (word >> 13) % 10_000


@pytest.mark.parametrize("config", ALLOCATOR_CONFIGS)
@settings(max_examples=NUM_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_slots=st.integers(16, 160),
    extra_bytes=st.integers(0, BPT - 1),
    words=st.lists(st.integers(0, 2**27 - 1), min_size=1, max_size=25),
)
def test_random_operations_against_model(config, num_slots, extra_bytes, words):
    model = Model(config, num_slots, extra_bytes)
    model.check()
    for op, a, b, c in map(decode, words):
        model.finish()
        if op == "admit":
            model.admit(a, b, c)
        elif op == "step":
            model.step(a, c)
        else:
            model.free(c)
        model.check()
    model.finish_all()


# --- mixed models: vLLM's KV cache groups (kvsim/engine/paged/kv_cache_manager.py) -----------------------------------

MIXED_LEN = 48
# group_size 2, pages of 32 B: two sliding groups (window 6; the second with a padding layer), a full group,
# and a state group whose 20 B state is padded to the page (block_size max_model_len: one block a request)
MIXED_POOL = PoolSpec(
    (
        VllmGroup("sliding", 2, 4, 32, 32, blocks_per_request=4, window=6),
        VllmGroup("sliding", 1, 4, 32, 32, blocks_per_request=4, window=6),
        VllmGroup("full", 2, 4, 32, 32, blocks_per_request=12),  # cdiv(48, 4)
        VllmGroup("state", 1, MIXED_LEN, 32, 20, blocks_per_request=1),
    ),
    group_size=2,
    bytes_per_block=64,  # 2 layers x 32 B
)
MIXED_SPEC = KVCacheSpec(
    groups=(
        KVCacheGroupSpec("sliding", 3, bytes_per_token=24, window=6),
        KVCacheGroupSpec("full", 2, bytes_per_token=16),
        KVCacheGroupSpec("state", 1, state_bytes=20),
    ),
    block_size=4, dtype="bf16", dtype_bytes=2, num_kv_heads=1, head_dim=2, num_attention_layers=5, pool=MIXED_POOL,
)


def check_mixed(alloc, live: dict, pool: np.ndarray, settled: dict) -> None:
    """Every held block in exactly one table entry with ref count 1; null blocks only as a table's head, exactly
    the blocks wholly before the window at the computed count of the last allocation (`settled`); free =
    usable - held; padding exact; the slot group's tokens from its first held block read back intact."""
    null = alloc.pool.null_block
    held = Counter()
    padding = 0
    for seq in live.values():
        for group, table in zip(MIXED_POOL.groups, alloc._reqs[seq].tables):
            nulls = next((i for i, b in enumerate(table) if b != null), len(table))
            assert all(b != null for b in table[nulls:])
            assert len(table) * group.block_size >= seq.num_computed_tokens
            skipped = max(0, settled[seq.seq_id] - group.window + 1) if group.kind == "sliding" else 0
            assert nulls == min(skipped // group.block_size, len(table)), (nulls, skipped, group)
            held.update(table[nulls:])
            padding += (len(table) - nulls) * (alloc.bytes_per_block - group.num_layers * group.layer_page_bytes)
        table = alloc.block_table(seq)
        first = next((i for i, b in enumerate(table) if b is not None), len(table)) * alloc.block_size
        slots = alloc.slot_mapping(seq, first, seq.num_computed_tokens)
        assert np.array_equal(pool[slots], seq.token_ids[first : seq.num_computed_tokens])
    assert all(n == 1 for n in held.values()) and 0 not in held
    assert all(b.ref_count == (b.block_id in held) for b in alloc.pool.blocks)
    assert alloc.num_free_blocks == alloc.pool.num_usable_blocks - len(held)
    b = alloc.breakdown()
    assert b.padding_bytes == padding <= b.internal_fragmentation_bytes
    assert b.free_bytes == alloc.num_free_blocks * alloc.bytes_per_block


@settings(max_examples=NUM_EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(4, 60),
    extra_bytes=st.integers(0, 63),
    words=st.lists(st.integers(0, 2**27 - 1), min_size=1, max_size=25),
)
def test_mixed_model_random_operations(num_blocks, extra_bytes, words):
    """Admissions in chunks, prefill chunks, decode, frees over vLLM's groups; freeing everything restores
    the pool and leaves only the null block and the remainder as internal fragmentation."""
    alloc = make_allocator(AllocatorConfig("paged", block_size=4), MIXED_SPEC, num_blocks * 64 + extra_bytes, max_model_len=MIXED_LEN)
    pool = np.full(alloc.num_slots, -1, dtype=np.int64)
    live: dict[int, Sequence] = {}
    settled: dict[int, int] = {}  # computed tokens at each request's last allocation

    def compute(seq, n):
        start = seq.num_computed_tokens
        slots = alloc.slot_mapping(seq, start, start + n)
        pool[slots[slots >= 0]] = seq.token_ids[start : start + n][slots >= 0]
        seq.num_computed_tokens += n

    for i, (op, a, b, c) in enumerate(map(decode, words)):
        for seq in [s for s in live.values() if s.num_computed_tokens == s.num_final_tokens]:
            alloc.free(live.pop(seq.seq_id))
        if op == "admit":
            output = min(b, MIXED_LEN - a)
            seq = Sequence(i, a, output, token_ids=10_000 * (i + 1) + np.arange(a + output, dtype=np.int64))
            chunk = 1 + c % a
            if alloc.allocate(seq, chunk) is not None:
                live[i], settled[i] = seq, 0
                compute(seq, chunk)
        elif op == "step" and live:
            seq = live[sorted(live)[c % len(live)]]
            n = max(1, min(a, seq.num_prompt_tokens - seq.num_computed_tokens))  # a prefill chunk or a decode
            settled[seq.seq_id] = seq.num_computed_tokens
            if alloc.append_slots(seq, n):
                compute(seq, n)
            else:
                alloc.free(live.pop(seq.seq_id))
        elif op == "free" and live:
            alloc.free(live.pop(sorted(live)[c % len(live)]))
        check_mixed(alloc, live, pool, settled)
    for seq in list(live.values()):
        alloc.free(seq)
    b = alloc.breakdown()
    assert (b.token_states_bytes, b.reservation_bytes, b.padding_bytes) == (0, 0, 0)
    assert b.internal_fragmentation_bytes == alloc.budget_bytes - alloc.pool.num_usable_blocks * alloc.bytes_per_block
    assert alloc.num_free_blocks == alloc.pool.num_usable_blocks


# prefix caching over the sliding and full groups (state groups have no prefix caching here)
PREFIX_POOL = PoolSpec(MIXED_POOL.groups[:3], group_size=2, bytes_per_block=64)
PREFIX_SPEC = replace(MIXED_SPEC, groups=MIXED_SPEC.groups[:2], pool=PREFIX_POOL)


@settings(max_examples=NUM_EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(4, 60),
    extra_bytes=st.integers(0, 63),
    words=st.lists(st.integers(0, 2**27 - 1), min_size=1, max_size=25),
)
def test_mixed_model_with_prefix_caching_random_operations(num_blocks, extra_bytes, words):
    """Requests of 3 prefix families over vLLM's groups with prefix caching: a block is held by exactly the
    table entries that name it (its ref count), the null blocks of a sliding table are exactly those wholly
    before the window of its last allocation, every computed token from the first held block reads back
    intact (so hits are real), every cached block is under its own key, and the bytes add up to the budget."""
    config = AllocatorConfig("paged", block_size=4, prefix_caching=True)
    alloc = make_allocator(config, PREFIX_SPEC, num_blocks * 64 + extra_bytes, max_model_len=MIXED_LEN)
    pool = np.full(alloc.num_slots, -1, dtype=np.int64)
    live: dict[int, Sequence] = {}
    settled: dict[int, int] = {}
    null = alloc.pool.null_block

    def compute(seq, n):
        start = seq.num_computed_tokens
        slots = alloc.slot_mapping(seq, start, start + n)
        pool[slots[slots >= 0]] = seq.token_ids[start : start + n][slots >= 0]
        seq.num_computed_tokens += n

    def check():
        held = Counter()
        for seq in live.values():
            for group, table in zip(PREFIX_POOL.groups, alloc._reqs[seq].tables):
                nulls = next((i for i, b in enumerate(table) if b != null), len(table))
                assert all(b != null for b in table[nulls:])
                skipped = max(0, settled[seq.seq_id] - group.window + 1) if group.kind == "sliding" else 0
                assert nulls == min(skipped // group.block_size, len(table)), (nulls, skipped, group)
                held.update(table[nulls:])
            table = alloc.block_table(seq)
            first = next((i for i, b in enumerate(table) if b is not None), len(table)) * alloc.block_size
            slots = alloc.slot_mapping(seq, first, seq.num_computed_tokens)
            assert np.array_equal(pool[slots], seq.token_ids[first : seq.num_computed_tokens])
        assert 0 not in held
        assert_pool_matches(alloc, held)
        b = alloc.breakdown()
        parts = (b.token_states_bytes, b.reservation_bytes, b.internal_fragmentation_bytes, b.free_bytes)
        assert min(parts) >= 0 and sum(parts) + b.external_fragmentation_bytes == alloc.budget_bytes

    for i, (op, a, b, c) in enumerate(map(decode, words)):
        for seq in [s for s in live.values() if s.num_computed_tokens == s.num_final_tokens]:
            alloc.free(live.pop(seq.seq_id))
        if op == "admit":
            output = min(b, MIXED_LEN - a)
            ids = 10_000 * (i + 1) + np.arange(a + output, dtype=np.int64)
            shared = min(a, 4 * (c % 7))
            ids[:shared] = 1_000 * (c % 3 + 1) + np.arange(shared)  # the family's prefix
            seq = Sequence(i, a, output, token_ids=ids)
            hit = alloc.allocate(seq, 1 + c % a)
            if hit is not None:
                assert hit % alloc.block_size == 0 and hit < a and hit <= shared
                live[i], settled[i] = seq, hit
                seq.num_computed_tokens = hit
                compute(seq, min(1 + c % a, a - hit))
        elif op == "step" and live:
            seq = live[sorted(live)[c % len(live)]]
            n = max(1, min(a, seq.num_prompt_tokens - seq.num_computed_tokens))
            settled[seq.seq_id] = seq.num_computed_tokens
            if alloc.append_slots(seq, n):
                compute(seq, n)
            else:
                alloc.free(live.pop(seq.seq_id))
        elif op == "free" and live:
            alloc.free(live.pop(sorted(live)[c % len(live)]))
        check()
    for seq in list(live.values()):
        alloc.free(seq)
    b = alloc.breakdown()
    assert (b.token_states_bytes, b.reservation_bytes, b.padding_bytes) == (0, 0, 0)
    assert alloc.num_free_blocks == alloc.pool.num_usable_blocks
