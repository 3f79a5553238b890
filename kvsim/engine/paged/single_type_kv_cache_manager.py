"""One manager per KV cache group, as vLLM 0.33.0's `single_type_kv_cache_manager.py`: how many blocks a group
needs for `num_tokens`, which of its blocks fall outside the attention window (replaced by the null block)."""

from __future__ import annotations

from kvsim.engine.paged.block_pool import Block, BlockPool
from kvsim.size.kv_cache_spec import VllmGroup


class SingleTypeManager:
    """vLLM's `SingleTypeKVCacheManager` for one group over the shared pool (prefix caching off).

    The per-request block table is the caller's (`HybridCoordinator` keeps one per group and request); a
    manager only reads and extends it. Tables hold the pool's null block where blocks were skipped:

        sliding window 8, block_size 4, 13 tokens computed (processed):
        table  [ null ][ 7 ][ 9 ][ 4 ]     tokens 0-3 lie before the window of token 13 (6-13): block freed
    """

    def __init__(self, group: VllmGroup, pool: BlockPool):
        self.group = group
        self.block_size = group.block_size
        self.pool = pool
        self.null_block = pool.null_block

    def get_num_blocks_to_allocate(
        self,
        table: list[Block],
        num_tokens: int,
        apply_admission_cap: bool = False,
        new_computed_blocks: list[Block] | None = None,
        num_computed_tokens: int = 0,
    ) -> int:
        """New blocks `table` needs to hold `num_tokens` tokens (null blocks count as held, as in vLLM).

        `apply_admission_cap`: the full-sequence admission gate caps a sliding or chunked group's need at
        `max_admission_blocks_per_request` (`SingleTypeKVCacheManager.get_num_blocks_to_allocate`). A new
        request's hit (`new_computed_blocks`, `num_computed_tokens` long): the hit's blocks before the window
        become null blocks and cost nothing; a cached hit nobody holds counts, as it leaves the free queue.
        """
        required = -(-num_tokens // self.block_size)
        cap = self.group.max_admission_blocks
        if apply_admission_cap and cap is not None and cap < required:
            required = cap
        if new_computed_blocks is None:
            return max(required - len(table), 0)
        skipped = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        num_new = max(required - max(skipped, len(new_computed_blocks) + len(table)), 0)
        null = self.null_block
        evictable = sum(b.ref_count == 0 and b is not null for b in new_computed_blocks[max(0, skipped - len(table)) :])
        return num_new + evictable

    def add_local_computed_blocks(self, table: list[Block], new_computed_blocks: list[Block], num_computed_tokens: int) -> None:
        """A new request's hit into its empty `table`: null blocks for what lies before the window, the rest
        touched (held once more, out of the free queue) (`add_local_computed_blocks`)."""
        assert not table
        skipped = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        hit = new_computed_blocks[skipped:]
        self.pool.touch(hit)
        table += [self.null_block] * skipped
        table += hit

    def allocate_new_blocks(self, table: list[Block], num_tokens: int) -> None:
        """Extend `table` to `cdiv(num_tokens, block_size)` blocks from the pool (`allocate_new_blocks`)."""
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new > 0:
            table += self.pool.get_new_blocks(num_new)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens attention will never read again: none for full attention and state groups."""
        return 0

    def reachable_block_mask(
        self, start_block: int, end_block: int, retention_interval: int | None, reachable_boundaries: tuple[int, ...]
    ) -> list[bool] | None:
        """Which of blocks [start_block, end_block) `cache_blocks` caches; None: every one (full attention)."""
        return None

    def remove_skipped_blocks(self, table: list[Block], processed_computed_tokens: int) -> int:
        """Replace the blocks wholly before the skipped tokens with the null block and free them, the latest
        first, stopping at the first block already nulled (`_remove_blocks_in_range`). Returns how many."""
        skipped = self.get_num_skipped_tokens(processed_computed_tokens)
        if skipped <= 0:
            return 0
        null = self.null_block
        freed = []
        for i in range(min(skipped // self.block_size, len(table)) - 1, -1, -1):
            if table[i] is null:
                break
            freed.append(table[i])
            table[i] = null
        if freed:
            self.pool.free_blocks(freed)
        return len(freed)

    def free(self, table: list[Block]) -> None:
        """Return every real block of `table`, tail first (`free`: `pop_blocks_for_free` trims the null head)."""
        null = self.null_block
        start = 0
        while start < len(table) and table[start] is null:
            start += 1
        self.pool.free_blocks(reversed(table[start:]))
        table.clear()


class FullAttentionManager(SingleTypeManager):
    """Full attention and MLA groups: every token's block is kept for the request's life."""


class SlidingWindowManager(SingleTypeManager):
    """Sliding-window groups: tokens before `num_computed_tokens - window + 1` are never read again."""

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.group.window + 1)

    def reachable_block_mask(
        self, start_block: int, end_block: int, retention_interval: int | None, reachable_boundaries: tuple[int, ...]
    ) -> list[bool] | None:
        """The blocks a later hit can use (vLLM's `SlidingWindowManager.reachable_block_mask`, no EAGLE, hits
        aligned to the block size). A hit at token t needs the `need = cdiv(window - 1, block_size)` blocks
        before t, so only such tails are worth caching:

            retention_interval None (dense): the tail before every block boundary, i.e. every block;
            0 (vLLM 0.33's default): only the tail before each reachable boundary (the prompt's
              `num_prompt_tokens - 1`, and a shared prefix another group already caches);
            k > 0: the tail before every k-token boundary, plus the reachable ones.

            window 40, block_size 16 (need 3), prompt 150 tokens, retention 0:
            block  0 1 2 3 4 5 6 7 8 9          boundary (150 - 1) // 16 * 16 = 144 = block 9
            cached . . . . . . Y Y Y .          blocks 6-8 end on it
        """
        bs = self.block_size
        need = -(-(self.group.window - 1) // bs)
        mask = [False] * (end_block - start_block)
        segment = bs if retention_interval is None else (retention_interval or None)
        if segment is not None:
            per_segment = segment // bs
            if need >= per_segment:
                return None
            for i in range(start_block, end_block):
                if i % per_segment >= per_segment - need:
                    mask[i - start_block] = True
        if retention_interval is not None:
            for boundary in reachable_boundaries:
                end = boundary // bs
                for j in range(max(start_block, end - need), min(end_block, end)):
                    mask[j - start_block] = True
        return mask


class ChunkedLocalAttentionManager(SingleTypeManager):
    """Chunked local attention: a token reads only its own chunk, so the finished chunks are skipped."""

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        chunk = self.group.window
        return num_computed_tokens // chunk * chunk


class MambaManager(SingleTypeManager):
    """State groups without prefix caching (`mamba_cache_mode` none): the group's block size is
    max_model_len, so a request holds one block, its running state, for its life."""


MANAGERS: dict[str, type[SingleTypeManager]] = {
    "full": FullAttentionManager,
    "mla": FullAttentionManager,
    "sliding": SlidingWindowManager,
    "chunked": ChunkedLocalAttentionManager,
    "state": MambaManager,
}


def make_manager(group: VllmGroup, pool: BlockPool) -> SingleTypeManager:
    """The manager vLLM's `get_manager_for_kv_cache_spec` picks for `group`'s kind."""
    return MANAGERS[group.kind](group, pool)
