"""One allocator config's replay: the step loop that drives scheduler, allocator and model runner over a
simulated clock (the roofline, or this run's measured kernel times), recording every scheduled row."""

from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import Callable, Generator

import numpy as np

from kvsim.engine.factory import AllocatorConfig, make_allocator
from kvsim.errors import KvsimError
from kvsim.replay.options import ProgressFn, ReplayContext, ReplayOptions
from kvsim.replay.records import AllocatorRun, fill_kernel_columns, offload_record, step_columns
from kvsim.clock.roofline import Roofline
from kvsim.replay.runner import ModelRunner
from kvsim.replay.sched.scheduler import Scheduler
from kvsim.replay.sched.output import SchedSeq, SchedulerOutput

PROGRESS_EVERY = 512  # rows between progress callbacks
_computed_tokens = attrgetter("num_computed_tokens")
# (step, now, dt, scheduler output, requests it finished, scheduler, preemptions) after each row's postprocess
StepObserver = Callable[[int, float, float, SchedulerOutput, list, Scheduler, int], None]


@dataclass
class Arrivals:
    """The requests one engine is given, as indices into the request list, in arrival order.

    One engine's replay hands it every request up front (`closed`). A fleet's router appends each request as it
    routes it and closes the queue after the last: until then the loop yields before each row (see
    `engine_rows`); `next_unrouted_s` is when the next request not yet routed arrives anywhere (no decode run
    covers it), and the loop shows its `scheduler` here for the router to read.
    """

    queue: deque = field(default_factory=deque)
    closed: bool = True
    next_unrouted_s: float = math.inf
    scheduler: Scheduler | None = None


def replay_allocator(config: AllocatorConfig, requests: list, ctx: ReplayContext, options: ReplayOptions, *, progress: ProgressFn | None = None, observer: StepObserver | None = None, on_schedule: Callable[[SchedulerOutput, Scheduler], None] | None = None) -> AllocatorRun:
    """Run one allocator config over `requests` (RequestSpec list, sorted by arrival) and record it."""
    rows = engine_rows(config, requests, ctx, options, Arrivals(deque(range(len(requests)))), progress=progress, observer=observer, on_schedule=on_schedule)
    try:
        while True:
            next(rows)  # a closed queue never yields
    except StopIteration as stop:
        return stop.value


