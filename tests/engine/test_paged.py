"""PagedAllocator (one KV cache group): hand-computed block tables, slots, prefix hits, eviction, watermark."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.engine.paged.unitary_kv_cache_manager import PagedAllocator
from kvsim.engine.sequence import Sequence
from kvsim.errors import KvsimError

BS = 4
# 2 (K,V) * 1 layer * 1 head * 4 dims * 2 bytes = 16 bytes per token; a block of 4 tokens = 64 bytes.
SPEC = KVCacheSpec.uniform(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, dtype_bytes=2)
BPT, BLOCK = 16, 64


def make_alloc(num_blocks: int, *, extra: int = 0, spec: KVCacheSpec = SPEC, **kwargs) -> PagedAllocator:
    """`num_blocks` usable blocks, 1 to num_blocks: the pool has one more, block 0, vLLM's null block."""
    kwargs.setdefault("watermark", 0.0)
    return PagedAllocator(spec, (num_blocks + 1) * BLOCK + extra, max_model_len=256, **kwargs)


def make_seq(seq_id: int, prompt: int, output: int, prefix: np.ndarray | None = None) -> Sequence:
    ids = 1_000_000 + seq_id * 1_000 + np.arange(prompt + output, dtype=np.int64)
    if prefix is not None:
        ids[: len(prefix)] = prefix
    return Sequence(seq_id, prompt, output, token_ids=ids)


def admit(alloc: PagedAllocator, seq: Sequence) -> int | None:
    """Scheduler side: allocate the whole prompt, then mark it computed."""
    hit = alloc.allocate(seq, seq.num_prompt_tokens)
    if hit is not None:
        seq.num_computed_tokens = seq.num_prompt_tokens
    return hit


def decode(alloc: PagedAllocator, seq: Sequence) -> bool:
    ok = alloc.append_slots(seq, 1)
    if ok:
        seq.num_computed_tokens += 1
    return ok


def parts(alloc: PagedAllocator) -> tuple[int, int, int, int, int]:
    b = alloc.breakdown()
    return (b.token_states_bytes, b.reservation_bytes, b.internal_fragmentation_bytes, b.external_fragmentation_bytes, b.free_bytes)


def test_num_blocks_tables_slots_and_breakdown():
    alloc = make_alloc(10, extra=5)
    assert (alloc.num_blocks, alloc.num_slots, alloc.num_free_blocks) == (11, 44, 10)
    a, b = make_seq(0, 6, 4), make_seq(1, 5, 1)  # KV for 6 + 4 - 1 = 9 and 5 + 1 - 1 = 5 tokens
    assert admit(alloc, a) == 0 and admit(alloc, b) == 0
    assert alloc.block_table(a) == [1, 2] and alloc.block_table(b) == [3, 4]
    assert alloc.slot_mapping(a, 0, 6).tolist() == [4, 5, 6, 7, 8, 9]
    assert alloc.slot_mapping(b, 3, 5).tolist() == [15, 16]
    assert alloc.slot_mapping(b, 3, 5).dtype == np.int64
    # a: 6 computed, 2 reserved (final 9 > 8 slots). b: 5 computed, 0 reserved, 3 past its final 5.
    # internal = b's 3 slots + the null block + the 5-byte remainder; free = 6 blocks.
    assert parts(alloc) == (11 * BPT, 2 * BPT, 3 * BPT + BLOCK + 5, 0, 6 * BLOCK)
    assert decode(alloc, a) and decode(alloc, a) and alloc.block_table(a) == [1, 2]
    assert decode(alloc, a) and alloc.block_table(a) == [1, 2, 5]  # token 8 opens a third block
    assert alloc.slot_mapping(a, 7, 9).tolist() == [11, 20]
    # a: 9 computed of 12 slots, final 9: 3 slots internal; b's 3 as before.
    assert parts(alloc) == (14 * BPT, 0, 6 * BPT + BLOCK + 5, 0, 5 * BLOCK)
    alloc.free(a)
    c = make_seq(2, 4, 0)
    assert admit(alloc, c) == 0 and alloc.block_table(c) == [5]  # a's last block, freed first, is reused first
    alloc.free(b)
    alloc.free(c)
    assert alloc.num_free_blocks == 10 and parts(alloc) == (0, 0, BLOCK + 5, 0, 10 * BLOCK)


