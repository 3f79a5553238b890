"""A conformance stream: a workload file (one paged allocator) and a scheduling mode, resolved into what both
sides run: kvsim's replay context and request stream, and vLLM's scheduler setup."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from kvsim.conformance.vllm_engine import EngineSetup
from kvsim.errors import KvsimError

STREAMS_DIR = Path(__file__).with_name("streams")


@dataclass(frozen=True)
class Stream:
    """`workload` (a YAML under streams/, or any path) replayed with `async_scheduling` on both sides (True: vLLM's
    `AsyncScheduler`, False: its synchronous `Scheduler`), or as the file's `scheduler:` says (None; a workload's
    default is async, as vllm serve's). A fleet's workload (deployment.replicas > 1) is one stream per `replica`:
    the requests its router sent that replica."""

    name: str
    workload: Path
    async_scheduling: bool | None = None
    replica: int | None = None


@dataclass
class ResolvedStream:
    """Everything both sides need for one stream."""

    stream: Stream
    workload: object  # kvsim.workload.Workload
    config: object  # kvsim.engine.factory.AllocatorConfig: the one paged allocator
    ctx: object  # kvsim.replay.options.ReplayContext
    requests: list  # kvsim.workload.requests.RequestSpec, by arrival
    setup: EngineSetup


def resolve(stream: Stream) -> ResolvedStream:
    """Load the workload and build kvsim's replay context and vLLM's setup from the same numbers.

    The KV budget must be given in bytes (`kv_budget`) and the workload must name exactly one paged allocator;
    vLLM gets budget // block bytes blocks, the count kvsim's paged allocator computes from the same budget (a
    mixed model: vLLM plans its groups and blocks from its layers' specs, and must arrive at kvsim's count).
    """
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu
    from kvsim.replay.options import ReplayContext
    from kvsim.workload.requests import generate_requests
    from kvsim.clock.roofline import Roofline
    from kvsim.size.sizing import kv_cache_spec, weight_bytes
    from kvsim.size.vllm_capacity import num_gpu_blocks as vllm_num_gpu_blocks
    from kvsim.workload.spec import load_workload

    workload = load_workload(stream.workload)
    source = str(stream.workload)
    paged = [a for a in workload.allocators if a.kind == "paged"]
    if len(workload.allocators) != 1 or not paged:
        raise KvsimError("a conformance stream names exactly one paged allocator", source=source, field="allocators")
    if workload.kv_budget_bytes is None:
        raise KvsimError("a conformance stream gives kv_budget (bytes), not gpu_memory_utilization", source=source, field="kv_budget")
    if stream.async_scheduling is not None:
        workload = replace(workload, scheduler=replace(workload.scheduler, async_scheduling=stream.async_scheduling))
    config = paged[0]
    model = resolve_model(workload.model)
    gpu = get_gpu(workload.hardware)
    from kvsim.replay.run import serve_defaults
    from kvsim.size.kv_dtype import kv_cache_dtype

    workload = replace(workload, kv_dtype=kv_cache_dtype(workload.kv_dtype, model, field="kv_dtype", source=source))
    workload = replace(workload, allocators=serve_defaults(workload.allocators, model, gpu.key, source))
    config = workload.allocators[0]
    weights = weight_bytes(model)
    spec = kv_cache_spec(model, kv_dtype=workload.kv_dtype, block_size=config.block_size)
    roofline = Roofline.for_model(model, gpu, weight_bytes=weights, kv_bytes_per_token=spec.bytes_per_token)
    sc = workload.scheduler
    ctx = ReplayContext(model, workload.kv_dtype, workload.kv_budget_bytes, workload.max_model_len, roofline, sc, workload.seed,
                        offload=workload.offload, gpu=gpu, source=source)
    kv_spec = ctx.spec(config.block_size, config)  # a mixed model: vLLM's groups (a KvsimError where vLLM builds none)
    pool = kv_spec.pool
    num_gpu_blocks = vllm_num_gpu_blocks(kv_spec, workload.kv_budget_bytes)
    offload = None
    if workload.offload is not None:  # the CPU tier: vLLM's connector with its worker side on kvsim's host link
        from kvsim.conformance.vllm_engine import OffloadSetup
        from kvsim.models.interconnect import get_host_link

        o = workload.offload
        from kvsim.size.vllm_capacity import bytes_per_block

        offload = OffloadSetup(o.cpu_bytes, o.policy, o.block_size, o.store_threshold, o.max_tracker_size,
                               o.sync_load_budget_bytes, bytes_per_block(kv_spec), get_host_link(gpu)[0])  # one block id of the pool
    setup = EngineSetup(
        num_gpu_blocks=num_gpu_blocks,
        block_size=config.block_size,
        num_layers=spec.num_attention_layers,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_dim,
        kv_dtype=workload.kv_dtype,
        max_model_len=workload.max_model_len,
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        watermark=config.watermark,
        reserve_full_isl=sc.scheduler_reserve_full_isl,
        enable_prefix_caching=bool(config.prefix_caching),
        async_scheduling=sc.async_scheduling,  # the stream's, else the workload's
        model=None if pool is None else model,
        kv_budget_bytes=workload.kv_budget_bytes,
        prefix_cache_retention_interval=config.prefix_cache_retention_interval,
        mamba_cache_mode=config.mamba_cache_mode if pool is not None and kv_spec.state_bytes_per_sequence else "none",
        mamba_checkpoint_alignment=config.mamba_checkpoint_alignment or 0,
        offload=offload,
    )
    if workload.deployment.replicas > 1:  # a fleet: the requests its router sent this replica
        from kvsim.deployment.streams import replica_streams

        if stream.replica is None or not 0 <= stream.replica < workload.deployment.replicas:
            raise KvsimError(f"a fleet of {workload.deployment.replicas} replicas is checked one replica at a time "
                             f"(0..{workload.deployment.replicas - 1}), got {stream.replica}", source=source, field="deployment.replicas")
        requests = replica_streams(workload)[1][stream.replica]
    else:
        requests = generate_requests(workload)
    return ResolvedStream(stream, workload, config, ctx, requests, setup)
