"""The paged allocators' block pool, as vLLM 0.33.0's `BlockPool` / `FreeKVCacheBlockQueue` with blocks as ints:
ref counts, cache keys and the free queue are arrays indexed by block id, so a request's blocks are taken, cached
and freed in a few array operations instead of one Python step per block (the hot path of a prefix-cached
replay: a 12,000-token prompt is 750 blocks); a few blocks (a decode step's one) go one at a time through
memoryviews of the same arrays (Python ints, cheaper than numpy's scalars). One pool serves every KV cache group
of a model: the single-group path of uniform models and the per-group managers of mixed ones.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque

import numpy as np

from kvsim.engine.paged.prefix_table import EMPTY, NUM_SLOTS, SLOT_BITS, SLOT_MASK, PrefixTable

_NOT_QUEUED = -1
_FEW = 8  # up to this many blocks, a call goes block by block: numpy's fixed cost (~1 µs an operation) is more
_FEW_REFS = 24  # up to this many, blocks are taken, touched and freed one at a time (scalars via memoryviews)


class FreeBlockSegments:
    """The free queue in eviction order (the head reused first) as a deque of segments of block ids.

        head <-> [uncached ...] <-> [never used ...] <-> [cached, least recently freed ... most recent] <-> tail
        segments: [ids 4 2] [ids 5 6 7 ...] [ids 1 3]   a freed request's blocks are one segment, pushed
                  at the head (uncached) or the tail (cached)

    A segment is `[ids one at a time, ids as an int64 array, serial of its first entry, next position]`: it keeps
    the form it was pushed in (a list from a few blocks, an array from many) and makes the other on first need (one
    block at a time reads the list, or a memoryview of the array: no list of a freed table's hundreds of blocks
    for the few a decode step takes; many at once slice the array). A block pulled out of the middle (a prefix hit
    on a free cached block) is not searched for: its entry goes stale. The entries of a segment carry consecutive
    serial numbers, and `serial[block]` is the one of a queued block's live entry (-1: taken out), so a stale entry
    is skipped when the head reaches it; a block the head hands out keeps its last serial, which no entry ahead
    of the head carries. While no entry is stale (`num_entries == num_free_blocks`) the head hands out blocks
    without checking them. Entries are compacted once stale ones outnumber the pool.
    """

    def __init__(self, num_blocks: int, first_free: np.ndarray):
        self.serial = np.full(num_blocks, _NOT_QUEUED, dtype=np.int64)  # (num_blocks,) live entry's serial
        self._serial = memoryview(self.serial)  # the same memory, one block at a time as Python ints
        self.segments: deque[list] = deque()  # [ids list | None, ids (m,) int64 | None, first serial, next position]
        self.num_entries = 0  # entries not yet passed by the head, stale ones included
        self.num_free_blocks = 0
        self._next_serial = 0
        self._limit = 2 * num_blocks + 1024  # entries kept before stale ones are compacted away
        self.push_tail(first_free)

    def _segment(self, ids: list[int] | np.ndarray) -> list:
        n = len(ids)
        base = self._next_serial
        self._next_serial = base + n
        self.num_entries += n
        self.num_free_blocks += n
        if type(ids) is not list:
            if n == 1:  # (a request's last block, partly filled): as a list too, for the head's next take
                block = int(ids[0])
                self._serial[block] = base
                return [[block], ids, base, 0]
            self.serial[ids] = np.arange(base, base + n, dtype=np.int64)
            return [None, ids, base, 0]
        if n > _FEW_REFS:
            self.serial[ids] = np.arange(base, base + n, dtype=np.int64)
        else:
            serial = self._serial
            for s, block in enumerate(ids, base):
                serial[block] = s
        return [ids, None, base, 0]

    def push_tail(self, ids: list[int] | np.ndarray) -> None:
        """Queue `ids` (in order; a list or an int64 array, kept: not to be changed after) at the tail: the last
        to be reused."""
        if len(ids):
            self.segments.append(self._segment(ids))
            if self.num_entries > self._limit:
                self.compact()

    def push_head(self, ids: list[int] | np.ndarray) -> None:
        """Queue `ids` (in order, the first reused first; a list or an int64 array, kept) at the head."""
        if len(ids):
            self.segments.appendleft(self._segment(ids))
            if self.num_entries > self._limit:
                self.compact()

    def remove(self, ids: np.ndarray) -> None:
        """Take queued `ids` out (their entries go stale)."""
        self.serial[ids] = _NOT_QUEUED
        self.num_free_blocks -= len(ids)

    def remove_one(self, block: int) -> None:
        """Take queued `block` out (its entry goes stale)."""
        self._serial[block] = _NOT_QUEUED
        self.num_free_blocks -= 1

    def pop(self, num_blocks: int) -> np.ndarray:
        """The `num_blocks` blocks at the head, head first, out of the queue: (num_blocks,) int64."""
        assert num_blocks <= self.num_free_blocks, (num_blocks, self.num_free_blocks)
        clean = self.num_entries == self.num_free_blocks  # no stale entry: every entry taken is a block
        out, need = [], num_blocks
        while need:
            seg = self.segments[0]
            ids, arr, base, pos = seg
            if arr is None:
                arr = seg[1] = np.array(ids, dtype=np.int64)
            take = min(len(arr) - pos, need)
            if not take:
                self.segments.popleft()
                continue
            cand = arr[pos : pos + take]  # (take,)
            if not clean:
                valid = self.serial[cand] == np.arange(base + pos, base + pos + take, dtype=np.int64)
                if np.count_nonzero(valid) != take:
                    cand = cand[valid]
            out.append(cand)
            need -= len(cand)
            seg[3] = pos + take
            self.num_entries -= take
        self.num_free_blocks -= num_blocks
        return out[0] if len(out) == 1 else np.concatenate(out)

    def pop_list(self, num_blocks: int) -> list[int]:
        """`pop(num_blocks)` as a list, one entry at a time (for a few blocks)."""
        assert num_blocks <= self.num_free_blocks, (num_blocks, self.num_free_blocks)
        clean = self.num_entries == self.num_free_blocks
        serial = self._serial
        out: list[int] = []
        need = num_blocks
        while need:
            seg = self.segments[0]
            ids, arr, base, pos = seg
            if ids is None:
                ids = seg[0] = memoryview(arr)  # (its entries one at a time, as Python ints)
            take = min(len(ids) - pos, need)
            if not take:
                self.segments.popleft()
                continue
            seg[3] = pos + take
            self.num_entries -= take
            if clean:
                out += ids[pos : pos + take]
                need -= take
                continue
            for s, block in enumerate(ids[pos : pos + take], base + pos):
                if serial[block] == s:
                    out.append(block)
                    need -= 1
        self.num_free_blocks -= num_blocks
        return out

    def pop_one(self) -> int:
        """The block at the head, out of the queue (the caller checks that one is free)."""
        serial = self._serial
        while True:
            seg = self.segments[0]
            ids, arr, base, pos = seg
            if ids is None:
                ids = seg[0] = memoryview(arr)  # (its entries one at a time, as Python ints)
            if pos == len(ids):
                self.segments.popleft()
                continue
            block = ids[pos]
            seg[3] = pos + 1
            self.num_entries -= 1
            if serial[block] == base + pos:
                self.num_free_blocks -= 1
                return block

    def compact(self) -> None:
        """Drop stale entries and passed positions: one segment, same order."""
        ids = self.queued_ids()
        self.segments.clear()
        self.num_entries = self.num_free_blocks = 0
        if len(ids):
            self.segments.append(self._segment(ids))

    def queued_ids(self) -> np.ndarray:
        """Queued blocks, head first: (num_free_blocks,) int64."""
        parts = []
        for ids, arr, base, pos in self.segments:
            if arr is None:
                arr = np.array(ids, dtype=np.int64)
            live = self.serial[arr[pos:]] == np.arange(base + pos, base + len(arr), dtype=np.int64)
            parts.append(arr[pos:][live])
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


class CachedHashes:
    """The keys group 0 of a `BlockPool` caches now, as a container (`key in cached`): its table less stale
    entries (a router's view of the cache)."""

    __slots__ = ("pool",)

    def __init__(self, pool: BlockPool):
        self.pool = pool

    def __contains__(self, block_hash: object) -> bool:
        return self.pool.get_cached_block(block_hash) is not None

    def __len__(self) -> int:
        return int(np.count_nonzero(self.pool.is_primary & (self.pool.block_group == 0)))


class BlockView:
    """One block of a `BlockPool` seen as an object (for tests and debugging): its id, ref count, key, group."""

    __slots__ = ("pool", "block_id")

    def __init__(self, pool: BlockPool, block_id: int):
        self.pool, self.block_id = pool, block_id

    @property
    def ref_count(self) -> int:
        return int(self.pool.ref_count[self.block_id])

    @property
    def block_hash(self) -> int | None:
        """The key the block is cached under, None if uncached."""
        return int(self.pool.block_hash[self.block_id]) if self.pool.is_cached[self.block_id] else None

    @property
    def group(self) -> int:
        """The KV cache group it was last cached for."""
        return int(self.pool.block_group[self.block_id])

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class BlockPool:
    """vLLM's `BlockPool` over arrays: block ids are ints, `ref_count`, `block_hash` (the cache key), `block_group`
    and `is_cached` are arrays indexed by block id, and the free queue is `FreeBlockSegments`. Block 0 is vLLM's
    null block (`null_block`), never handed out.

    Every KV cache group of a model takes its blocks from this one pool; a block is cached under (key, group), as
    vLLM's `BlockHashWithGroupId`, in its group's prefix table. `tables[g]` (a `PrefixTable`: slots of 32
    consecutive keys, so a run of a request's keys is one slice) maps a key to the oldest block caching it, as
    vLLM's `BlockHashToBlockMap` (`cached_block_hash_to_block` is group 0's, the only one of a uniform model);
    `duplicates[g]` holds the younger ones, oldest first, and `has_younger` marks the blocks that have some.
    Evicting a block with no younger copy leaves its entry in the table, stale (it no longer answers:
    `is_primary` is False, or the block caches another key or group now), so evictions cost no table operation;
    stale entries are replaced at the next insert of their key, or all dropped at once when the table's chunks
    outnumber the pool's blocks (`_purge`).
    `num_shared_refs` is the running sum over blocks of (ref_count - 1) for shared blocks: how many block
    allocations sharing (prefix hits on held blocks) avoided.
    """

    null_block = 0

    def __init__(self, num_blocks: int, *, enable_caching: bool = False, num_groups: int = 1):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.num_groups = num_groups
        self.ref_count = np.zeros(num_blocks, dtype=np.int64)  # (num_blocks,)
        self.block_hash = np.zeros(num_blocks, dtype=np.int64)  # (num_blocks,) meaningful where is_cached
        self.block_group = np.zeros(num_blocks, dtype=np.int64)  # (num_blocks,) the group of that key
        self.is_cached = np.zeros(num_blocks, dtype=bool)  # (num_blocks,)
        # `ref_count`, `is_cached` and `block_hash` one block at a time (Python ints and bools; numpy scalars
        # cost more)
        self._refs, self._cached = memoryview(self.ref_count), memoryview(self.is_cached)
        self._hashes = memoryview(self.block_hash)
        self.is_primary = np.zeros(num_blocks, dtype=bool)  # (num_blocks,) the table's answer for its key
        self.has_younger = np.zeros(num_blocks, dtype=bool)  # (num_blocks,) a primary with younger copies
        self._primary, self._younger = memoryview(self.is_primary), memoryview(self.has_younger)  # as _refs
        self.free_queue = FreeBlockSegments(num_blocks, np.arange(1, num_blocks, dtype=np.int64))
        self.tables = [PrefixTable() for _ in range(num_groups)]  # key -> oldest block (or stale)
        self.duplicates: list[dict[int, list[int]]] = [{} for _ in range(num_groups)]  # key -> younger copies
        self.cached_block_hash_to_block = self.tables[0]
        self.cached_duplicates = self.duplicates[0]
        self.num_shared_refs = 0
        self.num_blocks_allocated = 0  # blocks handed out since creation (for benchmarks)
        # cached blocks uncached by eviction since creation: while it stands, every live entry stays live and
        # every free cached block stays free but for hits (what a refused admission's retry is answered by,
        # `PagedAllocator._still_refused`)
        self.num_evicted = 0
        self._table_limit = num_blocks + 1024  # a table's chunks, stale included, before a purge
        self._views: list[BlockView] | None = None

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out: all but the null block."""
        return max(self.num_blocks - 1, 0)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached-but-unreferenced included (they can be evicted on demand)."""
        return self.free_queue.num_free_blocks

    def get_usage(self) -> float:
        """vLLM's `BlockPool.get_usage`: the fraction of usable blocks requests hold (a router's KV-utilization)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` from the head of the free queue, evicting their cached prefixes; ref count 1."""
        ids = self.get_new_block_ids(num_blocks)
        return ids if type(ids) is list else ids.tolist()

    def get_new_block_ids(self, num_blocks: int) -> list[int] | np.ndarray:
        """`get_new_blocks(num_blocks)` as a list for a few, as an int64 array (num_blocks,) for more."""
        if num_blocks <= _FEW_REFS:  # a few: one at a time beats numpy's fixed cost (same blocks, same order)
            out = self.free_queue.pop_list(num_blocks)
            refs, cached = self._refs, self._cached
            for block in out:
                refs[block] = 1
                if cached[block]:
                    self._evict_one(block)
            self.num_blocks_allocated += num_blocks
            return out
        ids = self.free_queue.pop(num_blocks)  # (num_blocks,)
        self.ref_count[ids] = 1
        cached = self.is_cached[ids]
        num_cached = np.count_nonzero(cached)
        if num_cached:
            self._evict(ids[cached] if num_cached != num_blocks else ids)
        self.num_blocks_allocated += num_blocks
        return ids

    def get_new_block(self) -> int:
        """`get_new_blocks(1)[0]`: a decode step opening one block."""
        block = self.free_queue.pop_one()
        self._refs[block] = 1
        if self._cached[block]:
            self._evict_one(block)
        self.num_blocks_allocated += 1
        return block

    def _evict_one(self, block: int) -> None:
        """Uncache `block`, taken from the free queue (`_evict` of one block)."""
        self.num_evicted += 1
        self._cached[block] = False
        if self._younger[block] or not self._primary[block]:
            self._uncache(block, int(self.block_hash[block]))
        else:
            self._primary[block] = False

    def _evict(self, ids: np.ndarray) -> None:
        """Uncache `ids` (`_maybe_evict_cached_block`): their table entries go stale, but for blocks with younger
        copies (the next one takes over) and younger copies themselves (they leave their key's list), which
        are uncached one at a time in `ids`' order, as vLLM evicts."""
        self.num_evicted += len(ids)
        self.is_cached[ids] = False
        if not any(self.duplicates):  # no younger copies anywhere: every cached block is its key's answer
            self.is_primary[ids] = False
            return
        slow = self.has_younger[ids] | ~self.is_primary[ids]
        if not np.count_nonzero(slow):  # (count_nonzero: a fraction of any()'s fixed cost)
            self.is_primary[ids] = False
            return
        self.is_primary[ids[~slow]] = False
        for block in ids[slow].tolist():
            self._uncache(block, int(self.block_hash[block]))

    def _uncache(self, block: int, key: int) -> None:
        """`block`, cached under `key` with younger copies or as one, leaves: the next oldest copy answers."""
        g = int(self.block_group[block])
        table, duplicates = self.tables[g], self.duplicates[g]
        younger = duplicates.get(key)
        if self.is_primary[block] and table.get(key) == block:  # the copy lookups find
            self.is_primary[block] = False
            self.has_younger[block] = False
            if younger:
                first = younger.pop(0)
                table.set(key, first)
                self.is_primary[first] = True
                self.has_younger[first] = bool(younger)
        elif younger is not None:  # a younger copy
            younger.remove(block)
            primary = table.get(key)
            self.has_younger[primary] = bool(younger)
        if younger is not None and not younger:
            del duplicates[key]

    def get_cached_block(self, block_hash: int, group: int = 0) -> int | None:
        """The oldest block caching `block_hash` for `group` (vLLM's `get_one_block`), or None."""
        table = self.tables[group]
        base = table.rows.get(block_hash >> SLOT_BITS)
        if base is None:
            return None
        block = table.slot[base + (block_hash & SLOT_MASK)]
        if (block == EMPTY or not self._primary[block] or self._hashes[block] != block_hash
                or self.block_group[block] != group):
            return None
        return block

    def cache_full_block(self, block: int, block_hash: int, group: int = 0) -> None:
        """Register uncached full `block` under (`block_hash`, `group`), behind any block already caching it
        (one block: its scalars through the memoryviews)."""
        self._hashes[block] = block_hash
        if self.num_groups > 1:
            self.block_group[block] = group
        self._cached[block] = True
        table = self.tables[group]
        base = table.rows.get(block_hash >> SLOT_BITS)
        if base is None:  # the first key of its chunk
            base = table.add_chunk(block_hash >> SLOT_BITS)  # (before `table.slot`: it may grow the table)
            table.slot[base + (block_hash & SLOT_MASK)] = block
            self._primary[block] = True
            if len(table.rows) > self._table_limit:
                self._purge()
            return
        at = base + (block_hash & SLOT_MASK)
        slot = table.slot
        first = slot[at]
        if first != EMPTY and first != block:
            if self._primary[first] and self._hashes[first] == block_hash and self.block_group[first] == group:
                self.duplicates[group].setdefault(block_hash, []).append(block)  # behind a live older copy
                self._younger[first] = True
                return
        slot[at] = block  # an empty slot or a stale entry
        self._primary[block] = True

    def cache_full_blocks(self, ids: list[int], keys: np.ndarray, runs: list[int], start: int,
                          arr: np.ndarray | None = None) -> None:
        """Register uncached full blocks `ids` of group 0 under `keys[start : start + len(ids)]` (`runs`:
        `key_runs(keys)`; `arr`: `ids` as an int64 array, if the caller has it), each behind any block already
        caching its key. Each run of keys is one dict operation (its chunk); their slots are then read and
        written as one slice or one gather: an empty slot or a stale entry (an evicted block's) takes the block,
        a live one (an older copy) keeps its slot and the block queues behind it. (A key given twice in one call,
        which a request's keys never are, leaves its last block in the slot.)"""
        n = len(ids)
        end = start + n
        if n <= _FEW:  # a few (a decode run's blocks): one at a time
            for block, key in zip(ids, keys[start:end].tolist()):
                self.cache_full_block(block, key)
            return
        if arr is None:
            arr = np.fromiter(ids, dtype=np.int64, count=n)  # (n,)
        new_keys = keys[start:end]  # (n,)
        self.block_hash[arr] = new_keys
        self.is_cached[arr] = True
        if self.num_groups > 1:
            self.block_group[arr] = 0
        table = self.cached_block_hash_to_block
        rows = table.rows
        r = bisect_right(runs, start)  # runs[r]: the end of the run `start` is in
        num_runs = bisect_left(runs, end, r) - r + 1
        if (len(rows) + num_runs) * NUM_SLOTS > len(table.slots):
            table.reserve(num_runs)  # room for a new chunk per run: `slots` stays as it is below
        slots = table.slots
        next_base = len(rows) * NUM_SLOTS  # where a new chunk's slots start (`add_chunk`, inlined)
        offsets, lengths = [], []  # per run: its first slot less its first position in `ids`, its length
        i = start
        while i < end:
            stop = runs[r] if runs[r] < end else end
            r += 1
            key = keys.item(i)
            base = rows.get(key >> SLOT_BITS)
            if base is None:  # a new chunk
                base = rows[key >> SLOT_BITS] = next_base
                next_base += NUM_SLOTS
            offset = base + (key & SLOT_MASK) - (i - start)
            if offsets and offsets[-1] == offset:  # its slots follow the last run's (new chunks come in order)
                lengths[-1] += stop - i
            else:
                offsets.append(offset)
                lengths.append(stop - i)
            i = stop
        if len(offsets) == 1:
            pos = slice(offsets[0], offsets[0] + n)
        else:
            pos = np.repeat(offsets, lengths) + np.arange(n)  # (n,) the slot of each key
        older = slots[pos]  # (n,) the entries there
        if np.count_nonzero(older):  # (count_nonzero: a fraction of any()'s fixed cost)
            live = self.is_primary[older] & (self.block_hash[older] == new_keys)  # (n,) an older copy answers
            if self.num_groups > 1:
                live &= self.block_group[older] == 0
            if np.count_nonzero(live):
                arr = self._queue_behind_older(arr, new_keys, older, live)
                if type(pos) is slice:
                    pos = np.arange(pos.start, pos.stop)
                pos = pos[~live]
        slots[pos] = arr
        self.is_primary[arr] = True
        if len(rows) > self._table_limit:
            self._purge()

    def _queue_behind_older(self, arr: np.ndarray, keys: np.ndarray, older: np.ndarray, live: np.ndarray) -> np.ndarray:
        """`cache_full_blocks`' blocks `arr` (n,) whose keys `keys` (n,) a live older copy `older` (n,) answers
        (`live`, (n,) bool) queue behind it, in `arr`'s order; returns `arr` less them."""
        queued = np.flatnonzero(live)  # positions in `arr`
        duplicates = self.duplicates[0]
        for key, block in zip(keys[queued].tolist(), arr[queued].tolist()):
            duplicates.setdefault(key, []).append(block)
        self.has_younger[older[queued]] = True
        return arr[~live]

    def _purge(self) -> None:
        """Drop the tables' stale entries: each keeps only its live ones."""
        for g, table in enumerate(self.tables):
            ids = np.flatnonzero(self.is_primary & (self.block_group == g))
            table.rebuild(self.block_hash[ids], ids)

    def cached_hashes(self) -> CachedHashes:
        """The keys group 0 caches now, as a container (a router's view of the cache)."""
        return CachedHashes(self)

    def num_evictable(self, ids: list[int]) -> int:
        """How many of `ids` nobody holds (a hit on them takes them out of the free queue)."""
        if len(ids) <= 4 * _FEW_REFS:  # reads only: block by block wins for longer
            refs = self._refs
            return [refs[block] for block in ids].count(0)
        return int(np.count_nonzero(self.ref_count[np.array(ids, dtype=np.int64)] == 0))

    def touch(self, ids: list[int]) -> None:
        """One more holder for each of `ids` (a prefix hit); free ones leave the free queue."""
        if len(ids) <= _FEW_REFS:
            refs = self._refs
            for block in ids:
                ref = refs[block]
                if ref:
                    self.num_shared_refs += 1
                else:
                    self.free_queue.remove_one(block)
                refs[block] = ref + 1
            return
        arr = np.array(ids, dtype=np.int64)  # (n,)
        refs = self.ref_count[arr]  # (n,)
        free = refs == 0
        self.touch_hit(arr, refs, free, int(np.count_nonzero(free)))

    def touch_hit(self, ids: np.ndarray, refs: np.ndarray, free: np.ndarray, num_free: int) -> None:
        """`touch(ids)` with what the lookup that found them read: `refs` (n,) their ref counts, `free` (n,)
        `refs == 0`, `num_free` its count (none of them changed since)."""
        if num_free:
            self.free_queue.remove(ids[free] if num_free != len(ids) else ids)
        self.num_shared_refs += len(ids) - num_free
        refs += 1
        self.ref_count[ids] = refs

    def free_blocks(self, ids: list[int] | np.ndarray, num_uncached: int | None = None) -> None:
        """One holder fewer for each of `ids` (a list, or an int64 array the queue may keep), given in eviction
        order (a request's tail first). A block nobody holds goes back to the free queue: cached ones to the
        tail, uncached to the head, each kind in the order given (vLLM's `append_n` / `prepend_n`).
        `num_uncached`: the first so many of `ids` are uncached, none of them shared, and the rest go as cached
        ones, whatever `is_cached` says (the caller's word: a finished request's private blocks, which are never
        cached but queue as cached ones, `PagedAllocator.free_finished`)."""
        if num_uncached is not None:
            self._free_split(ids, num_uncached)
            return
        if len(ids) <= _FEW_REFS:
            if type(ids) is not list:
                ids = ids.tolist()
            refs, is_cached = self._refs, self._cached
            uncached, cached = [], []
            for block in ids:
                ref = refs[block] - 1
                refs[block] = ref
                if ref:
                    assert ref > 0, "a block freed more often than held"
                    self.num_shared_refs -= 1
                elif is_cached[block]:
                    cached.append(block)
                else:
                    uncached.append(block)
            if uncached:
                self.free_queue.push_head(uncached)
            if cached:
                self.free_queue.push_tail(cached)
            return
        arr = np.array(ids, dtype=np.int64) if type(ids) is list else ids  # (n,)
        refs = self.ref_count[arr]  # (n,)
        refs -= 1
        self.ref_count[arr] = refs
        num_held = np.count_nonzero(refs)  # blocks still shared with another request
        if num_held:
            assert refs.min() >= 0, "a block freed more often than held"
            self.num_shared_refs -= int(num_held)
            arr = arr[refs == 0]
        cached = self.is_cached[arr]
        num_cached = np.count_nonzero(cached)
        if num_cached == len(arr):
            self.free_queue.push_tail(arr)
        elif not num_cached:
            self.free_queue.push_head(arr)
        elif num_cached == len(arr) - 1 and not cached[0]:  # a request's last block, partly filled, first
            self.free_queue.push_head(arr[:1])
            self.free_queue.push_tail(arr[1:])
        else:
            self.free_queue.push_head(arr[~cached])
            self.free_queue.push_tail(arr[cached])

    def _free_split(self, ids: list[int] | np.ndarray, num_uncached: int) -> None:
        """`free_blocks(ids, num_uncached)`."""
        queue = self.free_queue
        if len(ids) <= _FEW_REFS:
            if type(ids) is not list:
                ids = ids.tolist()
            refs = self._refs
            for block in ids[:num_uncached]:
                assert refs[block] == 1, "an uncached block shared"
                refs[block] = 0
            cached = []
            for block in ids[num_uncached:]:
                ref = refs[block] - 1
                refs[block] = ref
                if ref:
                    assert ref > 0, "a block freed more often than held"
                    self.num_shared_refs -= 1
                else:
                    cached.append(block)
            if num_uncached:
                queue.push_head(ids[:num_uncached])
            if cached:
                queue.push_tail(cached)
            return
        arr = np.array(ids, dtype=np.int64) if type(ids) is list else ids  # (n,)
        refs = self.ref_count[arr]  # (n,)
        refs -= 1
        self.ref_count[arr] = refs
        num_held = np.count_nonzero(refs)  # blocks still shared with another request (cached ones)
        if num_held:
            assert refs.min() >= 0 and not np.count_nonzero(refs[:num_uncached]), "an uncached block shared"
            self.num_shared_refs -= int(num_held)
            arr = arr[refs == 0]
        if num_uncached:
            queue.push_head(arr[:num_uncached])
        if num_uncached < len(arr):
            queue.push_tail(arr[num_uncached:])

    # --- for tests and debugging -------------------------------------------------------------------------

    @property
    def blocks(self) -> list[BlockView]:
        """Every block as a `BlockView` (the same object each time)."""
        if self._views is None:
            self._views = [BlockView(self, i) for i in range(self.num_blocks)]
        return self._views

    def cached_keys(self) -> dict[tuple[int, int], int]:
        """Every (key, group) cached now, and the block a lookup returns for it."""
        ids = np.flatnonzero(self.is_primary).tolist()
        return dict(zip(zip(self.block_hash[ids].tolist(), self.block_group[ids].tolist()), ids))

    def free_block_views(self) -> list[BlockView]:
        """The free queue's blocks, head (next reused) first."""
        return [self.blocks[i] for i in self.free_queue.queued_ids().tolist()]
