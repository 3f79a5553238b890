"""The replay: one request stream through every allocator of a workload, on a simulated clock.

For each allocator config: a fresh allocator over the same KV budget, a `Scheduler`, optionally real cache
tensors (`KVCache`: every step writes, reads are sampled every `read_every` decode steps), and a loop that
jumps the clock over idle gaps and advances it by each step's time (the roofline, or this run's measured
kernel times). Records are compact arrays, one row per scheduled row.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import re
from contextlib import contextmanager
from array import array
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from kvsim.engine.factory import AllocatorConfig, make_allocator
from kvsim.engine.kv_cache_spec import KVCacheSpec
from kvsim.errors import KvsimError
from kvsim.roofline import Roofline
from kvsim.runner import ModelRunner
from kvsim.scheduler import SchedSeq, Scheduler, SchedulerOutput

# Step-record columns: (name, array typecode). Bytes and counts are integers, times floats. A row covers
# `num_steps` steps (a decode run): its token counts are totals, its bytes are at the run's middle step, its
# kernel times (µs, NaN when not measured) are per step, the mean of the run's steps.
STEP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("step", "q"),
    ("num_steps", "q"),
    ("time_s", "d"),
    ("step_time_s", "d"),
    ("num_running", "q"),
    ("num_waiting", "q"),
    ("num_prefill_tokens", "q"),
    ("num_decode_tokens", "q"),
    ("token_states_bytes", "q"),
    ("reservation_bytes", "q"),
    ("internal_fragmentation_bytes", "q"),
    ("external_fragmentation_bytes", "q"),
    ("free_bytes", "q"),
    ("shared_saved_bytes", "q"),
    ("num_preemptions", "q"),
    ("write_us", "d"),
    ("read_us", "d"),
    ("attention_us", "d"),
)
KERNEL_COLUMNS = ("write_us", "read_us", "attention_us")
TIMINGS = ("roofline", "measured")
PROGRESS_EVERY = 512  # rows between progress callbacks
# Default --read-every per device. On CUDA a read is cheap: every step. On a CPU a read of every decoding
# request's whole context moves 100+ MiB through host memory (tens of ms) while a step's write takes tens
# of µs: sampling one decode step in CPU_READ_EVERY keeps workloads/poisson.yaml with tensors near 20 s.
CUDA_READ_EVERY = 1
CPU_READ_EVERY = 4000


@dataclass(frozen=True)
class ReplayOptions:
    """How to run a replay (the CLI's flags). `num_layers` layers are materialised when `tensors` is on.

    `read_every`: read + attend on every N-th decode step (per allocator); every step writes. None picks
    the device's default (CUDA_READ_EVERY, CPU_READ_EVERY); measured timing needs every step (1).
    """

    device: str = "auto"
    tensors: bool = True
    timing: str = "roofline"
    num_layers: int = 1
    integrity: bool = False
    read_every: int | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):  # a typo is caught even with --no-tensors
            raise KvsimError(f"unknown device {self.device!r} (choose cpu, cuda, cuda:N or auto)", field="--device")
        if self.timing not in TIMINGS:
            raise KvsimError(f"unknown timing {self.timing!r} (choose roofline or measured)", field="--timing")
        if self.timing == "measured" and not self.tensors:
            raise KvsimError("measured timing needs the cache tensors (drop --no-tensors)", field="--timing")
        if self.integrity and not self.tensors:
            raise KvsimError("integrity checks need the cache tensors (drop --no-tensors)", field="--integrity")
        if self.num_layers < 1:
            raise KvsimError(f"must be >= 1, got {self.num_layers}", field="--layers")
        if self.read_every is not None and self.read_every < 1:
            raise KvsimError(f"must be >= 1, got {self.read_every}", field="--read-every")
        if self.timing == "measured" and self.read_every not in (None, 1):
            raise KvsimError("measured timing times every step's read (use --read-every 1)", field="--read-every")


@dataclass
class AllocatorRun:
    """Everything one allocator config produced: step columns, per-request arrays, prefix-cache counters."""

    config: AllocatorConfig
    label: str
    budget_bytes: int
    steps: dict[str, np.ndarray]  # STEP_COLUMNS, one row per scheduled row
    admitted_s: np.ndarray  # (num_requests,) float64, NaN when never admitted
    first_token_s: np.ndarray
    finished_s: np.ndarray
    num_preemptions: np.ndarray  # (num_requests,) int64
    num_cached_tokens: np.ndarray
    rejected_reason: list[str | None]
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_read_samples: int = 0  # decode steps that read + attended (kernel-time summaries cover only these)


@dataclass
class ReplayResult:
    """A whole replay: the workload, what it resolved to, and one `AllocatorRun` per allocator config."""

    workload: object  # kvsim.workload.Workload
    model_name: str
    hardware_name: str
    budget_bytes: int
    device: str
    options: ReplayOptions
    arrival_s: np.ndarray  # (num_requests,) float64
    num_prompt_tokens: np.ndarray  # (num_requests,) int64
    max_tokens: np.ndarray
    runs: list[AllocatorRun] = field(default_factory=list)
    note: str | None = None  # what the replay decided for the user (e.g. accounting only without CUDA)


@dataclass(frozen=True)
class ReplayContext:
    """What every allocator of a replay shares: the model's cache spec factory, budget, time model."""

    model: object  # kvsim.models.ModelSpec
    kv_dtype: str
    budget_bytes: int
    max_model_len: int
    roofline: Roofline
    scheduler_config: object  # kvsim.workload.SchedulerConfig
    seed: int

    def spec(self, block_size: int) -> KVCacheSpec:
        from kvsim.sizing import kv_cache_spec

        return kv_cache_spec(self.model, kv_dtype=self.kv_dtype, block_size=block_size)


ProgressFn = Callable[[str, int, int], None]  # (allocator label, requests done, total requests)


def run_replay(
    workload, options: ReplayOptions = ReplayOptions(), *, progress: ProgressFn | None = None, workers: int | None = None
) -> ReplayResult:
    """Replay `workload`'s request stream through each of its allocator configs; see the module docstring.

    `workers` > 1 runs allocator configs in parallel processes (default: one per CPU, except with CUDA
    tensors or measured timing, whose kernel times must not share the machine: 1); the result's simulated
    figures are the same either way.
    """
    from kvsim.catalogue import resolve_model
    from kvsim.hardware import get_gpu
    from kvsim.requests import generate_requests
    from kvsim.sizing import kv_budget_bytes, kv_cache_spec, weight_bytes

    source = str(workload.path)
    with _workload_field(source, "model"):  # the catalogue's errors name --model; here it is the file's field
        model = resolve_model(workload.model)
        weights = weight_bytes(model)
    with _workload_field(source, "hardware"):
        gpu = get_gpu(workload.hardware)
    if workload.kv_budget_bytes is not None:
        budget = workload.kv_budget_bytes
    else:
        utilization = workload.gpu_memory_utilization
        usable = int(gpu.memory_bytes * utilization)
        if usable <= weights:
            raise KvsimError(
                f"{gpu.name}: {gpu.memory_bytes:,} B x {utilization:g} = {usable:,} B leaves no room for KV cache "
                f"after {model.name}'s weights ({weights:,} B); raise it, or give kv_budget instead",
                source=source,
                field="gpu_memory_utilization",
            )
        budget = kv_budget_bytes(gpu.memory_bytes, utilization=utilization, weight_bytes=weights)
    bytes_per_token = kv_cache_spec(model, kv_dtype=workload.kv_dtype).bytes_per_token
    for config in workload.allocators:  # a budget below one block would build an allocator with no slots
        unit_bytes = bytes_per_token * (config.block_size if config.kind == "paged" else 1)
        if budget < unit_bytes:
            raise KvsimError(
                f"a KV budget of {budget:,} B holds not one {config.label} block ({unit_bytes:,} B of {model.name} KV)",
                source=source,
                field="kv_budget" if workload.kv_budget_bytes is not None else "gpu_memory_utilization",
            )
    roofline = Roofline.for_model(model, gpu, weight_bytes=weights, kv_bytes_per_token=bytes_per_token)
    requests = generate_requests(workload)
    if not requests:
        raise KvsimError("the workload has no requests", source=source, field="requests")
    device, note = "none", None
    num_attention_layers = len(model.attention_layers)
    if options.tensors and options.num_layers > num_attention_layers:  # more would be timed as more than the model
        raise KvsimError(f"{model.name} has {num_attention_layers} attention layers; materialise at most that many, "
                         f"got {options.num_layers}", field="--layers")
    if options.tensors:
        from kvsim.engine.device import resolve_device

        try:
            resolved = resolve_device(options.device)
        except KvsimError as exc:  # the engine names its argument `device`; the user typed --device
            raise KvsimError(str(exc).removeprefix(f"{exc.field}: "), field="--device") from None
        device = str(resolved)
        read_every = options.read_every
        if read_every is None:
            read_every = 1 if resolved.type == "cuda" or options.timing == "measured" else CPU_READ_EVERY
        if options.device == "auto" and resolved.type == "cpu":
            note = f"no CUDA device: cache tensors on the CPU, reads sampled every {read_every} decode steps"
            # CPU tensors are the default since every step's write is one cheap scatter and the reads, which
            # move 100+ MiB each on a CPU, are sampled: workloads/poisson.yaml takes ~18 s instead of hours.
        options = replace(options, device=device, read_every=read_every)
    ctx = ReplayContext(model, workload.kv_dtype, budget, workload.max_model_len, roofline, workload.scheduler, workload.seed)
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
    )
    configs = list(workload.allocators)
    if workers is None:
        alone = options.tensors and (device.startswith("cuda") or options.timing == "measured")
        workers = 1 if alone else min(len(configs), os.cpu_count() or 1)
    if workers > 1 and len(configs) > 1 and "fork" in multiprocessing.get_all_start_methods():
        from kvsim.replay_workers import replay_in_processes

        result.runs = replay_in_processes(configs, requests, ctx, options, progress, workers)
    else:
        result.runs = [replay_allocator(config, requests, ctx, options, progress=progress) for config in configs]
    return result


