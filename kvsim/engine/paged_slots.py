"""The paged allocator's block table and slot mapping: slot = block_id * block_size + offset, with the decode
run of a whole batch in array arithmetic (one C pass instead of a call per request)."""

from __future__ import annotations

import operator

import numpy as np

from kvsim.engine.paged_layout import Lane, PagedRequest
from kvsim.engine.sequence import Sequence

_BLOCK_ID = operator.attrgetter("block_id")


class PagedSlots:
    """PagedAllocator's `block_table`, `slot_mapping` and `decode_slot_mapping` (a mixin: the state is the
    allocator's, set in its __init__). Slots follow the primary lane (`lanes[0]`)."""

    block_size: int
    lanes: list[Lane]
    _reqs: dict[Sequence, PagedRequest]

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
        if first == last and table[first * k] is not None:  # a decode run inside one block: the common case
            base = table[first * k].block_id * bs - first * bs
            return np.arange(base + start, base + end, dtype=np.int64)
        blocks = (table[j * k] for j in range(first, last + 1))
        ids = np.fromiter((-1 if b is None else b.block_id for b in blocks), dtype=np.int64, count=last - first + 1)
        pos = np.arange(start, end, dtype=np.int64)  # (end - start,)
        block_ids = ids[pos // bs - first]
        slots = block_ids * bs + pos % bs
        if self.lanes[0].window is not None:
            slots[block_ids < 0] = -1
        return slots

    def decode_slot_mapping(self, seqs: list[Sequence], starts: np.ndarray, k: int) -> np.ndarray:
        """Slots of positions [starts[n], starts[n] + k) of each of `seqs`, as (k, N): a decode run's
        `slot_mapping` for the whole batch at once. A run of at most one block's tokens touches at most two
        blocks per request, so two block ids per request and array arithmetic replace N calls."""
        bs, lane = self.block_size, self.lanes[0]
        if lane.window is not None or lane.pages_per_block != 1 or k > bs or not len(seqs):
            return np.stack([self.slot_mapping(s, c, c + k) for s, c in zip(seqs, starts.tolist())], axis=1)
        reqs = self._reqs
        tables = [reqs[s].tables[0] for s in seqs]
        first, last = starts // bs, (starts + k - 1) // bs  # (N,) block index of each run's first and last token
        b0 = np.fromiter((t[b].block_id for t, b in zip(tables, first.tolist())), dtype=np.int64, count=len(seqs))
        pos = starts[None, :] + np.arange(k, dtype=np.int64)[:, None]  # (k, N)
        block_ids = np.broadcast_to(b0, (k, len(seqs)))  # (k, N): runs inside one block, most of them
        cross = np.flatnonzero(last != first)  # runs that step into their next block
        if len(cross):
            try:
                b1 = np.array([tables[i][b].block_id for i, b in zip(cross.tolist(), last[cross].tolist())], dtype=np.int64)
            except IndexError:
                raise AssertionError("decode run past the allocated blocks") from None
            block_ids = block_ids.copy()
            block_ids[:, cross] = np.where(pos[:, cross] // bs == first[cross], b0[cross], b1)
        return block_ids * bs + pos % bs
