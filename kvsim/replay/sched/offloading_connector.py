"""The CPU KV tier's scheduler side as vLLM 0.33.0's `OffloadingConnectorScheduler` runs it
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py), over kvsim.offload's
`CPUOffloadingManager`, with the worker side's transfers on the replay's clock.

Every KV cache group of full attention, MLA, sliding-window or chunked local attention, and Mamba state groups in
align mode, each with its own keys (`kvsim.replay.sched.offload_groups`). What it follows, hook by hook
(docs/cpu-tier.md has the rules as read):

- `get_num_new_matched_tokens(seq, num_computed_tokens)`: on admission, after the GPU prefix hit (block aligned);
  resets `next_stored_chunk_idx` to 0; None (skip the request this step) while it has transfers in flight, when a
  hit chunk is still being written (HIT_PENDING) or being loaded by another request; else the tokens past the GPU
  hit that whole chunks in the tier cover (0 when less than one chunk), `_lookup_complete_chunks`: full-attention
  groups from the GPU hit on, sliding windows and state groups (a window of one chunk) from the right, tightening the
  hit in turn until it converges; with a state group the hit is rounded down to its chunk (`resolve_mamba_align_size`).
- `update_state_after_alloc(seq, num_external_tokens)`: pins the chunks (`prepare_load`) and queues a load job;
  the request then skips the chunks it loaded when it stores (`OffloadPolicy.CHUNK_LEVEL`).
- `build_connector_meta(scheduled, finished, preempted)`: the end of `schedule()`: the in-flight stores of
  preempted requests are flushed (the worker waits for them); the state blocks the allocator cached since the last
  step, each offered alone (`_build_aligned_boundary_store_jobs`: a state group's chunks never join the prompt-chunk
  offers, as its block table is not append-only); each scheduled request, then each finished one,
  offers its prompt chunks computed by the end of the step from `next_stored_chunk_idx` on (`_build_store_jobs`:
  prompt only, all or nothing, a refused offer made again next step; a sliding window's chunks only where a later
  hit can reach them, and never from a block it freed and the pool handed out again); `on_request_finished` for
  the finished.
- `complete_until(t)`: the worker side's reports (`update_connector_output`): the jobs finished by `t` complete
  (`complete_store` / `complete_load`); a finished load makes its request ready (`finished_recving`).

Transfers: `bytes / host_bandwidth` each, one queue per direction (vLLM's `SingleDirectionOffloadingHandler`:
each job starts after the ones submitted before it in its direction), overlapping compute. A load starts with
the step that carries it; a store with the step after it (the worker defers stores to the next step's start,
`prepare_store_kv`). Bytes are one rank's (every rank moves its own slice over its own link at once).

A store's source blocks are fenced (`_block_id_to_pending_jobs`: from the request's finish on, `request_finished`):
a step that allocates one of them flushes the store, and the worker waits for it before the step runs.

Left out: `max_load_tokens`/`max_offload_tokens` (per-request parameters), cache resets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsim.engine.paged.kv_cache_utils import block_hashes
from kvsim.offload.manager import CPUOffloadingManager, LookupResult
from kvsim.offload.request_context import ReqContext, make_offload_key
from kvsim.replay.sched.offload_groups import (GroupOffloadConfig, alignment_tokens, cdiv, mamba_align_size,
                                               reachable_block_mask, sliding_window_lookup)


@dataclass(slots=True)
class TransferJob:
    """One load or store: its request, keys, bytes (one rank's), and when it runs on the host link."""

    job_id: int
    seq: object
    keys: list
    is_store: bool
    num_bytes: int
    start_s: float | None = None  # None: not submitted to the worker yet
    finish_s: float | None = None
    gpu_block_ids: list = field(default_factory=list)  # the GPU blocks it reads (store) or writes (load)
    cpu_chunk_ids: list = field(default_factory=list)  # the tier's chunks it writes (store) or reads (load)
    # with cache tensors: each GPU block's host block (its chunk x blocks_per_chunk + its index in the chunk), its
    # index in its group's block table, and the blocks of each group in turn (vLLM's `GPULoadStoreSpec.group_sizes`)
    host_block_ids: list = field(default_factory=list)
    block_indices: list = field(default_factory=list)
    group_sizes: list = field(default_factory=list)
    copied: bool = False  # with cache tensors: its blocks have moved
    sync: bool = False  # a load within the step (`sync_load_budget_bytes`): its own queue, and the step waits
    # a store's source blocks a reallocation must wait for (vLLM's `TransferJobStatus`): those of sliding-window
    # groups from its creation, the others once its request has finished
    fenced_block_ids: list = field(default_factory=list)
    deferred_fence_block_ids: list = field(default_factory=list)


@dataclass(slots=True)
class RequestGroupState:
    """One group of one request (vLLM's `RequestGroupState`): its keys, its GPU block ids as the connector saw
    them scheduled (0 where a block was skipped, or freed and reallocated), and the next chunk to store."""

    offload_keys: list = field(default_factory=list)
    block_ids: list = field(default_factory=list)
    next_stored_chunk_idx: int = 0


@dataclass(slots=True)
class RequestOffloadState:
    """vLLM's `RequestOffloadState`: one `RequestGroupState` per offloaded group."""

    seq: object
    req_context: ReqContext
    groups: tuple
    num_locally_computed_tokens: int = 0
    transfer_jobs: set = field(default_factory=set)
    finished_signaled: bool = False
    load_ready: bool = False  # its load finished (vLLM's `finished_recving_kv_req_ids`)
    load_start_s: float = 0.0
    full_table: bool = True  # its next scheduling hands the connector its whole block table (new or resumed)
    finished: bool = False  # `request_finished` was called (vLLM's `req.is_finished()`)
    shared_prefix_boundary: int = 0  # vLLM's `Request.shared_prefix_boundary`, read when it was scheduled
    num_keyed_tokens: int = 0  # tokens its keys were last extended over

    @property
    def next_stored_chunk_idx(self) -> int:
        """The first group's (the only one of a uniform model)."""
        return self.groups[0].next_stored_chunk_idx

    @property
    def offload_keys(self) -> list:
        return self.groups[0].offload_keys


class OffloadingConnector:
    """The scheduler side of vLLM's `OffloadingConnector` for a replay (see the module docstring).

    `block_size` is the GPU block, `blocks_per_chunk` GPU blocks make one CPU chunk of `num_chunks`;
    `bytes_per_block` is one GPU block of one rank, `host_bandwidth_bytes_per_s` one direction of its host link.
    """

    def __init__(self, *, block_size: int, blocks_per_chunk: int, num_chunks: int, bytes_per_block: int,
                 host_bandwidth_bytes_per_s: float, policy: str = "lru", store_threshold: int = 0,
                 max_tracker_size: int = 64_000, allocator=None, groups: tuple[GroupOffloadConfig, ...] | None = None,
                 retention_interval: int | None = 0, sync_load_budget_bytes: int = 0,
                 kv_bytes_per_token: int = 0) -> None:
        assert block_size > 0 and blocks_per_chunk > 0 and host_bandwidth_bytes_per_s > 0
        if groups is None:  # one full-attention group
            groups = (GroupOffloadConfig(0, "full", block_size, block_size * blocks_per_chunk, blocks_per_chunk, None),)
        self.groups = groups
        self._full_groups = tuple(i for i, g in enumerate(groups) if g.window_chunks is None)
        # sliding-window (and chunked local) groups, the widest window first
        self._group_index = {g.group_idx: i for i, g in enumerate(groups)}  # a KV cache group's offloaded index
        self._sliding_groups = tuple(sorted((i for i, g in enumerate(groups) if g.window_chunks is not None),
                                            key=lambda i: groups[i].window_chunks, reverse=True))
        self._lookup_groups = self._full_groups + self._sliding_groups
        self.alignment_tokens = alignment_tokens(groups, blocks_per_chunk)
        # Mamba state groups in align mode (vLLM's `requires_cow_source`): their keys are never offered by the
        # prompt-chunk stores; each state reaches the tier from the allocator's hand-off of the block its caching
        # committed, and a hit is rounded down to their chunk (`resolve_mamba_align_size`)
        self._state_groups = tuple(i for i, g in enumerate(groups) if g.kind == "state")
        self.mamba_align_size = mamba_align_size(groups)
        if self._state_groups and allocator is not None:
            allocator.record_boundary_states()
        self.retention_interval = retention_interval  # vLLM's prefix_cache_retention_interval (its default: 0)
        # loads within the step, up to this many bytes a step (one rank's), priced at `kv_bytes_per_token` (the
        # offloaded groups' bytes a token, summed: it overestimates windows, which load less, as vLLM's does)
        self.sync_load_budget_bytes = sync_load_budget_bytes
        self.kv_bytes_per_token = kv_bytes_per_token or bytes_per_block // block_size
        self._sync_loads: set = set()  # this step's requests that load synchronously
        self._sync_load_bytes = 0
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.tokens_per_chunk = block_size * blocks_per_chunk
        self.bytes_per_chunk = bytes_per_block * blocks_per_chunk
        self.bytes_per_block = bytes_per_block
        self.host_bandwidth = host_bandwidth_bytes_per_s
        self.manager = CPUOffloadingManager(num_chunks, policy, store_threshold, max_tracker_size)
        self._req_status: dict[int, RequestOffloadState] = {}
        self._jobs: dict[int, TransferJob] = {}
        self._unsubmitted: list[TransferJob] = []
        # the chunks loads in flight read, tracked only with a GPU prefix cache (vLLM's `_chunks_being_loaded` is
        # None without one: a request then loads a chunk another load is reading, into its own blocks)
        self._chunks_being_loaded: set | None = set() if allocator is None or allocator.enable_prefix_caching else None
        self._job_counter = 0
        self._free_at = {"load": 0.0, "store": 0.0, "sync": 0.0}  # per queue: when it drains (vLLM's handlers:
        # loads, stores, and the expedited loads waited on within the step)
        self._flush: dict[int, TransferJob] = {}  # this step's jobs to flush (vLLM's `jobs_to_flush`)
        # store jobs by the GPU blocks they read, whose reallocation flushes them (`_block_id_to_pending_jobs`),
        # and the block ids this step allocated (`_current_batch_allocated_block_ids`)
        self._block_id_to_pending_jobs: dict[int, set[int]] = {}
        self._allocated: set[int] = set()
        self.now = 0.0  # the replay's clock when the scheduler runs (set by the step loop)
        # Requests finished since the last step reach the tier in vLLM's `finished_req_ids` order: the iteration
        # order of a set of request id strings, which follows the process's string hash seed (PYTHONHASHSEED).
        # The replay keeps them in the order they finished (reproducible under any seed); the conformance harness
        # sets this, running both sides in one process, to compare the rest.
        self.finished_in_set_order = False
        self.allocator = allocator  # the GPU pool (KVAllocator): the block ids a job moves
        # With cache tensors (kvsim.engine.tensors.host_pool.HostKVPool over the replay's KVCache): the blocks
        # really move between the device pool and the host pool, and a load is checked in integrity mode
        self.host_pool = None
        self._finishing: set = set()  # the ids of the finished requests build_connector_meta stores
        self.events: list | None = None  # when a list: every job, flush, completion, eviction and CPU hit, as
        # kvsim.conformance.trace's event tuples (the conformance harness compares them with vLLM's)
        # totals and this row's figures (the replay's reports)
        self.cpu_hit_tokens = self.cpu_loaded_bytes = self.cpu_stored_bytes = 0
        self.load_wait_s = 0.0
        self.row_hit_tokens = self.row_loaded_bytes = self.row_stored_bytes = self.row_gpu_hit_tokens = 0

    # --- state -----------------------------------------------------------------------------------------

    def _status(self, seq) -> RequestOffloadState:
        status = self._req_status.get(seq.seq_id)
        if status is None:  # `on_new_request`
            status = RequestOffloadState(seq, ReqContext(str(seq.seq_id)),
                                         tuple(RequestGroupState() for _ in self.groups))
            self.manager.on_new_request(status.req_context)
            self._req_status[seq.seq_id] = status
        return status

    def _update_offload_keys(self, status: RequestOffloadState, num_tokens: int) -> None:
        """Each group's keys of the whole chunks within the first `num_tokens` known tokens: the hash of each
        chunk's last block with the group's index (`update_offload_keys`)."""
        seq = status.seq
        if num_tokens <= status.num_keyed_tokens or seq.token_ids is None:
            return
        if all(num_tokens // g.tokens_per_chunk <= len(gs.offload_keys) for g, gs in zip(self.groups, status.groups)):
            return
        status.num_keyed_tokens = num_tokens
        hashes = block_hashes(seq.token_ids, num_tokens, self.block_size)  # (full blocks,)
        for g, gs in zip(self.groups, status.groups):
            H, T = g.hashes_per_chunk, g.tokens_per_chunk
            keys = gs.offload_keys
            for i in range(len(keys), len(hashes) // H):
                key = make_offload_key(hashes[(i + 1) * H - 1].to_bytes(8, "big", signed=True), g.group_idx)
                keys.append(key)
                status.req_context.set_offload_key_position(key, (i + 1) * T)

    def has_jobs(self) -> bool:
        return bool(self._jobs)

    def is_load_ready(self, seq) -> bool:
        status = self._req_status.get(seq.seq_id)
        return status is not None and status.load_ready

    # --- admission ---------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq, num_computed_tokens: int) -> int | None:
        """Tokens past the GPU hit `num_computed_tokens` the tier can load, or None to skip the request now."""
        status = self._status(seq)
        for gs in status.groups:
            gs.block_ids = []
            gs.next_stored_chunk_idx = 0  # restarting at token 0: offer every chunk again
        status.full_table = True
        if status.transfer_jobs:
            return None
        self._update_offload_keys(status, seq.num_tokens)
        status.num_locally_computed_tokens = num_computed_tokens
        num_hit_tokens = self._lookup_complete_chunks(status)
        self._reserve_sync_load(seq, num_computed_tokens, num_hit_tokens)
        return num_hit_tokens

    def _reserve_sync_load(self, seq, num_computed_tokens: int, num_hit_tokens: int | None) -> None:
        """`_reserve_sync_load`: a hit that leaves a token to compute and whose bytes fit what is left of this
        step's `sync_load_budget_bytes` loads within the step."""
        self._sync_loads.discard(seq.seq_id)
        if (not self.sync_load_budget_bytes or not num_hit_tokens
                or num_computed_tokens + num_hit_tokens >= seq.num_tokens):
            return
        num_bytes = num_hit_tokens * self.kv_bytes_per_token
        if self._sync_load_bytes + num_bytes > self.sync_load_budget_bytes:
            return
        self._sync_load_bytes += num_bytes
        self._sync_loads.add(seq.seq_id)

    def is_sync_load(self, seq) -> bool:
        """Whether the hit `get_num_new_matched_tokens` just found for `seq` loads within the step: the request is
        then scheduled at once with the hit as computed tokens (vLLM's `load_kv_async` False)."""
        return seq.seq_id in self._sync_loads

    def _lookup_complete_chunks(self, status: RequestOffloadState) -> int | None:
        """`_lookup_complete_chunks`: full-attention groups look up a prefix from the GPU hit on, sliding windows
        a run of window chunks from the right; each may tighten the hit, and the groups are asked again until it
        converges. With a sliding window the hit stops one token short (the last prompt token is recomputed)."""
        groups, lookup = self.groups, self.manager.lookup
        ctx = status.req_context
        num_computed = status.num_locally_computed_tokens
        max_hit = status.seq.num_tokens
        if self._sliding_groups:
            max_hit -= 1
            if self.mamba_align_size is not None:  # a hit ends on a state's chunk
                max_hit = max_hit // self.mamba_align_size * self.mamba_align_size
        num_hit_tokens = 0
        defer = False
        lookup_groups = self._lookup_groups
        while lookup_groups:
            looked_up_sliding = False
            pass_groups, lookup_groups = lookup_groups, ()
            for gi in pass_groups:
                g = groups[gi]
                T = g.tokens_per_chunk
                keys = status.groups[gi].offload_keys
                max_hit = min(max_hit, len(keys) * T)
                if max_hit - num_computed < T:
                    return 0
                num_chunks = min(cdiv(max_hit, T), len(keys))
                start = num_computed // T
                window = keys[start:num_chunks]
                if g.window_chunks is None:  # `_maximal_prefix_lookup`
                    hits, pending = 0, False
                    for key in window:
                        result = lookup(key, ctx)
                        if result is LookupResult.MISS:
                            break
                        hits += 1
                        pending |= result is LookupResult.HIT_PENDING
                    num_hit_chunks = None if pending else hits
                else:
                    initial = g.load_window_size_in_chunks(min(max_hit, num_chunks * T))
                    num_hit_chunks = sliding_window_lookup(lookup, window, g.window_chunks, ctx, initial)
                if num_hit_chunks == 0:
                    return 0
                if num_hit_chunks is None:
                    defer = True
                else:
                    max_hit = min(max_hit, T * (start + num_hit_chunks))
                new_num_hit_tokens = max_hit - num_computed
                if new_num_hit_tokens < T:
                    return 0
                if new_num_hit_tokens < num_hit_tokens:
                    if defer:  # ask every group again whether the hit is still pending
                        defer = False
                        lookup_groups = self._lookup_groups
                    elif looked_up_sliding and not lookup_groups:  # confirm the windows at the shorter hit
                        lookup_groups = self._sliding_groups
                looked_up_sliding |= g.window_chunks is not None
                num_hit_tokens = new_num_hit_tokens
        if defer:
            return None
        if self._chunks_being_loaded:  # a hit chunk another request is loading delays this one
            end_tokens = num_computed + num_hit_tokens
            for g, gs in zip(groups, status.groups):
                keys = gs.offload_keys[num_computed // g.tokens_per_chunk:cdiv(end_tokens, g.tokens_per_chunk)]
                window = g.load_window_size_in_chunks(end_tokens)
                if window is not None:
                    keys = keys[-window:]
                if any(key in self._chunks_being_loaded for key in keys):
                    return None
        return num_hit_tokens

    def update_state_after_alloc(self, seq, num_external_tokens: int) -> None:
        """Pin the hit chunks and queue their load (`update_state_after_alloc`); nothing without a hit. The
        request's blocks count as allocated this step either way. Each group loads the chunks of its blocks past
        the GPU hit that are not null (a sliding window's before its window are)."""
        tables = self.allocator.block_tables(seq) if self.allocator is not None else None
        if tables is not None:
            for table in tables:
                self._allocated.update(table)
            self._allocated.discard(0)
        if num_external_tokens == 0:
            return
        status = self._req_status[seq.seq_id]
        sync = seq.seq_id in self._sync_loads
        local = status.num_locally_computed_tokens
        num_cached = local + num_external_tokens
        B = self.blocks_per_chunk
        keys: list = []
        gpu_block_ids: list = []
        copies = self.host_pool is not None and tables is not None
        key_of: list = []  # with cache tensors: each block's key, by its index in `keys`
        block_indices: list = []
        group_sizes: list = []
        for gi, (g, gs) in enumerate(zip(self.groups, status.groups)):
            bs = g.tokens_per_block
            num_gpu_blocks = cdiv(num_cached, bs)
            load_start = cdiv(local, bs)
            if tables is not None:
                table = tables[g.group_idx]
                while load_start < num_gpu_blocks and table[load_start] == 0:
                    load_start += 1
                gpu_block_ids += table[load_start:num_gpu_blocks]
            if copies:  # the group's blocks past those skipped, each from its chunk (a partial first one from its offset)
                key_of += [len(keys) + j // B - load_start // B for j in range(load_start, num_gpu_blocks)]
                block_indices += range(load_start, num_gpu_blocks)
                group_sizes.append(max(0, num_gpu_blocks - load_start))
            num_chunks = cdiv(num_cached, g.tokens_per_chunk)
            if num_gpu_blocks > load_start:
                keys += gs.offload_keys[load_start // B:num_chunks]
            gs.next_stored_chunk_idx = num_chunks  # OffloadPolicy.CHUNK_LEVEL
            if tables is None and gi == 0:
                num_blocks = num_gpu_blocks - load_start
        chunk_ids = self.manager.prepare_load(keys, status.req_context)
        num_blocks = len(gpu_block_ids) if tables is not None else num_blocks
        job = self._new_job(seq, keys, False, num_blocks * self.bytes_per_block)
        job.cpu_chunk_ids = list(chunk_ids)
        job.gpu_block_ids = gpu_block_ids
        if copies:
            job.host_block_ids = [chunk_ids[k] * B + j % B for k, j in zip(key_of, block_indices)]
            job.block_indices, job.group_sizes = block_indices, group_sizes
        job.sync = sync
        if self.events is not None:
            self.events.append((6, seq.index, num_external_tokens))  # HIT
            self.events.append((1, job.job_id, seq.index, job.gpu_block_ids, job.cpu_chunk_ids))  # LOAD
        status.transfer_jobs.add(job.job_id)
        status.load_ready = False
        status.load_start_s = self.now
        if self._chunks_being_loaded is not None and not sync:  # a sync load completes before the forward pass
            self._chunks_being_loaded.update(keys)
        self.cpu_hit_tokens += num_external_tokens
        self.row_hit_tokens += num_external_tokens
        self.row_gpu_hit_tokens += local

    # --- end of schedule() -------------------------------------------------------------------------------

    def build_connector_meta(self, scheduled: list, finished: list, preempted: list) -> None:
        """Flushes for `preempted`, stores for `scheduled` ((seq, tokens computed by the end of the step)) and
        then `finished` requests, and `on_request_finished` for the finished (`_build_connector_meta`)."""
        self._update_req_states(scheduled)
        for seq in preempted:
            status = self._req_status.get(seq.seq_id)
            if status is not None:
                self._flush_jobs(j for j in status.transfer_jobs if self._jobs[j].is_store or self._jobs[j].sync)
        pending = self._block_id_to_pending_jobs
        if pending and not self._allocated.isdisjoint(pending):  # stores reading blocks reallocated this step
            self._flush_jobs(j for bid in self._allocated if bid in pending for j in pending[bid])
        if self._state_groups:  # `_build_partial_tail_store_jobs`: the states committed since the last step
            self._store_boundary_states(self.allocator.take_boundary_state_offloads())
        for seq, num_tokens_after_batch in scheduled:
            self._store(seq, num_tokens_after_batch)
        if self.finished_in_set_order and len(finished) > 1:  # vLLM's order: a set of request id strings
            by_id = {str(seq.seq_id): seq for seq in finished}
            finished = [by_id[i] for i in set(by_id)]
        self._finishing = {seq.seq_id for seq in finished}
        for seq in finished:
            self._store(seq, max(seq.num_prompt_tokens, seq.num_tokens - 1))
        self._finishing = set()
        if self.events is not None:
            self.events.extend((3, job_id) for job_id in self._flush)  # FLUSH
        self._allocated = set()
        self._sync_loads = set()
        self._sync_load_bytes = 0
        for seq in finished:
            status = self._req_status.get(seq.seq_id)
            if status is None:
                continue
            status.finished_signaled = True
            self.manager.on_request_finished(status.req_context)
            if not status.transfer_jobs:
                del self._req_status[seq.seq_id]

    def _update_req_states(self, scheduled: list) -> None:
        """The block ids each scheduled request got this step: its whole table when it was (re)admitted since
        it was last scheduled, else the blocks past those the connector has (`_update_req_states`). Then a
        sliding window's blocks not yet stored that the pool handed out again this step become 0: they were
        freed when they left the window, and a store must not read them."""
        if self.allocator is None:
            return
        allocated = self._allocated
        ends: dict[int, tuple[int, ...]] = {}  # pre-extend lengths of the sliding groups' block ids
        for seq, _ in scheduled:
            status = self._req_status.get(seq.seq_id)
            if status is None:
                continue
            if self._sliding_groups:
                status.shared_prefix_boundary = self.allocator.shared_prefix_boundary(seq)
            tables = self.allocator.block_tables(seq)
            if status.full_table:
                status.full_table = False
                for gs in status.groups:
                    gs.block_ids = []
            if self._sliding_groups:
                ends[seq.seq_id] = tuple(len(status.groups[gi].block_ids) for gi in self._sliding_groups)
            for g, gs in zip(self.groups, status.groups):
                table = tables[g.group_idx]
                new = table[len(gs.block_ids):]
                gs.block_ids.extend(new)
                allocated.update(new)
        allocated.discard(0)
        if self._sliding_groups and allocated:
            B = self.blocks_per_chunk
            for seq_id, status in self._req_status.items():
                seq_ends = ends.get(seq_id)
                for i, gi in enumerate(self._sliding_groups):
                    gs = status.groups[gi]
                    ids = gs.block_ids
                    end = seq_ends[i] if seq_ends is not None else len(ids)
                    for j in range(gs.next_stored_chunk_idx * B, end):
                        if ids[j] in allocated:
                            ids[j] = 0

    def _flush_jobs(self, job_ids) -> None:
        for job_id in job_ids:
            self._flush[job_id] = self._jobs[job_id]

    def request_finished(self, seq) -> None:
        """`request_finished`, before the request's blocks are freed: the blocks its stores in flight read are
        fenced from now on (a reallocation waits for the store)."""
        status = self._req_status.get(seq.seq_id)
        if status is None:
            return
        status.finished = True
        for job_id in status.transfer_jobs:
            for bid in self._jobs[job_id].deferred_fence_block_ids:
                self._block_id_to_pending_jobs.setdefault(bid, set()).add(job_id)

    def _storable_chunks(self, g: GroupOffloadConfig, gs: RequestGroupState, num_offloadable: int) -> int:
        """`storable_chunks`: the leading chunks computed, allocated and keyed."""
        num_chunks = min(num_offloadable // g.tokens_per_chunk, len(gs.offload_keys))
        if self.allocator is not None:
            num_chunks = min(num_chunks, len(gs.block_ids) // self.blocks_per_chunk)
        return num_chunks

    def _advance_stored_idx(self, status: RequestOffloadState, num_offloadable: int) -> None:
        for g, gs in zip(self.groups, status.groups):
            gs.next_stored_chunk_idx = max(gs.next_stored_chunk_idx, self._storable_chunks(g, gs, num_offloadable))

    def _store(self, seq, num_tokens_after_batch: int) -> None:
        """`_build_store_jobs` for one request: each group's prompt chunks from its `next_stored_chunk_idx`, all
        groups' in one all-or-nothing offer. A sliding window's chunk is offered only where a later hit can reach
        it (`reachable_block_mask`) and when none of its blocks is 0 (skipped, or freed and reallocated)."""
        status = self._req_status.get(seq.seq_id)
        if status is None:
            return
        offloadable = min(num_tokens_after_batch, seq.num_tokens, seq.num_prompt_tokens)  # offload_prompt_only
        prompt_offloadable = seq.num_prompt_tokens
        self._update_offload_keys(status, seq.num_prompt_tokens)
        B, have_blocks = self.blocks_per_chunk, self.allocator is not None
        retention, alignment = self.retention_interval, self.alignment_tokens
        finished = status.finished
        boundaries: tuple[int, ...] = ()
        if retention is not None:
            boundaries = (seq.num_prompt_tokens - 1,)
            if status.shared_prefix_boundary:
                boundaries += (status.shared_prefix_boundary,)
        new_keys: list = []
        ranges: list[tuple[int, int]] = []
        for g, gs in zip(self.groups, status.groups):
            num_chunks = self._storable_chunks(g, gs, offloadable)
            start = gs.next_stored_chunk_idx
            prompt_horizon = prompt_offloadable // g.tokens_per_chunk
            final_alignment_blocks = (alignment // g.tokens_per_block if alignment is not None and g.kind == "sliding"
                                      and alignment % g.tokens_per_block == 0 else None)
            reconsider = (finished and num_chunks != prompt_horizon and retention is None
                          and final_alignment_blocks is not None)
            if retention is not None:
                horizon = None
            elif finished:
                horizon = num_chunks
            elif num_chunks <= prompt_horizon:
                horizon = prompt_horizon
            else:
                horizon = None
            if reconsider:
                horizon_blocks = num_chunks * B
                start = min(start, (horizon_blocks - horizon_blocks % final_alignment_blocks) // B)
            ranges.append((start, num_chunks))
            if g.kind == "state" or num_chunks <= start:  # a state comes from the boundary hand-off
                continue
            keys = gs.offload_keys[start:num_chunks]
            if not have_blocks:
                new_keys += keys
                continue
            ids = gs.block_ids
            mask = reachable_block_mask(g, start * B, num_chunks * B, alignment, retention, boundaries,
                                        None if horizon is None else horizon * B)
            prompt_mask = (reachable_block_mask(g, start * B, num_chunks * B, alignment, retention, boundaries,
                                                prompt_horizon * B) if reconsider else None)
            for k, key in enumerate(keys):
                chunk = start + k
                if ids[chunk * B + B - 1] == 0:
                    continue
                if (reconsider and chunk < gs.next_stored_chunk_idx
                        and (prompt_mask is None or any(prompt_mask[k * B:(k + 1) * B]))):
                    continue
                if mask is not None and not any(mask[k * B:(k + 1) * B]):
                    continue
                if any(ids[chunk * B + b] == 0 and (mask is None or mask[k * B + b]) for b in range(B)):
                    continue  # a reachable null block would leave part of the chunk unwritten
                new_keys.append(key)
        if not new_keys:
            self._advance_stored_idx(status, offloadable)
            return
        out = self.manager.prepare_store(new_keys, status.req_context)
        if out is None:
            return  # refused: offered again next step
        if self.events is not None and out.evicted_keys:
            self.events.append((5, len(out.evicted_keys)))  # EVICT
        if not out.keys_to_store:
            self._advance_stored_idx(status, offloadable)
            return
        stored = set(out.keys_to_store)
        src: list = []
        fenced: list = []  # sliding windows' blocks: fenced from now on
        deferred: list = []  # the others': once the request has finished
        # with cache tensors: each source block's host block, index in its table, and the blocks of each group
        chunk_of = dict(zip(out.keys_to_store, out.chunk_ids)) if self.host_pool is not None else None
        host_block_ids: list = []
        block_indices: list = []
        group_sizes: list = []
        for g, gs, (start, num_chunks) in zip(self.groups, status.groups, ranges):
            if have_blocks:
                ids = gs.block_ids
                num_src = len(src)
                for chunk in range(start, num_chunks):
                    if gs.offload_keys[chunk] not in stored:
                        continue
                    for b, bid in enumerate(ids[chunk * B:(chunk + 1) * B]):
                        if bid:
                            src.append(bid)
                            (fenced if g.kind == "sliding" else deferred).append(bid)
                            if chunk_of is not None:
                                host_block_ids.append(chunk_of[gs.offload_keys[chunk]] * B + b)
                                block_indices.append(chunk * B + b)
                group_sizes.append(len(src) - num_src)
            gs.next_stored_chunk_idx = max(gs.next_stored_chunk_idx, num_chunks)
        num_blocks = len(src) if have_blocks else len(out.keys_to_store) * B
        job = self._new_job(seq, list(out.keys_to_store), True, num_blocks * self.bytes_per_block)
        status.transfer_jobs.add(job.job_id)
        job.cpu_chunk_ids = list(out.chunk_ids)
        job.gpu_block_ids = src
        if chunk_of is not None:
            job.host_block_ids, job.block_indices, job.group_sizes = host_block_ids, block_indices, group_sizes
        job.fenced_block_ids = fenced
        job.deferred_fence_block_ids = deferred
        pending = self._block_id_to_pending_jobs
        for bid in fenced:  # a window frees its blocks before the request finishes
            pending.setdefault(bid, set()).add(job.job_id)
        if finished:  # a finished request's store: all its blocks are fenced now
            for bid in deferred:
                pending.setdefault(bid, set()).add(job.job_id)
                if bid in self._allocated:
                    self._flush[job.job_id] = job
        if self.events is not None:
            self.events.append((2, job.job_id, seq.index, job.gpu_block_ids, job.cpu_chunk_ids))  # STORE
        if self.host_pool is not None and seq.seq_id in self._finishing:  # its blocks are free: copy them before
            self._copy(job)  # this step can reuse and overwrite them (vLLM flushes such a store before the step)

    def _store_boundary_states(self, handoffs: dict) -> None:
        """`_build_aligned_boundary_store_jobs`: each state block the allocator's caching committed (an align-mode
        state at a block boundary, the tokens it follows) is offered alone under its chunk's key, when it lies
        on a chunk boundary within the prompt; a store job of one block, fenced from its creation (a state
        block is freed while its request runs). A refused offer is not made again: the hand-off is drained."""
        for seq, entries in handoffs.items():
            status = self._req_status.get(seq.seq_id)
            if status is None:
                continue
            max_boundary = min(seq.num_tokens, seq.num_prompt_tokens)  # offload_prompt_only
            self._update_offload_keys(status, max_boundary)
            for group_idx, block_id, boundary in entries:
                gi = self._group_index[group_idx]
                g = self.groups[gi]
                if block_id == 0 or boundary > max_boundary or boundary % g.tokens_per_chunk:
                    continue
                key = status.groups[gi].offload_keys[boundary // g.tokens_per_chunk - 1]
                out = self.manager.prepare_store([key], status.req_context)
                if out is None:
                    continue
                if self.events is not None and out.evicted_keys:
                    self.events.append((5, len(out.evicted_keys)))  # EVICT
                if not out.keys_to_store:
                    continue
                job = self._new_job(seq, [key], True, self.bytes_per_block)
                status.transfer_jobs.add(job.job_id)
                job.cpu_chunk_ids = list(out.chunk_ids)
                job.gpu_block_ids = [block_id]
                job.fenced_block_ids = [block_id]
                self._block_id_to_pending_jobs.setdefault(block_id, set()).add(job.job_id)
                if self.events is not None:
                    self.events.append((2, job.job_id, seq.index, job.gpu_block_ids, job.cpu_chunk_ids))  # STORE

    def _new_job(self, seq, keys: list, is_store: bool, num_bytes: int) -> TransferJob:
        job = TransferJob(self._job_counter, seq, keys, is_store, num_bytes)
        self._job_counter += 1
        self._jobs[job.job_id] = job
        self._unsubmitted.append(job)
        return job

    # --- the worker side on the clock ---------------------------------------------------------------------

    def submit(self, now: float, dt: float) -> float:
        """The step scheduled last starts at `now` and computes for `dt`, in the worker's order: the jobs to flush
        (those of preempted requests) that this step created go first, and the step waits until every job to
        flush has finished; its loads start then; its stores when its forward pass ends (vLLM defers them to the
        next step's start). Returns the wait."""
        flush, self._flush = sorted(self._flush.values(), key=lambda job: job.job_id), {}
        for job in flush:
            if job.finish_s is None:
                self._start(job, now)
        wait = max([0.0] + [job.finish_s - now for job in flush])
        for job in self._unsubmitted:  # loads (synchronous ones on their own queue) start now
            if job.finish_s is None and not job.is_store:
                self._start(job, now + wait)
        wait = max([wait] + [job.finish_s - now for job in self._unsubmitted if job.sync])  # the step waits for them
        for job in self._unsubmitted:  # stores when the forward pass ends
            if job.finish_s is None:
                self._start(job, now + wait + dt)
        self._unsubmitted.clear()
        return wait

    def copy_before_forward(self) -> None:
        """With cache tensors, before the step's forward pass: the jobs to flush, then the loads within the step
        (the worker waits for both in `start_kv_transfers` before the model runs; their blocks are the step's)."""
        for job in sorted(self._flush.values(), key=lambda job: job.job_id):
            self._copy(job)
        for job in self._unsubmitted:
            if job.sync:
                self._copy(job)

    def _copy(self, job: TransferJob) -> None:
        """With cache tensors: move the job's blocks (a store from the device pool to its chunks, a load back),
        once; a load in integrity mode is checked against what its request's tokens wrote."""
        if job.copied:
            return
        job.copied = True
        pool = self.host_pool
        if job.is_store:
            pool.store(job.gpu_block_ids, job.host_block_ids)
            return
        slots = pool.load(job.host_block_ids, job.gpu_block_ids)
        cache = pool.cache
        if cache.integrity and len(slots):  # each group's blocks hold its request's tokens at their positions
            import numpy as np

            bs = self.block_size
            positions = (np.asarray(job.block_indices, dtype=np.int64)[:, None] * bs + np.arange(bs)).ravel()
            end = 0
            for g, size in zip(self.groups, job.group_sizes):
                begin, end = end, end + size * bs
                if size:
                    cache.verify(job.seq.seq_id, slots[begin:end], positions[begin:end], group=g.group_idx)

    def _start(self, job: TransferJob, ready_s: float) -> None:
        if self.host_pool is not None:
            self._copy(job)
        queue = "store" if job.is_store else ("sync" if job.sync else "load")
        job.start_s = max(ready_s, self._free_at[queue])
        job.finish_s = job.start_s + job.num_bytes / self.host_bandwidth
        self._free_at[queue] = job.finish_s
        if job.is_store:
            self.cpu_stored_bytes += job.num_bytes
            self.row_stored_bytes += job.num_bytes
        else:
            self.cpu_loaded_bytes += job.num_bytes
            self.row_loaded_bytes += job.num_bytes

    def next_finish_s(self) -> float | None:
        """When the next submitted job finishes (None: none in flight)."""
        times = [j.finish_s for j in self._jobs.values() if j.finish_s is not None]
        return min(times) if times else None

    def complete_until(self, t: float) -> None:
        """The jobs finished by `t` complete, in job order (`update_connector_output`)."""
        done = [j for j in self._jobs.values() if j.finish_s is not None and j.finish_s <= t]
        for job in done:
            if self.events is not None:
                self.events.append((4, job.job_id))  # DONE
            status = self._req_status[job.seq.seq_id]
            if job.is_store:
                self.manager.complete_store(job.keys, status.req_context)
            else:
                self.manager.complete_load(job.keys, status.req_context)
                if self._chunks_being_loaded and not job.sync:
                    self._chunks_being_loaded.difference_update(job.keys)
                status.load_ready = not job.sync
                self.load_wait_s += job.finish_s - status.load_start_s
            if self._block_id_to_pending_jobs:
                self._remove_pending_job(job.job_id, job.fenced_block_ids)
                if status.finished:
                    self._remove_pending_job(job.job_id, job.deferred_fence_block_ids)
            del self._jobs[job.job_id]
            status.transfer_jobs.discard(job.job_id)
            if status.finished_signaled and not status.transfer_jobs:
                del self._req_status[job.seq.seq_id]

    def _remove_pending_job(self, job_id: int, block_ids: list) -> None:
        pending = self._block_id_to_pending_jobs
        for bid in block_ids:
            jobs = pending.get(bid)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del pending[bid]

    def take_row(self) -> tuple[int, int, int, int]:
        """This row's (CPU hit tokens, loaded bytes, stored bytes, GPU hit tokens of the loads started), reset."""
        row = (self.row_hit_tokens, self.row_loaded_bytes, self.row_stored_bytes, self.row_gpu_hit_tokens)
        self.row_hit_tokens = self.row_loaded_bytes = self.row_stored_bytes = self.row_gpu_hit_tokens = 0
        return row


def connector_for_replay(offload, model, spec, allocator, max_model_len: int, settings, tp: int, gpu,
                         source: str) -> OffloadingConnector:
    """The connector a workload's `offload:` (kvsim.workload.OffloadConfig) builds over `allocator`: the chunk
    count and each group's chunks as `kvsim size --cpu-offload` sizes vLLM's tier (kvsim.size.cpu_offload), the
    GPU's sourced host link (kvsim/models/data/interconnect.yaml). Refused in one line naming the workload and
    `offload`: a flat allocator; a hybrid state model without prefix caching (vLLM needs align mode) or with
    `sync_load_budget_bytes` (vLLM 0.33's own scheduler fails there)."""
    from dataclasses import replace

    from kvsim.errors import KvsimError
    from kvsim.models.interconnect import get_host_link
    from kvsim.size.cpu_offload import cpu_offload
    from kvsim.size.vllm import vllm_layers, vllm_startup

    def refuse(message: str) -> KvsimError:
        return KvsimError(message, source=source, field="offload")

    if not allocator.paged:
        raise refuse("the CPU tier moves KV blocks and needs a paged allocator")
    layers = vllm_layers(model, spec, tp)
    if spec.pool is not None and any(g.kind == "state" for g in spec.pool.groups):
        if not allocator.mamba_align:  # a state block of max_model_len tokens (`build_offloading_config` refuses it)
            raise refuse(f"vLLM 0.33 offloads a hybrid (state) model such as {model.name} only with prefix caching "
                         "on (mamba_cache_mode align): turn the allocator's prefix_caching on")
        settings = replace(settings, mamba_cache_mode="align",
                           mamba_checkpoint_alignment=allocator.mamba_checkpoint_alignment)
        if offload.sync_load_budget_bytes:
            raise KvsimError(f"loads within the step are not replayed on a hybrid (state) model such as {model.name}: "
                             "for such a hit vLLM 0.33's allocate_slots counts one block too few per state group (the "
                             "one allocate_external_computed_blocks takes) and fails ('Cannot get 1 free blocks from "
                             "the pool') once the pool is nearly full; set it to 0", source=source,
                             field="offload.sync_load_budget_bytes")
    startup = vllm_startup(layers, 1, max_model_len, spec.block_size, settings) if layers else None
    if startup is None:
        raise refuse(f"vLLM's KV cache groups for {model.name} are not modelled, so neither is its CPU tier")
    if spec.pool is not None and [g.kind for g in spec.pool.groups] != [g.kind for g in startup.groups]:
        raise refuse(f"the replay's KV cache groups of {model.name} differ from vLLM's start-up groups")
    replicated = all(layer.kind == "mla" for layer in layers)
    try:
        tier = cpu_offload(startup, offload.cpu_bytes, tp=tp, cpu_block_size=offload.block_size,
                           replicated=replicated, field="offload.cpu_bytes", block_size_field="offload.block_size")
    except KvsimError as exc:
        raise KvsimError(str(exc).removeprefix(f"{exc.field}: "), source=source, field=exc.field) from None
    groups = tuple(
        GroupOffloadConfig(i, g.kind, g.tokens_per_block, g.tokens_per_chunk, g.tokens_per_chunk // spec.block_size,
                           g.window_chunks, vg.window if g.kind in ("sliding", "chunked") else 0)
        for i, (g, vg) in enumerate(zip(tier.groups, startup.groups))
    )
    retention = allocator.prefix_cache_retention_interval if spec.pool is not None else 0
    # `kv_bytes_per_token`: each offloaded group's layers' bytes a token on one rank, summed
    bytes_per_token = sum(g.num_layers * g.page_bytes // g.block_size for g in startup.groups)
    with_link = get_host_link(gpu)
    return OffloadingConnector(
        block_size=spec.block_size,
        blocks_per_chunk=tier.blocks_per_chunk,
        num_chunks=tier.num_cpu_blocks,
        bytes_per_block=allocator.bytes_per_block,
        host_bandwidth_bytes_per_s=with_link[0],
        policy=offload.policy,
        store_threshold=offload.store_threshold,
        max_tracker_size=offload.max_tracker_size,
        allocator=allocator,
        groups=groups,
        retention_interval=retention,
        sync_load_budget_bytes=offload.sync_load_budget_bytes,
        kv_bytes_per_token=bytes_per_token,
    )