def replay_allocator(config: AllocatorConfig, requests: list, ctx: ReplayContext, options: ReplayOptions, *, progress: ProgressFn | None = None) -> AllocatorRun:
    """Run one allocator config over `requests` (RequestSpec list, sorted by arrival) and record it."""
    from kvsim.requests import make_token_ids

    spec = ctx.spec(config.block_size)
    allocator = make_allocator(config, spec, ctx.budget_bytes, max_model_len=ctx.max_model_len)
    cache = None
    if options.tensors:
        from kvsim.engine.cache import KVCache

        try:
            cache = KVCache(
                spec,
                allocator.num_slots,
                device=options.device,
                num_layers=options.num_layers,
                integrity=options.integrity,
                num_q_heads=ctx.model.num_attention_heads,
                seed=ctx.seed,
            )
        except KvsimError as exc:  # the cache names its argument num_layers; the user typed --layers
            if exc.field != "num_layers":
                raise
            raise KvsimError(str(exc).removeprefix("num_layers: "), field="--layers") from None
    runner = ModelRunner(cache, allocator, read_every=options.read_every or 1) if cache is not None else None
    needs_ids = config.prefix_caching or options.integrity

    def token_ids(seq: SchedSeq) -> np.ndarray:
        ids = make_token_ids(requests[seq.index], ctx.seed)  # (num_final_tokens,)
        if cache is not None:
            cache.register(seq.seq_id, ids)
        return ids

    sc = ctx.scheduler_config
    sched = Scheduler(
        allocator,
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_model_len=ctx.max_model_len,
        preemption=sc.preemption,
        swap_space_bytes=sc.swap_space_bytes,
        cache=cache,
        roofline=ctx.roofline,
        allow_runs=options.timing == "roofline",
        make_token_ids=token_ids if needs_ids else None,
    )
    n = len(requests)
    admitted = np.full(n, np.nan)
    first_token = np.full(n, np.nan)
    finished_s = np.full(n, np.nan)
    preemptions = np.zeros(n, dtype=np.int64)
    cached_tokens = np.zeros(n, dtype=np.int64)
    rejected: list[str | None] = [None] * n
    rows = array("d")  # every step-record column, row after row (bytes are exact in a double up to 8 PiB)
    timer_steps = array("q")  # per row: first and last timer step its kernels ran in
    first_timer_step = 0
    roofline = ctx.roofline
    measured = options.timing == "measured"
    scale = len(ctx.model.attention_layers) / options.num_layers  # measured layers -> the whole model
    arrivals = [r.arrival_time for r in requests]
    now, step, i, done, num_rows = 0.0, 0, 0, 0, 0
    pending_preemptions = pending_swap_bytes = empty_rounds = 0  # carried over rows that computed nothing
    nan = math.nan
    while True:
        while i < n and arrivals[i] <= now:
            r = requests[i]
            seq = SchedSeq(r.request_id, r.num_prompt_tokens, r.max_tokens, arrival_time=r.arrival_time, index=i)
            reason = sched.add_request(seq)
            if reason is not None:
                rejected[i] = reason
                done += 1
            i += 1
        if not sched.has_work:
            if i >= n:
                break
            now = arrivals[i]  # the clock jumps over the idle gap
            continue
        if cache is not None:
            cache.timer.new_step()
            first_timer_step = cache.timer.num_steps - 1
        out, rejects = sched.schedule(arrivals[i] - now if i < n else math.inf)
        for seq, reason in rejects:
            rejected[seq.index] = reason
            done += 1
        for seq in out.admitted:
            if admitted[seq.index] != admitted[seq.index]:  # NaN: first admission
                admitted[seq.index] = now
        pending_preemptions += len(out.preempted)
        pending_swap_bytes += out.swap_bytes
        if not out.prefills and not out.decodes:
            # Only preemptions or swap-ins: nothing computed; the next schedule runs what they made room for.
            empty_rounds += 1
            assert empty_rounds < 3, "the scheduler made no progress"
            continue
        empty_rounds = 0
        if runner is not None:
            runner.execute(out)
        if out.run_time_s is not None:
            dt = out.run_time_s + pending_swap_bytes / roofline.host_bandwidth_bytes_per_s
        else:
            dt = _step_time(roofline, out, pending_swap_bytes)
        pending_swap_bytes = 0
        kernels = (nan, nan, nan)
        if cache is not None:
            if measured:
                times = cache.timer.step_times()
                dt = sum(times.values()) * 1e-6 * scale
                kernels = (times.get("write", nan), times.get("read", nan), times.get("attention", nan))
            else:
                timer_steps.append(first_timer_step)
                timer_steps.append(cache.timer.num_steps - 1)
        b = out.breakdown
        rows.extend(
            (
                step,
                out.num_steps,
                now,
                dt,
                len(sched.running),
                len(sched.waiting) + len(sched.swapped),
                out.num_prefill_tokens,
                out.num_decode_tokens,
                b.token_states_bytes,
                b.reservation_bytes,
                b.internal_fragmentation_bytes,
                b.external_fragmentation_bytes,
                b.free_bytes,
                b.shared_saved_bytes,
                pending_preemptions,
                *kernels,
            )
        )
        pending_preemptions = 0
        step += out.num_steps
        for seq, start, num in out.prefills:  # the prompt's last chunk yields the first token
            if start + num >= seq.num_prompt_tokens and first_token[seq.index] != first_token[seq.index]:
                first_token[seq.index] = now + dt
        for seq in sched.postprocess(out):
            finished_s[seq.index] = now + dt
            preemptions[seq.index] = seq.num_preemptions
            cached_tokens[seq.index] = seq.num_cached_tokens
            done += 1
            if cache is not None:
                cache.forget(seq.seq_id)
        now += dt
        num_rows += 1
        if progress is not None and num_rows % PROGRESS_EVERY == 0:
            progress(config.label, done, n)
    if progress is not None:
        progress(config.label, done, n)

    table = np.frombuffer(rows, dtype=np.float64).reshape(num_rows, len(STEP_COLUMNS))  # (rows, columns)
    steps = {
        name: table[:, j].astype(np.int64) if code == "q" else table[:, j].copy()
        for j, (name, code) in enumerate(STEP_COLUMNS)
    }
    if cache is not None and not measured and len(timer_steps):
        all_times = cache.timer.all_steps()  # one host sync, after the loop
        spans = np.frombuffer(timer_steps, dtype=np.int64).reshape(-1, 2)  # (rows, [first, last] timer step)
        for name in KERNEL_COLUMNS:
            kind = name[: -len("_us")]
            steps[name] = np.array([_mean_step(all_times, kind, a, b) for a, b in spans.tolist()], dtype=np.float64)
    return AllocatorRun(
        config=config,
        label=config.label,
        budget_bytes=ctx.budget_bytes,
        steps=steps,
        admitted_s=admitted,
        first_token_s=first_token,
        finished_s=finished_s,
        num_preemptions=preemptions,
        num_cached_tokens=cached_tokens,
        rejected_reason=rejected,
        prefix_query_tokens=getattr(allocator, "prefix_query_tokens", 0),
        prefix_hit_tokens=getattr(allocator, "prefix_hit_tokens", 0),
        num_read_samples=runner.num_read_samples if runner is not None else 0,
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


def _mean_step(all_times: list[dict[str, float]], kind: str, first: int, last: int) -> float:
    """Mean microseconds of `kind` per step over timer steps [first, last]; NaN if never measured there."""
    values = [all_times[t][kind] for t in range(first, last + 1) if kind in all_times[t]]
    return sum(values) / len(values) if values else math.nan


def _step_time(roofline: Roofline, out: SchedulerOutput, swap_bytes: int) -> float:
    """Roofline seconds of one step: its tokens, the context they attend to, and the KV it reads."""
    attended = 0
    read = 0
    for _, start, num in out.prefills:  # a causal chunk: its token j attends to start + j + 1 positions
        attended += num * start + num * (num + 1) // 2
        read += start + num
    ctx = sum(seq.num_computed_tokens for seq in out.decodes) + len(out.decodes)  # each decode token's context
    attended += ctx
    read += ctx
    tokens = out.num_prefill_tokens + len(out.decodes)
    return roofline.step_time(tokens, attended, read, swap_bytes)
