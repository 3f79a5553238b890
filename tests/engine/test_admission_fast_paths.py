"""The cached admission path's shortcut gives the answers of the plain path: a refused admission's retry answered
from its last lookup (`PagedAllocator._still_refused`) against `allocate` with the shortcut off."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from kvsim.engine.paged.block_pool import BlockPool
from kvsim.engine.paged.unitary_kv_cache_manager import PagedAllocator
from kvsim.engine.sequence import Sequence
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.workload.requests import RequestSpec, make_block_key_runs

BS = 4
SPEC = KVCacheSpec.uniform(num_layers=1, num_kv_heads=1, head_dim=1, block_size=BS)


def _pool_state(pool: BlockPool) -> tuple:
    return (pool.free_queue.queued_ids().tolist(), pool.ref_count.tolist(), pool.cached_keys(),
            {k: list(v) for k, v in pool.cached_duplicates.items()}, pool.is_cached.tolist())


def _seq(r: RequestSpec) -> Sequence:
    seq = Sequence(r.request_id, r.num_prompt_tokens, r.max_tokens)
    seq.block_keys = partial(make_block_key_runs, r)
    return seq


def _admit_in_both(hits: list, waiting: list, running: list, index: int) -> None:
    """Both allocators answered the same; an admitted request moves from waiting to running in each replay."""
    assert hits[0] == hits[1]
    if hits[0] is not None:
        for w, run in zip(waiting, running):
            seq = w.pop(index)
            seq.num_computed_tokens = hits[0]
            run.append(seq)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("full", [False, True])
def test_a_refused_retry_is_answered_as_allocate_answers_it(seed, full):
    """Two allocators in lockstep, one with the retry shortcut and one without: requests sharing prefixes (so
    hits, free hit blocks revived by others, evictions and inserts of the next key happen between retries) are
    admitted in chunks of a varying budget, grow and finish; the queue head is retried at every step with
    another budget, watermark flag, reservation, query length and CPU-tier hit, and now and then a request
    behind it is admitted first.
    Every answer and the pools stay the same, and the shortcut
    answers some of the retries."""
    rng = np.random.default_rng(seed)
    allocs = []
    for shortcut in (True, False):
        alloc = PagedAllocator(SPEC, 48 * SPEC.block_bytes, max_model_len=4096, enable_prefix_caching=True,
                               watermark=0.04)
        if not shortcut:
            alloc._still_refused = lambda *args: False
        allocs.append(alloc)
    answered = []
    still = allocs[0]._still_refused

    def counted(*args):
        out = still(*args)
        answered.append(out)
        return out

    allocs[0]._still_refused = counted
    specs = []
    for i in range(200):
        group = int(rng.integers(0, 2))
        prefix = int(rng.integers(0, 6)) * 24
        specs.append(RequestSpec(i, 0.0, prefix + int(rng.integers(1, 60)), int(rng.integers(1, 30)),
                                 prefix_group=group if prefix else None, num_prefix_tokens=prefix))
    waiting = [[_seq(r) for r in specs] for _ in allocs]
    running: list[list[Sequence]] = [[], []]
    for _ in range(1500):
        op = rng.random()
        if len(waiting[0]) > 1 and rng.random() < 0.2:  # another request admitted ahead of the refused head
            # (as a connector's skips allow): it may revive the head's free hit blocks
            hits = [a.allocate(w[1], w[1].num_prompt_tokens, num_tokens=w[1].num_prompt_tokens) for a, w in
                    zip(allocs, waiting)]
            _admit_in_both(hits, waiting, running, 1)
        if waiting[0]:
            budget = int(rng.integers(1, 100))
            watermark = bool(rng.random() < 0.7)
            reserved = int(rng.integers(0, 3)) * int(rng.random() < 0.2)
            prompt = waiting[0][0].num_prompt_tokens  # a query now and then shorter than the last (its hit capped)
            num_tokens = max(1, prompt - int(rng.integers(0, 3 * BS)) * int(rng.random() < 0.3))
            ext = BS * int(rng.integers(0, 3)) * int(rng.random() < 0.2)  # a CPU tier's hit past the prefix hit
            ext = min(ext, (num_tokens - 1) // BS * BS // 2)
            hits = [a.allocate(w[0], budget, num_tokens=num_tokens, full_sequence_must_fit=full,
                               apply_watermark=watermark, reserved_blocks=reserved, num_external_computed_tokens=ext)
                    for a, w in zip(allocs, waiting)]
            _admit_in_both(hits, waiting, running, 0)
        if running[0] and op < 0.5:  # a running request computes a few more tokens
            i = int(rng.integers(len(running[0])))
            n = int(rng.integers(1, 40))
            grown = []
            for a, run in zip(allocs, running):
                seq = run[i]
                n_ok = min(n, seq.num_final_tokens - seq.num_computed_tokens)
                ok = n_ok <= 0 or a.append_slots(seq, n_ok)
                if ok and n_ok > 0:
                    seq.num_computed_tokens += n_ok
                grown.append(ok)
            assert grown[0] == grown[1]
        elif running[0] and op < 0.8:  # one finishes
            i = int(rng.integers(len(running[0])))
            for a, run in zip(allocs, running):
                a.free(run.pop(i))
        assert _pool_state(allocs[0].pool) == _pool_state(allocs[1].pool)
    assert sum(answered) > 20 and not all(answered)


def _twins(num_blocks: int = 40) -> list[PagedAllocator]:
    """An allocator with the retry shortcut and one without (`num_blocks - 1` usable blocks of 4 tokens)."""
    allocs = [PagedAllocator(SPEC, num_blocks * SPEC.block_bytes, max_model_len=4096, enable_prefix_caching=True)
              for _ in range(2)]
    allocs[1]._still_refused = lambda *args: False
    return allocs


def _admit(allocs: list[PagedAllocator], spec: RequestSpec, num_new: int | None = None) -> list[Sequence]:
    """`spec` admitted with `num_new` tokens (its whole prompt if None) and computed, in both; returns its seqs."""
    seqs = [_seq(spec) for _ in allocs]
    n = spec.num_prompt_tokens if num_new is None else num_new
    hits = [a.allocate(s, n, num_tokens=spec.num_prompt_tokens) for a, s in zip(allocs, seqs)]
    assert hits[0] == hits[1] is not None
    for s in seqs:
        s.num_computed_tokens = hits[0] + min(n, spec.num_prompt_tokens - hits[0])
    return seqs


def _both(allocs: list[PagedAllocator], seqs: list[Sequence], num_new: int | None = None) -> int | None:
    n = seqs[0].num_prompt_tokens if num_new is None else num_new
    hits = [a.allocate(s, n, num_tokens=s.num_prompt_tokens) for a, s in zip(allocs, seqs)]
    assert hits[0] == hits[1]
    assert _pool_state(allocs[0].pool) == _pool_state(allocs[1].pool)
    return hits[0]


def test_a_retry_after_a_running_request_cached_its_next_key():
    """Head C (a 64-token shared prefix) is refused with a hit of 9 blocks; D, running, computes the prefix's
    next 7 blocks and caches them. C's hit is then 16 blocks and it fits: the retry must look again."""
    allocs = _twins()
    _admit(allocs, RequestSpec(0, 0.0, 36, 1, prefix_group=0, num_prefix_tokens=32))  # 9 blocks, held
    b1 = _admit(allocs, RequestSpec(1, 0.0, 40, 1))  # 10 blocks
    _admit(allocs, RequestSpec(2, 0.0, 40, 1))  # 10 blocks: 10 free
    d = _admit(allocs, RequestSpec(4, 0.0, 64, 1, prefix_group=0, num_prefix_tokens=64), 4)  # hit 8, 1 new: 9 free
    c = [_seq(RequestSpec(3, 0.0, 100, 1, prefix_group=0, num_prefix_tokens=64)) for _ in allocs]  # 25 blocks
    assert _both(allocs, c) is None  # hit 9 (D's first block too): 16 new > 9
    for alloc, s in zip(allocs, d):
        assert alloc.append_slots(s, 28)  # D's next chunk: 7 more blocks, its keys 9 .. 15 cached; 2 free
    for alloc, s in zip(allocs, b1):
        alloc.free(s)  # 12 free
    assert allocs[0].pool.num_evicted == 0  # (only the next key changed)
    assert _both(allocs, c) == 64  # hit 16 blocks, all held: 9 new blocks