def test_append_decode_batches_and_reports_failures():
    alloc = make_alloc(3)
    a, b = make_seq(0, 4, 4), make_seq(1, 4, 4)
    admit(alloc, a)
    admit(alloc, b)
    assert alloc.append_decode_in_order([a, b]) == 1  # a takes the last block, b cannot grow
    assert alloc.block_table(a) == [1, 3] and alloc.block_table(b) == [2]


def test_prefix_hits_share_blocks_and_are_capped():
    alloc = make_alloc(20, enable_prefix_caching=True)
    prefix = 500 + np.arange(8, dtype=np.int64)  # two full blocks
    a, b, c = make_seq(0, 10, 2, prefix), make_seq(1, 10, 2, prefix), make_seq(2, 8, 2, prefix)
    assert admit(alloc, a) == 0
    assert admit(alloc, b) == 8
    assert alloc.block_table(b)[:2] == alloc.block_table(a)[:2]
    # Asked for 10 new tokens, but only 2 of the 10-token prompt are left past the 8-token hit: the request
    # gets room for its prompt (3 blocks), not for hit + 10 (which would strand 8 slots).
    assert alloc.block_table(b)[2:] == [4]
    assert admit(alloc, c) == 4  # the whole prompt is cached, but one token must be computed: 1 block
    assert (alloc.prefix_query_tokens, alloc.prefix_hit_tokens) == (28, 12)
    first, second = (alloc.pool.blocks[i] for i in alloc.block_table(a)[:2])
    assert (first.ref_count, second.ref_count) == (3, 2)
    bd = alloc.breakdown()
    assert bd.shared_saved_bytes == 3 * BLOCK
    # unique computed tokens: a's 10, b's 8..9, c's 4..7 in its own block.
    assert bd.token_states_bytes == 16 * BPT
    for seq in (a, b, c):
        alloc.free(seq)
    assert alloc.num_free_blocks == 20 and alloc.pool.num_shared_refs == 0
    d = make_seq(3, 10, 2, prefix)
    assert admit(alloc, d) == 8  # freed cached blocks stay reusable


def test_uncached_blocks_reused_first_and_cached_evicted_lru():
    alloc = make_alloc(6, enable_prefix_caching=True)
    a, b = make_seq(0, 5, 1), make_seq(1, 5, 1)  # one full (cached) block + one partial each
    admit(alloc, a)
    admit(alloc, b)
    assert alloc.block_table(a) == [1, 2] and alloc.block_table(b) == [3, 4]
    alloc.free(a)
    alloc.free(b)
    assert alloc.pool.free_queue.queued_ids().tolist() == [4, 2, 5, 6, 1, 3]
    d = make_seq(2, 20, 0)
    admit(alloc, d)
    assert alloc.block_table(d) == [4, 2, 5, 6, 1]  # uncached first, then a's cached block (freed first)
    assert alloc.pool.blocks[3].block_hash is not None and alloc.num_free_blocks == 1  # b's block still cached
    alloc.free(d)  # d's five full blocks join the cached tail behind b's block 3
    assert admit(alloc, make_seq(1, 5, 1)) == 4  # b's prefix survived
    assert admit(alloc, make_seq(0, 5, 1)) == 0  # a's was evicted


def test_a_recomputed_prefix_block_is_cached_as_a_duplicate():
    """A prompt wholly covered by the cache recomputes its last block (the hit is capped at num_tokens - 1).
    As vLLM's BlockPool, the recomputed block is cached too, freed to the tail, and serves once the first is
    evicted."""
    alloc = make_alloc(6, enable_prefix_caching=True)
    a = make_seq(0, 8, 0)
    admit(alloc, a)
    b = make_seq(1, 8, 0, prefix=a.token_ids)
    assert admit(alloc, b) == 4 and alloc.block_table(a) == [1, 2] and alloc.block_table(b) == [1, 3]
    pool = alloc.pool
    assert pool.blocks[3].block_hash == pool.blocks[2].block_hash is not None
    assert pool.get_cached_block(pool.blocks[2].block_hash) == 2  # the older block answers
    alloc.free(a)
    alloc.free(b)
    assert pool.free_queue.queued_ids().tolist() == [4, 5, 6, 2, 3, 1]
    d = make_seq(2, 16, 0)
    admit(alloc, d)
    assert alloc.block_table(d) == [4, 5, 6, 2]  # block 2 evicted: its younger copy, block 3, still caches
    alloc.free(d)
    assert probe_hit(alloc, np.concatenate([a.token_ids, [7]])) == 8


