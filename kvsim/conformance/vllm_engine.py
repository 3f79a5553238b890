"""vLLM 0.33.0's own `Scheduler` / `AsyncScheduler`, driven without a model by the engine core's loop.

The loop is vllm/v1/engine/core.py's: `step()` (schedule, execute, update) for the synchronous scheduler,
`step_with_batch_queue()` with a queue of two batches for async scheduling (step n+1 is scheduled before
step n's output is back). The "model" samples, for every request whose scheduled tokens reach the end of
what it has, the token kvsim's stream holds at that position; each batch takes kvsim's roofline time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

from kvsim.conformance.trace import DONE, EVICT, FLUSH, HIT, LOAD, STORE, StepRecord, Trace, encode_schedule, encode_transfers, tail_blocks
from kvsim.conformance.vllm_import import import_vllm

_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn", "int8": "int8"}


@dataclass(frozen=True)
class EngineSetup:
    """What vLLM's scheduler is built from: kvsim's workload, allocator and KV spec, in vLLM's terms."""

    num_gpu_blocks: int  # vLLM's count: block 0 is its null block
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    kv_dtype: str  # kvsim's name ("bf16")
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    watermark: float
    reserve_full_isl: bool  # scheduler_reserve_full_isl
    enable_prefix_caching: bool
    async_scheduling: bool
    # A mixed model (kvsim ModelSpec) and the KV budget: vLLM's KV cache config is then built from its layers'
    # specs by vLLM's own planning functions, as the size check does; None: one full-attention group.
    model: object = None
    kv_budget_bytes: int = 0
    # CacheConfig.prefix_cache_retention_interval: vLLM's default 0 (sparse), None (dense) or a block multiple
    prefix_cache_retention_interval: int | None = 0
    # a hybrid model: vLLM's mamba_cache_mode (align with prefix caching) and its state layers' prefill
    # checkpoint alignment (0: none)
    mamba_cache_mode: str = "none"
    mamba_checkpoint_alignment: int = 0
    offload: OffloadSetup | None = None  # the CPU tier: vLLM's OffloadingConnector, its worker side simulated


@dataclass(frozen=True)
class OffloadSetup:
    """The CPU tier as `vllm serve --kv-offloading-size` configures it (`kv_connector_extra_config`), and what the
    simulated worker side needs: bytes per GPU block (one rank) and the host link's bandwidth one way."""

    cpu_bytes: int
    policy: str
    block_size: int | None  # tokens per CPU chunk (None: one GPU block)
    store_threshold: int
    max_tracker_size: int
    sync_load_budget_bytes: int
    bytes_per_block: int
    host_bandwidth_bytes_per_s: float


