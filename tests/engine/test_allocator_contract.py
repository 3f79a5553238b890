"""The KVAllocator contract, run over every allocator configuration (built only through `make_allocator`)."""

from __future__ import annotations

import importlib
import itertools
import pkgutil

import numpy as np
import pytest

from kvsim.engine.allocator import KVAllocator, MemoryBreakdown
from kvsim.engine.factory import AllocatorConfig, make_allocator
from kvsim.size.kv_cache_spec import KVCacheGroupSpec, KVCacheSpec, PoolSpec, VllmGroup
from kvsim.engine.sequence import Sequence

BLOCK_SIZE = 4
# 2 (K,V) * 1 layer * 1 head * 4 dims * 2 bytes = 16 bytes per token; a block of 4 tokens = 64 bytes
SPEC = KVCacheSpec.uniform(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BLOCK_SIZE, dtype_bytes=2)
BPT = SPEC.bytes_per_token
MAX_MODEL_LEN = 40

# A mixed model as the replay builds it: vLLM's groups (a full and a sliding group, one layer each, 32-byte pages),
# 16 bytes per token across both like SPEC; the window is past max_model_len, so the contract's byte counts hold.
# Blocks a request of MAX_MODEL_LEN: cdiv(40, 4) = 10 in each.
MIXED = KVCacheSpec(
    groups=(KVCacheGroupSpec("full", 1, bytes_per_token=8), KVCacheGroupSpec("sliding", 1, bytes_per_token=8, window=1000)),
    block_size=BLOCK_SIZE, dtype="bf16", dtype_bytes=2, num_kv_heads=1, head_dim=2, num_attention_layers=2,
    pool=PoolSpec((VllmGroup("full", 1, BLOCK_SIZE, 32, 32, blocks_per_request=10), VllmGroup("sliding", 1, BLOCK_SIZE, 32, 32, blocks_per_request=10, window=1000)), 1, 32),
)
assert MIXED.bytes_per_token == BPT

ALLOCATOR_CONFIGS = [
    pytest.param(AllocatorConfig("flat", reserve=r, placement=p), id=f"flat-{r}-{p}")
    for r, p in itertools.product(("max", "pow2", "oracle"), ("first-fit", "best-fit", "buddy"))
] + [
    pytest.param(AllocatorConfig("paged", block_size=BLOCK_SIZE, prefix_caching=pc), id=f"paged{'+prefix' if pc else ''}")
    for pc in (False, True)
]
# Every allocator kind: the flat ones and the paged ones on a uniform model (PagedAllocator) and on a mixed model's
# groups (HybridPagedAllocator). `test_every_allocator_kind_is_in_the_contract` fails when a kind has no case.
ALLOCATOR_CASES = [pytest.param(*p.values, SPEC, id=p.id) for p in ALLOCATOR_CONFIGS] + [
    pytest.param(AllocatorConfig("paged", block_size=BLOCK_SIZE, prefix_caching=pc), MIXED, id=f"hybrid{'+prefix' if pc else ''}")
    for pc in (False, True)
]


def build(config: AllocatorConfig, spec: KVCacheSpec, budget_bytes: int, *, max_model_len: int = MAX_MODEL_LEN) -> KVAllocator:
    """The one way tests build an allocator: the factory, over a small test spec."""
    return make_allocator(config, spec, budget_bytes, max_model_len=max_model_len)


def make_seq(seq_id: int, prompt: int, output: int, *, prefix: np.ndarray | None = None) -> Sequence:
    """A request whose token ids are unique to it except for an optional shared `prefix`."""
    ids = 1_000_000 + seq_id * 1_000 + np.arange(prompt + output, dtype=np.int64)
    if prefix is not None:
        ids[: len(prefix)] = prefix
    return Sequence(seq_id, prompt, output, token_ids=ids)


def admit(alloc: KVAllocator, seq: Sequence, num_new_tokens: int | None = None) -> int | None:
    """Scheduler side of admission: allocate, then mark the hit and the chunk as computed."""
    n = seq.num_prompt_tokens if num_new_tokens is None else num_new_tokens
    hit = alloc.allocate(seq, n)
    if hit is not None:
        seq.num_computed_tokens = min(hit + n, seq.num_prompt_tokens)
    return hit


def capacity_bytes(alloc: KVAllocator) -> int:
    """Bytes of the budget the allocator can address: whole slots (flat) or whole blocks (paged)."""
    return alloc.num_blocks * alloc.bytes_per_block if alloc.paged else alloc.num_slots * BPT


