"""The paged allocator's growth: new blocks as a request's tokens pass its capacity, sliding-window freeing,
copy-on-write of a shared partial block, and the one-lane decode path with hashing inlined."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsim.engine.paged_layout import Lane, PagedRequest

if TYPE_CHECKING:
    from kvsim.engine.block_pool import BlockPool


class PagedGrowth:
    """PagedAllocator's growth steps (a mixin: the state is the allocator's, set in its __init__).

    `quiet_until` lets an append serve tokens with one compare; `_refresh` sets it after each event. The
    running totals `_sum_cap`, `_sum_used` and `_sum_freed` (for `breakdown()`) change here and in `_set_cap`.
    Copy-on-write and prefix registration are the fork and prefix-caching mixins' (`_copy_on_write`, `_register`).
    """

    block_size: int
    lanes: list[Lane]
    pool: BlockPool
    _shareable: bool
    _pages_per_block: int
    _sum_cap: int
    _sum_used: int
    _sum_freed: list[int]

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
            if block.block_hash is None:  # BlockPool.cache_full_block, inlined
                block.block_hash = h
                if self.pool.cached_block_hash_to_block.setdefault(h, block) is not block:
                    self.pool.add_duplicate(block)
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
