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
    if n <= 24:  # a few keys: one at a time beats numpy's fixed cost
        runs, prev = [0], None
        for i, key in enumerate(keys.tolist()):
            if i and (key != prev + 1 or not key & SLOT_MASK):
                runs.append(i)
            prev = key
        runs.append(n)
        return runs
    nxt = keys[1:]  # (n - 1,)
    cut = (nxt != keys[:-1] + 1) | ((nxt & SLOT_MASK) == 0)
    return [0, *(np.flatnonzero(cut) + 1).tolist(), n]


class PrefixTable:
    """Key -> block, as vLLM's `BlockHashToBlockMap` holds it, in chunks of 32 slots: `rows[key >> 5]` is where
    the chunk of `key` starts in `slots`, one flat list, and `slots[rows[key >> 5] + (key & 31)]` is the block
    of `key`, `EMPTY` where it has none.

        key  = tag << 61 | stream << 21 | j               (a replay's block key: `make_block_keys`)
        rows  {key >> 5: 0, ...: 32, ...: 64}             a chunk's offset, in the order chunks came
        slots [b0 b1 ... b31 | b0 ... b31 | ...]          one list: no object per chunk for the garbage collector

    A slot's block may be stale (evicted, or caching another key since): the pool checks whether an entry is
    live (`BlockPool`); the table only stores. Chunks are never dropped one by one: `rebuild` (the pool's purge)
    replaces them all with the live entries. Every int key works; a key with no neighbours takes a chunk alone.
    """

    __slots__ = ("rows", "slots")

    def __init__(self) -> None:
        self.rows: dict[int, int] = {}  # chunk (key >> 5) -> offset of its 32 slots in `slots`
        self.slots: list[int] = []  # 32 block ids (or EMPTY) per chunk

    def __len__(self) -> int:
        """Chunks held, stale ones included (what the pool purges by)."""
        return len(self.rows)

    def get(self, key: int) -> int:
        """The block `key`'s slot holds (perhaps stale), or `EMPTY`."""
        base = self.rows.get(key >> SLOT_BITS)
        return self.slots[base + (key & SLOT_MASK)] if base is not None else EMPTY

    def set(self, key: int, block: int) -> None:
        """`key`'s slot holds `block` from now."""
        base = self.rows.get(key >> SLOT_BITS)
        if base is None:
            base = self.add_chunk(key >> SLOT_BITS)
        self.slots[base + (key & SLOT_MASK)] = block

    def add_chunk(self, chunk: int) -> int:
        """Empty slots for keys `chunk << 5` ... `+ 31`, which have none yet: their offset in `slots`."""
        base = self.rows[chunk] = len(self.slots)
        self.slots += EMPTY_CHUNK
        return base

    def items(self) -> Iterator[tuple[int, int]]:
        """Every (key, block) entry, stale ones included (for tests and debugging)."""
        slots = self.slots
        for chunk, base in self.rows.items():
            for slot in range(NUM_SLOTS):
                if slots[base + slot] != EMPTY:
                    yield chunk << SLOT_BITS | slot, slots[base + slot]

    def rebuild(self, keys: np.ndarray, ids: np.ndarray) -> None:
        """Only `ids` (n,) under `keys` (n,), distinct: every other entry dropped."""
        self.rows.clear()
        chunk_ids, rows = np.unique(keys >> SLOT_BITS, return_inverse=True)  # (c,), (n,)
        grid = np.zeros((len(chunk_ids), NUM_SLOTS), dtype=np.int64)  # (c, 32)
        grid[rows.reshape(-1), keys & SLOT_MASK] = ids
        self.slots[:] = grid.reshape(-1).tolist()
        self.rows.update(zip(chunk_ids.tolist(), range(0, NUM_SLOTS * len(chunk_ids), NUM_SLOTS)))


EMPTY_CHUNK = [EMPTY] * NUM_SLOTS
