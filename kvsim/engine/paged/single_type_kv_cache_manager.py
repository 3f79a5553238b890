"""One manager per KV cache group, as vLLM 0.33.0's `single_type_kv_cache_manager.py`: how many blocks a group
needs for `num_tokens`, which of its blocks fall outside the attention window (replaced by the null block)."""

from __future__ import annotations

from kvsim.engine.paged.block_pool import BlockPool
from kvsim.engine.paged.kv_cache_utils import segment_tail_mask
from kvsim.size.kv_cache_spec import VllmGroup


class SingleTypeManager:
    """vLLM's `SingleTypeKVCacheManager` for one group over the shared pool (prefix caching off).

    The per-request block table (block ids) is the caller's (`HybridCoordinator` keeps one per group and request);
    a manager only reads and extends it. Tables hold the pool's null block (id 0) where blocks were skipped:

        sliding window 8, block_size 4, 13 tokens computed (processed):
        table  [ null ][ 7 ][ 9 ][ 4 ]     tokens 0-3 lie before the window of token 13 (6-13): block freed
    """

    def __init__(self, group: VllmGroup, pool: BlockPool, group_id: int = 0):
        self.group = group
        self.group_id = group_id  # its index among the model's groups: its blocks are cached under (key, group_id)
        self.block_size = group.block_size
        self.pool = pool
        self.null_block = pool.null_block

    def new_table(self) -> list[int]:
        """An empty block table for a new request."""
        return []

    def get_num_blocks_to_allocate(
        self,
        table: list[int],
        num_tokens: int,
        apply_admission_cap: bool = False,
        new_computed_blocks: list[int] | None = None,
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
        real = [b for b in new_computed_blocks[max(0, skipped - len(table)) :] if b != self.null_block]
        return num_new + self.pool.num_evictable(real)

    def add_local_computed_blocks(self, table: list[int], new_computed_blocks: list[int], num_computed_tokens: int) -> None:
        """A new request's hit into its empty `table`: null blocks for what lies before the window, the rest
        touched (held once more, out of the free queue) (`add_local_computed_blocks`)."""
        assert not table
        skipped = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        hit = new_computed_blocks[skipped:]
        self.pool.touch(hit)
        table += [self.null_block] * skipped
        table += hit

    def allocate_new_blocks(self, table: list[int], num_tokens: int) -> None:
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

    def remove_skipped_blocks(self, table: list[int], processed_computed_tokens: int) -> int:
        """Replace the blocks wholly before the skipped tokens with the null block and free them, the latest
        first, stopping at the first block already nulled (`_remove_blocks_in_range`). Returns how many."""
        skipped = self.get_num_skipped_tokens(processed_computed_tokens)
        if skipped <= 0:
            return 0
        null = self.null_block
        freed = []
        for i in range(min(skipped // self.block_size, len(table)) - 1, -1, -1):
            if table[i] == null:
                break
            freed.append(table[i])
            table[i] = null
        if freed:
            self.pool.free_blocks(freed)
        return len(freed)

    def free(self, table: list[int]) -> None:
        """Return every real block of `table`, tail first (`free`: `pop_blocks_for_free` trims the null head)."""
        null = self.null_block
        start = 0
        while start < len(table) and table[start] == null:
            start += 1
        self.pool.free_blocks(table[start:][::-1])
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
            mask = segment_tail_mask(start_block, end_block, segment // bs, need)
            if mask is None:
                return None
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


def mamba_prefill_checkpoint_position(num_tokens: int, block_size: int) -> int:
    """The last block boundary strictly below `num_tokens` (vLLM's `get_mamba_prefill_checkpoint_position`
    without EAGLE or hash lookahead): the last token is left to recompute for its logits."""
    return max((num_tokens - 1) // block_size * block_size, 0)


def is_mamba_prefill_checkpoint_valid(
    query_start: int, query_end: int, checkpoint_position: int, block_size: int, alignment: int
) -> bool:
    """Whether the state layers can export the state at `checkpoint_position` from inside the prefill chunk
    [query_start, query_end) (vLLM's `is_mamba_prefill_checkpoint_valid`, hashes at the block size): the chunk
    starts on a block boundary, reaches past the next one, and the checkpoint lies a multiple of the kernel's
    `alignment` after its start (0: the layers export no checkpoints)."""
    if not alignment:
        return False
    initial_state_col = (query_start - 1) // block_size
    checkpoint_col = -(-query_end // block_size) - 2
    return (
        query_start % block_size == 0
        and checkpoint_col > initial_state_col
        and query_start + block_size <= checkpoint_position
        and query_start < checkpoint_position < query_end
        and (checkpoint_position - query_start) % alignment == 0
    )


class MambaTable(list):
    """A state group's block table in align mode, with what vLLM's `MambaManager` keeps per request beside it:
    whether it was allocated once (`_allocated_block_reqs`), the running state's block of the previous
    allocation (`last_state_block_idx`), the blocks retired so far (`_num_retired_blocks`) and this
    allocation's prefill checkpoint (`_checkpoints`: position, block index)."""

    __slots__ = ("allocated", "last_state_block_idx", "num_retired", "checkpoint")

    def __init__(self) -> None:
        super().__init__()
        self.allocated = False
        self.last_state_block_idx: int | None = None
        self.num_retired = 0
        self.checkpoint: tuple[int, int] | None = None


class MambaManager(SingleTypeManager):
    """State groups. `mamba_cache_mode` none (prefix caching off): the group's block size is max_model_len, so a
    request holds one block, its running state, for its life.

    Align mode (prefix caching on, vllm serve's default for hybrid models): the block size is the attention
    groups' and block i of a table holds the state after (i + 1) * block_size tokens. Only the running state is
    kept: a table is null blocks before it, and the block behind it is freed once the step that wrote the next
    one has settled. A chunk that reaches the end of the prefill may also hold a checkpoint block, the state at
    the prompt's last block boundary, exported from inside the chunk (FlashInfer's gated delta net prefill every
    64 tokens, mamba2 at every token):

        block 576, prompt 1,000 tokens in one chunk, checkpoints on:
        allocate   [ ckpt (state at 576) ][ running (state at 1,000) ]     both new
        cache      ckpt cached under the hash of tokens 0-575 (the prompt's reachable boundary)
        decode     [ null ][ running ]                                      ckpt freed (stays cached)

    A hit on a cached state is [null] * i + [that block]. vLLM 0.33's `MambaManager` step for step where block
    hashes are taken at the block size (no sub-block hits), without speculative decoding; for a KV connector the
    coordinator records each state its caching commits (`_pending_boundary_state_offloads`).
    """

    def __init__(self, group: VllmGroup, pool: BlockPool, group_id: int = 0, *, align: bool = False,
                 checkpoint_alignment: int = 0):
        super().__init__(group, pool, group_id)
        self.align = align
        self.checkpoint_alignment = checkpoint_alignment if align else 0

    def new_table(self) -> list[int]:
        return MambaTable() if self.align else []

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Align mode: only the last computed token's state is needed (vLLM's `num_computed_tokens - 1`)."""
        return num_computed_tokens - 1 if self.align else 0

    def get_num_blocks_to_allocate(
        self,
        table: list[int],
        num_tokens: int,
        apply_admission_cap: bool = False,
        new_computed_blocks: list[int] | None = None,
        num_computed_tokens: int = 0,
        *,
        query_start: int = 0,
        prefill_end: int = 0,
        cached_this_step: set | None = None,
    ) -> int:
        """Align mode: at most one new block (the running state) and the checkpoint block where this chunk
        exports one (recorded on the table unless `apply_admission_cap`, vLLM's side effect), plus the hit
        blocks nobody holds. A hit on a state another request cached in this step cannot be used yet: more
        blocks than the pool has (vLLM's `num_gpu_blocks + 1`), so the request waits a step."""
        if not self.align:
            return super().get_num_blocks_to_allocate(table, num_tokens, apply_admission_cap, new_computed_blocks,
                                                      num_computed_tokens)
        hits = new_computed_blocks or ()
        if hits and cached_this_step and (int(self.pool.block_hash[hits[-1]]), self.group_id) in cached_this_step:
            return self.pool.num_blocks + 1
        bs = self.block_size
        num_new = -(-num_tokens // bs) - len(hits) - len(table)
        checkpoint = mamba_prefill_checkpoint_position(num_tokens, bs)
        if not self._needs_internal_checkpoint(table, query_start, num_tokens, checkpoint, prefill_end):
            checkpoint = 0
        if not apply_admission_cap:
            table.checkpoint = (checkpoint, -(-num_tokens // bs) - 2) if checkpoint > 0 else None
        if num_new > 0:
            num_new = min(num_new, 1 + (checkpoint > 0))
        return num_new + self.pool.num_evictable([b for b in hits if b != self.null_block])

    def _needs_internal_checkpoint(
        self, table: list[int], query_start: int, query_end: int, checkpoint_position: int, prefill_end: int
    ) -> bool:
        idx = -(-query_end // self.block_size) - 2
        return (
            self.checkpoint_alignment > 0
            and query_end >= prefill_end
            and is_mamba_prefill_checkpoint_valid(query_start, query_end, checkpoint_position, self.block_size,
                                                  self.checkpoint_alignment)
            and idx >= 0
            and (idx >= len(table) or table[idx] == self.null_block)
        )

    def allocate_new_blocks(self, table: list[int], num_tokens: int) -> None:
        """Align mode: null blocks up to the checkpoint (if any) and the running state's block, which are new."""
        if not self.align:
            return super().allocate_new_blocks(table, num_tokens)
        required = -(-num_tokens // self.block_size)
        checkpoint = table.checkpoint is not None
        if required <= len(table) and not checkpoint:
            table.allocated = True
            return
        prev = len(table)
        if prev > 0:  # the running state so far: freed once this allocation's step has settled
            table.last_state_block_idx = prev - 1
        null_end = required - 1 - checkpoint
        if prev < null_end:
            table += [self.null_block] * (null_end - prev)
        num_new = max(required - len(table), 0)
        assert num_new <= 1 + checkpoint, (num_new, checkpoint)
        if num_new:
            table += self.pool.get_new_blocks(num_new)
        table.allocated = True

    def remove_skipped_blocks(self, table: list[int], processed_computed_tokens: int) -> int:
        """Align mode: free every state before the last settled token's block (skipping null gaps, from the
        last retired one on), then the previous allocation's running state once a later block holds it."""
        if not self.align:
            return super().remove_skipped_blocks(table, processed_computed_tokens)
        null, bs = self.null_block, self.block_size
        num_freed = 0
        skipped = processed_computed_tokens - 1
        if skipped > 0:
            first, last = table.num_retired, min(skipped // bs, len(table))
            if first < last:
                freed = []
                for i in range(last - 1, first - 1, -1):
                    if table[i] != null:
                        freed.append(table[i])
                        table[i] = null
                if freed:
                    self.pool.free_blocks(freed)
                    num_freed += len(freed)
                table.num_retired = last
        idx = table.last_state_block_idx
        if idx is not None and idx < -(-processed_computed_tokens // bs) - 1 and table[idx] != null:
            self.pool.free_blocks([table[idx]])
            table[idx] = null
            num_freed += 1
        return num_freed

    def reachable_block_mask(
        self, start_block: int, end_block: int, retention_interval: int | None, reachable_boundaries: tuple[int, ...]
    ) -> list[bool] | None:
        """The state blocks a later hit can resume from (vLLM's `MambaManager.reachable_block_mask`): every one
        under dense retention (None); under vLLM's default 0 only the block ending on each reachable boundary
        (the prompt's last block boundary, a shared-prefix junction), as a hit needs that one state alone."""
        if retention_interval is None:
            return None
        bs = self.block_size
        mask = [False] * (end_block - start_block)
        if retention_interval:
            per_segment = retention_interval // bs
            if per_segment <= 1:
                return None
            first = (start_block + per_segment) // per_segment * per_segment - 1
            for i in range(first - start_block, len(mask), per_segment):
                mask[i] = True
        for boundary in reachable_boundaries:
            block = boundary // bs - 1
            if start_block <= block < end_block:
                mask[block - start_block] = True
        return mask

    def free(self, table: list[int]) -> None:
        """Every real block back, tail first; an align-mode table has null gaps between its states."""
        null = self.null_block
        self.pool.free_blocks([b for b in reversed(table) if b != null])
        table.clear()


MANAGERS: dict[str, type[SingleTypeManager]] = {
    "full": FullAttentionManager,
    "mla": FullAttentionManager,
    "sliding": SlidingWindowManager,
    "chunked": ChunkedLocalAttentionManager,
    "state": MambaManager,
}


def make_manager(group: VllmGroup, pool: BlockPool, group_id: int = 0, *, mamba_align: bool = False,
                 mamba_checkpoint_alignment: int = 0) -> SingleTypeManager:
    """The manager vLLM's `get_manager_for_kv_cache_spec` picks for `group`'s kind; a state group's in align
    mode (`mamba_align`, with the state layers' prefill `mamba_checkpoint_alignment`, 0: none)."""
    if group.kind == "state":
        return MambaManager(group, pool, group_id, align=mamba_align, checkpoint_alignment=mamba_checkpoint_alignment)
    return MANAGERS[group.kind](group, pool, group_id)
