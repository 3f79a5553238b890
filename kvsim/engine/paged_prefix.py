"""Prefix caching for the paged allocator: chained hashes of a request's full blocks, the lookup of its
leading cache hits at admission, and the registration of blocks in the cache as they fill."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvsim.engine.block_pool import Block
from kvsim.engine.paged_layout import PagedRequest
from kvsim.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvsim.engine.block_pool import BlockPool

_ROOT_HASH = 0x6B7673696D  # parent hash of a request's first block


class PrefixCaching:
    """PagedAllocator's prefix-caching steps (a mixin: the state is the allocator's, set in its __init__).

    A full block is cached under hash((parent block's hash, its token bytes)), so one hash names the whole
    prefix up to the block's end; `pool.cached_block_hash_to_block` maps hashes to blocks.
    """

    enable_prefix_caching: bool
    block_size: int
    pool: BlockPool
    _reqs: dict[Sequence, PagedRequest]
    _block_bytes_dtype: np.dtype

    def _token_blocks(self, seq: Sequence) -> list[bytes] | None:
        """`seq`'s token ids as int64 bytes, one object per full block of its final length (what a block's hash
        is taken of); None when nothing is hashed. One C call cuts them all (a void-dtype view's tolist)."""
        if not self.enable_prefix_caching or seq.token_ids is None:
            return None
        end = seq.num_final_tokens // self.block_size * self.block_size
        token_ids = np.ascontiguousarray(seq.token_ids[:end], dtype=np.int64)  # (end,)
        return token_ids.view(self._block_bytes_dtype).tolist()  # end // block_size bytes objects

    def _lookup(self, token_blocks: list[bytes], max_blocks: int) -> tuple[list[int], list[Block]]:
        """Chained hashes of leading full blocks while they hit the cache (the first miss's hash included).

        Hashes stop at the first miss: a request refused at admission (and retried each step) pays little.
        """
        get = self.pool.cached_block_hash_to_block.get
        hashes: list[int] = []
        hits: list[Block] = []
        parent = _ROOT_HASH
        for block_bytes in token_blocks[:max_blocks]:
            parent = hash((parent, block_bytes))
            hashes.append(parent)
            block = get(parent)
            if block is None:
                break
            hits.append(block)
        return hashes, hits

    def _chain(self, hashes: list[int], token_blocks: list[bytes]) -> list[int]:
        """`hashes` (of leading blocks) extended to every block of `token_blocks`: hash((parent hash, bytes)).

        All of an admitted request's blocks at once, in one tight loop: a decode step that fills a block
        then only looks its hash up.
        """
        h = hashes[-1] if hashes else _ROOT_HASH
        append = hashes.append
        for block_bytes in token_blocks[len(hashes) :]:
            h = hash((h, block_bytes))
            append(h)
        return hashes

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Cache `seq`'s full blocks within its first `num_tokens` tokens now (vLLM's
        `KVCacheManager.cache_blocks`, which async scheduling calls once a step's sampled tokens are known)."""
        req = self._reqs[seq]
        self._register(req, num_tokens)
        self._refresh(req)

    def _register(self, req: PagedRequest, total: int) -> None:
        """Cache every full block whose tokens are all within `total` (computed + scheduled) and known under
        its hash."""
        hashes = req.hashes
        if hashes is None:
            return
        j = req.num_hashed
        known = req.seq.num_known_tokens
        end = min(total, req.final, req.final if known is None else known) // self.block_size
        if j >= end:
            return
        pool = self.pool
        cached = pool.cached_block_hash_to_block
        for block, h in zip(req.tables[0][j:end], hashes[j:end]):  # as BlockPool.cache_full_block, inlined
            if block.block_hash is None:
                block.block_hash = h
                if cached.setdefault(h, block) is not block:
                    pool.add_duplicate(block)
        req.num_hashed = end
