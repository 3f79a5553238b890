"""The paged allocator for a model of one KV cache group (full attention or MLA layers only): vLLM v1's
`KVCacheManager` over its single-group coordinator, with prefix caching and the admission watermark.

A mixed model's groups are `HybridPagedAllocator`'s (`kv_cache_manager`); this class is their single-group fast
path, with every step of a decode token inlined: a replay spends most of its time here.
"""

from __future__ import annotations

from collections.abc import Container
from weakref import WeakSet

import numpy as np

from kvsim.engine.allocator import KVAllocator, MemoryBreakdown
from kvsim.engine.paged.block_pool import BlockPool
from kvsim.engine.paged.kv_cache_utils import RequestBlockKeys
from kvsim.engine.paged.prefix_table import EMPTY, SLOT_BITS, SLOT_MASK
from kvsim.engine.sequence import Sequence
from kvsim.errors import KvsimError
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.size.vllm_capacity import bytes_per_block, num_gpu_blocks

_FEW_HITS = 8  # up to this many hits, a lookup checks them one at a time (and keeps no answer for a retry)
_EAGER = 1 << 62  # `PagedRequest.lazy_from` of a request whose every block is cached as it fills
_FEW_BLOCKS = 24  # a table of up to this many blocks is freed as a list (the pool's one-at-a-time path), else an array
_NO_BLOCKS = np.empty(0, dtype=np.int64)
_NO_BLOCKS_VIEW = memoryview(_NO_BLOCKS)


class PagedRequest:
    """The allocator's state for one admitted request (mutable, owned by PagedAllocator)."""

    __slots__ = ("seq", "final", "ids", "table", "num_blocks", "hashes", "runs", "num_hashed", "lazy_from",
                 "quiet_until", "hit", "cap", "used", "returning")

    def __init__(self, seq: Sequence, hashes: tuple[np.ndarray, list[int]] | None, lazy_from: int = _EAGER):
        self.seq = seq
        self.final = seq.num_final_tokens
        # The block table: its first `num_blocks` entries of `ids`, an int64 array with room for the blocks of its
        # final tokens (blocks are only ever appended); `table` is the same memory as a memoryview, one block
        # at a time as Python ints. An array, not a list: a 12,000-token prompt's 750 blocks are taken, cached
        # and freed as one, with no Python int per block.
        self.ids: np.ndarray = _NO_BLOCKS
        self.table: memoryview = _NO_BLOCKS_VIEW
        self.num_blocks = 0
        # the keys of every full block of the final tokens, (blocks,) int64, and where their runs start
        # (`key_runs`); None: no prefix caching
        self.hashes, self.runs = hashes if hashes is not None else (None, None)
        self.num_hashed = 0  # leading blocks registered in the prefix cache
        # blocks from this index on (its private blocks) are cached when its blocks are freed, not as they fill
        self.lazy_from = lazy_from
        self.quiet_until = -1  # an append up to this many computed + new tokens is one compare
        self.hit = 0  # prefix-cache hit at admission
        self.cap = 0  # token slots allocated: num_blocks * block_size
        self.used = 0  # min(cap, num_final_tokens): slots this request will ever use
        self.returning = False  # it was freed before it finished (a preemption), and admitted again


