"""Run one resolved stream on each side and record it as a `Trace`: kvsim's replay loop (accounting only, one
paged allocator, one row per step) and vLLM's scheduler in the engine core's loop, on the same clock."""

from __future__ import annotations

from typing import Callable

from kvsim.conformance.stream import ResolvedStream
from kvsim.conformance.trace import StepRecord, Trace, encode_schedule, encode_transfers, tail_blocks


PROGRESS_EVERY = 1024  # steps between progress calls


def run_kvsim(rs: ResolvedStream, progress: Callable[[str], None] | None = None) -> Trace:
    """kvsim's `replay_allocator` over the stream, observed step by step; `progress(text)` every 1,024 steps."""
    from kvsim.replay.loop import replay_allocator
    from kvsim.replay.options import ReplayOptions

    trace = Trace("kvsim")
    lag = 1 if rs.workload.scheduler.async_scheduling else 0  # outputs come a row late
    block_size = rs.config.block_size
    schedules: list[tuple[bytes, bytes]] = []  # each computing row's schedule and the CPU tier's events up to it,
    # recorded as it is scheduled, until observed
    admissions: list[set[int]] = []  # each computing row's admitted requests (ids), until observed
    was_running: set[int] = set()  # the running queue after the last computing row was scheduled

    def scheduled(out, sched):
        # the allocator's block tables (uniform: one group; mixed: vLLM's groups), read at their tail only
        allocator = sched.allocator
        # admitted as vLLM's scheduler admits from its waiting queue: new or resumed requests, and requests whose
        # CPU-tier load finished (kvsim admits those when their load starts; vLLM schedules them from waiting)
        admitted = {id(seq) for seq in out.admitted} | {id(seq) for seq, _, _ in out.prefills if id(seq) not in was_running}
        was_running.clear()
        was_running.update(id(seq) for seq in sched.running)
        admissions.append(admitted)
        entries = []
        for seq, num in [(seq, num) for seq, _, num in out.prefills] + [(seq, 1) for seq in out.decodes]:
            k = tail_blocks(num, block_size, id(seq) in admitted)
            tables = [t if k is None else t[-k:] for t in allocator.block_tables(seq)]
            entries.append((seq.index, num, tables))
        connector = sched.connector
        transfers = b""
        if connector is not None:  # the CPU tier's events since the last computing row
            transfers = encode_transfers(connector.events)
            connector.events.clear()
        schedules.append((encode_schedule(entries), transfers))

    def observe(step, now, dt, out, finished, sched, preemptions):
        trace.num_gpu_blocks = sched.allocator.num_blocks
        for seq in finished:  # finished by the output of row `step - lag`
            trace.finished[seq.index] = step - lag
        if out is None:  # async: the last row's output, flushed
            return
        admitted = admissions.pop(0)
        hits = 0
        for seq, start, num in out.prefills:
            if id(seq) in admitted:
                hits += start
                trace.first_scheduled.setdefault(seq.index, step)
            if start + num >= seq.num_prompt_tokens:
                trace.first_token.setdefault(seq.index, step)
        for seq in out.decodes:
            trace.first_token.setdefault(seq.index, step)
        # postprocess removed the finished ones from the running queue; they were running when scheduled, unless
        # preempted while building this row (async: a stale output then finishes a request that waits)
        preempted = {id(seq) for seq in out.preempted}
        running = len(sched.running) + sum(1 for seq in finished if id(seq) not in preempted)
        trace.steps.append(StepRecord(now, running, out.num_prefill_tokens, out.num_decode_tokens, preemptions, hits,
                                      *schedules.pop(0)))
        if progress is not None and len(trace.steps) % PROGRESS_EVERY == 0:
            progress(f"kvsim's replay, step {len(trace.steps):,}")

    run = replay_allocator(rs.config, rs.requests, rs.ctx, ReplayOptions(tensors=False), observer=observe, on_schedule=scheduled)
    trace.rejected = {i for i, reason in enumerate(run.rejected_reason) if reason is not None}
    return trace


def run_vllm(rs: ResolvedStream, progress: Callable[[str], None] | None = None) -> Trace:
    """vLLM's own scheduler over the stream; every batch takes the time kvsim's replay gives that batch."""
    from kvsim.conformance.vllm_engine import VllmEngine
    from kvsim.replay.loop import _step_time
    from kvsim.workload.requests import make_token_ids

    roofline = rs.ctx.roofline
    seed = rs.workload.seed

    def token_ids(i: int):
        return make_token_ids(rs.requests[i], seed)

    def step_time(chunks: list[tuple[int, int]]) -> float:
        # Every scheduled request as a chunk (start, num): a decode is the chunk (computed, 1), which the
        # roofline prices exactly as kvsim's decode term does.
        return _step_time(roofline, _Batch([(None, start, num) for start, num in chunks]), 0)

    return VllmEngine(rs.setup, rs.requests, token_ids, step_time, progress=progress).run()


class _Batch:
    """The fields of kvsim's `SchedulerOutput` that the roofline step time reads."""

    def __init__(self, prefills):
        self.prefills = prefills
        self.decodes = []
        self.num_prefill_tokens = sum(num for _, _, num in prefills)