def probe_hit(alloc: PagedAllocator, token_ids: np.ndarray) -> int:
    """Prefix-cache hit (tokens) of a request with these token ids, admitted and freed at once."""
    seq = Sequence(99, len(token_ids), 0, token_ids=token_ids)
    hit = alloc.allocate(seq, len(token_ids))
    assert hit is not None
    alloc.free(seq)
    return hit


def test_a_block_filled_by_decode_is_cached_when_its_last_token_is_scheduled():
    alloc = make_alloc(12, enable_prefix_caching=True)
    a = make_seq(0, 5, 8)  # final 5 + 8 - 1 = 12: its 1st block full at admission, the 2nd and 3rd filled by decode
    admit(alloc, a)

    def num_cached() -> int:
        return sum(alloc.pool.blocks[i].block_hash is not None for i in alloc.block_table(a))

    assert num_cached() == 1
    for total in range(6, 13):
        assert alloc.append_decode_in_order([a]) == 1  # schedules token total - 1
        assert num_cached() == total // 4, total  # cached once its last token is scheduled, not before
        a.num_computed_tokens += 1
    assert alloc.block_table(a) == [1, 2, 3]
    alloc.free(a)
    assert probe_hit(alloc, np.concatenate([a.token_ids[:12], [7]])) == 12 and alloc.num_free_blocks == 12


def test_watermark_refuses_admission_but_not_growth():
    alloc = make_alloc(100, watermark=0.05)
    assert alloc.watermark_blocks == 5
    big = make_seq(0, 384, 30)
    assert alloc.allocate(big, 384) is None and alloc.num_free_blocks == 100  # would leave 4 < 5 free
    seq = make_seq(1, 380, 30)
    assert admit(alloc, seq) == 0 and alloc.num_free_blocks == 5
    assert alloc.allocate(make_seq(2, 1, 1), 1) is None
    assert alloc.append_slots(seq, 20) and alloc.num_free_blocks == 0  # growth may use the watermark
    assert not alloc.append_slots(seq, 21)
    assert alloc.num_free_blocks == 0 and len(alloc.block_table(seq)) == 100


def test_can_ever_fit():
    alloc = make_alloc(10, watermark=0.1)  # 1 block kept free when admitting beside a running request
    assert alloc.can_ever_fit(make_seq(0, 36, 5))  # 9 blocks to admit, 10 at the end (36 + 5 - 1 = 40 tokens)
    assert alloc.can_ever_fit(make_seq(1, 40, 0))  # all 10 blocks to admit: alone, the watermark does not apply
    assert not alloc.can_ever_fit(make_seq(2, 36, 6))  # 11 blocks at the end (36 + 6 - 1 = 41 tokens)
    assert not make_alloc(100).can_ever_fit(make_seq(3, 250, 8))  # 250 + 8 - 1 = 257: longer than max_model_len 256
def test_user_mistakes_raise_kvsim_errors():
    with pytest.raises(KvsimError, match="watermark"):
        make_alloc(10, watermark=1.5)


