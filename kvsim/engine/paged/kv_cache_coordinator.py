"""The KV cache groups of a mixed model over one pool, as vLLM 0.33.0's `HybridKVCacheCoordinator` (prefix
caching on or off): one manager and one block table per group, one shared free-block count, and prefix caching
across the groups (cache keys per group, a right-to-left hit search for sliding-window groups, and the fixed
point that reconciles the groups)."""

from __future__ import annotations

from kvsim.engine.paged.block_pool import BlockPool
from kvsim.size.kv_cache_spec import PoolSpec
from kvsim.engine.paged.single_type_kv_cache_manager import SingleTypeManager, make_manager

# the kinds whose groups share prefixes here; vLLM's `FullAttentionSpec` family first (MLA is one)
FULL_KINDS = ("full", "mla")
CACHEABLE_KINDS = FULL_KINDS + ("sliding",)


class HybridCoordinator:
    """One manager per group, asked in group order (`KVCacheCoordinator`).

    A request's blocks are `tables[g]` (block ids) for group g; the coordinator never pools them per group: every
    group takes its blocks from, and returns them to, the same `BlockPool`.

    With prefix caching a block is cached under (block hash, group id), vLLM's `BlockHashWithGroupId`: the same
    prefix has one block per group, and a hit needs every group of a kind to hold it. Groups of one kind and
    window are looked up together (vLLM's `SpecGroup`), full attention first.
    """

    def __init__(self, pool_spec: PoolSpec, pool: BlockPool, prefix_cache_retention_interval: int | None = 0, *,
                 mamba_align: bool = False, mamba_checkpoint_alignment: int = 0):
        self.pool = pool
        # vLLM's `prefix_cache_retention_interval`: which sliding-window and state blocks are cached (None: every one)
        self.retention_interval = prefix_cache_retention_interval
        self.managers: list[SingleTypeManager] = [
            make_manager(g, pool, i, mamba_align=mamba_align, mamba_checkpoint_alignment=mamba_checkpoint_alignment)
            for i, g in enumerate(pool_spec.groups)
        ]
        self.groups = groups = pool_spec.groups
        # mamba_cache_mode align: state groups cache their block-boundary states and take part in hits; the
        # keys of the states cached in the current step (vLLM's `cached_blocks_this_step`), which a new request
        # cannot hit before the next step
        self.mamba_align = mamba_align and any(g.kind == "state" for g in groups)
        self.cacheable_kinds = CACHEABLE_KINDS + (("state",) if self.mamba_align else ())
        self.cached_this_step: set = set()
        kinds: dict[tuple, list[int]] = {}
        for g, group in enumerate(groups):
            kinds.setdefault((group.kind in FULL_KINDS, group.kind, group.window, group.block_size), []).append(g)
        # full attention first (a stable sort, as vLLM's), then the other kinds in group order
        self.spec_groups = sorted(kinds.items(), key=lambda kv: not kv[0][0])

    def new_tables(self) -> list[list[int]]:
        return [m.new_table() for m in self.managers]

    def new_step_starts(self) -> None:
        """A scheduler step begins: the states cached in the last one may be hit (`new_step_starts`)."""
        self.cached_this_step.clear()

    def get_num_blocks_to_allocate(
        self,
        tables: list[list[int]],
        num_tokens: int,
        apply_admission_cap: bool = False,
        new_computed_blocks: list[list[int]] | None = None,
        num_computed_tokens: int = 0,
        *,
        query_start: int = 0,
        prefill_end: int = 0,
    ) -> int:
        """Blocks every group together needs to hold `num_tokens` tokens (`get_num_blocks_to_allocate`), a new
        request's prefix-cache hit (`new_computed_blocks`, `num_computed_tokens` long) included. Align-mode state
        groups also read where this chunk starts (`query_start`, the computed tokens) and where the request's
        prefill ends (`prefill_end`; under dense retention every chunk may export a checkpoint: 0)."""
        if self.mamba_align:
            if self.retention_interval != 0:
                prefill_end = 0
            need = 0
            for g, (m, t) in enumerate(zip(self.managers, tables)):
                hit = None if new_computed_blocks is None else new_computed_blocks[g]
                if self.groups[g].kind == "state":
                    need += m.get_num_blocks_to_allocate(t, num_tokens, apply_admission_cap, hit, num_computed_tokens,
                                                         query_start=query_start, prefill_end=prefill_end,
                                                         cached_this_step=self.cached_this_step)
                elif hit is None:
                    need += m.get_num_blocks_to_allocate(t, num_tokens, apply_admission_cap)
                else:
                    need += m.get_num_blocks_to_allocate(t, num_tokens, apply_admission_cap, hit, num_computed_tokens)
            return need
        if new_computed_blocks is None:
            return sum(m.get_num_blocks_to_allocate(t, num_tokens, apply_admission_cap) for m, t in zip(self.managers, tables))
        return sum(
            m.get_num_blocks_to_allocate(t, num_tokens, apply_admission_cap, hit, num_computed_tokens)
            for m, t, hit in zip(self.managers, tables, new_computed_blocks)
        )

    def allocate_new_computed_blocks(self, tables: list[list[int]], new_computed_blocks: list[list[int]], num_computed_tokens: int) -> None:
        """Every group takes its hit blocks before any group takes a new block, so no group evicts another's hit."""
        for manager, table, hit in zip(self.managers, tables, new_computed_blocks):
            manager.add_local_computed_blocks(table, hit, num_computed_tokens)

    def allocate_new_blocks(self, tables: list[list[int]], num_tokens: int) -> None:
        for manager, table in zip(self.managers, tables):
            manager.allocate_new_blocks(table, num_tokens)

    def remove_skipped_blocks(self, tables: list[list[int]], processed_computed_tokens: int) -> int:
        """Null the blocks each group no longer reads, against tokens whose step has settled; returns how many."""
        return sum(m.remove_skipped_blocks(t, processed_computed_tokens) for m, t in zip(self.managers, tables))

    def free(self, tables: list[list[int]]) -> None:
        """Every group's blocks back to the pool, group by group, each tail first (`KVCacheCoordinator.free`)."""
        for manager, table in zip(self.managers, tables):
            manager.free(table)

    # --- prefix caching across the groups ---------------------------------------------------------------

    def find_longest_cache_hit(self, hashes: list[int], max_length: int) -> tuple[list[list[int]], int, int]:
        """Each group's hit blocks, the hit length in tokens, and the shared prefix some group caches beyond it
        (`HybridKVCacheCoordinator.find_longest_cache_hit`'s `num_uncached_common_prefix_tokens`: the longest
        hit any one group's lookup found, less the hit).

        A fixed point: each kind accepts the candidate length or shortens it, until no kind shortens it.
        Full attention is downward closed, so it is looked up once and later only trimmed; with one full
        kind and one other kind, one pass suffices (vLLM stops there). Full groups are then truncated to the
        result. A sliding group's hit keeps null blocks before its run of cached blocks.
        """
        hit_blocks: list[list[int] | None] = [None] * len(self.groups)
        hit_by_group = [0] * len(self.groups)
        simple = len(self.spec_groups) == 2 and self.spec_groups[0][0][0]
        hit_length = max_length
        longest = 0
        while True:
            curr = hit_length
            for (is_full, kind, window, bs), ids in self.spec_groups:
                if is_full and hit_blocks[ids[0]] is not None:
                    curr = min(curr, hit_by_group[ids[0]])
                    continue
                if is_full:
                    blocks, curr = self._full_hit(hashes, curr, ids, bs)
                elif kind == "state":
                    blocks, curr = self._mamba_hit(hashes, curr, ids, bs)
                else:
                    blocks, curr = self._sliding_hit(hashes, curr, ids, bs, window)
                for g, b in zip(ids, blocks):
                    hit_blocks[g], hit_by_group[g] = b, curr
                longest = max(longest, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if simple:
                break
        for (is_full, _, _, bs), ids in self.spec_groups:
            if is_full:
                for g in ids:
                    del hit_blocks[g][-(-hit_length // bs):]
        return [b if b is not None else [] for b in hit_blocks], hit_length, longest - hit_length

    def _get(self, block_hash: int, ids: list[int]) -> list[int] | None:
        """The cached block of each group in `ids` for `block_hash`, or None if any group misses."""
        get = self.pool.get_cached_block
        out = []
        for g in ids:
            block = get(block_hash, g)
            if block is None:
                return None
            out.append(block)
        return out

    def _full_hit(self, hashes: list[int], max_length: int, ids: list[int], bs: int) -> tuple[list[list[int]], int]:
        """Leading cached blocks, left to right until the first miss (`FullAttentionManager`)."""
        blocks: list[list[int]] = [[] for _ in ids]
        for h in hashes[: max_length // bs]:
            cached = self._get(h, ids)
            if cached is None:
                break
            for out, b in zip(blocks, cached):
                out.append(b)
        return blocks, len(blocks[0]) * bs

    def _mamba_hit(self, hashes: list[int], max_length: int, ids: list[int], bs: int) -> tuple[list[list[int]], int]:
        """From the right, the first block whose state every group in `ids` caches; the blocks before it are null
        blocks (`MambaManager.find_longest_cache_hit`: a state needs no blocks before it)."""
        null = self.pool.null_block
        for i in range(max_length // bs - 1, -1, -1):
            cached = self._get(hashes[i], ids)
            if cached is not None:
                return [[null] * i + [b] for b in cached], (i + 1) * bs
        return [[] for _ in ids], 0

    def _sliding_hit(
        self, hashes: list[int], max_length: int, ids: list[int], bs: int, window: int
    ) -> tuple[list[list[int]], int]:
        """From the right, the first run of `cdiv(window - 1, bs)` cached blocks; the blocks before it are null
        blocks (`SlidingWindowManager.find_longest_cache_hit`). Without such a run, the leading cached blocks
        from the start of the prompt, if that is where the run touches."""
        need = -(-(window - 1) // bs)
        n = max_length // bs
        null = self.pool.null_block
        blocks: list[list[int]] = [[null] * n for _ in ids]
        run = 0
        for i in range(n - 1, -1, -1):
            cached = self._get(hashes[i], ids)
            if cached is None:
                run = 0
                continue
            for out, b in zip(blocks, cached):
                out[i] = b
            run += 1
            if run >= need:
                for out in blocks:
                    del out[i + run :]
                return blocks, (i + run) * bs
        for out in blocks:
            del out[run:]
        return blocks, run * bs

    def cache_blocks(
        self, tables: list[list[int]], hashes: list[int], start: int, end: int, reachable_boundaries: tuple[int, ...] = (),
        boundary_states: list | None = None,
    ) -> None:
        """Cache blocks [start, end) of every group under (hash, group id), skipping null blocks and hit blocks
        (`cache_full_blocks`); a block that repeats a cached prefix joins its key. A sliding group's blocks
        are cached before they leave the window, only those its manager's `reachable_block_mask` keeps under
        the retention interval (`reachable_boundaries`: token positions a later hit can resume at).

        `boundary_states`, when a list: each align-mode state block cached here is appended as (group, block,
        the tokens its state follows), vLLM's `MambaManager._pending_boundary_state_offloads` (the hand-off of
        committed boundary states to a KV connector)."""
        pool, null = self.pool, self.pool.null_block
        is_cached = pool.is_cached
        cacheable = self.cacheable_kinds
        for g, table in enumerate(tables):
            kind = self.groups[g].kind
            if kind not in cacheable:
                continue
            mask = self.managers[g].reachable_block_mask(start, end, self.retention_interval, reachable_boundaries)
            for i, (block, h) in enumerate(zip(table[start:end], hashes[start:end])):
                if block != null and not is_cached[block] and (mask is None or mask[i]):
                    pool.cache_full_block(block, h, g)
                    if kind == "state":
                        self.cached_this_step.add((h, g))
                        if boundary_states is not None:
                            boundary_states.append((g, block, (start + i + 1) * self.groups[g].block_size))
