"""The CPU tier's host pool: `num_chunks` chunks of `tokens_per_chunk` token rows in host memory (pinned when the
device pool is on CUDA), the copies of vLLM's `CPUOffloadingWorker` between the device pool's blocks and them.

    rows [2 * L, num_chunks * tokens_per_chunk, H * D]   (the device pool's integer view, all materialised layers)

A chunk holds `tokens_per_chunk // block_size` GPU blocks back to back: host block `c * blocks_per_chunk + i` is
block i of chunk c. As vLLM's (`v1/kv_offload/cpu/gpu_worker.py`: one CPU tensor per GPU tensor, `num_cpu_chunks`
pages of `blocks_per_chunk` GPU pages), the chunks are shared by every KV cache group: a chunk holds the blocks of
the group its key names, in the layer tensors that group's layers use, so a mixed model's host pool is the size a
uniform model's is. Copies are bit-exact (same-width integer views) and timed into the cache's timer as "swap"
(host copies, as the swap preemption's).
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
        self.num_chunks = num_chunks
        rows = cache._slot_rows  # [2L, S, H*D]
        shape = (rows.shape[0], num_chunks * tokens_per_chunk, rows.shape[2])
        self.rows = torch.zeros(shape, dtype=rows.dtype, pin_memory=cache.device.type == "cuda")

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def _slots(self, block_ids) -> np.ndarray:
        """Token rows of whole blocks, in order: (len(block_ids) * block_size,)."""
        bs = self.block_size
        return (np.asarray(block_ids, dtype=np.int64)[:, None] * bs + np.arange(bs)).ravel()

    def store(self, gpu_block_ids, host_block_ids) -> None:
        """A store job: each GPU block into its host block (`chunk * blocks_per_chunk + its index in the chunk`)."""
        assert len(gpu_block_ids) == len(host_block_ids)
        if not len(gpu_block_ids):
            return
        src = self.cache._index(self._slots(gpu_block_ids))
        dst = torch.from_numpy(self._slots(host_block_ids))
        with self.cache.timer.measure("swap"):
            self.rows[:, dst] = self.cache._slot_rows.index_select(1, src).to("cpu")

    def load(self, host_block_ids, gpu_block_ids) -> np.ndarray:
        """A load job: each host block back into a GPU block of the request. Returns the device slots written."""
        assert len(gpu_block_ids) == len(host_block_ids)
        slots = self._slots(gpu_block_ids)
        if not len(slots):
            return slots
        src = torch.from_numpy(self._slots(host_block_ids))
        with self.cache.timer.measure("swap"):
            rows = self.rows[:, src].to(self.cache.device, non_blocking=True)
            self.cache._slot_rows.index_copy_(1, self.cache._index(slots), rows)
        return slots
