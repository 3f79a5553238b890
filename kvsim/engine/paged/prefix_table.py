"""One KV cache group's prefix table, vLLM 0.33.0's `BlockHashToBlockMap` (a block's key -> the block caching
it), kept as chunks of 32 consecutive keys: a run of consecutive keys is one dict operation and one slice."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

SLOT_BITS = 5
NUM_SLOTS = 1 << SLOT_BITS  # keys per chunk
SLOT_MASK = NUM_SLOTS - 1
EMPTY = 0  # a slot without an entry (block 0, the null block, is never cached)


def key_runs(keys: np.ndarray) -> list[int]:
    """Where `keys`' runs start, and `len(keys)` last: a run is consecutive keys k, k + 1, ... within one chunk.

    A replay's block key packs (stream, j) into one int, so a stream's blocks are consecutive keys: a Mooncake
    hash id's 32 blocks at block size 16 are one run, a 12,000-token prompt of its own stream 24. Any other keys
    (chained hashes of token ids) are runs of one key each."""
    n = len(keys)
    if n <= 1:
        return [0, n] if n else [0]
    nxt = keys[1:]  # (n - 1,)
    cut = (nxt != keys[:-1] + 1) | ((nxt & SLOT_MASK) == 0)
    return [0, *(np.flatnonzero(cut) + 1).tolist(), n]


class PrefixTable:
    """Key -> block, as vLLM's `BlockHashToBlockMap` holds it, in chunks: `chunks[key >> 5][key & 31]` is the
    block of `key`, `EMPTY` where it has none.

        key  = tag << 61 | stream << 21 | j          (a replay's block key: `make_block_keys`)
        chunks[key >> 5] = [b0 b1 ... b31]           the slots of keys (key >> 5) << 5 ... + 31

    A slot's block may be stale (evicted, or caching another key since): the pool checks whether an entry is
    live (`BlockPool`); the table only stores. Chunks are never dropped one by one: `rebuild` (the pool's purge)
    replaces them all with the live entries. Every int key works; a key with no neighbours takes a chunk alone.
    """

    __slots__ = ("chunks",)

    def __init__(self) -> None:
        self.chunks: dict[int, list[int]] = {}

    def __len__(self) -> int:
        """Chunks held, stale ones included (what the pool purges by)."""
        return len(self.chunks)

    def get(self, key: int) -> int:
        """The block `key`'s slot holds (perhaps stale), or `EMPTY`."""
        chunk = self.chunks.get(key >> SLOT_BITS)
        return chunk[key & SLOT_MASK] if chunk is not None else EMPTY

    def set(self, key: int, block: int) -> None:
        """`key`'s slot holds `block` from now."""
        chunk = self.chunks.get(key >> SLOT_BITS)
        if chunk is None:
            chunk = self.chunks[key >> SLOT_BITS] = [EMPTY] * NUM_SLOTS
        chunk[key & SLOT_MASK] = block

    def items(self) -> Iterator[tuple[int, int]]:
        """Every (key, block) entry, stale ones included (for tests and debugging)."""
        for c, chunk in self.chunks.items():
            for slot, block in enumerate(chunk):
                if block != EMPTY:
                    yield c << SLOT_BITS | slot, block

    def rebuild(self, keys: np.ndarray, ids: np.ndarray) -> None:
        """Only `ids` (n,) under `keys` (n,), distinct: every other entry dropped (the dict kept: others hold it)."""
        self.chunks.clear()
        if not len(ids):
            return
        chunk_ids, rows = np.unique(keys >> SLOT_BITS, return_inverse=True)  # (c,), (n,)
        slots = np.zeros((len(chunk_ids), NUM_SLOTS), dtype=np.int64)  # (c, 32)
        slots[rows.reshape(-1), keys & SLOT_MASK] = ids
        self.chunks.update(zip(chunk_ids.tolist(), slots.tolist()))
