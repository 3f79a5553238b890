"""Forks for parallel sampling in the paged allocator: a child shares its parent's blocks, and a shared
partial block is copied on the first write into it (copy-on-write)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsim.engine.block_pool import Block
from kvsim.engine.paged_layout import PagedRequest
from kvsim.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvsim.engine.block_pool import BlockPool


class ForkCopyOnWrite:
    """PagedAllocator's forks and copy-on-write (a mixin: the state is the allocator's, set in its __init__).

    `_fork_partials` records the shared partial blocks (block id -> tokens computed in it at the fork);
    `_cow` queues the (src, dst) copies the cache layer must make. A child's hashes are chained with the
    prefix-caching steps (`_token_blocks`, `_chain`); its capacity is set with the allocator's `_set_cap`.
    """

    block_size: int
    pool: BlockPool
    _reqs: dict[Sequence, PagedRequest]
    _shareable: bool
    _cow: list[tuple[int, int]]
    _fork_partials: dict[int, int]

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """`child` shares the blocks of `parent`'s computed tokens; a shared partial block is copied on write."""
        if not self._shareable:
            return False  # mixed models: sliding and state blocks cannot be shared
        assert child not in self._reqs
        parent_req = self._reqs[parent]
        computed = parent.num_computed_tokens
        shared = parent_req.tables[0][: -(-computed // self.block_size)]
        self.pool.touch(shared)
        num_hashed = min(parent_req.num_hashed, computed // self.block_size)
        token_blocks = self._token_blocks(child)
        hashes = None
        if token_blocks is not None:  # the shared blocks keep the parent's hashes; the child's own chain from them
            hashes = self._chain(parent_req.hashes[:num_hashed] if parent_req.hashes else [], token_blocks)
        req = PagedRequest(child, 1, hashes)
        req.tables[0] = list(shared)
        req.num_hashed = num_hashed
        req.hit = computed
        self._set_cap(req, len(shared) * self.block_size)
        self._reqs[child] = req
        if computed % self.block_size:
            self._fork_partials[shared[-1].block_id] = computed % self.block_size
        parent_req.quiet_until = req.quiet_until = -1  # both take the slow path once: copy-on-write check
        return True

    def pop_copy_on_write(self) -> list[tuple[int, int]]:
        """Pending (src_block_id, dst_block_id) copies made by copy-on-write; the cache layer copies the data."""
        out, self._cow = self._cow, []
        return out

    def _copy_on_write(self, table0: list[Block | None], j: int) -> None:
        """Swap shared block `j` of `table0` for a fresh one before this request writes into it (the caller
        checked it is shared and has room) and queue the data copy for `pop_copy_on_write`."""
        pool = self.pool
        src = table0[j]
        (dst,) = pool.get_new_blocks(1)
        pool.free_blocks((src,))
        table0[j] = dst
        if src.ref_count <= 1:
            self._fork_partials.pop(src.block_id, None)
        self._cow.append((src.block_id, dst.block_id))

    def _forget_partials(self, blocks: list[Block | None]) -> None:
        """Drop fork-partial records of `blocks` that are no longer shared."""
        for block in blocks:
            if block is not None and block.ref_count <= 1:
                self._fork_partials.pop(block.block_id, None)