def build_scheduler(setup: EngineSetup):
    """vLLM's `Scheduler` (or `AsyncScheduler`) over one full-attention KV cache group of `num_gpu_blocks`."""
    import torch

    kvi = import_vllm("vllm.v1.kv_cache_interface")
    sched_mod = import_vllm("vllm.v1.core.sched.async_scheduler" if setup.async_scheduling else "vllm.v1.core.sched.scheduler")
    SchedulerConfig = import_vllm("vllm.config.scheduler").SchedulerConfig
    CacheConfig = import_vllm("vllm.config.cache").CacheConfig
    EncoderCacheManagerConfig = import_vllm("vllm.config.ec_manager_config").EncoderCacheManagerConfig

    scheduler_config = SchedulerConfig(
        max_model_len=setup.max_model_len,
        is_encoder_decoder=False,
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        watermark=setup.watermark,
        scheduler_reserve_full_isl=setup.reserve_full_isl,
        async_scheduling=setup.async_scheduling,
    )
    hybrid_config = hybrid_kv_cache_config(setup) if setup.model is not None else None
    # cache_config.block_size after start-up: the smallest group's (a hybrid mamba model's raised block)
    block_size = setup.block_size if hybrid_config is None else min(g.kv_cache_spec.block_size for g in hybrid_config.kv_cache_groups)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=setup.enable_prefix_caching,
                               prefix_cache_retention_interval=setup.prefix_cache_retention_interval,
                               mamba_cache_mode=setup.mamba_cache_mode)
    cache_config.num_gpu_blocks = setup.num_gpu_blocks
    concurrent_batches = 2 if setup.async_scheduling else 1  # VllmConfig.max_concurrent_batches, pp = 1
    kv_transfer_config = None
    if setup.offload is not None:  # as VllmConfig._post_init_kv_transfer_config sets it for --kv-offloading-size
        o = setup.offload
        extra = {"cpu_bytes_to_use": o.cpu_bytes, "eviction_policy": o.policy, "store_threshold": o.store_threshold,
                 "max_tracker_size": o.max_tracker_size}
        if o.sync_load_budget_bytes:
            extra["sync_load_budget_bytes"] = o.sync_load_budget_bytes
        if o.block_size is not None:
            extra["block_size"] = o.block_size
        kv_transfer_config = import_vllm("vllm.config.kv_transfer").KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra, engine_id="kvsim")
    # The VllmConfig fields the scheduler reads, nothing else (a missing one fails loudly).
    vllm_config = SimpleNamespace(
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        model_config=SimpleNamespace(
            max_model_len=setup.max_model_len, uses_mrope=False, is_encoder_decoder=False, runner_type="generate",
            is_diffusion=False, supports_multimodal_inputs=False, return_sampling_mask=False,
            use_mla=False, model="kvsim", dtype=_TORCH_DTYPES[setup.kv_dtype],
            get_total_num_kv_heads=lambda: setup.num_kv_heads,
        ),
        parallel_config=SimpleNamespace(
            data_parallel_index=0, data_parallel_size=1, pipeline_parallel_size=1, tensor_parallel_size=1,
            decode_context_parallel_size=1, prefill_context_parallel_size=1, world_size=1, rank=0,
            data_parallel_rank_local=None, distributed_executor_backend="mp", nnodes_within_dp=1,
        ),
        observability_config=SimpleNamespace(
            per_request_spec_decode_metrics="none", kv_cache_metrics=False, enable_mfu_metrics=False,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
        aux_output_config=SimpleNamespace(enabled=False),
        ec_manager_config=EncoderCacheManagerConfig(),
        lora_config=None, kv_events_config=None, kv_transfer_config=kv_transfer_config, ec_transfer_config=None,
        speculative_config=None, is_mm_encoder_only=False,
        num_speculative_tokens=0, num_lookahead_tokens=0, num_prefill_lookahead_tokens=0, num_hash_lookahead_tokens=0,
        max_concurrent_batches=concurrent_batches,
        max_in_flight_tokens=concurrent_batches * setup.max_num_batched_tokens,
        use_v2_model_runner=True,  # 0.33's default on a CUDA GPU with Triton
    )
    if hybrid_config is not None:
        kv_cache_config = hybrid_config
    else:
        spec = kvi.FullAttentionSpec(
            block_size=setup.block_size, num_kv_heads=setup.num_kv_heads, head_size=setup.head_size,
            dtype=getattr(torch, _TORCH_DTYPES[setup.kv_dtype]),
        )
        layers = [f"layers.{i}" for i in range(setup.num_layers)]
        # one backing allocation, layer-outermost (the connector reads one block id's bytes across it)
        tensors = [kvi.KVCacheTensor(size=setup.num_gpu_blocks * spec.page_size_bytes * setup.num_layers, layers=layers,
                                     layer_stride=setup.num_gpu_blocks * spec.page_size_bytes, block_stride=spec.page_size_bytes)]
        kv_cache_config = kvi.KVCacheConfig(
            num_blocks=setup.num_gpu_blocks,
            kv_cache_tensors=tensors if setup.offload is not None else [],
            kv_cache_groups=[kvi.KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)],
        )
    # the engine core's choice (vllm/v1/engine/core.py): one group's block size, else the lcm of the groups'
    scheduler_block_size, hash_block_size = import_vllm("vllm.v1.core.kv_cache_utils").resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    cls = sched_mod.AsyncScheduler if setup.async_scheduling else sched_mod.Scheduler
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, structured_output_manager=_NoGrammar(),
               block_size=scheduler_block_size, hash_block_size=hash_block_size, log_stats=False)