def test_nothing_leaks_after_a_busy_run():
    from kvsim.bench.allocator import make_trace, run_allocator_bench

    result = run_allocator_bench(num_requests=40, max_running=8, block_size=16, prefix_caching=True, seed=3)
    trace = make_trace(40, 3)
    assert result.prefill_tokens == sum(s.num_prompt_tokens for s in trace)
    # the prefill samples the first token; max_tokens - 1 decodes compute the others but the last, never written
    assert result.decode_tokens == sum(s.max_tokens - 1 for s in trace)
    assert result.blocks_allocated == sum(-(-s.num_final_tokens // 16) for s in trace)  # no hits, no preemption


def test_bench_cli_json_and_csv(cli, tmp_path):
    out = tmp_path / "bench.csv"
    res = cli(["bench", "allocator", "--num-requests", "12", "--max-running", "4", "--seed", "1", "--json", "--out", str(out)])
    assert res.exit_code == 0, res.output
    random, shared = json.loads(res.stdout)  # prefix caching on: both streams
    for data in (random, shared):
        assert data["num_requests"] == 12 and data["prefix_caching"] is True and data["decode_us_per_token"] > 0 < data["decode_cpu_us_per_token"]
    assert (random["stream"], shared["stream"]) == ("random", "shared-prefix")
    assert random["prefix_hit_tokens"] == 0 < shared["prefix_hit_tokens"]  # only the shared stream times the cached path
    lines = out.read_text().splitlines()
    assert lines[0].startswith("num_requests,max_running") and len(lines) == 3
    off = cli(["bench", "allocator", "--num-requests", "12", "--max-running", "4", "--no-prefix-caching", "--json"])
    assert [d["stream"] for d in json.loads(off.stdout)] == ["random"]
    bad = cli(["bench", "allocator", "--num-requests", "0"])
    assert bad.exit_code == 2 and "must be positive" in bad.output


def test_shared_prefix_stream_hits_the_cache_by_hand():
    from kvsim.bench.allocator import SHARED_PREFIX_GROUPS, SHARED_PREFIX_TOKENS, make_trace, run_allocator_bench

    trace = make_trace(40, 3, "shared-prefix")
    assert all((s.token_ids[:64] == trace[i % SHARED_PREFIX_GROUPS].token_ids[:64]).all() for i, s in enumerate(trace))
    # At most: every request after its group's first hits the group's full prefix blocks (a hit stops short of
    # the prompt's last token, as vLLM never serves a whole prompt from the cache); fewer where the small pool
    # evicted them. Random ids never hit.
    result = run_allocator_bench(num_requests=40, max_running=8, block_size=16, prefix_caching=True, seed=3, stream="shared-prefix")
    most = sum(min(SHARED_PREFIX_TOKENS, s.num_prompt_tokens - 1) // 16 * 16 for s in trace[SHARED_PREFIX_GROUPS:])
    assert 0 < result.prefix_hit_tokens <= most and result.prefix_hit_tokens % 16 == 0
    assert run_allocator_bench(num_requests=40, max_running=8, block_size=16, prefix_caching=True, seed=3).prefix_hit_tokens == 0


@pytest.mark.parametrize("stream", ["random", "shared-prefix"])
def test_bench_with_block_keys_and_with_token_id_hashes_does_the_same_work(stream):
    """The bench's requests carry a replay's block keys; hashing their token ids instead finds the same hits and
    takes the same blocks (the keys are equal exactly where the ids are built equal)."""
    from kvsim.bench.allocator import run_allocator_bench

    kw = dict(num_requests=60, max_running=8, block_size=16, prefix_caching=True, seed=5, stream=stream)
    keyed, hashed = run_allocator_bench(**kw), run_allocator_bench(**kw, hash_token_ids=True)
    assert (keyed.block_identity, hashed.block_identity) == ("block keys", "token-id hashes")
    same = ("prefix_hit_tokens", "prefill_tokens", "decode_tokens", "blocks_allocated", "preemptions")
    assert [getattr(keyed, f) for f in same] == [getattr(hashed, f) for f in same]


def slot_reference(alloc: PagedAllocator) -> tuple[int, int, int]:
    """(token states, reservation, internal) bytes by classifying every slot of every held block.

    A slot is token states if any holder has computed its position, else reservation if any holder will
    still write it, else internal fragmentation; each physical slot counts once. The null block (block 0,
    never handed out) is internal fragmentation.
    """
    rank = {"ts": 0, "res": 1, "int": 2}
    best: dict[tuple[int, int], str] = {}
    for seq, req in alloc._reqs.items():
        computed = max(seq.num_computed_tokens, req.hit)
        for j, block_id in enumerate(req.table[: req.num_blocks]):
            for i in range(BS):
                pos = j * BS + i
                kind = "ts" if pos < computed else "res" if pos < seq.num_final_tokens else "int"
                if rank[kind] < rank[best.get((block_id, i), "int")] or (block_id, i) not in best:
                    best[(block_id, i)] = kind
    kinds = list(best.values())
    return kinds.count("ts") * BPT, kinds.count("res") * BPT, (kinds.count("int") + BS) * BPT


@pytest.mark.parametrize("seed", range(3))
def test_breakdown_matches_a_slot_by_slot_count(seed):
    """Random admissions (chunked, prefix hits), growth and frees; every step completes its tokens."""
    rng = np.random.default_rng(seed)
    prefixes = [np.arange(100) + 1000 * k for k in range(3)]
    for _ in range(100):
        alloc = make_alloc(40, enable_prefix_caching=bool(rng.random() < 0.7))
        live: list[Sequence] = []
        for step in range(30):
            r = rng.random()
            if r < 0.3 or not live:
                prompt = int(rng.integers(1, 21))
                seq = make_seq(1000 + step, prompt, int(rng.integers(0, 13)), prefixes[rng.integers(3)][: rng.integers(0, prompt + 1)])
                chunk = int(rng.integers(1, prompt + 1))
                hit = alloc.allocate(seq, chunk, num_tokens=prompt)
                if hit is not None:
                    seq.num_computed_tokens = hit + min(chunk, prompt - hit)
                    live.append(seq)
            elif r < 0.45:
                alloc.free(live.pop(int(rng.integers(len(live)))))
            else:
                seq = live[int(rng.integers(len(live)))]
                left = seq.num_final_tokens - seq.num_computed_tokens
                n = int(rng.integers(1, left + 1)) if left else 0
                if n and alloc.append_slots(seq, n):
                    seq.num_computed_tokens += n
            assert parts(alloc)[:3] == slot_reference(alloc)


def plain_breakdown(alloc: PagedAllocator) -> tuple[int, int, int, int, int, int]:
    """`breakdown()` request by request, as written before it was tuned: computed tokens clamped to at least the
    hit and at most the slots each request will use."""
    computed = sum(min(max(r.seq.num_computed_tokens, r.hit), r.used) for r in alloc._reqs.values())
    saved = alloc.pool.num_shared_refs * BLOCK
    unusable = alloc.budget_bytes - alloc.pool.num_usable_blocks * BLOCK
    used = sum(r.used for r in alloc._reqs.values())
    cap = sum(r.cap for r in alloc._reqs.values())
    return (computed * BPT - saved, (used - computed) * BPT, (cap - used) * BPT + unusable, 0,
            alloc.num_free_blocks * BLOCK, saved)


@pytest.mark.parametrize("seed", range(6))
def test_breakdown_equals_the_plain_sums_over_random_operations(seed):
    """Admissions sharing prefixes (hits held by several requests), a request whose computed tokens are still 0
    below its hit, decode tokens, chunks and frees."""
    rng = np.random.default_rng(seed)
    alloc = make_alloc(40, extra=7, enable_prefix_caching=True)
    prefixes = [np.arange(4 * 8, dtype=np.int64) + 10_000 * p for p in range(3)]
    live: list[Sequence] = []
    for i in range(200):
        op = rng.integers(4)
        if op == 0:
            prompt = int(rng.integers(1, 40))
            s = make_seq(i, prompt, int(rng.integers(1, 20)), prefixes[rng.integers(3)][: int(rng.integers(0, prompt + 1))])
            hit = alloc.allocate(s, prompt)
            if hit is not None:
                live.append(s)
                if rng.integers(3):  # else computed stays 0, below the hit (the caller has not set it yet)
                    s.num_computed_tokens = prompt
        elif op in (1, 2) and live:
            s = live[rng.integers(len(live))]
            n = int(rng.integers(1, 6)) if op == 1 else 1
            if s.num_computed_tokens + n <= s.num_final_tokens and alloc.append_slots(s, n):
                s.num_computed_tokens += n
        elif op == 3 and live:
            alloc.free(live.pop(rng.integers(len(live))))
        b = alloc.breakdown()
        assert (b.token_states_bytes, b.reservation_bytes, b.internal_fragmentation_bytes,
                b.external_fragmentation_bytes, b.free_bytes, b.shared_saved_bytes) == plain_breakdown(alloc)


@pytest.mark.parametrize("step", [1, 3, 9])
def test_table_grows_past_its_final_tokens(step):
    """A table's array has room for the blocks of its final tokens; growth past them (one block or several at a
    time) moves it to a larger one with its blocks kept, in order, and frees every block."""
    alloc = make_alloc(20)
    seq = make_seq(0, 5, 1)  # final tokens 5: two blocks' room
    assert admit(alloc, seq) == 0
    assert alloc.block_table(seq) == [1, 2]
    while seq.num_computed_tokens < 40:
        assert alloc.append_slots(seq, step)
        seq.num_computed_tokens += step
    want = -(-seq.num_computed_tokens // BS)
    assert alloc.block_table(seq) == list(range(1, want + 1))
    assert alloc.num_blocks_held(seq) == want
    assert alloc.slot_mapping(seq, 0, seq.num_computed_tokens).tolist() == list(range(BS, BS + seq.num_computed_tokens))
    alloc.free(seq)
    assert alloc.num_free_blocks == 20


def test_decode_slot_mapping_past_the_table_is_refused():
    """A decode run may not read past a table's blocks, though its array has room there (its final tokens')."""
    alloc = make_alloc(20)
    seq = make_seq(0, 6, 10)  # final tokens 15: four blocks' room, two held after the prompt
    assert admit(alloc, seq) == 0
    assert alloc.decode_slot_mapping([seq], np.array([6]), 2).tolist() == [[10], [11]]
    with pytest.raises(AssertionError, match="past the allocated blocks"):
        alloc.decode_slot_mapping([seq], np.array([7]), 2)  # token 8 is in the third block, not held


def test_retried_admission_takes_its_own_lookups_hit():
    """A refused admission's retry finds a few hits block by block, after a lookup of more made an array that
    the evictions since made stale (same length, other blocks): its table holds the blocks this lookup found."""
    from kvsim.engine.paged.prefix_table import key_runs

    def keyed(seq_id: int, keys: list[int], prompt: int, max_tokens: int = 1) -> Sequence:
        keys = np.array(keys, dtype=np.int64)

        def block_keys(bs: int, n: int) -> tuple[np.ndarray, list[int]]:
            k = keys[: n // bs].copy()
            return k, key_runs(k)

        return Sequence(seq_id, prompt, max_tokens, block_keys=block_keys)

    def key(stream: int, j: int) -> int:
        return stream * 4096 + j

    P, Q, X = 1, 2, 3
    alloc = make_alloc(40, enable_prefix_caching=True)
    alloc.lazy_private_blocks = False  # every block cached as it fills
    c = keyed(0, [key(P, j) for j in range(3)], 12)
    a1 = keyed(1, [key(P, j) for j in range(3)], 12)
    a2 = keyed(2, [key(P, j) for j in range(6)], 24)
    b = keyed(3, [key(X, j) for j in range(6)] + [key(Q, 6)], 28)
    s = keyed(4, [key(P, j) for j in range(6)] + [key(Q, j) for j in range(6, 10)], 40)
    d = Sequence(5, 4, 200)
    assert alloc.allocate(c, 4) == 0
    c.num_computed_tokens = 4
    assert alloc.allocate(a1, 12) is not None
    a1.num_computed_tokens = 12
    assert alloc.append_slots(c, 8)
    c.num_computed_tokens = 12
    for seq in (a2, b):
        assert alloc.allocate(seq, seq.num_prompt_tokens) is not None
        seq.num_computed_tokens = seq.num_prompt_tokens
    alloc.free(a2), alloc.free(b), alloc.free(a1)
    never_used = alloc.num_free_blocks - 12
    assert alloc.allocate(d, 4 * (never_used + 3)) == 0
    d.num_computed_tokens = 4 * (never_used + 3)
    assert alloc.allocate(s, 40, reserved_blocks=1000) is None  # refused after a lookup of more than 8 blocks
    assert alloc.append_slots(d, 32)  # evicts some of those hits; a younger copy answers one of their keys
    d.num_computed_tokens += 32
    alloc.free(d)
    assert alloc.allocate(s, 40) == 12  # the retry: three hits, found block by block
    table = alloc.block_table(s)
    assert table[:3] == [alloc.pool.get_cached_block(key(P, j)) for j in range(3)]
    assert len(set(table)) == len(table)


def test_caching_past_the_blocks_held_is_refused():
    """`cache_blocks` never reads a table's spare room: caching past the blocks a request holds is an error."""
    alloc = make_alloc(10, enable_prefix_caching=True)
    seq = make_seq(0, 4, 20)
    assert admit(alloc, seq) == 0
    with pytest.raises(AssertionError, match="caching 2 blocks, 1 held"):
        alloc.cache_blocks(seq, 8)
    assert not alloc.pool.is_cached[0]  # the null block stays uncached