class PagedAllocator(KVAllocator):
    """Block tables over a pool of `num_gpu_blocks = budget // bytes_per_block` blocks, block 0 the null block;
    slot = block_id * block_size + offset.

    Layout of one request (block_size 4, 10 tokens computed, final length 13, 4 blocks held):

        block table  [ 7 ][ 2 ][ 9 ][ 4 ]
        tokens        0-3  4-7  8-9 | 10-12 reservation | 13-15 internal fragmentation
                      ^^^^^^^^^^^^^ token states

    `quiet_until` lets an append serve tokens with one compare: the next block to open or to hash comes one
    token later. The running totals `_sum_cap` and `_sum_used` over admitted requests make `breakdown()` one
    pass over their computed lengths.

    Private blocks are cached lazily. A request with exact block keys (`Sequence.block_keys`, a replay's
    `make_block_keys`) keys every block whose last token is past its prompt (j >= prompt // block_size) by its
    own stream, and on its first admission every block from `num_shareable_tokens // block_size` on by streams no
    other request has (`kvsim.workload.requests.num_shareable_tokens`; on a re-admission its prompt's blocks are
    cached as they fill, for older copies of their keys may be cached): no other request ever looks such a key up
    (a parallel-sampling child shares only the prompt's blocks). Its entry matters only once the request's blocks
    are freed (their place in the free queue, its own re-admission's hit, eviction order), so these blocks are not
    cached as they fill but all at once just before `free`, `free_finished` or `pop_blocks_for_free`
    (`_cache_private_blocks`), up to where vLLM's eager caching would have taken them by then, in the same
    order: the table, its duplicates and the free queue are then exactly as eager
    caching leaves them (an older copy of the key, from the request's earlier admission, evicted meanwhile or
    not, answers or queues the new block alike; the blocks are held, so no eviction meets them). A finished
    request never looks its own keys up again: if it was never freed before (no older copy of them exists), its
    private blocks are not cached at all but queue as cached blocks do (`free_finished`). A decode block then
    costs what it costs without prefix caching. Where that bound is, from the request's state at the free:

        synchronous scheduling      min(computed, final) tokens     vLLM's allocate_slots caches
                                                                    min(computed + new, num_tokens), and every
                                                                    step scheduled has computed
        async scheduling            min(computed - in flight,       the last `cache_blocks` of a processed
                                        known, final)               output (update_from_output), or the last
                                                                    allocate_slots when no step is in flight

    A request preempted with a step in flight whose tokens were all known when that step was scheduled (no
    output of it was processed since) had its blocks cached further, up to min(computed, known), by that
    step's allocate_slots: the scheduler asks `cache_blocks` for those before the free. `cache_blocks` caches
    private blocks too (exact eager caching up to its bound), so a scheduler that calls it as outputs settle
    stays exact; it need not for lazy requests (`needs_settled_caching`). Laziness stops (requests admitted
    from then on cache every block as it fills) once something observes caching as it happens: a router's view
    of the cache (`cached_block_hashes`) or a KV connector's question (`get_computed_tokens`). Requests keyed by
    hashes of their token ids cache every block as it fills (two requests' outputs may repeat each other).
    """

    caches_private_blocks_at_free = True  # a request's blocks keyed by its own streams (see above)

    paged = True

    def __init__(
        self,
        spec: KVCacheSpec,
        budget_bytes: int,
        *,
        max_model_len: int,
        enable_prefix_caching: bool = False,
        watermark: float = 0.0,
    ):
        if not 0.0 <= watermark < 1.0:
            raise KvsimError(f"watermark must be in [0, 1), got {watermark}", field="watermark")
        if max_model_len <= 0:
            raise KvsimError(f"max_model_len must be positive, got {max_model_len}", field="max_model_len")
        assert spec.is_uniform and spec.pool is None, "a mixed model's groups are HybridPagedAllocator's"
        self.spec = spec
        self.budget_bytes = budget_bytes
        self.block_size = spec.block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark
        self.bytes_per_token = spec.bytes_per_token
        self.bytes_per_block = bytes_per_block(spec)
        self.num_blocks = num_gpu_blocks(spec, budget_bytes)  # the null block included
        self.num_slots = self.num_blocks * self.block_size
        self.watermark_blocks = int(watermark * self.num_blocks)
        self.pool = BlockPool(self.num_blocks, enable_caching=enable_prefix_caching)
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self._reqs: dict[Sequence, PagedRequest] = {}
        self._sum_cap = 0  # token slots allocated, over admitted requests
        self._num_popped = 0  # blocks handed out by pop_blocks_for_free and not yet returned
        self._sum_used = 0  # of those, slots before each request's final length
        self._keys = RequestBlockKeys(self.block_size)
        self._last_hit: tuple | None = None  # (keys, hit blocks as an array) of the last lookup of more than 8
        # the last lookup's hit array, and its blocks' ref counts, which are free and how many (`_count_free`)
        self._hit_refs: tuple[np.ndarray, np.ndarray, np.ndarray, int] | None = None
        # the last refused admission, until the next admission: (seq, its token ids, its keys, query, hit blocks,
        # revived, the pool's `num_evicted` then); see `_still_refused`
        self._refused: tuple | None = None
        # requests admitted from now on with exact block keys cache their private blocks lazily (see above)
        self.lazy_private_blocks = enable_prefix_caching
        self._num_eager = 0  # admitted requests that cache every block as it fills
        # requests freed before they finished (preempted): their private keys may have older copies cached (weak:
        # a caller that frees finished requests with `free` does not keep them alive here)
        self._returning: WeakSet[Sequence] = WeakSet()

    # --- the KVAllocator interface ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def kv_cache_usage(self) -> float:
        return self.pool.get_usage()

    @property
    def needs_settled_caching(self) -> bool:
        """Whether some admitted request caches its blocks as its tokens settle (async scheduling's
        `cache_blocks` after each output); False: every admitted request caches its private blocks lazily and
        the scheduler may skip those calls."""
        return self._num_eager > 0

    def cached_block_hashes(self) -> Container[int]:
        """The keys cached now (a router's view). Not a pure query: the router reads caching as it happens, so
        requests admitted from now on cache every block as it fills. Membership of a prompt block's key, which is
        what a router asks, is exact either way (no lazy block's key is another request's); the container's size
        is not while requests admitted before still hold lazy blocks (a router asks before the first admission)."""
        self.lazy_private_blocks = False
        return self.pool.cached_hashes()

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        *,
        num_tokens: int | None = None,
        full_sequence_must_fit: bool = False,
        apply_watermark: bool = True,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        reserved_blocks: int = 0,
    ) -> int | None:
        """Admit `seq` with room for its prefix-cache hit plus `num_new_tokens`, or None (nothing changed).

        A CPU tier's hit (`num_external_computed_tokens`, past the prefix-cache hit) takes blocks too; with
        `delay_cache_blocks` (an asynchronous load) the blocks past the prefix-cache hit are cached only once the
        load is done (`cache_blocks`), as vLLM's `allocate_slots`; `reserved_blocks` stay free for other requests
        (checked against this allocation, not against the whole sequence of `full_sequence_must_fit`).

        As vLLM's `KVCacheManager.allocate_slots` for a waiting request: the blocks it needs (for all
        `num_tokens` when `full_sequence_must_fit`, else for the hit plus this chunk), counting revived cached
        hits, plus the watermark when `apply_watermark` (vLLM: only while some request is running), must not
        exceed the free blocks.
        """
        assert seq not in self._reqs, f"{seq} is already admitted"
        refused = self._refused
        if refused is not None and refused[0] is seq and self._still_refused(
                refused, num_new_tokens, num_tokens, full_sequence_must_fit, apply_watermark,
                num_external_computed_tokens, reserved_blocks):
            return None
        bs = self.block_size
        hit_blocks: list[int] | np.ndarray = []
        hashes: tuple[np.ndarray, list[int]] | None = None
        query = 0
        if num_tokens is None:
            num_tokens = max(seq.num_prompt_tokens, num_new_tokens)
        if self.enable_prefix_caching and self._keys.has_keys(seq):
            hashes = self._keys.get(seq)
            query = min(num_tokens, seq.num_final_tokens)
            hit_blocks, revived = self._find_longest_cache_hit(hashes, (query - 1) // bs, count_free=True)
        else:
            revived = 0
        hit = len(hit_blocks) * bs
        total = self._tokens_if_they_fit(len(hit_blocks), revived, num_new_tokens, num_tokens,
                                         full_sequence_must_fit, apply_watermark, num_external_computed_tokens,
                                         reserved_blocks)
        if total is None:
            return self._refuse(seq, hashes, query, len(hit_blocks), revived)
        self._refused = None
        num_blocks = -(-total // bs)

        lazy_from = _EAGER
        returning = False
        if hashes is not None:
            self._keys.forget()  # admitted: its keys move to its PagedRequest
            returning = seq in self._returning
            if self.lazy_private_blocks and seq.block_keys is not None:
                # its blocks from here on are its own streams'; its prompt's, only on a first admission (a
                # re-admission's may have older copies, which eager caching queues them behind as they fill)
                shareable = seq.num_shareable_tokens
                lazy_from = (seq.num_prompt_tokens if shareable is None or returning else shareable) // bs
            else:
                self._num_eager += 1
        req = PagedRequest(seq, hashes, lazy_from)
        req.returning = returning
        req.num_hashed = len(hit_blocks)
        req.hit = hit
        # the hits, before get_new_blocks so that they cannot be evicted: an array's with the ref counts its
        # lookup read (`_count_free`), a list's one at a time
        num_hit = len(hit_blocks)
        if type(hit_blocks) is list:
            self.pool.touch(hit_blocks)
        else:
            assert self._hit_refs is not None and self._hit_refs[0] is hit_blocks
            self.pool.touch_hit(*self._hit_refs)
        self._hit_refs = None
        new_blocks = self.pool.get_new_block_ids(num_blocks - num_hit)
        req.ids = ids = np.empty(max(num_blocks, -(-req.final // bs)), dtype=np.int64)  # (blocks of its final tokens,)
        req.table = table = memoryview(ids)
        if type(hit_blocks) is not list:
            ids[:num_hit] = hit_blocks
        elif num_hit:
            for i, block in enumerate(hit_blocks):
                table[i] = block
        if type(new_blocks) is list:  # a few: one at a time
            for i, block in enumerate(new_blocks, num_hit):
                table[i] = block
        else:
            ids[num_hit:num_blocks] = new_blocks
        req.num_blocks = num_blocks
        self._set_cap(req, num_blocks * bs)
        self._reqs[seq] = req
        if query:
            self.prefix_query_tokens += query
            self.prefix_hit_tokens += hit
        end = hit if delay_cache_blocks else total
        if end > lazy_from * bs and not req.returning:  # (a first admission's private prompt blocks wait too)
            end = lazy_from * bs
        self._cache_full_blocks(req, end)
        self._refresh(req)
        return hit

    def num_blocks_held(self, seq: Sequence) -> int:
        """Blocks in `seq`'s block table."""
        return self._reqs[seq].num_blocks

    def num_blocks_to_finish(self, seq: Sequence) -> int:
        """Blocks admitted `seq` still needs to hold all its tokens (vLLM's `_request_remaining_blocks`)."""
        need = -(-min(seq.num_tokens, self.max_model_len) // self.block_size)
        return max(0, need - self._reqs[seq].num_blocks)

    def get_computed_tokens(self, seq: Sequence, num_tokens: int) -> int:
        """The prefix-cache hit `allocate` would find for `seq` now, in tokens, leaving the table and `seq` as they
        are (what vLLM's scheduler hands a KV connector before it allocates); requests admitted from now on cache
        every block as it fills."""
        # a KV connector asks this before each admission: it sees caching as it happens, so requests admitted from
        # now on cache every block as it fills (see the class docstring)
        self.lazy_private_blocks = False
        if not self.enable_prefix_caching or not self._keys.has_keys(seq):
            return 0
        query = min(num_tokens, seq.num_final_tokens)
        return len(self._find_longest_cache_hit(self._keys.get(seq), (query - 1) // self.block_size)[0]) * self.block_size

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for `seq.num_computed_tokens + num_new_tokens` tokens; growth may dip below the watermark."""
        req = self._reqs[seq]
        total = seq.num_computed_tokens + num_new_tokens
        if total <= req.quiet_until:
            return True
        return self._grow(req, total)

    def append_decode_in_order(self, seqs: list[Sequence]) -> int:
        """One decode token each, stopping at the first request that cannot grow: returns its index. The
        common case (the token lands in the last block) is one compare."""
        reqs = self._reqs
        for seq in seqs:
            req = reqs[seq]
            if seq.num_computed_tokens >= req.quiet_until and not self._grow(req, seq.num_computed_tokens + 1):
                return seqs.index(seq)  # (rare: the pool is out of blocks)
        return len(seqs)

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq`; its tail blocks first so cached prefixes outlive cached suffixes. Its
        private blocks are cached first, as far as eager caching would have cached them (`_cache_private_blocks`):
        it may come back (a preemption), and its re-admission looks them up."""
        req = self._reqs.pop(seq)
        self._set_cap(req, 0)
        self._cache_private_blocks(req)
        if req.hashes is not None:
            self._returning.add(seq)
        self.pool.free_blocks(self._reversed_table(req))

    def free_finished(self, seq: Sequence) -> None:
        """`free` for a request that has finished: nothing ever looks its private blocks up again. If it was never
        freed before (no older copy of their keys can be cached), they are not cached at all, but queue where
        cached blocks do, behind the free queue's tail (`BlockPool.free_blocks`' `num_uncached`): the pool is as
        eager caching leaves it but for their table entries, which no lookup would ask for, and the evictions of
        those entries when the blocks are taken again."""
        req = self._reqs.pop(seq)
        self._set_cap(req, 0)
        if req.returning:
            self._returning.discard(seq)
        end = self._cache_private_blocks(req, listed=req.returning)
        self.pool.free_blocks(self._reversed_table(req), req.num_blocks - end)

    def pop_blocks_for_free(self, seq: Sequence) -> list:
        """Forget finished `seq`; its blocks, not yet returned (`breakdown` counts what only they hold as
        internal fragmentation until `free_popped_blocks`), with its private blocks cached first as `free` does
        (they go back later, by what they cache then)."""
        req = self._reqs.pop(seq)
        self._set_cap(req, 0)
        self._returning.discard(seq)
        self._cache_private_blocks(req)
        self._num_popped += req.num_blocks
        return req.ids[: req.num_blocks].tolist()

    def free_popped_blocks(self, blocks: list) -> None:
        self._num_popped -= len(blocks)
        self.pool.free_blocks(blocks[::-1])

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Cache `seq`'s full blocks within its first `num_tokens` tokens now (vLLM's
        `KVCacheManager.cache_blocks`, which async scheduling calls once a step's sampled tokens are known), its
        private blocks too: what eager caching has cached by now, so calling it is always exact (and needless for
        a lazy request, see `needs_settled_caching`)."""
        req = self._reqs[seq]
        j, bs = req.num_hashed, self.block_size
        if num_tokens < (j + 1) * bs or req.hashes is None:  # no block filled since (async scheduling calls
            return  # this for every request at every step)
        end = num_tokens if num_tokens < req.final else req.final  # `_cache_full_blocks`, inlined
        known = seq.num_known_tokens
        if known is not None and known < end:
            end = known
        end //= bs
        if end <= j:
            return
        assert end <= req.num_blocks, f"{seq}: caching {end} blocks, {req.num_blocks} held"
        if end == j + 1:  # one block: a decode step's
            self.pool.cache_full_block(req.table[j], req.hashes.item(j))
        else:
            self.pool.cache_full_blocks(req.table[j:end], req.hashes, req.runs, j, req.ids[j:end])
        req.num_hashed = end
        event = (end + 1) * bs  # `_refresh`: the next block to hash fills here
        req.quiet_until = req.cap if req.cap < event or end >= req.lazy_from else event - 1

    def can_ever_fit(self, seq: Sequence) -> bool:
        """Whether `seq` fits alone: its whole prompt admitted at once, then decoded to the end.

        Alone means nothing else runs, so the watermark does not apply (vLLM applies it only while a request
        is running); the null block is never usable. Blocks only grow, so the peak is the final length's.
        """
        bs, prompt, final = self.block_size, seq.num_prompt_tokens, seq.num_final_tokens
        if final > self.max_model_len:
            return False
        usable = self.pool.num_usable_blocks
        return -(-prompt // bs) <= usable and -(-final // bs) <= usable

    def max_decode_run(self, num_seqs: int) -> int:
        """Each of `num_seqs` requests grows by at most ceil((k - 1) / block_size) blocks in a run of k steps."""
        return self.pool.num_free_blocks // num_seqs * self.block_size + 1

    def block_table(self, seq: Sequence) -> list[int | None]:
        """Block ids of `seq`'s block table."""
        req = self._reqs[seq]
        return req.ids[: req.num_blocks].tolist()  # every decode step of a replay with tensors reads this

    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """The one group's block ids (a uniform model has one KV cache group)."""
        return [self.block_table(seq)]

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Slots of positions [start, end)."""
        bs = self.block_size
        req = self._reqs[seq]
        table = req.table
        assert 0 <= start <= end <= req.num_blocks * bs, (start, end)
        if start == end:
            return np.empty(0, dtype=np.int64)
        first, last = start // bs, (end - 1) // bs
        if first == last:  # a decode run inside one block: the common case
            base = table[first] * bs - first * bs
            return np.arange(base + start, base + end, dtype=np.int64)
        ids = req.ids[first : last + 1]  # (last - first + 1,)
        pos = np.arange(start, end, dtype=np.int64)  # (end - start,)
        return ids[pos // bs - first] * bs + pos % bs

    def decode_slot_mapping(self, seqs: list[Sequence], starts: np.ndarray, k: int) -> np.ndarray:
        """Slots of positions [starts[n], starts[n] + k) of each of `seqs`, as (k, N): a decode run's
        `slot_mapping` for the whole batch at once. A run of at most one block's tokens touches at most two
        blocks per request, so two block ids per request and array arithmetic replace N calls."""
        bs = self.block_size
        if k > bs or not len(seqs):
            return np.stack([self.slot_mapping(s, c, c + k) for s, c in zip(seqs, starts.tolist())], axis=1)
        reqs = [self._reqs[s] for s in seqs]
        tables = [r.table for r in reqs]
        first, last = starts // bs, (starts + k - 1) // bs  # (N,) block index of each run's first and last token
        if int(first.min()) < 0 or any(b >= r.num_blocks for r, b in zip(reqs, last.tolist())):
            raise AssertionError("decode run past the allocated blocks")  # (a table's array has room beyond them)
        b0 = np.fromiter((t[b] for t, b in zip(tables, first.tolist())), dtype=np.int64, count=len(seqs))
        pos = starts[None, :] + np.arange(k, dtype=np.int64)[:, None]  # (k, N)
        block_ids = np.broadcast_to(b0, (k, len(seqs)))  # (k, N): runs inside one block, most of them
        cross = np.flatnonzero(last != first)  # runs that step into their next block
        if len(cross):
            b1 = np.array([tables[i][b] for i, b in zip(cross.tolist(), last[cross].tolist())], dtype=np.int64)
            block_ids = block_ids.copy()
            block_ids[:, cross] = np.where(pos[:, cross] // bs == first[cross], b0[cross], b1)
        return block_ids * bs + pos % bs

    def breakdown(self, waiting_head: Sequence | None = None) -> MemoryBreakdown:
        """From the running totals: token states up to each request's computed length, reservation up to its
        final length, internal fragmentation past it; a block shared by several requests counted once.

        The replay asks for one at every row: the one pass over admitted requests is written for speed (no
        `max` call: a builtin's call costs more than the comparisons)."""
        computed = 0
        for req in self._reqs.values():  # each request's computed tokens, at least its hit, at most its used slots
            c = req.seq.num_computed_tokens
            if c < req.hit:
                c = req.hit
            used = req.used
            computed += c if c < used else used
        bpt, bpb, budget = self.bytes_per_token, self.bytes_per_block, self.budget_bytes
        pool = self.pool
        saved = pool.num_shared_refs * bpb  # shared blocks were counted once per holder
        free = pool.free_queue.num_free_blocks * bpb
        # The null block and the budget's remainder smaller than one block are never used.
        unusable = budget - pool.num_usable_blocks * bpb
        internal = (self._sum_cap - self._sum_used) * bpt + unusable
        if self._num_popped:  # blocks only a deferred free still holds (async scheduling with a KV connector)
            internal += budget - self._sum_cap * bpt - unusable - free
        return MemoryBreakdown(budget_bytes=budget, token_states_bytes=computed * bpt - saved,
                               reservation_bytes=(self._sum_used - computed) * bpt, internal_fragmentation_bytes=internal,
                               external_fragmentation_bytes=0, free_bytes=free, shared_saved_bytes=saved)

    # --- internals ---------------------------------------------------------------------------------------

    def _refresh(self, req: PagedRequest) -> None:
        """`quiet_until`: the most computed + new tokens an append serves with one compare (the next block to
        open or to hash comes one token later)."""
        event = req.cap + 1
        if req.hashes is not None and req.num_hashed < req.lazy_from:  # (lazy blocks: no event)
            event = min(event, (req.num_hashed + 1) * self.block_size)
        req.quiet_until = event - 1

    def _set_cap(self, req: PagedRequest, cap: int) -> None:
        used = min(cap, req.final)
        self._sum_cap += cap - req.cap
        self._sum_used += used - req.used
        req.cap, req.used = cap, used

    def _grow(self, req: PagedRequest, total: int) -> bool:
        """An append past `quiet_until`: new blocks up to `total` tokens, then the blocks it filled cached.

        A decode token comes here twice per block: when it fills the last block (hash and cache it) and when
        it opens the next one (one block from the pool). Both single-block cases are inlined.
        """
        bs, cap = self.block_size, req.cap
        if total > cap:
            pool = self.pool
            if total - cap <= bs:  # one block: `pool.get_new_block()`, its common case inlined
                queue = pool.free_queue
                if not queue.num_free_blocks:
                    return False
                seg = queue.segments[0]  # the head's segment: its next entry, if live (`pop_one`)
                ids, pos = seg[0], seg[3]
                if ids is not None and pos < len(ids) and queue._serial[ids[pos]] == seg[2] + pos:
                    block = ids[pos]
                    seg[3] = pos + 1
                    queue.num_entries -= 1
                    queue.num_free_blocks -= 1
                else:
                    block = queue.pop_one()
                pool._refs[block] = 1
                if pool._cached[block]:  # it caches an older prefix: evicted (`_evict_one`)
                    if pool._younger[block] or not pool._primary[block]:
                        pool._evict_one(block)
                    else:
                        pool.num_evicted += 1
                        pool._cached[block] = False
                        pool._primary[block] = False
                pool.num_blocks_allocated += 1
                n = req.num_blocks
                try:
                    req.table[n] = block
                except IndexError:  # (no room left in its array: tokens past its final ones)
                    self._make_room(req, n + 1)
                    req.table[n] = block
                req.num_blocks = n + 1
                cap += bs
            else:
                num_new = (total - cap + bs - 1) // bs
                if pool.free_queue.num_free_blocks < num_new:
                    return False
                new_blocks = pool.get_new_block_ids(num_new)
                n = req.num_blocks
                if n + num_new > len(req.ids):
                    self._make_room(req, n + num_new)
                req.ids[n : n + num_new] = new_blocks
                req.num_blocks = n + num_new
                cap += num_new * bs
            final = req.final
            used = cap if cap < final else final
            self._sum_cap += cap - req.cap
            self._sum_used += used - req.used
            req.cap, req.used = cap, used
        hashes = req.hashes
        if hashes is None:
            req.quiet_until = cap
            return True
        j = req.num_hashed
        if j >= req.lazy_from:  # the rest are private blocks: cached when they are freed
            req.quiet_until = cap
            return True
        event = (j + 1) * bs  # the next block to hash fills here
        if total < event:  # none filled (a decode token opening a block)
            req.quiet_until = cap if cap < event else event - 1
            return True
        filled = (total if total < req.final else req.final) // bs  # leading blocks all within total
        known = req.seq.num_known_tokens
        if known is not None and known < filled * bs:  # async: the last scheduled token is not known yet
            filled = known // bs
        if filled > req.lazy_from:  # the private blocks wait for the free
            filled = req.lazy_from
        if filled == j + 1:  # one block filled: `pool.cache_full_block`, its common case inlined
            block, key = req.table[j], hashes.item(j)
            pool = self.pool
            table = pool.cached_block_hash_to_block
            base = table.rows.get(key >> SLOT_BITS)
            if base is not None and table.slot[base + (key & SLOT_MASK)] == EMPTY:  # its chunk, no entry yet
                pool._hashes[block] = key
                pool._cached[block] = True
                table.slot[base + (key & SLOT_MASK)] = block
                pool._primary[block] = True
            else:
                pool.cache_full_block(block, key)
            req.num_hashed = j = filled
        elif filled > j:
            self._cache_full_blocks(req, filled * bs)
            j = req.num_hashed
        event = (j + 1) * bs  # the next block to hash fills here
        req.quiet_until = cap if cap < event or j >= req.lazy_from else event - 1
        return True

    def _find_longest_cache_hit(self, keys: tuple[np.ndarray, list[int]], max_blocks: int, *,
                                count_free: bool = False) -> tuple[list[int] | np.ndarray, int]:
        """The cached blocks of the leading keys (at most `max_blocks`; `keys`: the keys and where their runs
        start), up to the first miss: the prefix table's entries, one gather over the runs of keys, up to the first key
        it has none for or whose run starts with a stale entry (an evicted block's), then those still live,
        checked at once. With `count_free`, also how many of them nobody holds (`BlockPool.num_evictable`: a
        hit revives them), else 0. The hit blocks: a list of a few, else an int64 array (whose ref counts
        `count_free` keeps as `_hit_refs` for the admission's touch)."""
        pool = self.pool
        key_array, runs = keys
        table = pool.cached_block_hash_to_block
        rows = table.rows
        is_primary, block_hash = pool.is_primary, pool.block_hash
        last = self._last_hit
        if last is not None and last[0] is keys:  # a refused admission retried: its last answer, if it stands
            arr = last[1]
            n = min(len(arr), max_blocks)
            if n < len(arr):
                arr = arr[:n]
            still = np.count_nonzero(is_primary[arr] & (block_hash[arr] == key_array[:n])) == n
            if still and (n == max_blocks or n == len(key_array) or not self._is_live(keys, n)):
                # every block still answers its key (a live block is its key's entry) and the next key has none
                return arr, self._count_free(arr) if count_free else 0
        slot, primary, cached_key = table.slot, pool._primary, pool._hashes
        offsets, lengths = [], []  # per stretch of adjacent slots (runs led by a live entry): its first slot less
        # its first key's position, its length
        n = 0
        for r in range(len(runs) - 1):
            start = runs[r]
            if start >= max_blocks:
                break
            key = key_array.item(start)
            base = rows.get(key >> SLOT_BITS)
            if base is None:
                break
            at = base + (key & SLOT_MASK)
            block = slot[at]
            if block == EMPTY or not primary[block] or cached_key[block] != key:
                break
            stop = runs[r + 1]
            if stop > max_blocks:
                stop = max_blocks
            if offsets and offsets[-1] == at - start:  # its slots follow the last run's (chunks cached in order)
                lengths[-1] += stop - start
            else:
                offsets.append(at - start)
                lengths.append(stop - start)
            n = stop
        if n <= _FEW_HITS:  # a few: block by block, through the memoryviews (numpy's fixed cost is more)
            self._hit_refs = None
            hits: list[int] = []
            first = 0
            for offset, length in zip(offsets, lengths):
                for i, key in enumerate(key_array[first : first + length].tolist(), first):
                    block = slot[offset + i]
                    if block == EMPTY or not primary[block] or cached_key[block] != key:
                        return hits, pool.num_evictable(hits) if count_free else 0
                    hits.append(block)
                first += length
            return hits, pool.num_evictable(hits) if count_free else 0
        if len(offsets) == 1:
            arr = table.slots[offsets[0] : offsets[0] + n].copy()  # (n,)
        else:
            arr = table.slots[np.repeat(offsets, lengths) + np.arange(n)]  # (n,)
        live = is_primary[arr] & (block_hash[arr] == key_array[:n])  # (n,) an empty slot (block 0) is never live
        if np.count_nonzero(live) != n:  # (count_nonzero: a fraction of all()'s fixed cost)
            n = int(live.argmin())  # the hit ends before the first key without a live entry
            arr = arr[:n]
        self._last_hit = (keys, arr)
        return arr, self._count_free(arr) if count_free else 0

    def _count_free(self, hit: np.ndarray) -> int:
        """How many of `hit`'s blocks nobody holds; their ref counts and which are free are kept as `_hit_refs`
        for the admission's `BlockPool.touch_hit` (nothing changes a ref count in between)."""
        refs = self.pool.ref_count[hit]  # (n,)
        free = refs == 0  # (n,)
        num_free = int(np.count_nonzero(free))
        self._hit_refs = (hit, refs, free, num_free)
        return num_free

    def _refuse(self, seq: Sequence, hashes: tuple[np.ndarray, list[int]] | None, query: int, num_hit: int,
                revived: int) -> None:
        """`allocate` refuses `seq`: what its retry needs to know whether the refusal stands (`_still_refused`)."""
        if hashes is not None:
            self._refused = (seq, seq.token_ids, hashes[0], query, num_hit, revived, self.pool.num_evicted)
        return None

    def _still_refused(self, refused: tuple, num_new_tokens: int, num_tokens: int | None,
                       full_sequence_must_fit: bool, apply_watermark: bool, ext: int, reserved_blocks: int) -> bool:
        """Whether `allocate` would refuse the last refused request again now, answered without its lookup (a
        refused queue head is asked again at every step); False: not known, `allocate` decides.

        At the refusal its hit was `h` blocks, `r` of them free. Its hit now is the longest run of live leading
        keys (capped as then), so at most `h` while key `h` has no live entry; fewer hit blocks never need fewer
        new blocks (the blocks for this chunk past the hit, less the hit, only grow as the hit shrinks). While
        no cached block was evicted (the pool's `num_evicted`), its `h` hit blocks all still answer and its `r`
        free ones are still free (only a hit takes a free block out of the queue but for an eviction, and any
        admission ends the record): at least `r` revived; else at least 0.
        If even those lower bounds exceed the free blocks now, the refusal stands, whatever else changed (frees,
        inserts, this step's token budget): the exact answer, as the full path would give it."""
        seq, token_ids, key_array, query, num_hit, revived, evicted = refused
        if seq.token_ids is not token_ids:
            return False
        bs = self.block_size
        if num_tokens is None:
            num_tokens = max(seq.num_prompt_tokens, num_new_tokens)
        if min(num_tokens, seq.num_final_tokens) != query:
            return False
        pool = self.pool
        if num_hit < (query - 1) // bs and num_hit < len(key_array):  # its next key: a live entry would extend it
            key = key_array.item(num_hit)
            table = pool.cached_block_hash_to_block
            base = table.rows.get(key >> SLOT_BITS)
            if base is not None:
                block = table.slot[base + (key & SLOT_MASK)]
                if block != EMPTY and pool._primary[block] and pool._hashes[block] == key:
                    return False
        if pool.num_evicted != evicted:
            revived = 0
        return self._tokens_if_they_fit(num_hit, revived, num_new_tokens, num_tokens, full_sequence_must_fit,
                                        apply_watermark, ext, reserved_blocks) is None

    def _tokens_if_they_fit(self, num_hit: int, revived: int, num_new_tokens: int, num_tokens: int,
                            full_sequence_must_fit: bool, apply_watermark: bool, ext: int,
                            reserved_blocks: int) -> int | None:
        """The tokens an admission with a hit of `num_hit` blocks (`revived` of them free) holds room for (the hit,
        a CPU tier's `ext` tokens and this chunk), or None where `allocate`'s rule refuses it: the whole sequence
        first with `full_sequence_must_fit` (the reservation not counted), then this allocation leaving
        `reserved_blocks` free; the watermark kept free when `apply_watermark`."""
        bs = self.block_size
        hit = num_hit * bs
        total = hit + ext + min(num_new_tokens, num_tokens - hit - ext)
        num_blocks = -(-total // bs)
        watermark = self.watermark_blocks if apply_watermark else 0
        free = self.pool.free_queue.num_free_blocks
        if full_sequence_must_fit:
            full = -(-min(num_tokens, self.max_model_len) // bs)
            if max(full, num_blocks) - num_hit + revived + watermark > free:
                return None
        if num_blocks - num_hit + revived + watermark + reserved_blocks > free:
            return None
        return total

    def _is_live(self, keys: tuple[np.ndarray, list[int]], i: int) -> bool:
        """Whether key `i` of `keys` has a live entry (a block caching it that answers for it)."""
        pool = self.pool
        key = keys[0].item(i)
        block = pool.cached_block_hash_to_block.get(key)
        return block != EMPTY and bool(pool.is_primary[block]) and pool.block_hash[block] == key

    @staticmethod
    def _reversed_table(req: PagedRequest) -> list[int] | np.ndarray:
        """`req`'s block table last block first, as the pool frees it: a list for a few, else an int64 array."""
        n = req.num_blocks
        if n <= _FEW_BLOCKS:
            blocks = req.table[:n].tolist()
            blocks.reverse()
            return blocks
        return req.ids[n - 1 :: -1]

    @staticmethod
    def _make_room(req: PagedRequest, num_blocks: int) -> None:
        """Room for `num_blocks` in `req`'s table: a larger array (twice the size at least), its blocks copied."""
        ids = np.empty(max(num_blocks, 2 * len(req.ids)), dtype=np.int64)
        ids[: req.num_blocks] = req.ids[: req.num_blocks]
        req.ids, req.table = ids, memoryview(ids)

    def _cache_private_blocks(self, req: PagedRequest, *, listed: bool = True) -> int:
        """A lazy request's blocks are about to be freed: cache its private blocks as far as vLLM's eager caching
        would have by now (the class docstring's bound: computed tokens less those in flight, within the known
        and the final tokens), oldest first, in one `cache_full_blocks` call; with `listed` False, leave them
        uncached (`free_finished`). Returns how many leading blocks of its table are cached, or with `listed`
        False would be: those the free queue takes as cached ones."""
        if req.lazy_from == _EAGER:
            if req.hashes is not None:
                self._num_eager -= 1
            return req.num_hashed
        seq = req.seq
        end = seq.num_computed_tokens - seq.num_in_flight_tokens
        known = seq.num_known_tokens
        if known is not None and known < end:
            end = known
        if req.final < end:
            end = req.final
        end //= self.block_size
        j = req.num_hashed
        if end <= j:
            return j
        assert end <= req.num_blocks, f"{seq}: caching {end} blocks, {req.num_blocks} held"
        if not listed:
            return end
        if end == j + 1:
            self.pool.cache_full_block(req.table[j], req.hashes.item(j))
        else:
            self.pool.cache_full_blocks(req.table[j:end], req.hashes, req.runs, j, req.ids[j:end])
        req.num_hashed = end
        return end

    def _cache_full_blocks(self, req: PagedRequest, total: int) -> None:
        """Cache every full block whose tokens are all within `total` (computed + scheduled) and known under
        its hash (`BlockPool.cache_full_blocks`)."""
        hashes = req.hashes
        if hashes is None:
            return
        j = req.num_hashed
        known = req.seq.num_known_tokens
        end = min(total, req.final, req.final if known is None else known) // self.block_size
        if j >= end:
            return
        assert end <= req.num_blocks, f"{req.seq}: caching {end} blocks, {req.num_blocks} held"
        # fresh blocks: a request's hits end before num_hashed
        if end == j + 1:  # one block (async scheduling caches each decode block so): as `_grow` does
            self.pool.cache_full_block(req.table[j], hashes.item(j))
        else:
            self.pool.cache_full_blocks(req.table[j:end], hashes, req.runs, j, req.ids[j:end])
        req.num_hashed = end