def null_bytes(alloc: KVAllocator) -> int:
    """The paged pool's null block (vLLM's block 0): never handed out."""
    return alloc.bytes_per_block if alloc.paged else 0


def assert_empty(alloc: KVAllocator, b: MemoryBreakdown) -> None:
    """Nothing held: all bytes free except the budget's remainder smaller than one slot or block and the null block."""
    assert (b.token_states_bytes, b.reservation_bytes, b.external_fragmentation_bytes) == (0, 0, 0)
    assert b.internal_fragmentation_bytes == alloc.budget_bytes - capacity_bytes(alloc) + null_bytes(alloc)
    assert b.free_bytes == capacity_bytes(alloc) - null_bytes(alloc)


def test_every_allocator_kind_is_in_the_contract():
    """Every concrete KVAllocator in kvsim.engine is built by some case above: a new kind, or a renamed module,
    fails here instead of silently leaving the contract."""
    import kvsim.engine

    for info in pkgutil.walk_packages(kvsim.engine.__path__, "kvsim.engine."):
        if ".tensors" not in info.name:  # the tensors need torch and hold no allocator
            importlib.import_module(info.name)

    def concrete(cls) -> set:
        subs = set(cls.__subclasses__())
        return {c for c in subs if not c.__abstractmethods__} | set().union(*(concrete(c) for c in subs))

    kinds = concrete(KVAllocator)
    built = {type(build(*case.values[:2], 64 * BPT)) for case in ALLOCATOR_CASES}
    assert {k.__name__ for k in kinds} == {"FlatAllocator", "PagedAllocator", "HybridPagedAllocator"}
    assert built == kinds


contract = pytest.mark.parametrize("config, spec", ALLOCATOR_CASES)


@contract
def test_fresh_allocator_is_all_free(config, spec):
    alloc = build(config, spec, 64 * BPT + 7)
    assert alloc.num_slots > 0 and 0 < capacity_bytes(alloc) <= alloc.budget_bytes
    b = alloc.breakdown()
    assert b.budget_bytes == 64 * BPT + 7
    assert_empty(alloc, b)


@contract
def test_admit_compute_and_read_slots(config, spec):
    alloc = build(config, spec, 256 * BPT)
    a, b = make_seq(1, 10, 6), make_seq(2, 7, 3)
    assert admit(alloc, a) == 0 and admit(alloc, b) == 0
    ma, mb = alloc.slot_mapping(a, 0, 10), alloc.slot_mapping(b, 0, 7)
    assert ma.dtype == np.int64 and ma.shape == (10,) and mb.shape == (7,)
    slots = np.concatenate([ma, mb])
    assert len(np.unique(slots)) == 17  # distinct requests never share a slot
    assert slots.min() >= 0 and slots.max() < alloc.num_slots
    assert alloc.breakdown().token_states_bytes == 17 * BPT


@contract
def test_decode_grows_and_keeps_earlier_slots(config, spec):
    alloc = build(config, spec, 256 * BPT)  # room for three flat-max slabs, even as 64-slot buddy blocks
    seqs = [make_seq(i, 5 + i, 6) for i in range(3)]
    for s in seqs:
        assert admit(alloc, s) == 0
    before = [alloc.slot_mapping(s, 0, s.num_computed_tokens) for s in seqs]
    for _ in range(5):  # max_tokens 6: 5 decodes write the KV of sampled tokens 1-5 (the 6th's is never written)
        assert alloc.append_decode_in_order(seqs) == len(seqs)
        for s in seqs:
            s.num_computed_tokens += 1
    for s, old in zip(seqs, before, strict=True):
        assert s.num_computed_tokens == s.num_final_tokens == 5 + s.seq_id + 6 - 1
        now = alloc.slot_mapping(s, 0, s.num_computed_tokens)
        assert np.array_equal(now[: len(old)], old)
        assert len(np.unique(now)) == s.num_final_tokens
    b = alloc.breakdown()
    assert b.token_states_bytes == (10 + 11 + 12) * BPT  # prompt 5 + i, + 6 - 1
    assert b.reservation_bytes == 0


@contract
def test_prefill_in_chunks(config, spec):
    alloc = build(config, spec, 128 * BPT)
    s = make_seq(1, 13, 2)
    assert admit(alloc, s, 5) == 0 and s.num_computed_tokens == 5
    assert alloc.append_slots(s, 5)
    s.num_computed_tokens = 10
    assert alloc.append_slots(s, 3)
    s.num_computed_tokens = 13
    assert len(np.unique(alloc.slot_mapping(s, 0, 13))) == 13
    assert alloc.breakdown().token_states_bytes == 13 * BPT


