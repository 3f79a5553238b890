"""The CPU KV tier's scheduler side as vLLM 0.33.0's `OffloadingConnectorScheduler` runs it
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py), over kvsim.offload's
`CPUOffloadingManager`, with the worker side's transfers on the replay's clock.

One KV cache group of full attention (or MLA): the replay refuses the tier on mixed models. What it follows, hook
by hook (docs/cpu-tier.md has the rules as read):

- `get_num_new_matched_tokens(seq, num_computed_tokens)`: on admission, after the GPU prefix hit (block aligned);
  resets `next_stored_chunk_idx` to 0; None (skip the request this step) while it has transfers in flight, when a
  hit chunk is still being written (HIT_PENDING) or being loaded by another request; else the tokens past the GPU
  hit that whole chunks in the tier cover (0 when less than one chunk), `_lookup_complete_chunks`.
- `update_state_after_alloc(seq, num_external_tokens)`: pins the chunks (`prepare_load`) and queues a load job;
  the request then skips the chunks it loaded when it stores (`OffloadPolicy.CHUNK_LEVEL`).
- `build_connector_meta(scheduled, finished, preempted)`: the end of `schedule()`: the in-flight stores of
  preempted requests are flushed (the worker waits for them); each scheduled request, then each finished one,
  offers its prompt chunks computed by the end of the step from `next_stored_chunk_idx` on (`_build_store_jobs`:
  prompt only, all or nothing, a refused offer made again next step); `on_request_finished` for the finished.
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
    first_block: int = 0  # a load: the request's block index of gpu_block_ids[0]
    copied: bool = False  # with cache tensors: its blocks have moved
    # a store's source blocks a reallocation must wait for (vLLM's `TransferJobStatus`): those of sliding-window
    # groups from its creation, the others once its request has finished
    fenced_block_ids: list = field(default_factory=list)
    deferred_fence_block_ids: list = field(default_factory=list)


@dataclass(slots=True)
class RequestOffloadState:
    """vLLM's `RequestOffloadState` for one full-attention group."""

    seq: object
    req_context: ReqContext
    offload_keys: list = field(default_factory=list)
    next_stored_chunk_idx: int = 0
    num_locally_computed_tokens: int = 0
    transfer_jobs: set = field(default_factory=set)
    finished_signaled: bool = False
    load_ready: bool = False  # its load finished (vLLM's `finished_recving_kv_req_ids`)
    load_start_s: float = 0.0
    block_ids: list | None = None  # its GPU block ids as the connector saw them scheduled (vLLM's
    # `RequestGroupState.block_ids`); None until it is next scheduled, which hands over its whole table
    finished: bool = False  # `request_finished` was called (vLLM's `req.is_finished()`)


