"""The replay: one request stream through every allocator of a workload, on a simulated clock. `run_replay`
resolves the workload (model, hardware, KV budget, device, requests) into a `ReplayContext` and replays each
allocator config (`replay_loop`) here or in worker processes (`replay_workers`)."""

from __future__ import annotations

import gc
import multiprocessing
import os
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from kvsim.errors import KvsimError
from kvsim.replay.loop import replay_allocator
from kvsim.replay.options import CPU_MEASURED_READ_EVERY, CPU_READ_EVERY, CUDA_READ_EVERY, ProgressFn, ReplayContext, ReplayOptions
from kvsim.replay.records import ReplayResult
from kvsim.clock.roofline import Roofline
from kvsim.size.vllm_capacity import bytes_per_block, num_gpu_blocks


def run_replay(
    workload, options: ReplayOptions = ReplayOptions(), *, progress: ProgressFn | None = None, workers: int | None = None
) -> ReplayResult:
    """Replay `workload`'s request stream through each of its allocator configs; see the module docstring.

    `workers` > 1 runs allocator configs in parallel processes (default: one per CPU, except with CUDA
    tensors or measured timing, whose kernel times must not share the machine: 1); the result's simulated
    figures are the same either way.
    """
    result, ctx, requests, options = resolve_replay(workload, options)
    configs = list(result.workload.allocators)  # with vllm serve's defaults for the model
    device = result.device
    if workers is None:
        alone = options.tensors and (device.startswith("cuda") or options.timing == "measured")
        workers = 1 if alone else min(len(configs), os.cpu_count() or 1)
    with _heap_frozen():
        if workers > 1 and len(configs) > 1 and "fork" in multiprocessing.get_all_start_methods():
            from kvsim.replay.workers import replay_in_processes

            result.runs = replay_in_processes(configs, requests, ctx, options, progress, workers)
        else:
            result.runs = [replay_allocator(config, requests, ctx, options, progress=progress) for config in configs]
    return result


