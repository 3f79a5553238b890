"""The block pool's invariants after any sequence of allocator calls, shared by the property tests."""

from __future__ import annotations


def assert_pool_matches(alloc, held: dict[int, int]) -> None:
    """Every usable block's ref count is the number of block tables holding it (`held`: block id -> count), the
    free count is the rest of the pool, and each group's live prefix-table entry names a block cached under that
    very key and group."""
    pool = alloc.pool
    assert all(b.ref_count == held.get(b.block_id, 0) for b in pool.blocks[1:])
    assert alloc.num_free_blocks == pool.num_usable_blocks - len(held)
    for g, table in enumerate(pool.tables):
        for key, _ in table.items():
            block = pool.get_cached_block(key, g)  # a live entry (stale ones answer None)
            assert block is None or (pool.blocks[block].block_hash, pool.blocks[block].group) == (key, g)