def hybrid_kv_cache_config(setup: EngineSetup):
    """vLLM's scheduler KV cache config for a mixed model: its layers' specs (the size check's), grouped and
    sized over the budget by `get_kv_cache_groups`, `get_kv_cache_configs`, `generate_scheduler_kv_cache_config`.
    Its block count must be the one kvsim's pool computed (`setup.num_gpu_blocks`)."""
    from kvsim.conformance.size_specs import vllm_config, vllm_modules, vllm_specs
    from kvsim.size.sizing import kv_cache_spec
    from kvsim.size.vllm import VllmSettings, hybrid_pages, vllm_layers

    v = vllm_modules()
    spec = kv_cache_spec(setup.model, kv_dtype=setup.kv_dtype, block_size=setup.block_size)
    settings = VllmSettings(max_num_batched_tokens=setup.max_num_batched_tokens, async_scheduling=setup.async_scheduling,
                            mamba_cache_mode=setup.mamba_cache_mode, mamba_checkpoint_alignment=setup.mamba_checkpoint_alignment)
    report = {
        "tp": 1, "block_size": setup.block_size, "kv_dtype": setup.kv_dtype, "context_tokens": setup.max_model_len,
        "state_bytes_per_sequence": spec.state_bytes_per_sequence,
        "vllm_mamba_cache_mode": setup.mamba_cache_mode,
        "vllm_mamba_checkpoint_alignment": setup.mamba_checkpoint_alignment,
    }
    hybrid = hybrid_pages(vllm_layers(setup.model, spec), setup.block_size, settings)
    if hybrid is not None:  # the raised attention block and the state page padded to its page
        report |= {"vllm_block_size": hybrid.block_size, "vllm_state_page_padded_bytes": hybrid.page_bytes}
    specs = vllm_specs(v, setup.model, report)
    cfg = vllm_config(v, settings, setup.max_model_len, 1)
    groups = v.planning.get_kv_cache_groups(cfg, dict(specs))
    configs = v.planning.get_kv_cache_configs(cfg, [specs], [setup.kv_budget_bytes], groups)
    config = v.utils.generate_scheduler_kv_cache_config(configs)
    assert config.num_blocks == setup.num_gpu_blocks, (config.num_blocks, setup.num_gpu_blocks)
    # The workload's retention (vLLM's default 0: a sliding-window group keeps only the blocks a replay of the
    # same prompt or a detected shared-prefix junction can hit; None: every full block)
    config.prefix_cache_retention_interval = setup.prefix_cache_retention_interval
    return config


class _NoGrammar:
    """The structured-output manager of requests without a grammar (StructuredOutputManager.accept_tokens's
    first branch); the scheduler calls nothing else of it for them."""

    def accept_tokens(self, request, new_token_ids) -> bool:
        assert not request.use_structured_output
        return True