def test_a_retry_after_its_free_hit_blocks_were_evicted_many_at_once():
    """Head C hits A's 8 free cached blocks and is refused (a chunk of 100 tokens: 25 + 8 revived > 32 free); B
    then grows by 32 blocks at once, evicting them all (`_evict`); E finishes (32 free). C now hits nothing and
    needs 25 blocks: it fits, which the 8 revived blocks of its refusal would deny."""
    allocs = _twins(80)
    a = _admit(allocs, RequestSpec(0, 0.0, 36, 1, prefix_group=0, num_prefix_tokens=32))
    for alloc, seq in zip(allocs, a):
        alloc.free(seq)  # 9 cached blocks, free, at the tail
    e = _admit(allocs, RequestSpec(1, 0.0, 128, 1))  # 32 blocks
    b = _admit(allocs, RequestSpec(2, 0.0, 60, 200))  # 15 blocks: 32 free
    c = [_seq(RequestSpec(3, 0.0, 232, 1, prefix_group=0, num_prefix_tokens=32)) for _ in allocs]
    assert _both(allocs, c, 100) is None
    evicted = allocs[0].pool.num_evicted
    for alloc, seq in zip(allocs, b):
        assert alloc.append_slots(seq, 128)  # 32 blocks at once, A's 9 among them
    assert allocs[0].pool.num_evicted == evicted + 9
    for alloc, seq in zip(allocs, e):
        alloc.free(seq)
    assert _both(allocs, c, 100) == 0
