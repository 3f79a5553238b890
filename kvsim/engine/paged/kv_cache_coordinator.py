"""The KV cache groups of a mixed model over one pool, as vLLM 0.33.0's `HybridKVCacheCoordinator` (prefix
caching on or off): one manager and one block table per group, one shared free-block count."""

from __future__ import annotations

from kvsim.engine.paged.block_pool import Block, BlockPool
from kvsim.size.kv_cache_spec import PoolSpec
from kvsim.engine.paged.single_type_kv_cache_manager import SingleTypeManager, make_manager


class HybridCoordinator:
    """One manager per group, asked in group order (`KVCacheCoordinator`).

    A request's blocks are `tables[g]` for group g; the coordinator never pools them per group: every
    group takes its blocks from, and returns them to, the same `BlockPool`.
    """

    def __init__(self, pool_spec: PoolSpec, pool: BlockPool):
        self.pool = pool
        self.managers: list[SingleTypeManager] = [make_manager(g, pool) for g in pool_spec.groups]

    def new_tables(self) -> list[list[Block]]:
        return [[] for _ in self.managers]

    def get_num_blocks_to_allocate(
        self,
        tables: list[list[Block]],
        num_tokens: int,
        apply_admission_cap: bool = False,
        new_computed_blocks: list[list[Block]] | None = None,
        num_computed_tokens: int = 0,
    ) -> int:
        """Blocks every group together needs to hold `num_tokens` tokens (`get_num_blocks_to_allocate`), a new
        request's prefix-cache hit (`new_computed_blocks`, `num_computed_tokens` long) included."""
        if new_computed_blocks is None:
            return sum(m.get_num_blocks_to_allocate(t, num_tokens, apply_admission_cap) for m, t in zip(self.managers, tables))
        return sum(
            m.get_num_blocks_to_allocate(t, num_tokens, apply_admission_cap, hit, num_computed_tokens)
            for m, t, hit in zip(self.managers, tables, new_computed_blocks)
        )

    def allocate_new_computed_blocks(self, tables: list[list[Block]], new_computed_blocks: list[list[Block]], num_computed_tokens: int) -> None:
        """Every group takes its hit blocks before any group takes a new block, so no group evicts another's hit."""
        for manager, table, hit in zip(self.managers, tables, new_computed_blocks):
            manager.add_local_computed_blocks(table, hit, num_computed_tokens)

    def allocate_new_blocks(self, tables: list[list[Block]], num_tokens: int) -> None:
        for manager, table in zip(self.managers, tables):
            manager.allocate_new_blocks(table, num_tokens)

    def remove_skipped_blocks(self, tables: list[list[Block]], processed_computed_tokens: int) -> int:
        """Null the blocks each group no longer reads, against tokens whose step has settled; returns how many."""
        return sum(m.remove_skipped_blocks(t, processed_computed_tokens) for m, t in zip(self.managers, tables))

    def free(self, tables: list[list[Block]]) -> None:
        """Every group's blocks back to the pool, group by group, each tail first (`KVCacheCoordinator.free`)."""
        for manager, table in zip(self.managers, tables):
            manager.free(table)