class VllmEngine:
    """The engine core's loop around vLLM's scheduler, on kvsim's roofline clock; `run()` returns a Trace.

    `requests` are kvsim `RequestSpec`s sorted by arrival, `token_ids(i)` the (prompt + max_tokens,) ids of
    request i, `step_time(chunks)` the roofline seconds of a batch of (start, num_tokens) chunks.
    """

    def __init__(self, setup: EngineSetup, requests: list, token_ids, step_time, progress=None):
        self.setup = setup
        self.progress = progress  # progress(text) every 1,024 steps, or None
        self.requests = requests
        self.token_ids = token_ids
        self.step_time = step_time
        self.scheduler = build_scheduler(setup)
        kvu = import_vllm("vllm.v1.core.kv_cache_utils")
        hashing = import_vllm("vllm.utils.hashing")
        self._block_hasher = None
        if setup.enable_prefix_caching or setup.offload is not None:  # as EngineCore.__init__ builds it (a KV
            # connector needs the block hashes too)
            hash_fn = hashing.get_hash_fn_by_name(self.scheduler.cache_config.prefix_caching_hash_algo)
            kvu.init_none_hash(hash_fn)
            self._block_hasher = kvu.get_request_block_hasher(self.scheduler.hash_block_size, hash_fn)
        self._Request = import_vllm("vllm.v1.request").Request
        self._SamplingParams = import_vllm("vllm.sampling_params").SamplingParams
        self._ModelRunnerOutput = import_vllm("vllm.v1.outputs").ModelRunnerOutput
        self.trace = Trace("vllm", num_gpu_blocks=self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks)
        self._ids: dict[str, list[int]] = {}  # live requests' token ids
        self._target: dict[str, int] = {}  # tokens a request had when (re)admitted: its prefill ends there
        self._index: dict[str, int] = {}
        # preemptions made by scheduler calls that scheduled no token: counted with the next step, as kvsim does
        self._pending_preemptions = 0
        self.worker = None  # the CPU tier's simulated worker side
        self._events: list[tuple] = []  # the CPU tier's events since the last step recorded
        if setup.offload is not None:
            self._watch_connector()

    def _watch_connector(self) -> None:
        """The simulated worker side, and observers on vLLM's connector: the CPU hits it accepts
        (`update_state_after_alloc`) and the chunks its manager evicts (`prepare_store`). Both call through."""
        from kvsim.conformance.offload_worker import SimulatedOffloadWorker

        o = self.setup.offload
        self.worker = SimulatedOffloadWorker(o.bytes_per_block, o.host_bandwidth_bytes_per_s)
        self._KVConnectorOutput = import_vllm("vllm.v1.outputs").KVConnectorOutput
        self._WorkerMetadata = import_vllm(
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common").OffloadingWorkerMetadata
        connector = self.scheduler.connector
        manager = connector.connector_scheduler.manager
        update_state_after_alloc, prepare_store = connector.update_state_after_alloc, manager.prepare_store

        def after_alloc(request, blocks, num_external_tokens):
            if num_external_tokens:
                self._events.append((HIT, self._index[request.request_id], num_external_tokens))
            return update_state_after_alloc(request, blocks, num_external_tokens)

        def store(keys, req_context):
            out = prepare_store(keys, req_context)
            if out is not None and out.evicted_keys:
                self._events.append((EVICT, len(out.evicted_keys)))
            return out

        connector.update_state_after_alloc = after_alloc
        manager.prepare_store = store

    def _record_jobs(self, meta) -> None:
        """The loads, stores and flushes of one `OffloadingConnectorMetadata`, as events."""
        for job_id, job in meta.load_jobs.items():
            self._events.append((LOAD, job_id, self._index[job.req_id], [int(b) for b in job.dst_spec.block_ids],
                                 [int(b) for b in job.src_spec.block_ids]))
        for job_id, job in meta.store_jobs.items():
            self._events.append((STORE, job_id, self._index[job.req_id], [int(b) for b in job.src_spec.block_ids],
                                 [int(b) for b in job.dst_spec.block_ids]))
        self._events.extend((FLUSH, job_id) for job_id in meta.jobs_to_flush or ())

    # --- the engine core's loops -------------------------------------------------------------------

    def run(self) -> Trace:
        sched = self.scheduler
        reqs = self.requests
        n, i, now = len(reqs), 0, 0.0
        queue: deque = deque()  # (scheduler_output, model_runner_output, end time, step), newest at the left
        size = 2 if self.setup.async_scheduling else 1
        self._gpu_free_at = 0.0  # when the last batch queued ends: batches run one after another
        while True:
            while i < n and reqs[i].arrival_time <= now:
                self._add(i)
                i += 1
            self._next = i
            if not sched.has_requests() and not queue:
                if i >= n:
                    break
                now = reqs[i].arrival_time  # the clock jumps over the idle gap
                continue
            if sched.has_requests():
                queue.appendleft(self._schedule(now))
                executed = queue[0][0].total_num_scheduled_tokens > 0
                if size > 1 and len(queue) < size and (executed or sched.has_requests()):
                    continue  # step_with_batch_queue: fill the queue before waiting on an output
            so, out, end, step = queue.pop()
            now = max(now, end)  # its output is back
            sched.update_from_output(so, out)
            self._after_update(so, step)
            if out.kv_connector_output is not None:  # the worker's reports, seen by the scheduler now
                meta = out.kv_connector_output.kv_connector_worker_meta
                self._events.extend((DONE, job_id) for job_id in (meta.completed_jobs if meta else ()))
            if so.total_num_scheduled_tokens == 0 and not queue and sched.has_requests() and self.worker is None:
                raise RuntimeError(f"vLLM's scheduler scheduled nothing with {len(sched.waiting)} requests waiting")
        return self.trace

    # --- one step ------------------------------------------------------------------------------------

    def _add(self, i: int) -> None:
        """EngineCore.add_request after the input processor: a prompt of max_model_len or more is refused
        (`InputProcessor._validate_prompt_len`: it leaves no room for one output token)."""
        r = self.requests[i]
        if r.num_prompt_tokens >= self.setup.max_model_len:
            self.trace.rejected.add(i)
            return
        ids = [int(t) for t in self.token_ids(i)]
        req_id = str(r.request_id)
        params = self._SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0)
        request = self._Request(req_id, ids[: r.num_prompt_tokens], params, None, arrival_time=r.arrival_time,
                                block_hasher=self._block_hasher)
        self._ids[req_id] = ids
        self._index[req_id] = i
        self.scheduler.add_request(request)

    def _schedule(self, now: float):
        sched = self.scheduler
        before = {r.request_id: r.num_computed_tokens for r in sched.running}
        for r in sched.waiting:
            self._target[r.request_id] = r.num_tokens
        so = sched.schedule()
        self._pending_preemptions += len(so.preempted_req_ids or ())
        meta = so.kv_connector_metadata if self.worker is not None else None
        if meta is not None:
            self._record_jobs(meta)
        if so.total_num_scheduled_tokens == 0:
            end = now
            if self.worker is not None:  # an empty step runs after the one in flight (async), taking no time;
                # with none in flight, the engine idles in it until a transfer ends (or a request arrives)
                end = max(now, self._gpu_free_at)
                self.worker.execute(meta, end, 0.0)
                if self.worker.has_jobs() and self._gpu_free_at <= now:
                    next_arrival = self.requests[self._next].arrival_time if self._next < len(self.requests) else float("inf")
                    end = max(end, min(self.worker.next_finish_s(), next_arrival))
                self._gpu_free_at = end
            return so, self._model_output([], {}, end), end, None
        step = len(self.trace.steps)
        chunks, sampled = [], {}
        prefill = decode = hits = 0
        managers = sched.kv_cache_manager.coordinator.single_type_managers
        entries = []
        for req_id, num in so.num_scheduled_tokens.items():
            request = sched.requests[req_id]
            end = request.num_computed_tokens  # already advanced by `num`
            start = end - num
            index = self._index[req_id]
            if req_id not in before:  # admitted (new or resumed): its start is what the prefix cache held
                hits += start
                self.trace.first_scheduled.setdefault(index, step)
            k = tail_blocks(num, self.setup.block_size, req_id not in before)
            tables = [m.req_to_blocks.get(req_id, []) for m in managers]
            entries.append((index, num, [[b.block_id for b in (t if k is None else t[-k:])] for t in tables]))
            target = self._target.get(req_id, request.num_prompt_tokens)
            in_prefill = max(0, min(end, target) - start)
            prefill += in_prefill
            decode += num - in_prefill
            chunks.append((start, num))
            if not request.is_prefill_chunk:  # the model samples the token at position `end`
                ids = self._ids[req_id]
                assert end < len(ids), (req_id, end, len(ids))  # never past prompt + max_tokens
                sampled[req_id] = [ids[end]]
        # With async scheduling a batch is scheduled while the one before runs, and starts when that one ends.
        start = max(now, self._gpu_free_at)
        dt = self.step_time(chunks)
        if self.worker is not None:  # flushed jobs delay the step
            dt += self.worker.execute(meta, start, dt)
        self._gpu_free_at = start + dt
        transfers = encode_transfers(self._events) if self.worker is not None else b""
        self._events = []
        record = StepRecord(start, len(sched.running), prefill, decode, self._pending_preemptions, hits, encode_schedule(entries),
                            transfers)
        self._pending_preemptions = 0
        self.trace.steps.append(record)
        if self.progress is not None and len(self.trace.steps) % 1024 == 0:
            self.progress(f"vLLM's scheduler, step {len(self.trace.steps):,}")
        return so, self._model_output(list(so.num_scheduled_tokens), sampled, self._gpu_free_at), self._gpu_free_at, step

    def _model_output(self, req_ids: list[str], sampled: dict[str, list[int]], end_s: float):
        """The model runner's output of a step ending at `end_s`, with the worker's reports of the transfers
        finished by then (`get_finished`, `build_connector_worker_meta`)."""
        kv_output = None
        if self.worker is not None:
            completed, recving = self.worker.finished_by(end_s)
            kv_output = self._KVConnectorOutput(
                finished_sending=None, finished_recving=recving or None,
                kv_connector_worker_meta=self._WorkerMetadata(completed_jobs=completed) if completed else None)
        return self._ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: k for k, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            kv_connector_output=kv_output,
        )

    def _after_update(self, so, step: int | None) -> None:
        if step is None:
            return
        out = so.num_scheduled_tokens
        for req_id in out:
            index = self._index[req_id]
            request = self.scheduler.requests.get(req_id)
            if request is None:  # finished and freed by update_from_output
                self.trace.finished.setdefault(index, step)
                self.trace.first_token.setdefault(index, step)
                self._ids.pop(req_id, None)
                self._target.pop(req_id, None)
            elif request.num_output_tokens > 0:
                self.trace.first_token.setdefault(index, step)
