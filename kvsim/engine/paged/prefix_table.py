"""One KV cache group's prefix table, vLLM 0.33.0's `BlockHashToBlockMap` (a block's key -> the block caching
it), kept as chunks of 32 consecutive keys: a run of consecutive keys is one dict operation and one slice (or
its part of one gather)."""

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
    the chunk of `key` starts in `slots`, one flat int64 array, and `slots[rows[key >> 5] + (key & 31)]` is the
    block of `key`, `EMPTY` where it has none.

        key  = tag << 61 | stream << 21 | j               (a replay's block key: `make_block_keys`)
        rows  {key >> 5: 0, ...: 32, ...: 64}             a chunk's offset, in the order chunks came
        slots [b0 b1 ... b31 | b0 ... b31 | ... | 0 0 0]  one array, spare capacity (all EMPTY) at its end

    `slot` is the same memory as a memoryview: one slot at a time as a Python int (numpy's scalars cost more); a
    run of slots is one slice or one gather of `slots`. Both are replaced when the array grows (`add_chunk`,
    `reserve`): read them after adding chunks. A slot's block may be stale (evicted, or caching another key
    since): the pool checks whether an entry is live (`BlockPool`); the table only stores. Chunks are never
    dropped one by one: `rebuild` (the pool's purge) replaces them all with the live entries, in place (no
    object per entry: a purge costs the live entries and one clear of the array, however many stale ones).
    Every int key works; a key with no neighbours takes a chunk alone.
    """

    __slots__ = ("rows", "slots", "slot")

    def __init__(self, capacity: int = 64) -> None:
        self.rows: dict[int, int] = {}  # chunk (key >> 5) -> offset of its 32 slots in `slots`
        self.slots = np.zeros(capacity * NUM_SLOTS, dtype=np.int64)  # (capacity * 32,) block ids or EMPTY
        self.slot = memoryview(self.slots)  # the same memory, one slot at a time

    def __len__(self) -> int:
        """Chunks held, stale ones included (what the pool purges by)."""
        return len(self.rows)

    def get(self, key: int) -> int:
        """The block `key`'s slot holds (perhaps stale), or `EMPTY`."""
        base = self.rows.get(key >> SLOT_BITS)
        return self.slot[base + (key & SLOT_MASK)] if base is not None else EMPTY

    def set(self, key: int, block: int) -> None:
        """`key`'s slot holds `block` from now."""
        base = self.rows.get(key >> SLOT_BITS)
        if base is None:
            base = self.add_chunk(key >> SLOT_BITS)
        self.slot[base + (key & SLOT_MASK)] = block

    def add_chunk(self, chunk: int) -> int:
        """Empty slots for keys `chunk << 5` ... `+ 31`, which have none yet: their offset in `slots` (which
        may be a new array: read `slots` and `slot` after)."""
        base = len(self.rows) * NUM_SLOTS
        if base == len(self.slots):
            self.reserve(1)
        self.rows[chunk] = base
        return base

    def reserve(self, num_chunks: int) -> None:
        """Room for `num_chunks` more chunks without growing `slots` (capacity doubled as needed)."""
        need = (len(self.rows) + num_chunks) * NUM_SLOTS
        if need > len(self.slots):
            grown = np.zeros(max(need, 2 * len(self.slots)), dtype=np.int64)
            grown[: len(self.slots)] = self.slots
            self.slots, self.slot = grown, memoryview(grown)

    def items(self) -> Iterator[tuple[int, int]]:
        """Every (key, block) entry, stale ones included (for tests and debugging)."""
        slot = self.slot
        for chunk, base in self.rows.items():
            for i in range(NUM_SLOTS):
                if slot[base + i] != EMPTY:
                    yield chunk << SLOT_BITS | i, slot[base + i]

    def rebuild(self, keys: np.ndarray, ids: np.ndarray) -> None:
        """Only `ids` (n,) under `keys` (n,), distinct: every other entry dropped."""
        self.slots[: len(self.rows) * NUM_SLOTS] = EMPTY
        self.rows.clear()
        chunk_ids, rows = np.unique(keys >> SLOT_BITS, return_inverse=True)  # (c,), (n,)
        self.reserve(len(chunk_ids))
        self.slots[rows.reshape(-1) * NUM_SLOTS + (keys & SLOT_MASK)] = ids
        self.rows.update(zip(chunk_ids.tolist(), range(0, NUM_SLOTS * len(chunk_ids), NUM_SLOTS)))