@contextmanager
def _heap_frozen():
    """Every object alive before the replays (modules, the request stream) left out of the collector's passes while
    they run (`gc.freeze`), and handed back after: a full pass walked them all, ~0.05-0.1 s of the Mooncake trace's
    replay. Forked workers inherit the frozen heap, whose pages the collector then leaves unwritten. Another
    freeze in force is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def resolve_replay(workload, options: ReplayOptions = ReplayOptions()) -> tuple[ReplayResult, ReplayContext, list, ReplayOptions]:
    """What a replay of `workload` runs on, checked before anything runs: the result to fill (no runs yet), the
    context (model, one rank's budget, clocks), the request stream, and the options as resolved (device)."""
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu
    from kvsim.workload.requests import generate_requests
    from kvsim.size.sizing import weight_bytes
    from kvsim.size.startup import vllm_kv_cache_memory

    source = str(workload.path)
    with _workload_field(source, "model"):  # the catalogue's errors name --model; here it is the file's field
        model = resolve_model(workload.model)
        if model.num_params is None and not model.checkpoint_bytes:  # a workload has no --params to give
            raise KvsimError(f"{model.source}: the parameter count of {model.name} is unknown, and the replay's clock "
                             "needs its weight bytes (a workload has no --params): use a catalogue model, or for a "
                             "plain decoder give the config.json vocab_size and intermediate_size to count them from")
    workload = with_model_kv_dtype(workload, model)
    tp, ep, tp_field, ep_field = _deployment(workload, options)
    bytes_per_token = rank_bytes_per_token(workload, model, tp, tp_field)
    weights = weight_bytes(model, tp=tp)  # one rank's, as `kvsim size --tp` counts them
    if workload.max_model_len > model.max_model_len and model.attention_layers:
        # vLLM refuses it too (ModelConfig: "User-specified max_model_len ... is greater than the derived
        # max_model_len"): positions past the model's length are garbage, and the replay would size them anyway.
        raise KvsimError(f"{workload.max_model_len:,} is more than {model.name} serves ({model.max_model_len:,} "
                         "tokens, from its config.json)", source=source, field="max_model_len")
    with _workload_field(source, "hardware"):
        gpu = get_gpu(workload.hardware)
    # what the file leaves out, as vllm serve sets it for this model on this GPU (hybrid models: prefix caching
    # on, mamba_cache_mode align, with the GPU's prefill checkpoint alignment)
    serve_note = None
    if any(c.kind == "paged" and c.prefix_caching is None for c in workload.allocators):
        from kvsim.size.vllm_settings import serve_mamba_defaults

        mode, _, text = serve_mamba_defaults(model, gpu.key)
        serve_note = text if mode == "align" else None  # said as `kvsim size` says it
    workload = replace(workload, allocators=serve_defaults(workload.allocators, model, gpu.key, source))
    if workload.kv_budget_bytes is not None:
        budget = workload.kv_budget_bytes
    else:
        budget = vllm_kv_cache_memory(model, gpu.reported_memory_bytes, utilization=workload.gpu_memory_utilization,
                                      tp=tp, device_name=gpu.name, source=source)
    for config in workload.allocators:  # a budget below one usable block would build an allocator with no slots
        unit_bytes = bytes_per_token * (config.block_size if config.kind == "paged" else 1)
        needed = 2 * unit_bytes if config.kind == "paged" else unit_bytes  # paged: block 0 is the null block
        if budget < needed:
            null = " besides the null block" if config.kind == "paged" else ""
            raise KvsimError(
                f"a KV budget of {budget:,} B holds not one {config.label} block{null} ({unit_bytes:,} B of {model.name} KV)",
                source=source,
                field="kv_budget" if workload.kv_budget_bytes is not None else "gpu_memory_utilization",
            )
    with _workload_field(source, "hardware"):  # at tp > 1 the GPU's link to its peers
        roofline = Roofline.for_model(model, gpu, weight_bytes=weights, kv_bytes_per_token=bytes_per_token, tp=tp)
    clock, clock_note = _kernel_clock(model, gpu, options.timing, source, workload.kv_dtype, tp, ep, ep_field)
    requests = generate_requests(workload)
    if not requests:
        raise KvsimError("the workload has no requests", source=source, field="requests")
    device, note = "none", None
    num_attention_layers = len(model.attention_layers)
    # more would be timed as more than the model; an attention-free model is refused by its allocators below
    if options.tensors and 0 < num_attention_layers < options.num_layers:
        raise KvsimError(f"{model.name} has {num_attention_layers} attention layers; materialise at most that many, "
                         f"got {options.num_layers}", field="--layers")
    if options.tensors:
        from kvsim.engine.tensors.device import resolve_device

        try:
            resolved = resolve_device(options.device)
        except KvsimError as exc:  # the engine names its argument `device`; the user typed --device
            raise KvsimError(str(exc).removeprefix(f"{exc.field}: "), field="--device") from None
        device = str(resolved)
        read_every = options.read_every
        if read_every is None:
            if resolved.type == "cuda":
                read_every = CUDA_READ_EVERY
            else:
                read_every = CPU_MEASURED_READ_EVERY if options.timing == "measured" else CPU_READ_EVERY
        if options.device == "auto" and resolved.type == "cpu":
            note = f"no CUDA device: cache tensors on the CPU, reads sampled every {read_every} decode steps"
            # CPU tensors are the default since every step's write is one cheap scatter and the reads, which
            # move 100+ MiB each on a CPU, are sampled: workloads/poisson.yaml takes seconds instead of hours.
        if options.timing == "measured" and read_every > 1:
            sampled = (f"measured timing: reads timed every {read_every} decode steps, the steps between "
                       "at the last read's µs per context token")  # fmt: skip
            note = f"{note}; {sampled}" if note else sampled
        options = replace(options, device=device, read_every=read_every)
    note = "; ".join(n for n in (note, clock_note, serve_note) if n) or None
    ctx = ReplayContext(model, workload.kv_dtype, budget, workload.max_model_len, roofline, workload.scheduler, workload.seed, clock, tp=tp,
                        offload=workload.offload, gpu=gpu, source=source)
    if workload.offload is not None:
        _check_offload(workload, ctx, options)
    for i, config in enumerate(workload.allocators):  # the engine's check, before anything runs, naming file and allocator
        if config.kind == "flat" and bytes_per_token == 0:  # a flat reservation is per token: nothing to reserve
            raise KvsimError(f"{model.name} has no attention layer: a flat allocator reserves KV per token, and it keeps "
                             "none (its state is per sequence); use a paged allocator", source=source, field=f"allocators[{i}].kind")
        if config.kind != "paged":
            continue
        pool = ctx.spec(config.block_size, config).pool
        if pool is not None and config.prefix_caching:
            from kvsim.engine.paged.kv_cache_manager import check_prefix_caching

            try:
                check_prefix_caching(pool.groups)
            except KvsimError as exc:
                raise KvsimError(f"{model.name}: {str(exc).removeprefix('prefix_caching: ')}; drop prefix_caching for it",
                                 source=source, field=f"allocators[{i}].prefix_caching") from None
        try:  # what the paged engine refuses when it is built, said here with the file and the allocator
            _check_paged(config, pool)
        except KvsimError as exc:
            raise KvsimError(f"{model.name}: {str(exc).removeprefix(f'{exc.field}: ')}", source=source,
                             field=f"allocators[{i}].{exc.field}") from None
    _check_num_blocks(workload, ctx, source)
    if device == "cpu":
        _check_host_memory(workload.allocators, ctx, options)
    result = ReplayResult(
        workload=workload,
        model_name=model.name,
        hardware_name=gpu.name,
        budget_bytes=budget,
        device=device,
        options=options,
        note=note,
        arrival_s=np.array([r.arrival_time for r in requests], dtype=np.float64),
        num_prompt_tokens=np.array([r.num_prompt_tokens for r in requests], dtype=np.int64),
        max_tokens=np.array([r.max_tokens for r in requests], dtype=np.int64),
        clock=clock.label if clock is not None else ("roofline (kernels-db does not apply)" if clock_note else "roofline"),
        tp=tp,
        ep=ep,
    )
    return result, ctx, requests, options


def with_model_kv_dtype(workload, model):
    """`workload` with its kv_dtype resolved for `model`: auto (vllm serve's default) is what the checkpoint's
    quantization_config asks for, else the model's dtype (`kvsim.size.kv_dtype.kv_cache_dtype`)."""
    from kvsim.size.kv_dtype import kv_cache_dtype

    return replace(workload, kv_dtype=kv_cache_dtype(workload.kv_dtype, model, field="kv_dtype", source=str(workload.path)))


def rank_bytes_per_token(workload, model, tp: int, tp_field: str = "deployment.tp") -> int:
    """One rank's KV bytes a token at `tp`, under vLLM's rules for tp against the model's heads (split or
    replicated KV heads, MLA replicated); a tp they refuse names `tp_field` (and the file, unless it is --tp)."""
    from kvsim.size.sizing import kv_cache_spec

    try:
        return kv_cache_spec(model, kv_dtype=workload.kv_dtype, tp=tp).bytes_per_token
    except KvsimError as exc:
        if exc.field != "--tp":
            raise
        message = str(exc).removeprefix("--tp: ").replace(f"--tp {tp} ", f"tp {tp} ")
        raise KvsimError(message, source=None if tp_field == "--tp" else str(workload.path), field=tp_field) from None


def serve_defaults(configs, model, gpu_key: str, source: str) -> tuple:
    """Each allocator configuration with vllm serve's defaults for `model` on `gpu_key` where the file leaves
    them out (`AllocatorConfig.with_serve_defaults`); a mistake names the file and the allocator."""
    out = []
    for i, config in enumerate(configs):
        try:
            out.append(config.with_serve_defaults(model, gpu_key))
        except KvsimError as exc:
            raise KvsimError(str(exc).removeprefix(f"{exc.field}: "), source=source,
                             field=f"allocators[{i}].{exc.field}") from None
        first = next((j for j, c in enumerate(out[:-1]) if c.label == out[-1].label), None)
        if first is not None:
            raise KvsimError(f"is allocators[{first}] ({out[-1].label}) under vllm serve's defaults for {model.name} "
                             "(prefix caching on for a hybrid model): set prefix_caching on one of them",
                             source=source, field=f"allocators[{i}]")
    return tuple(out)


def _deployment(workload, options: ReplayOptions) -> tuple[int, int, str, str]:
    """(tp, ep, and the field each came from): --tp/--ep override the workload's `deployment`."""
    tp = options.tp if options.tp is not None else workload.deployment.tp
    ep = options.ep if options.ep is not None else workload.deployment.ep
    return tp, ep, "--tp" if options.tp is not None else "deployment.tp", "--ep" if options.ep is not None else "deployment.ep"


def _kernel_clock(model, gpu, timing: str, source: str, kv_dtype: str, tp: int = 1, ep: int = 1, ep_field: str = "deployment.ep"):
    """(the kernels-db clock or None, a note for the header): `kernels-db` fails with a one-line error naming
    what the database lacks; `auto` falls back to the roofline and says why. Expert parallelism (ep > 1) is
    the database's alone: the roofline has no model of it, so there it is an error."""
    ep_source = None if ep_field.startswith("--") else source  # --ep came from the command line, not the file
    if timing not in ("kernels-db", "auto"):
        if ep > 1:
            raise KvsimError(f"ep {ep} needs the kernels-db clock (--timing kernels-db): the roofline does not model "
                             "expert parallelism", source=ep_source, field=ep_field)
        return None, None
    from kvsim.clock.kernels_db import kernel_clock

    try:
        return kernel_clock(model, gpu, kv_dtype=kv_dtype, tp=tp, ep=ep), None
    except KvsimError as exc:
        if exc.field == "ep":
            raise KvsimError(str(exc).removeprefix("ep: "), source=ep_source, field=ep_field) from None
        if timing == "auto" and ep > 1:
            raise KvsimError(f"ep {ep} needs the kernels-db clock, which does not apply ({exc})", source=ep_source,
                             field=ep_field) from None
        if timing == "auto":
            return None, f"roofline clock: the kernels-db clock does not apply ({exc})"
        if exc.field in ("model", "hardware", "kv_dtype"):
            raise KvsimError(str(exc).removeprefix(f"{exc.field}: "), source=source, field=exc.field) from None
        raise


# A paged pool is one Python object per block (~112 B, and about a second per million to build): 2**24 blocks
# take ~1.9 GB of host memory. A GPU's pool is far smaller: 80 GiB of 1.75 MiB blocks is ~47,000.
MAX_NUM_BLOCKS = 2**24


def _check_num_blocks(workload, ctx: ReplayContext, source: str) -> None:
    """Refuse, before anything is built, a paged pool of more blocks than the host holds (a kv_budget of 64TiB)."""
    for config in workload.allocators:
        if config.kind != "paged":
            continue
        spec = ctx.spec(config.block_size, config)
        page, num_blocks = bytes_per_block(spec), num_gpu_blocks(spec, ctx.budget_bytes)
        if num_blocks > MAX_NUM_BLOCKS:
            raise KvsimError(
                f"{ctx.budget_bytes:,} B is {num_blocks:,} {config.label} blocks of {page:,} B, more than the replay "
                f"builds ({MAX_NUM_BLOCKS:,}: ~112 B of host memory each)",
                source=source, field="kv_budget" if workload.kv_budget_bytes is not None else "gpu_memory_utilization",
            )


def _check_paged(config, pool) -> None:
    """The paged engine's refusals of a model (`None` pool: one uniform group), raised as the engine raises them."""
    from kvsim.engine.paged.kv_cache_manager import check_retention_interval

    groups = pool.groups if pool is not None else ()  # a uniform pool has no sliding group of its own
    check_retention_interval(config.prefix_cache_retention_interval, groups)
    if pool is not None and all(g.kind == "state" for g in groups):
        raise KvsimError("it has no attention layer group, and the paged replay follows one (an attention-free "
                         "model has no block table to replay)", field="kind")


def _check_offload(workload, ctx: ReplayContext, options: ReplayOptions) -> None:
    """The CPU tier, refused before anything runs: beyond --max-host-memory with cache tensors (its host pool
    would be allocated), or on a model or allocator it cannot serve (one line naming the file and `offload`)."""
    from kvsim.engine.factory import make_allocator
    from kvsim.replay.loop import connector_settings
    from kvsim.replay.sched.offloading_connector import connector_for_replay

    cpu_bytes = workload.offload.cpu_bytes
    if options.tensors and cpu_bytes > options.max_host_bytes:
        raise KvsimError(f"the CPU tier's {cpu_bytes:,} B exceed the host memory a replay may take "
                         f"({options.max_host_bytes:,} B): raise --max-host-memory or replay with --no-tensors",
                         field="--max-host-memory")
    for config in workload.allocators:
        spec = ctx.spec(config.block_size, config)
        allocator = make_allocator(config, spec, ctx.budget_bytes, max_model_len=ctx.max_model_len)
        connector = connector_for_replay(ctx.offload, ctx.model, spec, allocator, ctx.max_model_len,
                                         connector_settings(ctx), ctx.tp, ctx.gpu, ctx.source)
        if options.tensors and any(g.kind == "state" for g in connector.groups):
            raise KvsimError(f"with cache tensors the CPU tier's host pool does not take {ctx.model.name}'s Mamba state "
                             "blocks (vLLM hands each committed state to the tier alone): give --no-tensors to replay "
                             "its tier (accounting only)", source=ctx.source, field="offload")
        if options.tensors and len(connector.groups) > 1 and ctx.scheduler_config.preemption == "swap":
            raise KvsimError(f"with cache tensors, preemption: swap moves {ctx.model.name}'s slot group only, and its "
                             "CPU tier moves every group's blocks: use preemption: recompute (vLLM's), or give "
                             "--no-tensors to replay its tier (accounting only)", source=ctx.source, field="scheduler.preemption")


def _check_host_memory(configs, ctx: ReplayContext, options: ReplayOptions) -> None:
    """Refuse, before anything runs, a CPU cache pool over `options.max_host_bytes` (--max-host-memory)."""
    from kvsim.engine.factory import make_allocator
    from kvsim.units import format_bytes

    for config in configs:
        spec = ctx.spec(config.block_size, config)
        num_slots = make_allocator(config, spec, ctx.budget_bytes, max_model_len=ctx.max_model_len).num_slots
        nbytes = 2 * options.num_layers * num_slots * spec.num_kv_heads * spec.head_dim * spec.dtype_bytes
        if nbytes > options.max_host_bytes:
            raise KvsimError(
                f"{config.label}'s CPU cache pool needs {format_bytes(nbytes)} of host memory ({num_slots:,} slots x "
                f"{options.num_layers} layer(s)), over the {format_bytes(options.max_host_bytes)} allowed; replay with "
                f"--no-tensors, or allow it with --max-host-memory {-(-nbytes // 2**30)}GiB",
                field="--max-host-memory",
            )


@contextmanager
def _workload_field(source: str, field: str):
    """Re-raise a KvsimError from a lookup (model, GPU) as one naming the workload file and `field`.

    A config.json's own errors keep its path in the message: `w.yaml: model: cfg/config.json: invalid JSON`.
    """
    try:
        yield
    except KvsimError as exc:
        message = str(exc)
        if exc.field and exc.field.startswith("--"):  # a flag's name means nothing in a workload file
            prefix = ": ".join(p for p in (exc.source, exc.field) if p) + ": "
            inner = message[len(prefix):] if message.startswith(prefix) else message
            message = f"{exc.source}: {inner}" if exc.source else inner
        raise KvsimError(message, source=source, field=field) from None