class OffloadingConnector:
    """The scheduler side of vLLM's `OffloadingConnector` for a replay (see the module docstring).

    `block_size` is the GPU block, `blocks_per_chunk` GPU blocks make one CPU chunk of `num_chunks`;
    `bytes_per_block` is one GPU block of one rank, `host_bandwidth_bytes_per_s` one direction of its host link.
    """

    def __init__(self, *, block_size: int, blocks_per_chunk: int, num_chunks: int, bytes_per_block: int,
                 host_bandwidth_bytes_per_s: float, policy: str = "lru", store_threshold: int = 0,
                 max_tracker_size: int = 64_000, allocator=None) -> None:
        assert block_size > 0 and blocks_per_chunk > 0 and host_bandwidth_bytes_per_s > 0
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
        self._free_at = {False: 0.0, True: 0.0}  # per direction (load, store): when its queue drains
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
            status = RequestOffloadState(seq, ReqContext(str(seq.seq_id)))
            self.manager.on_new_request(status.req_context)
            self._req_status[seq.seq_id] = status
        return status

    def _update_offload_keys(self, status: RequestOffloadState, num_tokens: int) -> None:
        """Keys of the whole chunks within the first `num_tokens` known tokens: the hash of each chunk's last
        block with group 0 (`update_offload_keys`)."""
        seq, T = status.seq, self.tokens_per_chunk
        if num_tokens // T <= len(status.offload_keys) or seq.token_ids is None:
            return
        hashes = block_hashes(seq.token_ids, num_tokens, self.block_size)  # (full blocks,)
        B = self.blocks_per_chunk
        for i in range(len(status.offload_keys), len(hashes) // B):
            key = make_offload_key(hashes[(i + 1) * B - 1].to_bytes(8, "big", signed=True), 0)
            status.offload_keys.append(key)
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
        status.next_stored_chunk_idx = 0  # restarting at token 0: offer every chunk again
        status.block_ids = None
        if status.transfer_jobs:
            return None
        num_tokens = seq.num_tokens
        self._update_offload_keys(status, num_tokens)
        status.num_locally_computed_tokens = num_computed_tokens
        T = self.tokens_per_chunk
        keys = status.offload_keys
        max_hit = min(num_tokens, len(keys) * T)
        if max_hit - num_computed_tokens < T:
            return 0
        start = num_computed_tokens // T
        end = min(-(-max_hit // T), len(keys))
        hits, pending = 0, False
        lookup = self.manager.lookup
        for key in keys[start:end]:  # `_maximal_prefix_lookup`
            result = lookup(key, status.req_context)
            if result is LookupResult.MISS:
                break
            hits += 1
            pending |= result is LookupResult.HIT_PENDING
        if hits == 0:
            return 0
        if pending:
            return None
        num_hit_tokens = min(max_hit, T * (start + hits)) - num_computed_tokens
        if num_hit_tokens < T:
            return 0
        if self._chunks_being_loaded:
            end = -(-(num_computed_tokens + num_hit_tokens) // T)
            if any(key in self._chunks_being_loaded for key in keys[start:end]):
                return None
        return num_hit_tokens

    def update_state_after_alloc(self, seq, num_external_tokens: int) -> None:
        """Pin the hit chunks and queue their load (`update_state_after_alloc`); nothing without a hit. The
        request's blocks count as allocated this step either way."""
        if self.allocator is not None:
            for table in self.allocator.block_tables(seq):
                self._allocated.update(table)
            self._allocated.discard(0)
        if num_external_tokens == 0:
            return
        status = self._req_status[seq.seq_id]
        local = status.num_locally_computed_tokens
        num_cached = local + num_external_tokens
        bs, B = self.block_size, self.blocks_per_chunk
        first_block = -(-local // bs)
        num_blocks = -(-num_cached // bs) - first_block
        num_chunks = -(-num_cached // self.tokens_per_chunk)
        keys = status.offload_keys[first_block // B:num_chunks]
        status.next_stored_chunk_idx = num_chunks  # OffloadPolicy.CHUNK_LEVEL
        chunk_ids = self.manager.prepare_load(keys, status.req_context)
        job = self._new_job(seq, keys, False, num_blocks * self.bytes_per_block)
        job.cpu_chunk_ids = list(chunk_ids)
        job.first_block = first_block
        if self.allocator is not None:
            job.gpu_block_ids = list(self.allocator.block_tables(seq)[0][first_block:first_block + num_blocks])
        if self.events is not None:
            self.events.append((6, seq.index, num_external_tokens))  # HIT
            self.events.append((1, job.job_id, seq.index, job.gpu_block_ids, job.cpu_chunk_ids))  # LOAD
        status.transfer_jobs.add(job.job_id)
        status.load_ready = False
        status.load_start_s = self.now
        if self._chunks_being_loaded is not None:
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
                self._flush_jobs(j for j in status.transfer_jobs if self._jobs[j].is_store)
        pending = self._block_id_to_pending_jobs
        if pending and not self._allocated.isdisjoint(pending):  # stores reading blocks reallocated this step
            self._flush_jobs(j for bid in self._allocated if bid in pending for j in pending[bid])
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
        it was last scheduled, else the blocks past those the connector has (`_update_req_states`)."""
        if self.allocator is None:
            return
        for seq, _ in scheduled:
            status = self._req_status.get(seq.seq_id)
            if status is None:
                continue
            tables = self.allocator.block_tables(seq)
            if status.block_ids is None:
                status.block_ids = [[] for _ in tables]
            for held, table in zip(status.block_ids, tables):
                new = table[len(held):]
                held.extend(new)
                self._allocated.update(new)
        self._allocated.discard(0)

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

    def _store(self, seq, num_tokens_after_batch: int) -> None:
        """`_build_store_jobs` for one request: prompt chunks from `next_stored_chunk_idx`, all or nothing."""
        status = self._req_status.get(seq.seq_id)
        if status is None:
            return
        offloadable = min(num_tokens_after_batch, seq.num_tokens, seq.num_prompt_tokens)  # offload_prompt_only
        self._update_offload_keys(status, seq.num_prompt_tokens)
        num_chunks = min(offloadable // self.tokens_per_chunk, len(status.offload_keys))
        start = status.next_stored_chunk_idx
        if num_chunks <= start:
            status.next_stored_chunk_idx = max(start, num_chunks)
            return
        out = self.manager.prepare_store(status.offload_keys[start:num_chunks], status.req_context)
        if out is None:
            return  # refused: offered again next step
        if self.events is not None and out.evicted_keys:
            self.events.append((5, len(out.evicted_keys)))  # EVICT
        status.next_stored_chunk_idx = num_chunks
        if not out.keys_to_store:
            return
        job = self._new_job(seq, list(out.keys_to_store), True, len(out.keys_to_store) * self.bytes_per_chunk)
        status.transfer_jobs.add(job.job_id)
        job.cpu_chunk_ids = list(out.chunk_ids)
        if self.allocator is not None:  # each stored chunk's GPU blocks, in chunk order
            table, B, stored = status.block_ids[0], self.blocks_per_chunk, set(out.keys_to_store)
            job.gpu_block_ids = [table[i * B + b] for i in range(start, num_chunks) if status.offload_keys[i] in stored
                                 for b in range(B)]
            job.deferred_fence_block_ids = job.gpu_block_ids
            if status.finished:  # a finished request's store: its blocks are fenced now
                for bid in job.gpu_block_ids:
                    self._block_id_to_pending_jobs.setdefault(bid, set()).add(job.job_id)
                    if bid in self._allocated:
                        self._flush[job.job_id] = job
        if self.events is not None:
            self.events.append((2, job.job_id, seq.index, job.gpu_block_ids, job.cpu_chunk_ids))  # STORE
        if self.host_pool is not None and seq.seq_id in self._finishing:  # its blocks are free: copy them before
            self._copy(job)  # this step can reuse and overwrite them (vLLM flushes such a store before the step)

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
        for job in self._unsubmitted:
            if job.finish_s is None:
                self._start(job, now + wait + (dt if job.is_store else 0.0))
        self._unsubmitted.clear()
        return wait

    def _copy(self, job: TransferJob) -> None:
        """With cache tensors: move the job's blocks (a store from the device pool to its chunks, a load back),
        once; a load in integrity mode is checked against what its request's tokens wrote."""
        if job.copied:
            return
        job.copied = True
        pool = self.host_pool
        if job.is_store:
            pool.store(job.gpu_block_ids, job.cpu_chunk_ids)
            return
        slots = pool.load(job.cpu_chunk_ids, job.first_block, job.gpu_block_ids)
        cache = pool.cache
        if cache.integrity and len(slots):
            import numpy as np

            start = job.first_block * self.block_size
            cache.verify(job.seq.seq_id, slots, np.arange(start, start + len(slots), dtype=np.int64))

    def _start(self, job: TransferJob, ready_s: float) -> None:
        if self.host_pool is not None:
            self._copy(job)
        job.start_s = max(ready_s, self._free_at[job.is_store])
        job.finish_s = job.start_s + job.num_bytes / self.host_bandwidth
        self._free_at[job.is_store] = job.finish_s
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
                if self._chunks_being_loaded:
                    self._chunks_being_loaded.difference_update(job.keys)
                status.load_ready = True
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
    count as `kvsim size --cpu-offload` sizes vLLM's tier (kvsim.size.cpu_offload), the GPU's sourced host link
    (kvsim/models/data/interconnect.yaml). A mixed model (more than one KV cache group) is refused: one line
    naming the workload and `offload`."""
    from kvsim.errors import KvsimError
    from kvsim.models.interconnect import get_host_link
    from kvsim.size.cpu_offload import cpu_offload
    from kvsim.size.vllm import vllm_layers, vllm_startup

    def refuse(message: str) -> KvsimError:
        return KvsimError(message, source=source, field="offload")

    if not allocator.paged:
        raise refuse("the CPU tier moves KV blocks and needs a paged allocator")
    if not spec.is_uniform or spec.pool is not None:
        groups = {} if spec.pool is None else {g.kind: None for g in spec.pool.groups}
        names = {"full": "full attention", "mla": "MLA", "sliding": "sliding window", "chunked": "chunked local attention",
                 "state": "Mamba state"}
        named = ", ".join(names.get(kind, kind) for kind in groups)
        raise refuse(f"{model.name} has {len(spec.pool.groups) if spec.pool else 'several'} "
                     f"KV cache groups ({named or 'mixed layers'}): vLLM 0.33's OffloadingConnector offloads each "
                     "group (sliding windows and state groups by their own rules), which the replay's CPU tier does "
                     "not follow yet; it serves models of one full-attention or MLA group")
    layers = vllm_layers(model, spec, tp)
    startup = vllm_startup(layers, 1, max_model_len, spec.block_size, settings) if layers else None
    if startup is None or len(startup.groups) != 1 or startup.groups[0].kind not in ("full", "mla"):
        raise refuse("the replay's CPU tier follows vLLM's connector for models of one full-attention (or MLA) "
                     "KV cache group only")
    replicated = all(layer.kind == "mla" for layer in layers)
    try:
        tier = cpu_offload(startup, offload.cpu_bytes, tp=tp, cpu_block_size=offload.block_size,
                           replicated=replicated, field="offload.block_size")
    except KvsimError as exc:
        raise KvsimError(str(exc).removeprefix(f"{exc.field}: "), source=source, field=exc.field) from None
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
    )
