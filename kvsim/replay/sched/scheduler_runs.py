"""Decode runs: one scheduled row covering several identical decode steps, equal to stepping them one by one
(a mixin of `kvsim.replay.scheduler.Scheduler`: the state is the scheduler's)."""

from __future__ import annotations

from kvsim.replay.sched.output import SchedulerOutput

# Longest run of identical decode steps one `schedule()` may cover (one row of the step records).
MAX_DECODE_RUN = 256


class DecodeRuns:
    """Scheduler's decode runs: sized so that nothing could change before the run's last step."""

    def _extend_decode_run(self, out: SchedulerOutput, time_to_next_arrival: float, waiting_head) -> None:
        """Cover k identical decode steps in this row when nothing can change before the k-th.

        Every running request decodes in every step of the run and nothing is admitted during it: either
        nothing waits and the next arrival is after the run's last step starts, or the queue head just failed
        to fit (or found no budget or seat) and memory only shrinks while requests grow.
        Requests finish no earlier than the run's end. A paged allocator must have the free blocks for every
        request's growth up front, so no decode step inside the run could fail (no preemption is skipped).
        """
        decodes = out.decodes
        n = len(decodes)
        k = min(MAX_DECODE_RUN, min([seq.max_tokens - seq.num_output_tokens for seq in decodes]))
        k = min(k, self.allocator.max_decode_run(n))
        if k < 2:
            return
        ctx_sum = sum(seq.num_computed_tokens for seq in decodes)
        if waiting_head is None:
            k, run_time = self.roofline.decode_steps_before(n, ctx_sum, k, time_to_next_arrival)
            if k < 2:
                return
        else:
            run_time = self.roofline.decode_run(n, ctx_sum, k)
        out.num_steps = k
        out.run_time_s = run_time
        # Room for the middle step, the memory breakdown there, then room for the whole run.
        mid = (k - 1) // 2
        alloc = self.allocator
        for seq in decodes:
            ok = alloc.append_slots(seq, mid + 1)
            assert ok, seq
            seq.num_computed_tokens += mid
        out.breakdown = alloc.breakdown(waiting_head)
        for seq in decodes:
            ok = alloc.append_slots(seq, k - mid)
            assert ok, seq
            seq.num_computed_tokens -= mid

