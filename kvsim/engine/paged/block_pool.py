"""The paged allocator's blocks: the free-block queue (LRU over cached prefixes) and the prefix-hash table.

vLLM v1's `BlockPool` / `FreeKVCacheBlockQueue` idea: a freed block that still holds a cached prefix stays
in the free queue, reusable by a later request with the same prefix until it is evicted, in LRU order.
"""

from __future__ import annotations

from typing import Iterable


class Block:
    """One KV block (a page of the pool): its id, how many requests hold it, and its prefix hash if cached.

    `prev_free` / `next_free` link it into the free queue while `ref_count == 0`.
    """

    __slots__ = ("block_id", "ref_count", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with O(1) `remove` from the middle; `BlockPool` takes blocks from the
    head and splices freed ones in at either end, through the sentinels `head` and `tail`.

    Order is eviction order: the head is reused first. Uncached free blocks go to the head (reused before
    any cached prefix is evicted); freed cached blocks go to the tail, so cached blocks leave in LRU order.
    `remove` pulls a cached block out of the middle when a prefix-cache hit revives it.

        head <-> [uncached ...] <-> [never used ...] <-> [cached, least recently freed ... most recent] <-> tail
    """

    def __init__(self, blocks: list[Block]):
        self.head = Block(-1)  # sentinels: never handed out
        self.tail = Block(-1)
        self.num_free_blocks = 0
        prev = self.head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self.tail.prev_free = self.tail, prev
        self.num_free_blocks = len(blocks)

    def remove(self, block: Block) -> None:
        """Take `block` out of the middle in O(1) (a prefix-cache hit on a free cached block)."""
        self._unlink(block)

    def _unlink(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def blocks(self) -> list[Block]:
        """The free blocks, head (next reused) first. O(n): for tests and debugging."""
        out, block = [], self.head.next_free
        while block is not self.tail:
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    """Owns every block: hands out free ones, takes them back by ref count, and keeps the prefix-hash table.

    As vLLM's `BlockHashToBlockMap`, the table does not de-duplicate: a block computed again for a prefix that
    another block already caches is cached too (block tables stay append-only). `cached_block_hash_to_block`
    maps a hash to the oldest of its cached blocks (what a lookup returns, vLLM's `get_one_block`);
    `cached_duplicates` holds the younger ones, oldest first. Evicting a block removes that block only.

    Block 0 is vLLM's null block (`BlockPool.null_block`): taken out of the free queue at creation and never
    handed out, so `num_blocks - 1` blocks are usable. `num_shared_refs` is the running sum over blocks of
    (ref_count - 1) for shared blocks: how many block allocations sharing (prefix hits on held blocks)
    avoided.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = False):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0] if num_blocks else None
        self.free_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[int, Block] = {}
        self.cached_duplicates: dict[int, list[Block]] = {}  # hash -> its younger cached blocks, oldest first
        self.num_shared_refs = 0
        self.num_blocks_allocated = 0  # blocks handed out by get_new_blocks since creation (for benchmarks)
        self._uncached_mark, self._cached_mark = Block(-1), Block(-1)  # free_blocks' scratch chain ends

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

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Take `num_blocks` from the head of the free queue, evicting their cached prefixes; ref_count 1."""
        queue = self.free_queue
        assert num_blocks <= queue.num_free_blocks, (num_blocks, queue.num_free_blocks)
        head = queue.head
        out = []
        append = out.append
        block = head.next_free
        for _ in range(num_blocks):  # off the head, one at a time: this runs once per block of every request
            append(block)
            block = block.next_free
        head.next_free, block.prev_free = block, head
        cached = self.cached_block_hash_to_block
        duplicates = self.cached_duplicates
        for taken in out:
            if taken.block_hash is not None:  # evict its prefix (`_maybe_evict_cached_block`)
                if duplicates and taken.block_hash in duplicates:
                    self._uncache(taken)
                else:
                    del cached[taken.block_hash]
                taken.block_hash = None
            taken.ref_count = 1
            taken.prev_free = taken.next_free = None
        queue.num_free_blocks -= num_blocks
        self.num_blocks_allocated += num_blocks
        return out

    def get_new_block(self) -> Block:
        """`get_new_blocks(1)[0]` without the lists: a decode step opening one block."""
        queue = self.free_queue
        head = queue.head
        block = head.next_free
        assert block is not queue.tail, "free queue is empty"
        nxt = block.next_free
        head.next_free, nxt.prev_free = nxt, head
        block.prev_free = block.next_free = None
        if block.block_hash is not None:
            if self.cached_duplicates and block.block_hash in self.cached_duplicates:
                self._uncache(block)
            else:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        queue.num_free_blocks -= 1
        self.num_blocks_allocated += 1
        return block

    def get_cached_block(self, block_hash: int) -> Block | None:
        """The oldest cached block under `block_hash` (vLLM's `get_one_block`), or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_block(self, block: Block, block_hash: int) -> None:
        """Register a full block under its chained hash, even when another block already caches that prefix."""
        if block.block_hash is None:
            block.block_hash = block_hash
            if self.cached_block_hash_to_block.setdefault(block_hash, block) is not block:
                self.add_duplicate(block)

    def add_duplicate(self, block: Block) -> None:
        """Cache `block` (its `block_hash` set) behind the older block(s) cached under the same hash."""
        self.cached_duplicates.setdefault(block.block_hash, []).append(block)

    def _uncache(self, block: Block) -> None:
        """Drop `block` (cached) from the table; the next oldest block under its hash, if any, takes its place."""
        block_hash = block.block_hash
        younger = self.cached_duplicates.get(block_hash)
        if younger is None:
            del self.cached_block_hash_to_block[block_hash]
            return
        if self.cached_block_hash_to_block[block_hash] is block:
            self.cached_block_hash_to_block[block_hash] = younger.pop(0)
        else:
            younger.remove(block)
        if not younger:
            del self.cached_duplicates[block_hash]

    def touch(self, blocks: Iterable[Block]) -> None:
        """One more holder for each of `blocks` (a prefix hit); free ones leave the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            else:
                self.num_shared_refs += 1
            block.ref_count += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """One holder fewer for each of `blocks`, given in eviction order (a request's tail first).

        A block nobody holds goes back to the free queue: cached ones to the tail, uncached to the head, each
        kind in the order given (vLLM's `append_n` / `prepend_n`: the first uncached one freed is reused
        first). Each kind is first linked into a chain of its own behind a scratch sentinel (two link writes
        a block), then spliced into the queue once:

            head <-> [uncached chain] <-> ...queue... <-> [cached chain] <-> tail
        """
        queue = self.free_queue
        u_mark, c_mark = self._uncached_mark, self._cached_mark
        u_last = u_mark  # both chains grow at their back: the first one freed is reused (evicted) first
        c_last = c_mark
        still_shared = freed = 0
        for block in blocks:
            ref_count = block.ref_count = block.ref_count - 1
            if ref_count:
                assert ref_count > 0, block
                still_shared += 1
                continue
            if block.block_hash is None:
                u_last.next_free, block.prev_free = block, u_last
                u_last = block
            else:
                c_last.next_free, block.prev_free = block, c_last
                c_last = block
            freed += 1
        if u_last is not u_mark:
            head = queue.head
            u_first, nxt = u_mark.next_free, head.next_free
            head.next_free, u_first.prev_free = u_first, head
            u_last.next_free, nxt.prev_free = nxt, u_last
            u_mark.next_free = None
        if c_last is not c_mark:
            tail = queue.tail
            c_first, prev = c_mark.next_free, tail.prev_free
            prev.next_free, c_first.prev_free = c_first, prev
            c_last.next_free, tail.prev_free = tail, c_last
            c_mark.next_free = None
        self.num_shared_refs -= still_shared
        queue.num_free_blocks += freed
