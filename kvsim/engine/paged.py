"""The paged allocator (vLLM v1 class): block tables, prefix caching, forks with copy-on-write, watermark.

Mixed models share one pool of equal-size pages: each layer group's block takes a whole number of pages,
sliding-window groups free blocks that fall wholly outside the window, state groups take pages once.
"""

from __future__ import annotations

import operator

import numpy as np

from kvsim.engine.allocator import KVAllocator
from kvsim.engine.block_pool import Block, BlockPool
from kvsim.engine.kv_cache_spec import KVCacheSpec
from kvsim.engine.paged_breakdown import PagedBreakdown
from kvsim.engine.paged_fork import ForkCopyOnWrite
from kvsim.engine.paged_layout import Lane, PagedRequest, page_layout
from kvsim.engine.paged_prefix import PrefixCaching
from kvsim.engine.sequence import Sequence
from kvsim.errors import KvsimError

_BLOCK_ID = operator.attrgetter("block_id")


class PagedAllocator(PrefixCaching, ForkCopyOnWrite, PagedBreakdown, KVAllocator):
    """Block tables over a pool of `budget // page_bytes` pages; slot = block_id * block_size + offset.

    Layout of one request (block_size 4, 10 tokens computed, final length 13, 4 blocks held):

        block table  [ 7 ][ 2 ][ 9 ][ 4 ]
        tokens        0-3  4-7  8-9 | 10-12 reservation | 13-15 internal fragmentation
                      ^^^^^^^^^^^^^ token states

    Uniform models have one lane and page = one block. Mixed models get one lane for the full-attention
    groups and one per sliding window; the primary lane (full, else the first) defines slots. Prefix caching,
    forks with copy-on-write and `breakdown()` are mixins (paged_prefix, paged_fork, paged_breakdown) over
    the state this class keeps.
    """

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
        per_token = [g for g in spec.groups if g.kind != "state"]
        if not per_token:
            raise KvsimError("the paged allocator needs at least one attention layer group", field="model")
        if enable_prefix_caching and not spec.is_uniform:
            raise KvsimError(
                "prefix caching is not supported for models with sliding-window or state layers",
                field="prefix_caching",
            )
        self.spec = spec
        self.budget_bytes = budget_bytes
        self.block_size = bs = spec.block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark

        layout = page_layout(spec)  # one lane for the full groups, one per distinct window
        self.page_bytes = layout.page_bytes
        self.lanes: list[Lane] = list(layout.lanes)
        self._state_pages = list(layout.state_pages)
        self._state_bytes = spec.state_bytes_per_sequence
        self._state_pad = sum(self._state_pages) * self.page_bytes - self._state_bytes
        self._pages_per_block = sum(lane.pages_per_block for lane in self.lanes)
        # forks need every block shareable: one full-attention lane, no state pages (sliding blocks get freed)
        self._shareable = len(self.lanes) == 1 and self.lanes[0].window is None and not self._state_pages

        self.num_blocks = budget_bytes // self.page_bytes  # pages of the pool
        self.num_slots = self.num_blocks * bs
        self.watermark_blocks = int(watermark * self.num_blocks)
        self._block_bytes_dtype = np.dtype((np.void, bs * 8))  # one block of int64 token ids, for hashing
        self.pool = BlockPool(self.num_blocks, enable_caching=enable_prefix_caching)
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self._reqs: dict[Sequence, PagedRequest] = {}
        self._cow: list[tuple[int, int]] = []  # pending (src_block, dst_block) copies for the cache layer
        self._fork_partials: dict[int, int] = {}  # block id -> tokens computed in it, for shared partial blocks
        # Running totals over admitted requests, for a cheap breakdown().
        self._sum_cap = 0
        self._sum_used = 0
        self._sum_freed = [0] * len(self.lanes)  # tokens of freed leading blocks, per lane
        one_page_blocks = len(self.lanes) == 1 and self.lanes[0].pages_per_block == 1
        self._grow_decode = self._grow_uniform if one_page_blocks and self._shareable else self._grow

    # --- the KVAllocator protocol -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        *,
        num_tokens: int | None = None,
        full_sequence_must_fit: bool = False,
        apply_watermark: bool = True,
    ) -> int | None:
        """Admit `seq` with room for its prefix-cache hit plus `num_new_tokens`, or None (nothing changed).

        As vLLM's `KVCacheManager.allocate_slots` for a waiting request: the blocks it needs (for all
        `num_tokens` when `full_sequence_must_fit`, else for the hit plus this chunk), counting revived cached
        hits, plus the watermark when `apply_watermark` (vLLM: only while some request is running), must not
        exceed the free blocks.
        """
        assert seq not in self._reqs, f"{seq} is already admitted"
        bs = self.block_size
        hit_blocks: list[Block] = []
        hashes: list[int] | None = None
        query = 0
        if num_tokens is None:
            num_tokens = max(seq.num_prompt_tokens, num_new_tokens)
        token_blocks = self._token_blocks(seq)
        if token_blocks is not None:
            query = min(num_tokens, seq.num_final_tokens)
            hashes, hit_blocks = self._lookup(token_blocks, (query - 1) // bs)
        hit = len(hit_blocks) * bs
        total = hit + min(num_new_tokens, num_tokens - hit)
        num_blocks = -(-total // bs)
        revived = sum(1 for b in hit_blocks if b.ref_count == 0)
        checked = -(-min(num_tokens, self.max_model_len) // bs) if full_sequence_must_fit else num_blocks
        new_pages = (max(checked, num_blocks) - len(hit_blocks)) * self._pages_per_block + sum(self._state_pages)
        watermark = self.watermark_blocks if apply_watermark else 0
        if new_pages + revived + watermark > self.pool.num_free_blocks:
            return None

        if hashes is not None:
            hashes = self._chain(hashes, token_blocks)  # admitted: hash the rest of its blocks now, once
        req = PagedRequest(seq, len(self.lanes), hashes)
        req.num_hashed = len(hit_blocks)
        req.hit = hit
        self.pool.touch(hit_blocks)  # before get_new_blocks, so the hits cannot be evicted
        for lane_idx, lane in enumerate(self.lanes):
            fresh = num_blocks - len(hit_blocks) if lane_idx == 0 else num_blocks
            req.tables[lane_idx] = (hit_blocks if lane_idx == 0 else []) + self.pool.get_new_blocks(fresh * lane.pages_per_block)
        for num_pages in self._state_pages:
            req.state_pages += self.pool.get_new_blocks(num_pages)
        self._set_cap(req, num_blocks * bs)
        self._reqs[seq] = req
        if query:
            self.prefix_query_tokens += query
            self.prefix_hit_tokens += hit
        self._register(req, total)
        self._refresh(req)
        return hit

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for `seq.num_computed_tokens + num_new_tokens` tokens; growth may dip below the watermark."""
        req = self._reqs[seq]
        total = seq.num_computed_tokens + num_new_tokens
        if total <= req.quiet_until:
            return True
        return self._grow_decode(req, seq.num_computed_tokens, total)

    def append_decode(self, seqs: list[Sequence]) -> list[Sequence]:
        """One decode token each. The common case (the token lands in the last block) is one compare."""
        reqs, grow = self._reqs, self._grow_decode
        failed = []
        for seq in seqs:
            req = reqs[seq]
            computed = seq.num_computed_tokens
            if computed >= req.quiet_until and not grow(req, computed, computed + 1):  # computed + 1 > quiet_until
                failed.append(seq)
        return failed

    def append_decode_in_order(self, seqs: list[Sequence]) -> int:
        """`append_decode` that stops at the first request that cannot grow and returns its index."""
        reqs, grow = self._reqs, self._grow_decode
        for i, seq in enumerate(seqs):
            req = reqs[seq]
            computed = seq.num_computed_tokens
            if computed >= req.quiet_until and not grow(req, computed, computed + 1):
                return i
        return len(seqs)

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq`; its tail blocks first so cached prefixes outlive cached suffixes."""
        req = self._reqs.pop(seq)
        self._set_cap(req, 0)
        for lane_idx, lane in enumerate(self.lanes):
            self._sum_freed[lane_idx] -= req.freed[lane_idx] * self.block_size
            table = req.tables[lane_idx]
            self.pool.free_blocks(reversed(table if lane.window is None else [b for b in table if b is not None]))
        self.pool.free_blocks(req.state_pages)
        if self._fork_partials:
            self._forget_partials(req.tables[0])

    def can_ever_fit(self, seq: Sequence) -> bool:
        """Whether `seq` fits alone: its whole prompt admitted at once, then decoded to the end.

        Alone means nothing else runs, so the watermark does not apply (vLLM applies it only while a request
        is running); the null block is never usable.

        Pages held after decode step c (c tokens computed, one more being written): every lane holds
        ceil((c + 1) / block_size) blocks, less the blocks each sliding lane freed, (c - window + 1) //
        block_size; plus the state pages. Sampled where a block opens (c a multiple of block_size), that
        count never falls (a lane frees at most one block per block opened), and between openings it only
        falls: the peak is at the step that opens the final block, c = max(prompt, (final_blocks - 1) *
        block_size). A scheduler that chunks the prompt may admit a little more than this says.
        """
        bs, prompt, final = self.block_size, seq.num_prompt_tokens, seq.num_final_tokens
        if final > self.max_model_len:
            return False
        state = sum(self._state_pages)
        usable = self.pool.num_usable_blocks
        admit_pages = -(-prompt // bs) * self._pages_per_block + state  # alone: no watermark (vLLM)
        if admit_pages > usable:
            return False
        if final == prompt:
            return True
        final_blocks = -(-final // bs)
        c = max(prompt, (final_blocks - 1) * bs)
        peak_pages = final_blocks * self._pages_per_block + state
        for lane in self.lanes:
            if lane.window is not None:
                peak_pages -= max(0, (c - lane.window + 1) // bs) * lane.pages_per_block
        return peak_pages <= usable

    def block_table(self, seq: Sequence) -> list[int | None]:
        """Block ids of `seq`'s primary lane (first page of each block); None where a sliding block was freed."""
        lane, table = self.lanes[0], self._reqs[seq].tables[0]
        if lane.window is None and lane.pages_per_block == 1:
            return list(map(_BLOCK_ID, table))  # every decode step of a replay with tensors reads this
        return [None if b is None else b.block_id for b in table[:: lane.pages_per_block]]

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Slots of positions [start, end); -1 where a sliding window freed the block (a model whose every
        layer slides: its primary lane is a sliding one), so swap and verify can skip those positions."""
        bs, k = self.block_size, self.lanes[0].pages_per_block
        table = self._reqs[seq].tables[0]
        assert 0 <= start <= end <= len(table) // k * bs, (start, end)
        if start == end:
            return np.empty(0, dtype=np.int64)
        first, last = start // bs, (end - 1) // bs
        blocks = (table[j * k] for j in range(first, last + 1))
        ids = np.fromiter((-1 if b is None else b.block_id for b in blocks), dtype=np.int64, count=last - first + 1)
        pos = np.arange(start, end, dtype=np.int64)  # (end - start,)
        block_ids = ids[pos // bs - first]
        slots = block_ids * bs + pos % bs
        if self.lanes[0].window is not None:
            slots[block_ids < 0] = -1
        return slots

    # --- internals ---------------------------------------------------------------------------------------

    def _refresh(self, req: PagedRequest) -> None:
        """`quiet_until`: the most computed + new tokens an append serves with one compare (the next block to
        open, to hash, or to leave a sliding window comes one token later)."""
        bs = self.block_size
        event = req.cap + 1
        if req.hashes is not None:
            event = min(event, (req.num_hashed + 1) * bs)
        for lane_idx, lane in enumerate(self.lanes):
            if lane.window is not None:
                event = min(event, (req.freed[lane_idx] + 1) * bs + lane.window)
        req.quiet_until = event - 1

    def _set_cap(self, req: PagedRequest, cap: int) -> None:
        used = min(cap, req.final)
        self._sum_cap += cap - req.cap
        self._sum_used += used - req.used
        req.cap, req.used = cap, used

    def _grow_uniform(self, req: PagedRequest, computed: int, total: int) -> bool:
        """`_grow` for one lane of one-page blocks with no copy-on-write pending: the decode hot path's slow step.

        A decode token comes here twice per block: when it fills the last block (hash and cache it) and when
        it opens the next one (one block from the pool). Both single-block cases are inlined.
        """
        if req.quiet_until < 0:  # just forked: the general path checks copy-on-write
            return self._grow(req, computed, total)
        bs, cap = self.block_size, req.cap
        if total > cap:
            pool = self.pool
            if total - cap <= bs:
                if not pool.free_queue.num_free_blocks:
                    return False
                req.tables[0].append(pool.get_new_block())
                cap += bs
            else:
                num_new = (total - cap + bs - 1) // bs
                if pool.free_queue.num_free_blocks < num_new:
                    return False
                req.tables[0] += pool.get_new_blocks(num_new)
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
        filled = (total if total < req.final else req.final) // bs  # leading blocks all within total
        known = req.seq.num_known_tokens
        if known is not None and known < filled * bs:  # async: the last scheduled token is not known yet
            filled = known // bs
        if filled == j + 1:  # one block filled: _register, inlined
            h = hashes[j]
            block = req.tables[0][j]
            cached = self.pool.cached_block_hash_to_block
            if block.block_hash is None and h not in cached:
                block.block_hash = h
                cached[h] = block
            req.num_hashed = j = filled
        elif filled > j:
            self._register(req, total)
            j = req.num_hashed
        event = (j + 1) * bs  # the next block to hash fills here
        req.quiet_until = cap if cap < event else event - 1
        return True

    def _grow(self, req: PagedRequest, computed: int, total: int) -> bool:
        """The slow path of an append: copy-on-write, sliding-window freeing, new blocks, prefix registration."""
        bs = self.block_size
        pool = self.pool
        table0 = req.tables[0]
        cow = self._shareable and computed % bs != 0 and table0[computed // bs].ref_count > 1
        num_blocks = -(-total // bs)
        grow_blocks = max(0, num_blocks - req.cap // bs)
        skip_blocks = []  # per lane: blocks now wholly outside the window
        reclaim = 0
        for lane_idx, lane in enumerate(self.lanes):
            if lane.window is None:
                skip_blocks.append(0)
            else:
                skip = min(max(0, (computed - lane.window + 1) // bs), req.cap // bs) - req.freed[lane_idx]
                skip_blocks.append(max(0, skip))
                reclaim += max(0, skip) * lane.pages_per_block
        if pool.num_free_blocks + reclaim < grow_blocks * self._pages_per_block + cow:
            return False

        for lane_idx, lane in enumerate(self.lanes):
            if skip_blocks[lane_idx]:
                k, table, start = lane.pages_per_block, req.tables[lane_idx], req.freed[lane_idx]
                stop = start + skip_blocks[lane_idx]
                pool.free_blocks(reversed(table[start * k : stop * k]))
                table[start * k : stop * k] = [None] * (stop - start) * k
                req.freed[lane_idx] = stop
                self._sum_freed[lane_idx] += (stop - start) * bs
        if cow:
            self._copy_on_write(table0, computed // bs)
        if grow_blocks:
            for lane_idx, lane in enumerate(self.lanes):
                req.tables[lane_idx] += pool.get_new_blocks(grow_blocks * lane.pages_per_block)
            self._set_cap(req, num_blocks * bs)
        self._register(req, total)
        self._refresh(req)
        return True
