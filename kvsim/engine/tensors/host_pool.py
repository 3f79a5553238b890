"""The CPU tier's host pool: `num_chunks` chunks of `tokens_per_chunk` token rows in host memory (pinned when the
device pool is on CUDA), the copies of vLLM's `CPUOffloadingWorker` between the device pool's blocks and them.

    rows [2 * L, num_chunks * tokens_per_chunk, H * D]   (the device pool's integer view, all materialised layers)

A chunk holds `tokens_per_chunk // block_size` GPU blocks back to back. Copies are bit-exact (same-width integer
views) and timed into the cache's timer as "swap" (host copies, as the swap preemption's).
"""

from __future__ import annotations

import numpy as np
import torch


class HostKVPool:
    """Host rows for a `KVCache`'s materialised layers; `store` and `load` move whole GPU blocks."""

    def __init__(self, cache, num_chunks: int, tokens_per_chunk: int):
        assert cache.enabled and tokens_per_chunk % cache.block_size == 0
        self.cache = cache
        self.block_size = cache.block_size
        self.blocks_per_chunk = tokens_per_chunk // cache.block_size
        self.tokens_per_chunk = tokens_per_chunk
        rows = cache._slot_rows  # [2L, S, H*D]
        shape = (rows.shape[0], num_chunks * tokens_per_chunk, rows.shape[2])
        self.rows = torch.zeros(shape, dtype=rows.dtype, pin_memory=cache.device.type == "cuda")

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def _slots(self, block_ids) -> np.ndarray:
        """The device pool's token slots of whole blocks, in order: (len(block_ids) * block_size,)."""
        bs = self.block_size
        return (np.asarray(block_ids, dtype=np.int64)[:, None] * bs + np.arange(bs)).ravel()

    def _host_rows(self, chunk_ids, first_block: int, num_blocks: int) -> np.ndarray:
        """Host rows of `num_blocks` consecutive blocks of a request, starting at its block `first_block`, held by
        the chunks `chunk_ids` (the first one holding block `first_block // blocks_per_chunk * blocks_per_chunk`)."""
        B, bs = self.blocks_per_chunk, self.block_size
        blocks = first_block + np.arange(num_blocks)
        chunk = np.asarray(chunk_ids, dtype=np.int64)[blocks // B - first_block // B]
        starts = chunk * self.tokens_per_chunk + (blocks % B) * bs
        return (starts[:, None] + np.arange(bs)).ravel()

    def store(self, gpu_block_ids, chunk_ids) -> None:
        """A store job: whole chunks, `blocks_per_chunk` GPU blocks each, into `chunk_ids` (one per chunk)."""
        if not len(gpu_block_ids):
            return
        src = self.cache._index(self._slots(gpu_block_ids))
        dst = torch.from_numpy(self._host_rows(chunk_ids, 0, len(gpu_block_ids)))
        with self.cache.timer.measure("swap"):
            self.rows[:, dst] = self.cache._slot_rows.index_select(1, src).to("cpu")

    def load(self, chunk_ids, first_block: int, gpu_block_ids) -> np.ndarray:
        """A load job: the request's blocks from `first_block` on (`gpu_block_ids`) from the chunks `chunk_ids`.
        Returns the device slots written."""
        slots = self._slots(gpu_block_ids)
        if not len(slots):
            return slots
        src = torch.from_numpy(self._host_rows(chunk_ids, first_block, len(gpu_block_ids)))
        with self.cache.timer.measure("swap"):
            rows = self.rows[:, src].to(self.cache.device, non_blocking=True)
            self.cache._slot_rows.index_copy_(1, self.cache._index(slots), rows)
        return slots
