"""The paged allocator (vLLM v1 class): block tables, prefix caching, forks with copy-on-write, watermark.

Mixed models share one pool of equal-size pages: each layer group's block takes a whole number of pages,
sliding-window groups free blocks that fall wholly outside the window, state groups take pages once.
"""

from __future__ import annotations

import numpy as np

from kvsim.engine.allocator import KVAllocator
from kvsim.engine.block_pool import Block, BlockPool
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.engine.paged_breakdown import PagedBreakdown
from kvsim.engine.paged_fork import ForkCopyOnWrite
from kvsim.engine.paged_growth import PagedGrowth
from kvsim.engine.paged_layout import Lane, PagedRequest, page_layout
from kvsim.engine.paged_prefix import PrefixCaching
from kvsim.engine.paged_slots import PagedSlots
from kvsim.engine.sequence import Sequence
from kvsim.errors import KvsimError


class PagedAllocator(PrefixCaching, ForkCopyOnWrite, PagedBreakdown, PagedGrowth, PagedSlots, KVAllocator):
    """Block tables over a pool of `budget // page_bytes` pages; slot = block_id * block_size + offset.

    Layout of one request (block_size 4, 10 tokens computed, final length 13, 4 blocks held):

        block table  [ 7 ][ 2 ][ 9 ][ 4 ]
        tokens        0-3  4-7  8-9 | 10-12 reservation | 13-15 internal fragmentation
                      ^^^^^^^^^^^^^ token states

    Uniform models have one lane and page = one block. Mixed models get one lane for the full-attention
    groups and one per sliding window; the primary lane (full, else the first) defines slots. Prefix caching,
    forks with copy-on-write, `breakdown()`, growth and slot mapping are mixins (paged_prefix, paged_fork,
    paged_breakdown, paged_growth, paged_slots) over the state this class keeps.
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
        # chunked layers are allocated as full ones (vLLM 0.33's default), so they share prefixes like them
        if enable_prefix_caching and not all(g.kind in ("full", "chunked") for g in spec.groups):
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