@contract
def test_refusal_is_a_value_and_changes_nothing(config, spec):
    alloc = build(config, spec, 64 * BPT)
    admitted = []
    for i in range(50):
        s = make_seq(i, 10, 6)
        before = alloc.breakdown()
        if admit(alloc, s) is None:
            assert alloc.breakdown() == before
            assert s.num_computed_tokens == 0
            break
        admitted.append(s)
    else:
        pytest.fail("a 64-slot budget admitted 50 requests of 10 + 6 - 1 = 15 tokens")
    assert 1 <= len(admitted) and len(admitted) * 10 <= alloc.num_slots


@contract
def test_free_returns_everything(config, spec):
    alloc = build(config, spec, 200 * BPT + 3)
    seqs = [make_seq(i, 8, 4) for i in range(3)]
    for s in seqs:
        assert admit(alloc, s) == 0
    for s in seqs:
        alloc.free(s)
    assert_empty(alloc, alloc.breakdown())
    again = make_seq(9, 8, 4)  # the space is reusable
    assert admit(alloc, again) is not None


@contract
def test_can_ever_fit(config, spec):
    alloc = build(config, spec, 64 * BPT)
    assert alloc.can_ever_fit(make_seq(1, 10, 10))
    assert not alloc.can_ever_fit(make_seq(2, 60, 10))  # longer than the whole budget and max_model_len


@contract
def test_breakdown_sums_with_a_waiting_head(config, spec):
    alloc = build(config, spec, 64 * BPT + 5)
    seqs = [make_seq(i, 6, 4) for i in range(4)]
    for s in seqs:
        admit(alloc, s)
    head = make_seq(99, 30, 5)
    for waiting in (None, head):
        b = alloc.breakdown(waiting)
        parts = (b.token_states_bytes, b.reservation_bytes, b.internal_fragmentation_bytes,
                 b.external_fragmentation_bytes, b.free_bytes)
        assert min(parts) >= 0 and sum(parts) == alloc.budget_bytes


@contract
def test_deterministic(config, spec):
    def run() -> list:
        alloc = build(config, spec, 180 * BPT)
        seqs = [make_seq(i, 3 + 2 * i, 5) for i in range(5)]
        out = [admit(alloc, s) for s in seqs]
        live = [s for s in seqs if s.num_computed_tokens]
        for s in live[1::2]:
            alloc.free(s)
        late = make_seq(7, 9, 2)
        out.append(admit(alloc, late))
        live = live[::2] + ([late] if late.num_computed_tokens else [])
        out += [alloc.slot_mapping(s, 0, s.num_computed_tokens).tolist() for s in live]
        out.append(alloc.breakdown())
        return out

    assert run() == run()


@contract
def test_prefix_cache_hit_is_capped_and_in_whole_blocks(config, spec):
    alloc = build(config, spec, 128 * BPT)
    first = make_seq(1, 14, 2)
    assert admit(alloc, first) == 0
    for prompt in (14, 12):  # 3 full blocks shared; the hit leaves at least one token to compute
        second = make_seq(prompt + 100, prompt, 2, prefix=first.token_ids[:prompt])
        hit = alloc.allocate(second, prompt)
        expected = ((prompt - 1) // BLOCK_SIZE) * BLOCK_SIZE if config.prefix_caching else 0
        assert hit == expected
        if hit:
            shared = alloc.slot_mapping(second, 0, hit)
            assert np.array_equal(shared, alloc.slot_mapping(first, 0, hit))
            assert alloc.breakdown().shared_saved_bytes >= hit * BPT
        alloc.free(second)


@pytest.mark.parametrize("k", [1, 3, BLOCK_SIZE])
@contract
def test_a_decode_runs_slots_in_one_call_are_each_requests_own(config, spec, k):
    # decode_slot_mapping (the replay's whole-batch form) against slot_mapping per request, across block edges.
    alloc = build(config, spec, 256 * BPT)
    seqs = [make_seq(i, 3 + 2 * i, 12) for i in range(4)]
    for s in seqs:
        assert admit(alloc, s) == 0
    for _ in range(5):
        starts = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
        for s in seqs:  # room for the run's k tokens, as the scheduler makes before a run
            assert alloc.append_slots(s, k)
        expected = np.stack([alloc.slot_mapping(s, c, c + k) for s, c in zip(seqs, starts.tolist())], axis=1)
        assert np.array_equal(alloc.decode_slot_mapping(seqs, starts, k), expected)
        for s in seqs:
            s.num_computed_tokens += 1  # the next run starts one token on: every offset in a block is covered