def engine_rows(config: AllocatorConfig, requests: list, ctx: ReplayContext, options: ReplayOptions, arrivals_in: Arrivals, *, progress: ProgressFn | None = None, observer: StepObserver | None = None, on_schedule: Callable[[SchedulerOutput, Scheduler], None] | None = None) -> Generator[float, None, AllocatorRun]:
    """Run one allocator config over the requests of `arrivals_in` (indices into `requests`, a RequestSpec list
    sorted by arrival) and record it; per-request arrays cover all of `requests` (NaN where not given here).

    While `arrivals_in` is open, yields before each row the time it will be scheduled at (`math.inf` while idle
    with nothing routed here): resume it once every request arriving up to then is routed. Closed, it runs to
    the end without yielding and returns the `AllocatorRun`.

    A fresh allocator over the same KV budget, a `Scheduler`, optionally real cache tensors (`KVCache`: every
    step writes, reads are sampled every `read_every` decode steps), and a loop that jumps the clock over idle
    gaps and advances it by each step's time (the roofline, or this run's measured kernel times). Records are
    compact arrays, one row per scheduled row.

    `observer(step, now, dt, out, finished, sched, preemptions)`, when given, sees every row after its
    postprocess (the conformance harness's view): `finished` are the requests that postprocess finished (with
    async scheduling, by the output of the row before); `preemptions` include those of rounds that computed
    nothing before it. With async scheduling it also sees the flush of the last row's output (`out` None).
    Decode runs are off with an observer, so every row is one step. `on_schedule(out, sched)` sees each row
    that computes, right after it is scheduled (the block tables as the row runs them).
    """
    from kvsim.workload.requests import make_block_key_runs, make_token_ids, num_shareable_tokens

    spec = ctx.spec(config.block_size, config)
    allocator = make_allocator(config, spec, ctx.budget_bytes, max_model_len=ctx.max_model_len)
    cache = None
    if options.tensors:
        from kvsim.engine.tensors.cache import KVCache

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
    runner = None
    if cache is not None:
        # a CPU tier with cache tensors moves every group's blocks: a mixed model's runner writes them all (a model
        # with state groups is refused before the replay: kvsim.replay.run._check_offload)
        all_groups = (ctx.offload is not None and cache.enabled and config.kind == "paged" and spec.pool is not None
                      and all(g.kind != "state" for g in spec.pool.groups))
        runner = ModelRunner(cache, allocator, read_every=options.read_every or 1, estimate_reads=options.timing == "measured",
                             all_groups=all_groups)
    connector = None
    if ctx.offload is not None:  # the CPU tier: vLLM's OffloadingConnector scheduler side on this clock
        from kvsim.replay.sched.offloading_connector import connector_for_replay

        connector = connector_for_replay(ctx.offload, ctx.model, spec, allocator, ctx.max_model_len, connector_settings(ctx),
                                         ctx.tp, ctx.gpu, ctx.source)
        if cache is not None and cache.enabled:  # the blocks really move to a host pool and back
            from kvsim.engine.tensors.host_pool import HostKVPool

            assert all(g.tokens_per_block == cache.block_size for g in connector.groups)
            connector.host_pool = HostKVPool(cache, connector.manager.num_chunks, connector.tokens_per_chunk)
        if observer is not None:  # the conformance harness reads the tier's events at every computing row
            connector.events = []
            connector.finished_in_set_order = True
    # prefix caching keys blocks by the requests' structure (`make_block_keys`): no token ids for it
    keyed = config.prefix_caching
    shareable = num_shareable_tokens(requests) if keyed else None  # what the allocator may cache lazily
    needs_ids = options.integrity or connector is not None

    def token_ids(seq: SchedSeq) -> np.ndarray:
        ids = make_token_ids(requests[seq.index], ctx.seed)  # (prompt + max_tokens,)
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
        reserve_full_isl=sc.scheduler_reserve_full_isl,
        async_scheduling=sc.async_scheduling,
        cache=cache,
        roofline=ctx.clock or ctx.roofline,
        allow_runs=options.timing != "measured" and observer is None and connector is None,  # connector: step by step
        make_token_ids=token_ids if needs_ids else None,
        connector=connector,
    )
    arrivals_in.scheduler = sched
    queue = arrivals_in.queue
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
    now, step, done, num_rows = 0.0, 0, 0, 0
    pending_preemptions = pending_swap_bytes = empty_rounds = 0  # carried over rows that computed nothing
    in_flight_start = in_flight_end = 0.0  # async scheduling: when the row whose output is in flight ran
    nan = math.nan
    offload_rows = array("d")  # connector: per row (CPU hit tokens started, bytes loaded, bytes stored, GPU hit tokens, loading)

    def finish(seqs, t: float) -> None:
        nonlocal done
        for seq in seqs:
            finished_s[seq.index] = t
            preemptions[seq.index] = seq.num_preemptions
            cached_tokens[seq.index] = seq.num_cached_tokens
            done += 1
            if cache is not None:
                cache.forget(seq.seq_id)
    while True:
        # Async: the scheduler runs while the row in flight executes, having seen the rows before it only.
        sched_now = in_flight_start if sched.has_in_flight else now
        if not arrivals_in.closed:  # a fleet: wait until the router has handed out every arrival up to sched_now
            yield sched_now if sched.has_work else (arrivals[queue[0]] if queue else math.inf)
        while queue and arrivals[queue[0]] <= sched_now:
            i = queue.popleft()
            r = requests[i]
            seq = SchedSeq(r.request_id, r.num_prompt_tokens, r.max_tokens, arrival_time=r.arrival_time, index=i)
            if keyed:
                seq.block_keys = partial(make_block_key_runs, r)
                seq.num_shareable_tokens = shareable[i]
            reason = sched.add_request(seq)
            if reason is not None:
                rejected[i] = reason
                done += 1
        if not sched.has_work:
            if not queue:
                if arrivals_in.closed:
                    break
                continue  # a fleet's idle engine: the next pass waits for the router
            now = arrivals[queue[0]]  # the clock jumps over the idle gap
            continue
        if cache is not None:
            cache.timer.new_step()
            first_timer_step = cache.timer.num_steps - 1
        if connector is not None:  # connector: loads it starts and their waits are timed from here
            connector.now = sched_now
        next_arrival = min(arrivals[queue[0]] if queue else math.inf, arrivals_in.next_unrouted_s)
        out, rejects = sched.schedule(next_arrival - now)
        idle_output_s = None  # connector, async: when an idle step ended whose output is still to be processed
        for seq, reason in rejects:
            rejected[seq.index] = reason
            done += 1
        for seq in out.admitted:
            if admitted[seq.index] != admitted[seq.index]:  # NaN: first admission
                admitted[seq.index] = now
                cached_tokens[seq.index] = seq.num_cached_tokens
        pending_preemptions += len(out.preempted)
        pending_swap_bytes += out.swap_bytes
        if not out.prefills and not out.decodes:
            if sched.has_in_flight:  # async: nothing to overlap with the step in flight: its output comes back
                if connector is not None:  # connector: this empty step's jobs start when the row in flight ends,
                    connector.submit(now, 0.0)  # whose output reports the transfers finished by then
                    connector.complete_until(now)
                flushed = sched.flush()
                if observer is not None:
                    observer(step, now, 0.0, None, flushed, sched, 0)
                finish(flushed, in_flight_end)
                empty_rounds = 0
                continue
            if connector is not None and connector.has_jobs():  # connector: idle until a transfer (or arrival) ends
                connector.submit(now, 0.0)
                idle_until = max(now, min(connector.next_finish_s(), next_arrival))
                if not sc.async_scheduling:
                    now = idle_until
                    connector.complete_until(now)
                    empty_rounds = 0
                    continue
                # Async: vLLM's batch queue schedules once more, on what it knew, while the idle step runs; then
                # the idle step's output reports the transfers finished by its end. The next step runs after it.
                out, rejects = sched.schedule(next_arrival - now)
                for seq, reason in rejects:
                    rejected[seq.index] = reason
                    done += 1
                for seq in out.admitted:
                    if admitted[seq.index] != admitted[seq.index]:
                        admitted[seq.index] = idle_until
                        cached_tokens[seq.index] = seq.num_cached_tokens
                pending_preemptions += len(out.preempted)
                pending_swap_bytes += out.swap_bytes
                now = idle_until
                empty_rounds = 0
                if not out.prefills and not out.decodes:
                    connector.complete_until(now)
                    connector.submit(now, 0.0)  # its jobs start when the idle step ends
                    continue
                idle_output_s = now  # the idle step's output is processed once this one is scheduled
            else:
                # Only preemptions or swap-ins: nothing computed; the next schedule runs what they made room for.
                empty_rounds += 1
                assert empty_rounds < 3, "the scheduler made no progress"
                continue
        empty_rounds = 0
        if on_schedule is not None:
            on_schedule(out, sched)
        if idle_output_s is not None:
            connector.complete_until(idle_output_s)
            idle_output_s = None
        if runner is not None:
            if connector is not None and connector.host_pool is not None:
                connector.copy_before_forward()  # loads within the step land before the step computes
            runner.execute(out)
        last_step_start = 0.0  # async: from the row's start to its last step's (that step is in flight next)
        if out.run_time_s is not None:
            swap_s = pending_swap_bytes / roofline.host_bandwidth_bytes_per_s
            dt = out.run_time_s + swap_s
            if out.num_steps > 1:
                last_step_start = swap_s + out.last_step_start_s
        else:
            dt = _step_time(roofline, out, pending_swap_bytes) if ctx.clock is None else ctx.clock.output_time(out, pending_swap_bytes)
        pending_swap_bytes = 0
        if connector is not None:  # connector: this row's transfers go on the host link; flushed stores delay it
            dt += connector.submit(now, dt)
            cpu_hit, loaded, stored, load_gpu_hit = connector.take_row()
            gpu_hit = load_gpu_hit + sum(start for seq, start, _ in out.prefills if seq in out.admitted)
            offload_rows.extend((cpu_hit, loaded, stored, gpu_hit, len(sched.loading)))
        kernels = (nan, nan, nan)
        if cache is not None:
            if measured:
                # The clock needs this step's own kernel time before the next step is scheduled: on CUDA this
                # waits for the step's last event, the one host sync per step that measured timing costs by
                # design. The roofline clock never waits; its kernel columns are resolved after the loop.
                times = {**runner.estimate, **cache.timer.step_times()}  # reads scaled from the last sample, if none
                dt = sum(times.values()) * 1e-6 * scale
                kernels = (times.get("write", nan), times.get("read", nan), times.get("attention", nan))
            else:
                timer_steps.append(first_timer_step)
                timer_steps.append(cache.timer.num_steps - 1)
        b = out.breakdown
        prefills, num_steps = out.prefills, out.num_steps
        rows.extend(
            (
                step,
                num_steps,
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
                b.padding_bytes,
                pending_preemptions,
                *kernels,
            )
        )
        row_preemptions, pending_preemptions = pending_preemptions, 0
        step += num_steps
        for seq, start, num in prefills:  # the prompt's last chunk yields the first token
            if start + num >= seq.num_prompt_tokens and first_token[seq.index] != first_token[seq.index]:
                first_token[seq.index] = now + dt
        # synchronous: this row's samples; async: those of the row before, in flight while this one was scheduled
        finished = sched.postprocess(out)
        if connector is not None:  # connector: the worker reports the transfers finished by the end of the step
            # whose output this is (async: the row in flight before this one)
            connector.complete_until(in_flight_end if sc.async_scheduling else now + dt)
        if observer is not None:
            observer(step - num_steps, now, dt, out, finished, sched, row_preemptions)
        if finished:
            finish(finished, in_flight_end if sc.async_scheduling else now + dt)
        in_flight_start, in_flight_end = now + last_step_start, now + dt
        now += dt
        num_rows += 1
        if progress is not None and num_rows % PROGRESS_EVERY == 0:
            progress(config.label, done, n)
    if progress is not None:
        progress(config.label, done, n)

    steps = step_columns(rows, num_rows)
    if cache is not None and not measured and len(timer_steps):
        fill_kernel_columns(steps, cache.timer, timer_steps)  # one host sync, after the loop
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
        prefix_query_tokens=allocator.prefix_query_tokens,
        prefix_hit_tokens=allocator.prefix_hit_tokens,
        num_read_samples=runner.num_read_samples if runner is not None else 0,
        offload=None if connector is None else offload_record(connector, offload_rows, num_rows),
    )


def connector_settings(ctx: ReplayContext):
    """vLLM's settings the CPU tier's sizing reads (the scheduler's token budget, async scheduling)."""
    from kvsim.size.vllm import VllmSettings

    sc = ctx.scheduler_config
    return VllmSettings(max_num_batched_tokens=sc.max_num_batched_tokens, async_scheduling=sc.async_scheduling)


def _step_time(roofline: Roofline, out: SchedulerOutput, swap_bytes: int) -> float:
    """Roofline seconds of one step: its tokens, the context they attend to, and the KV it reads."""
    tokens = attended = read = 0
    for _, start, num in out.prefills:  # a causal chunk: its token j attends to start + j + 1 positions
        tokens += num
        attended += num * start + num * (num + 1) // 2
        read += start + num
    decodes = out.decodes
    ctx = sum(map(_computed_tokens, decodes)) + len(decodes)  # each decode token's context
    return roofline.step_time(tokens + len(decodes), attended + ctx, read + ctx, swap_bytes)
