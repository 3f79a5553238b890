"""The paged allocator's byte accounting: `breakdown()` from running totals over admitted requests, with
shared blocks and the shared tails of forked partial blocks counted once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsim.engine.allocator import MemoryBreakdown
from kvsim.engine.paged_layout import Lane, PagedRequest
from kvsim.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvsim.engine.block_pool import BlockPool


class PagedBreakdown:
    """PagedAllocator's `breakdown()` (a mixin: the state is the allocator's, set in its __init__).

    `_sum_cap`, `_sum_used` (over admitted requests) and `_sum_freed` (per lane) are kept up to date by the
    allocator as requests grow and free, so a breakdown costs one pass over the requests' computed lengths.
    """

    budget_bytes: int
    block_size: int
    num_blocks: int
    page_bytes: int
    lanes: list[Lane]
    pool: BlockPool
    _reqs: dict[Sequence, PagedRequest]
    _state_bytes: int
    _state_pad: int
    _sum_cap: int
    _sum_used: int
    _sum_freed: list[int]
    _fork_partials: dict[int, int]

    def breakdown(self, waiting_head: Sequence | None = None) -> MemoryBreakdown:
        computed = 0
        for req in self._reqs.values():
            c = max(req.seq.num_computed_tokens, req.hit)
            computed += req.used if c > req.used else c
        bs = self.block_size
        token_states = len(self._reqs) * self._state_bytes
        reservation = 0
        # The null block and the budget's remainder smaller than one page are never used.
        internal = len(self._reqs) * self._state_pad + self.budget_bytes - self.pool.num_usable_blocks * self.page_bytes
        for lane, freed in zip(self.lanes, self._sum_freed):
            token_states += (computed - freed) * lane.bytes_per_token
            reservation += (self._sum_used - computed) * lane.bytes_per_token
            internal += (self._sum_cap - self._sum_used) * lane.bytes_per_token + (self._sum_cap - freed) // bs * lane.pad_bytes
        # Shared blocks were counted once per holder: take the extra copies out. A shared full block is
        # token states for every holder; a fork's shared partial block is token states up to the fork, and
        # each slot after it is reservation if any holder will still write it there, else internal.
        saved = self.pool.num_shared_refs * self.page_bytes
        dup_res, dup_int = self._fork_tail_duplicates() if self._fork_partials else (0, 0)
        bpt = self.lanes[0].bytes_per_token
        token_states -= saved - (dup_res + dup_int) * bpt
        reservation -= dup_res * bpt
        internal -= dup_int * bpt
        return MemoryBreakdown(
            budget_bytes=self.budget_bytes,
            token_states_bytes=token_states,
            reservation_bytes=reservation,
            internal_fragmentation_bytes=internal,
            external_fragmentation_bytes=0,
            free_bytes=self.pool.num_free_blocks * self.page_bytes,
            shared_saved_bytes=saved,
        )

    def _fork_tail_duplicates(self) -> tuple[int, int]:
        """Slots past the fork point of shared partial blocks counted more than once: (reservation, internal).

        Each holder counts the tail [tokens, block_size) of such a block as its own reservation (positions
        before its final length) or internal fragmentation; physically it is one tail, reservation up to the
        longest holder's final length. A holder has not computed into the block (it would have copied it),
        so the block is the one at its computed length.
        """
        bs = self.block_size
        tails: dict[int, list[int]] = {}  # block id -> tail slots each holder will still write
        for req in self._reqs.values():
            c = max(req.seq.num_computed_tokens, req.hit)
            table = req.tables[0]
            if c % bs and c // bs < len(table):
                block_id = table[c // bs].block_id
                if block_id in self._fork_partials:
                    assert c % bs == self._fork_partials[block_id], (req.seq, block_id)
                    tails.setdefault(block_id, []).append(max(0, req.final - c))
        dup_res = dup_int = 0
        for block_id, writes in tails.items():
            tail = bs - self._fork_partials[block_id]
            assert len(writes) == self.pool.blocks[block_id].ref_count, (block_id, writes)
            writes = [min(w, tail) for w in writes]
            dup_res += sum(writes) - max(writes)
            dup_int += sum(tail - w for w in writes) - (tail - max(writes))
        return dup_res, dup_int
