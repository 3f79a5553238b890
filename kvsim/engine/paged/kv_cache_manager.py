"""The paged allocator for mixed models, as vLLM 0.33.0's hybrid KV cache manager: vLLM's KV cache groups with
padded equal pages, one block table per group, blocks outside a window replaced by the null block."""

from __future__ import annotations

from collections.abc import Container
from itertools import chain

import math

import numpy as np

from kvsim.engine.allocator import KVAllocator, MemoryBreakdown
from kvsim.engine.paged.block_pool import BlockPool
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.size.vllm_capacity import bytes_per_block, num_gpu_blocks
from kvsim.engine.paged.kv_cache_coordinator import CACHEABLE_KINDS, HybridCoordinator
from kvsim.engine.paged.kv_cache_utils import RequestBlockKeys
from kvsim.engine.sequence import Sequence
from kvsim.errors import KvsimError


class HybridRequest:
    """The allocator's state for one admitted request: a block table per group, real blocks held per group."""

    __slots__ = ("seq", "tables", "held", "quiet_until", "next_skip", "hashes", "num_cached", "hit", "boundaries",
                 "shared_prefix_boundary", "prefill_end")

    def __init__(self, seq: Sequence, tables: list[list[int]], hashes: list[int] | None = None):
        self.seq = seq
        self.tables = tables
        self.hashes = hashes  # cache keys of the full blocks of its final length (prefix caching on)
        self.num_cached = 0  # leading blocks of every table already offered to the cache
        self.hit = 0  # prefix-cache hit at admission, in tokens (computed once the step runs)
        # token positions a later request can resume a hit at, whose sliding-window tails are cached under
        # sparse retention: the prompt's last token, and a shared-prefix junction found at admission
        self.boundaries: tuple[int, ...] = (seq.num_prompt_tokens - 1,)
        self.shared_prefix_boundary = 0  # vLLM's `Request.shared_prefix_boundary`: that junction, or 0
        self.prefill_end = seq.num_prompt_tokens  # where this admission's prefill ends (vLLM's `prefill_end`)
        self.held = [0] * len(tables)  # blocks of each table that are not the null block
        self.quiet_until = -1  # an append up to this many computed + new tokens needs no block
        self.next_skip = 0  # an append at this many computed tokens may null a block of a window group


