"""One CPU chunk's status: the slot it occupies and how many loads read it (-1 while its store is in flight)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ChunkStatus:
    """vLLM's `ChunkStatus`: `ref_cnt` is -1 until the store completes (not readable), then the number of loads
    reading the chunk; only a chunk at 0 may be evicted."""

    chunk_id: int
    ref_cnt: int = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0
