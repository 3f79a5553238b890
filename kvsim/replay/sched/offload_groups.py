"""The CPU tier's view of a model's KV cache groups, as vLLM 0.33.0's `OffloadingConnectorScheduler` keeps it
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py): one `GroupOffloadConfig` per
prefix-cacheable group (a Mamba state group in align mode keeps one chunk, its state; `mamba_align_size` rounds a
hit to it), the chunks a sliding window keeps (`load_window_size_in_chunks`), the sliding-window lookup from the
right, and the sliding-window blocks a store may skip (`SlidingWindowManager.reachable_block_mask`
in vllm/v1/core/single_type_kv_cache_manager.py, as the connector calls it). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.engine.paged.kv_cache_utils import segment_tail_mask
from kvsim.offload.manager import LookupResult


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class GroupOffloadConfig:
    """One offloaded KV cache group: its GPU block, its chunk (`blocks_per_chunk` blocks: one offload key), and the
    chunks a request of it can ever load back (`sliding_window_size_in_chunks`; None: full attention or MLA).
    `window` is the sliding window or the attention chunk in tokens (0 for full attention)."""

    group_idx: int
    kind: str  # full, mla, sliding, chunked, state (a Mamba state group in align mode: one state, window 1)
    tokens_per_block: int
    tokens_per_chunk: int
    hashes_per_chunk: int
    window_chunks: int | None
    window: int = 0

    def load_window_size_in_chunks(self, num_tokens: int) -> int | None:
        """A sliding window's chunks for a hit ending at `num_tokens`: lookups round the right edge up to a chunk,
        and the allocation keeps the window ending at the hit itself, possibly one chunk further left."""
        window = self.window_chunks
        if self.kind == "sliding":
            right_padding = -num_tokens % self.tokens_per_chunk
            window = max(window, cdiv(self.window - 1 + right_padding, self.tokens_per_chunk))
        return window


def alignment_tokens(groups: tuple[GroupOffloadConfig, ...], blocks_per_chunk: int) -> int | None:
    """`SchedulerOffloadConfig.from_spec`: the one full-attention chunk size (hits end on it), or the largest chunk
    when no group is full attention; None when full-attention groups disagree."""
    full = {g.tokens_per_chunk for g in groups if g.window_chunks is None}
    if len(full) == 1:
        return full.pop()
    if not full:
        return max(g.tokens_per_block * blocks_per_chunk for g in groups)
    return None


def mamba_align_size(groups: tuple[GroupOffloadConfig, ...]) -> int | None:
    """`resolve_mamba_align_size`: the chunk of the align-mode state groups (one for all), to which a hit is
    rounded down; None without a state group."""
    sizes = {g.tokens_per_chunk for g in groups if g.kind == "state"}
    assert len(sizes) <= 1, sizes
    return sizes.pop() if sizes else None


def sliding_window_lookup(lookup, keys: list, window_chunks: int, req_context, initial_window: int | None) -> int | None:
    """`_sliding_window_lookup`: scanning `keys` from the right, the end index of the last run of `window_chunks`
    consecutive hits (the first run may need `initial_window`), or the run at the start's length; None when a hit
    in the run found is still being written (HIT_PENDING)."""
    pending = False
    consecutive = 0
    required = initial_window or window_chunks
    for idx in range(len(keys) - 1, -1, -1):
        result = lookup(keys[idx], req_context)
        if result is LookupResult.MISS:
            consecutive = 0
            pending = False  # this gap rules out the incomplete window to its right
            required = window_chunks
        else:
            consecutive += 1
            pending |= result is LookupResult.HIT_PENDING
        if consecutive == required:
            return None if pending else idx + required
    return None if pending else consecutive


def reachable_block_mask(group: GroupOffloadConfig, start_block: int, end_block: int, alignment: int | None,
                         retention_interval: int | None, reachable_boundaries: tuple[int, ...],
                         final_segment_end_block: int | None) -> list[bool] | None:
    """Which blocks [start_block, end_block) of `group` a later hit can reach, so a store keeps them; None: every
    block (full attention, chunked local attention, or a sliding window whose mask cannot be exact).

    A sliding window W over blocks of B tokens: a hit ending at an aligned boundary needs the `cdiv(W - 1, B)`
    blocks before it. Under retention None (dense) every `alignment`-token boundary is one, and the request's final
    segment keeps its tail; under vLLM's default 0 only the reachable boundaries (the prompt's last token, a
    shared-prefix junction); under k > 0 every k tokens plus those.
    """
    if group.kind != "sliding" or alignment is None:
        return None
    bs = group.tokens_per_block
    if alignment % bs:
        return None  # a sub-block alignment (a full group's chunk finer than this block): dense
    need = cdiv(group.window - 1, bs)
    mask = [False] * (end_block - start_block)
    segment = alignment if retention_interval is None else (retention_interval or None)
    if segment is not None:
        per_segment = segment // bs
        mask = segment_tail_mask(start_block, end_block, per_segment, need)
        if mask is None:
            return None
        if final_segment_end_block is not None:
            size = final_segment_end_block % per_segment
            if size:
                tail_start = max(final_segment_end_block - size, final_segment_end_block - need)
                for i in range(max(start_block, tail_start), min(end_block, final_segment_end_block)):
                    mask[i - start_block] = True
    if retention_interval is not None:
        for boundary in reachable_boundaries:
            end = boundary // alignment * alignment // bs
            for j in range(max(start_block, end - need), min(end_block, end)):
                mask[j - start_block] = True
    return mask