class HybridPagedAllocator(KVAllocator):
    """vLLM's `KVCacheManager` over `HybridKVCacheCoordinator` for a model with several KV cache groups.

    The pool is `num_gpu_blocks = budget // bytes_per_block` blocks, block 0 the null block. One block id is
    one page in each of `group_size` layer tensors and belongs to one group (gemma-3-27b: 6 sliding groups
    and 1 full group of 10 layers, the last two sliding groups holding 8 real layers and 2 padding layers):

        tensor 0  [ blk 0 = null | blk 1: sliding-0 | blk 2: full | blk 3: sliding-4 | ... ]
        tensor 9  [ blk 0 = null | blk 1: sliding-0 | blk 2: full | blk 3: padding   | ... ]

    Before every allocation each group nulls the blocks it no longer reads against the settled tokens
    (computed less `num_in_flight_tokens`: with async scheduling a step in flight still reads them); then each group grows
    to `cdiv(num_tokens, its block_size)` blocks. Slots and `block_table` follow the first layer kind of the model that keeps tokens.
    Prefix caching (full-attention and sliding-window groups) caches each group's full blocks under (hash, group id)
    and admits a hit the groups agree on (the coordinator's `find_longest_cache_hit`).
    """

    paged = True

    def __init__(
        self,
        spec: KVCacheSpec,
        budget_bytes: int,
        *,
        max_model_len: int,
        watermark: float = 0.0,
        enable_prefix_caching: bool = False,
        prefix_cache_retention_interval: int | None = 0,
        mamba_checkpoint_alignment: int = 0,
    ):
        if not 0.0 <= watermark < 1.0:
            raise KvsimError(f"watermark must be in [0, 1), got {watermark}", field="watermark")
        if max_model_len <= 0:
            raise KvsimError(f"max_model_len must be positive, got {max_model_len}", field="max_model_len")
        assert spec.pool is not None, "a mixed model's paged pool needs vLLM's groups (KVCacheSpec.pool)"
        self.spec = spec
        self.pool_spec = pool_spec = spec.pool
        self.groups = pool_spec.groups
        self.budget_bytes = budget_bytes
        self.max_model_len = max_model_len
        self.watermark = watermark
        self.enable_prefix_caching = enable_prefix_caching
        if enable_prefix_caching:
            check_prefix_caching(spec.pool.groups)
        check_retention_interval(prefix_cache_retention_interval, spec.pool.groups)
        self.prefix_cache_retention_interval = prefix_cache_retention_interval
        # slots and block_table follow the first group that keeps tokens (a state group's block is a state)
        token_groups = [i for i, g in enumerate(self.groups) if g.kind != "state"]
        if not token_groups:
            raise KvsimError("the paged replay needs at least one attention layer group (an attention-free model "
                             "has no block table to replay)", field="model")
        self._slot_group = token_groups[0]
        self.block_size = self.groups[self._slot_group].block_size
        self.bytes_per_block = bpb = bytes_per_block(spec)
        self.num_blocks = num_gpu_blocks(spec, budget_bytes)  # the null block included
        self.num_slots = self.num_blocks * self.block_size
        self.watermark_blocks = int(watermark * self.num_blocks)
        self.pool = BlockPool(self.num_blocks, enable_caching=enable_prefix_caching, num_groups=len(self.groups))
        # vLLM's mamba_cache_mode: align (state groups cache their block-boundary states; prefill chunks end on
        # block boundaries) with prefix caching, as vllm serve runs hybrid models; none without
        has_state = any(g.kind == "state" for g in self.groups)
        self.mamba_align = enable_prefix_caching and has_state
        self.mamba_block_size = self.block_size if self.mamba_align else 0
        self.mamba_checkpoint_alignment = mamba_checkpoint_alignment if self.mamba_align else 0
        self.coordinator = HybridCoordinator(pool_spec, self.pool, prefix_cache_retention_interval,
                                             mamba_align=self.mamba_align,
                                             mamba_checkpoint_alignment=self.mamba_checkpoint_alignment)
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self._keys = RequestBlockKeys(self.block_size)
        self._reqs: dict[Sequence, HybridRequest] = {}
        # A decode run: blocks each token group opens per block_size tokens, and the smallest sliding window
        self._num_token_groups = sum(g.kind != "state" for g in self.groups)
        windows = [g.window for g in self.groups if g.kind == "sliding"]
        self._max_run_by_window = 2 * min(windows) - 1 if windows else None
        self.decode_frees_blocks = self.mamba_align or any(g.kind in ("sliding", "chunked") for g in self.groups)
        # breakdown(): bytes one token occupies in a group's block, and the padding of each of its blocks
        self._token_bytes = [g.num_layers * g.layer_page_bytes // g.block_size for g in self.groups]
        self._pad_bytes = [bpb - g.num_layers * g.layer_page_bytes for g in self.groups]
        self._windowed = [i for i, g in enumerate(self.groups) if g.kind in ("sliding", "chunked")]
        # groups that null blocks before each allocation, in group order: windows, and align-mode states
        self._skipping = [i for i, g in enumerate(self.groups)
                          if g.kind in ("sliding", "chunked") or (self.mamba_align and g.kind == "state")]
        self._state_groups = [i for i, g in enumerate(self.groups) if g.kind == "state"] if self.mamba_align else []
        # a KV connector's hand-off of align-mode boundary states (`record_boundary_states`): per state group, the
        # (request, group, block, tokens) its caching committed, until the connector takes them
        self._boundary_states: dict[int, list] | None = None

    # --- the KVAllocator protocol -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def kv_cache_usage(self) -> float:
        return self.pool.get_usage()

    def cached_block_hashes(self) -> Container[int]:
        return self.pool.cached_hashes()

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        *,
        num_tokens: int | None = None,
        full_sequence_must_fit: bool = False,
        apply_watermark: bool = True,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        reserved_blocks: int = 0,
    ) -> int | None:
        """Admit `seq` with room for `num_new_tokens`, or None (nothing changed): `allocate_slots` for a waiting
        request. With `full_sequence_must_fit` every group must have room for all `num_tokens` first, a sliding
        or chunked group capped at its `max_admission_blocks_per_request`.

        A CPU tier's hit (`num_external_computed_tokens` past the prefix-cache hit) takes blocks in every group
        but those before a window (`allocate_external_computed_blocks`, after every group took its hit blocks);
        with `delay_cache_blocks` (an asynchronous load) nothing past the prefix-cache hit is cached until
        `cache_blocks`; `reserved_blocks` stay free for other requests (this allocation only)."""
        assert seq not in self._reqs, f"{seq} is already admitted"
        if num_tokens is None:
            num_tokens = max(seq.num_prompt_tokens, num_new_tokens)
        coordinator, free = self.coordinator, self.pool.num_free_blocks
        tables = coordinator.new_tables()
        hashes, hit_blocks, hit, query, uncached = None, None, 0, 0, 0
        if self.enable_prefix_caching and self._keys.has_keys(seq):
            hashes = self._keys.get_list(seq)
            query = min(num_tokens, seq.num_final_tokens)
            hit_blocks, hit, uncached = coordinator.find_longest_cache_hit(hashes, query - 1)
        watermark = self.watermark_blocks if apply_watermark else 0
        prefill_end = max(seq.num_prompt_tokens, num_tokens - 1)  # num_tokens: vLLM's request.num_tokens
        ext = num_external_computed_tokens
        if ext and hit_blocks is None:
            hit_blocks = [[] for _ in tables]
        if full_sequence_must_fit:  # a window skips what lies before it at the hit's end, the CPU tier's included
            full = min(num_tokens, self.max_model_len)
            need = coordinator.get_num_blocks_to_allocate(tables, full, True, hit_blocks, hit + ext, query_start=hit + ext,
                                                          prefill_end=prefill_end)
            if need + watermark > free:
                return None
        total = min(hit + ext + min(num_new_tokens, num_tokens - hit - ext), self.max_model_len)
        if coordinator.get_num_blocks_to_allocate(tables, total, False, hit_blocks, hit + ext, query_start=hit + ext,
                                                  prefill_end=prefill_end) + watermark + reserved_blocks > free:
            return None
        self._keys.forget()
        req = HybridRequest(seq, tables, hashes)
        req.prefill_end = prefill_end
        if uncached:  # vLLM's `shared_prefix_boundary`: where the longest single group's hit ends
            req.boundaries += (hit + uncached,)
            req.shared_prefix_boundary = hit + uncached
        self._reqs[seq] = req
        if hit or ext:
            coordinator.allocate_new_computed_blocks(tables, hit_blocks, hit + ext)
            if ext:
                coordinator.allocate_new_blocks(tables, hit + ext)
            req.held = [len(t) - t.count(self.pool.null_block) for t in tables]
            req.num_cached = hit // self.block_size
            req.hit = hit
        if query:
            self.prefix_query_tokens += query
            self.prefix_hit_tokens += hit
        self._grow(req, hit, total, hit + ext, cache=not delay_cache_blocks)
        return hit

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for `seq.num_computed_tokens + num_new_tokens` tokens: `allocate_slots` for a running request.

        The blocks that left a window are nulled first, even when the growth then does not fit (vLLM frees
        them "even if we cannot schedule this request"); growth ignores the watermark.
        """
        req = self._reqs[seq]
        computed = seq.num_computed_tokens
        total = computed + num_new_tokens
        settled = computed - seq.num_in_flight_tokens
        if total <= req.quiet_until and settled < req.next_skip:
            return True
        return self._grow(req, max(0, settled), min(total, self.max_model_len), computed)

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq`, group by group, each table's tail first."""
        self._drop_boundary_states(seq)
        self.coordinator.free(self._reqs.pop(seq).tables)

    def record_boundary_states(self) -> None:
        """Keep, for a KV connector, each align-mode state block that caching commits (vLLM's
        `MambaManager._pending_boundary_state_offloads`): `take_boundary_state_offloads` drains them."""
        if self._boundary_states is None:
            self._boundary_states = {g: [] for g in self._state_groups}

    def take_boundary_state_offloads(self) -> dict[Sequence, list[tuple[int, int, int]]]:
        """The state blocks cached since the last call, {request: [(group, block id, boundary tokens), ...]},
        state group after state group in caching order (`KVCacheManager.take_boundary_state_offloads`)."""
        offloads: dict[Sequence, list[tuple[int, int, int]]] = {}
        if self._boundary_states:
            for entries in self._boundary_states.values():
                for seq, g, block, boundary in entries:
                    offloads.setdefault(seq, []).append((g, block, boundary))
                entries.clear()
        return offloads

    def _drop_boundary_states(self, seq: Sequence) -> None:
        """A request's blocks go back: its hand-offs not yet taken are dropped (`MambaManager.pop_blocks_for_free`)."""
        if self._boundary_states:
            for g, entries in self._boundary_states.items():
                if entries:
                    self._boundary_states[g] = [e for e in entries if e[0] is not seq]

    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()

    def get_computed_blocks(self, seq: Sequence, num_tokens: int) -> tuple[int, int]:
        """The prefix-cache hit `allocate` would find for `seq` now and vLLM's `shared_prefix_boundary` (where
        the longest single group's hit ends, when longer; else 0), in tokens, changing nothing: what vLLM's
        scheduler splits an align-mode prefill chunk by before it allocates."""
        if not self.enable_prefix_caching or not self._keys.has_keys(seq):
            return 0, 0
        hashes = self._keys.get_list(seq)
        _, hit, uncached = self.coordinator.find_longest_cache_hit(hashes, min(num_tokens, seq.num_final_tokens) - 1)
        return hit, hit + uncached if uncached else 0

    def get_computed_tokens(self, seq: Sequence, num_tokens: int) -> int:
        """The prefix-cache hit `allocate` would find for `seq` now, in tokens (what a KV connector is handed)."""
        return self.get_computed_blocks(seq, num_tokens)[0]

    def num_blocks_to_finish(self, seq: Sequence) -> int:
        """Blocks admitted `seq` still needs to hold all its tokens, window groups capped at their admission
        bound, a state group's checkpoint judged from its computed tokens (vLLM's
        `Scheduler._request_remaining_blocks`, no speculative tokens)."""
        req = self._reqs[seq]
        full = min(seq.num_tokens, self.max_model_len)
        return self.coordinator.get_num_blocks_to_allocate(req.tables, full, True, query_start=seq.num_computed_tokens,
                                                           prefill_end=req.prefill_end)

    def shared_prefix_boundary(self, seq: Sequence) -> int:
        """vLLM's `Request.shared_prefix_boundary` of admitted `seq`: the junction its admission found, or 0."""
        return self._reqs[seq].shared_prefix_boundary

    def remove_skipped_blocks(self, seq: Sequence, processed_computed_tokens: int) -> None:
        """Null and free the blocks each window group no longer reads at `processed_computed_tokens` (vLLM calls
        it for a finished request before a KV connector sees its block table; the async scheduler after a decode
        run, for what left the windows by its last step)."""
        req = self._reqs[seq]
        self._remove_skipped(req, processed_computed_tokens)
        self._refresh(req, processed_computed_tokens)

    def _remove_skipped(self, req: HybridRequest, computed: int) -> None:
        """Null and free what left each window at `computed` (settled) tokens."""
        managers, tables = self.coordinator.managers, req.tables
        for g in self._skipping:  # the other groups skip nothing
            req.held[g] -= managers[g].remove_skipped_blocks(tables[g], computed)

    def pop_blocks_for_free(self, seq: Sequence) -> list:
        """Forget `seq`; its blocks group after group, each table without its null head, not yet returned."""
        null, blocks = self.pool.null_block, []
        self._drop_boundary_states(seq)
        for table in self._reqs.pop(seq).tables:
            start = 0
            while start < len(table) and table[start] == null:
                start += 1
            blocks += table[start:]
        return blocks

    def free_popped_blocks(self, blocks: list) -> None:
        self.pool.free_blocks(blocks[::-1])

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Cache `seq`'s full blocks within its first `num_tokens` tokens now, in every group (vLLM's
        `KVCacheManager.cache_blocks`, which async scheduling calls once a step's sampled tokens are known)."""
        req = self._reqs[seq]
        if req.hashes is not None:
            self._register(req, num_tokens)
            self._set_quiet(req)  # next_skip stays: the window's blocks are nulled by the next append

    def can_ever_fit(self, seq: Sequence) -> bool:
        """Whether `seq` runs alone, within max_model_len, in one of two ways.

        vLLM's admission bound: its blocks, each window group capped at `max_admission_blocks_per_request`,
        within the usable blocks (what vLLM's start-up check guarantees for a request of max_model_len; the
        cap assumes prompt chunks of at most `max_num_batched_tokens`). Or without chunking: the whole prompt
        admitted at once, then every decode step's blocks after the window groups nulled theirs. A window
        group's blocks at computed c repeat with period block_size once c passes the window and the other
        groups' only grow, so the decode peak lies in the last lcm(block sizes, chunks) steps.
        """
        final, prompt = seq.num_final_tokens, seq.num_prompt_tokens
        if final > self.max_model_len:
            return False
        usable = self.pool.num_usable_blocks
        managers = self.coordinator.managers
        if self.coordinator.get_num_blocks_to_allocate(self.coordinator.new_tables(), final, apply_admission_cap=True) <= usable:
            return True
        if sum(-(-prompt // m.block_size) for m in managers) > usable:
            return False
        period = math.lcm(*(g.block_size for g in self.groups if g.kind != "state"), *(g.window for g in self.groups if g.kind == "chunked"))
        for c in range(max(prompt, final - 1 - period), final):
            held = 0
            for m in managers:
                bs = m.block_size
                held += -(-(c + 1) // bs) - m.get_num_skipped_tokens(c) // bs
            if held > usable:
                return False
        return True

    def max_decode_run(self, num_seqs: int) -> int:
        """Each of `num_seqs` requests opens at most ceil((k - 1) / block_size) blocks in every token group in a
        run of k steps; and the run's first step must still own its block when the run grows its requests to its
        middle step first (nulling what left a sliding window there): middle step < the smallest window."""
        if self.mamba_align:  # a state block is freed the step after the next one opens: no run keeps the ids
            return 1
        k = self.pool.num_free_blocks // num_seqs // self._num_token_groups * self.spec.block_size + 1
        return k if self._max_run_by_window is None else min(k, self._max_run_by_window)

    def block_table(self, seq: Sequence) -> list[int | None]:
        """Block ids of the slot group; None where the block was replaced by the null block (vLLM: block 0)."""
        null = self.pool.null_block
        return [None if b == null else b for b in self._reqs[seq].tables[self._slot_group]]

    @property
    def slot_window(self) -> int | None:
        group = self.groups[self._slot_group]
        return group.window if group.kind == "sliding" else None

    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """Every group's block ids as vLLM's `KVCacheBlocks.get_block_ids()` shows them (0: the null block)."""
        return [list(table) for table in self._reqs[seq].tables]

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Slots of positions [start, end) in the slot group's table; -1 where its block is the null block."""
        return self.group_slot_mapping(seq, self._slot_group, start, end)

    @property
    def token_groups(self) -> list[int]:
        """The groups whose blocks hold tokens' K/V (not a state group's), the slot group first."""
        return [g for g, group in enumerate(self.groups) if group.kind != "state"]

    def group_slot_mapping(self, seq: Sequence, group: int, start: int, end: int) -> np.ndarray:
        """Slots of positions [start, end) in `group`'s table (a token group of this pool's block size); -1 where
        its block is the null block."""
        assert self.groups[group].block_size == self.block_size, group
        bs, table = self.block_size, self._reqs[seq].tables[group]
        assert 0 <= start <= end <= len(table) * bs, (start, end)
        if start == end:
            return np.empty(0, dtype=np.int64)
        first, last = start // bs, (end - 1) // bs
        ids = np.array(table[first : last + 1], dtype=np.int64)  # (last - first + 1,)
        pos = np.arange(start, end, dtype=np.int64)  # (end - start,)
        block_ids = ids[pos // bs - first]
        slots = block_ids * bs + pos % bs
        slots[block_ids == 0] = -1
        return slots

    def breakdown(self, waiting_head: Sequence | None = None) -> MemoryBreakdown:
        """Slot by slot per group: a real block's token slots are token states (computed), reservation (before
        the final length) or internal fragmentation (after it); its padding layers and padded pages are
        padding, counted in internal fragmentation and named in `padding_bytes`. The null block and the
        budget's remainder smaller than a block are internal fragmentation too."""
        token = reservation = internal = padding = 0
        groups, token_bytes, pad_bytes = self.groups, self._token_bytes, self._pad_bytes
        # the replay asks at every row: each group's figures looked up once, no min/max calls in the loop
        kept = [(g, group.block_size, token_bytes[g], pad_bytes[g]) for g, group in enumerate(groups)
                if group.kind != "state"]  # groups that keep tokens
        states = [(g, self.bytes_per_block - pad_bytes[g], pad_bytes[g]) for g, group in enumerate(groups)
                  if group.kind == "state"]  # a state group's block holds one state
        for req in self._reqs.values():
            seq = req.seq
            c, final = seq.num_computed_tokens, seq.num_final_tokens
            if c < req.hit:
                c = req.hit
            tables, held_by_group = req.tables, req.held
            last = None  # (block size, table length, held) of the last group computed: windows alike repeat it
            for g, bs, tb, pb in kept:
                held = held_by_group[g]
                if not held:
                    continue
                padding += held * pb
                shape = (bs, len(tables[g]), held)
                if shape != last:
                    last = shape
                    cap = shape[1] * bs
                    lo = cap - held * bs
                    cc = c if c > lo else lo  # computed tokens in the held blocks: min(max(c, lo), cap)
                    if cc > cap:
                        cc = cap
                    used = cap if cap < final else final  # max(min(cap, final), cc)
                    if used < cc:
                        used = cc
                    computed_slots, reserved_slots, unused_slots = cc - lo, used - cc, cap - used
                token += computed_slots * tb
                reservation += reserved_slots * tb
                internal += unused_slots * tb
            for g, state_bytes, pb in states:
                held = held_by_group[g]
                padding += held * pb
                token += held * state_bytes
        saved = 0
        if self.pool.num_shared_refs:  # a prefix hit held by several requests was counted once per holder
            # every table's blocks in one array, request after request and group after group, and each block's group
            tables = [table for req in self._reqs.values() for table in req.tables]
            lengths = np.fromiter(map(len, tables), np.int64, len(tables))  # (requests x groups,)
            blocks = np.fromiter(chain.from_iterable(tables), np.int64, int(lengths.sum()))  # (blocks held,)
            block_groups = np.repeat(np.tile(np.arange(len(groups)), len(self._reqs)), lengths)  # (blocks held,)
            ref_count = self.pool.ref_count
            shared = ref_count[blocks] > 1
            # each shared block once, with the group of its first appearance
            shared_blocks, first = np.unique(blocks[shared], return_index=True)
            extra = ref_count[shared_blocks] - 1  # a shared block is full and computed for every holder
            first_groups = block_groups[shared][first]
            for g, group in enumerate(groups):
                num_extra = int(extra[first_groups == g].sum())
                if not num_extra:
                    continue
                # a shared state block holds one state
                kept_bytes = self.bytes_per_block - pad_bytes[g] if group.kind == "state" else group.block_size * token_bytes[g]
                token -= num_extra * kept_bytes
                padding -= num_extra * pad_bytes[g]
                saved += num_extra * self.bytes_per_block
        unusable = self.budget_bytes - self.pool.num_usable_blocks * self.bytes_per_block
        return MemoryBreakdown(
            budget_bytes=self.budget_bytes,
            token_states_bytes=token,
            reservation_bytes=reservation,
            internal_fragmentation_bytes=internal + padding + unusable,
            external_fragmentation_bytes=0,
            free_bytes=self.pool.num_free_blocks * self.bytes_per_block,
            padding_bytes=padding,
            shared_saved_bytes=saved,
        )

    # --- internals ---------------------------------------------------------------------------------------

    def _grow(self, req: HybridRequest, computed: int, total: int, query_start: int = 0, *, cache: bool = True) -> bool:
        """Null what left each window at `computed` (settled) tokens, then give every group room for `total`
        tokens, or False. `query_start`: where the chunk starts (align-mode state groups' checkpoint). `cache`
        False: cache nothing new yet (a load in flight)."""
        coordinator, tables = self.coordinator, req.tables
        self._remove_skipped(req, computed)
        need = coordinator.get_num_blocks_to_allocate(tables, total, query_start=query_start, prefill_end=req.prefill_end)
        if need > self.pool.num_free_blocks:
            self._refresh(req, computed)
            return False
        before = [len(t) for t in tables]
        coordinator.allocate_new_blocks(tables, total)
        for g, table in enumerate(tables):
            req.held[g] += len(table) - before[g]
        null = self.pool.null_block
        for g in self._state_groups:  # align mode pads a table with null blocks before its new states
            req.held[g] = len(tables[g]) - tables[g].count(null)
        if req.hashes is not None and cache:
            self._register(req, total)
        self._refresh(req, computed)
        return True

    def _register(self, req: HybridRequest, total: int) -> None:
        """Cache every full block whose tokens are all within `total` (computed + scheduled) and known."""
        seq = req.seq
        known = seq.num_known_tokens
        end = min(total, seq.num_final_tokens, seq.num_final_tokens if known is None else known) // self.block_size
        end = min(end, len(req.hashes))
        if end > req.num_cached:
            offers = [] if self._boundary_states is not None else None
            self.coordinator.cache_blocks(req.tables, req.hashes, req.num_cached, end, req.boundaries, offers)
            req.num_cached = end
            for g, block, boundary in offers or ():
                self._boundary_states[g].append((seq, g, block, boundary))

    def _refresh(self, req: HybridRequest, computed: int) -> None:
        """The next append that needs the slow path: a group's next block, the next block to cache, or a
        window group's next skip after nulling at `computed` (settled) tokens."""
        self._set_quiet(req)
        next_skip = math.inf
        for g in self._windowed:
            group = self.groups[g]
            bs, w = group.block_size, group.window
            if group.kind == "sliding":  # skipped blocks grow when (computed - w + 1) // bs does
                next_skip = min(next_skip, (max(0, computed - w + 1) // bs + 1) * bs + w - 1)
            else:
                next_skip = min(next_skip, (computed // w + 1) * w)
        req.next_skip = next_skip

    def _set_quiet(self, req: HybridRequest) -> None:
        """`quiet_until`: the most tokens an append serves without a new block or a block to cache (align mode:
        none, as every append may free a state block)."""
        if self.mamba_align:
            req.quiet_until = -1
            return
        req.quiet_until = min(len(t) * g.block_size for t, g in zip(req.tables, self.groups))
        if req.hashes is not None and req.num_cached < len(req.hashes):  # the next block to cache fills then
            req.quiet_until = min(req.quiet_until, (req.num_cached + 1) * self.block_size - 1)


def check_retention_interval(interval: int | None, groups) -> None:
    """vLLM's `_validate_prefix_cache_retention_interval`: None (dense) or 0 always; a positive interval is a
    multiple of the block size, for a model with a sliding-window group (else it has no effect: vLLM refuses it)."""
    if interval is None or interval == 0:
        return
    field = "prefix_cache_retention_interval"
    if not any(g.kind == "sliding" for g in groups):
        raise KvsimError(f"is {interval} but this model has no sliding-window layer group, so retention has no "
                         "effect (vLLM refuses it): set it to 0", field=field)
    block_size = groups[0].block_size
    if interval < 0 or interval % block_size:
        raise KvsimError(f"must be 0, null or a positive multiple of the block size ({block_size}), got {interval}",
                         field=field)


def check_prefix_caching(groups) -> None:
    """Prefix caching is modelled for full-attention, sliding-window and state groups (mamba align mode) of one
    block size; a model with chunked-local groups (vLLM: chunked hits) is a user error here."""
    unsupported = sorted({g.kind for g in groups if g.kind not in CACHEABLE_KINDS + ("state",)})
    if unsupported:
        raise KvsimError(
            f"prefix caching is not modelled for models with {' or '.join(unsupported)} layer groups "
            "(chunked-local hits are not built)",
            field="prefix_caching",
        )
    if len({g.block_size for g in groups}) != 1:
        raise KvsimError("prefix caching needs one block size across the KV cache groups", field="prefix_caching")
