"""After a step has run: computed tokens advance, sampled tokens are processed and finished requests freed, as
vLLM's `_update_after_schedule` and `update_from_output` (a mixin of `kvsim.replay.scheduler.Scheduler`: the
state is the scheduler's)."""

from __future__ import annotations

from kvsim.replay.sched.output import SchedSeq, SchedulerOutput


class OutputUpdate:
    """Scheduler's `postprocess` and `flush`, one step in flight under async scheduling."""

    def postprocess(self, out: SchedulerOutput) -> list[SchedSeq]:
        """After `out` has run: advance computed tokens by what it computed, then process sampled tokens (vLLM's
        `update_from_output`) and free and return the requests that finished (`check_stop`).

        Synchronous: `out`'s own samples. Async scheduling: those of the step before it, which was in flight
        while `out` was scheduled; `out` stays in flight until the next `postprocess` or `flush`.
        """
        self._advance(out)
        if not self.async_scheduling:
            return self._update_from_output(out)
        previous, self._in_flight = self._in_flight, out
        return self._update_from_output(previous) if previous is not None else []

    def flush(self) -> list[SchedSeq]:
        """Async scheduling: process the step in flight (nothing else was scheduled to overlap it)."""
        previous, self._in_flight = self._in_flight, None
        return self._update_from_output(previous) if previous is not None else []

    def _advance(self, out: SchedulerOutput) -> None:
        """What vLLM's `_update_after_schedule` does: computed tokens advance; a request whose tokens are all
        computed samples one (async: an output placeholder until its output is processed)."""
        sampled = out.sampled
        for seq, _, n in out.prefills:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens >= seq.num_tokens + seq.num_output_placeholders:
                sampled.append(seq)
        k = out.num_steps
        for seq in out.decodes:
            seq.num_computed_tokens += k
        sampled += out.decodes
        if self.async_scheduling:
            for seq in sampled:
                seq.num_output_placeholders += 1
            for seq, _, n in out.prefills:
                seq.num_in_flight_tokens += n
            for seq in out.decodes:
                seq.num_in_flight_tokens += k

    def _update_from_output(self, out: SchedulerOutput) -> list[SchedSeq]:
        """Append `out`'s sampled tokens and finish requests that reached `max_tokens`. A request preempted while
        `out` was in flight (async) still gets its token (vLLM delivers stale output) and may finish waiting."""
        stale = set()
        if self.async_scheduling:
            for seq, _, n in out.prefills:  # settled now, preempted or not (vLLM's update_from_output)
                seq.num_in_flight_tokens -= n
            for seq in out.decodes:
                seq.num_in_flight_tokens -= out.num_steps
            for seq in [chunk[0] for chunk in out.prefills] + out.decodes:
                if seq.stale_output:
                    seq.stale_output = False
                    stale.add(seq.seq_id)
        finished: list[SchedSeq] = []
        num_prefill_samples = len(out.sampled) - len(out.decodes)
        k = out.num_steps
        cache_blocks = self.allocator.cache_blocks if self.async_scheduling else None
        in_flight: dict[int, int] = {}  # tokens each request has in the newer step, still in flight
        if cache_blocks is not None and self._in_flight is not None:
            for seq in self._in_flight.decodes:
                in_flight[seq.seq_id] = 1
            for seq, _, n in self._in_flight.prefills:
                in_flight[seq.seq_id] = in_flight.get(seq.seq_id, 0) + n
        for j, seq in enumerate(out.sampled):
            count = 1 if j < num_prefill_samples else k
            seq.num_output_tokens += count
            if self.async_scheduling:
                seq.num_known_tokens = seq.num_tokens
            if seq.num_output_placeholders and seq.seq_id not in stale:
                seq.num_output_placeholders -= count
                if cache_blocks is not None:  # vLLM caches what the steps processed so far computed
                    cache_blocks(seq, seq.num_computed_tokens - in_flight.get(seq.seq_id, 0))
            if seq.num_output_tokens >= seq.max_tokens:
                finished.append(seq)
        if finished:
            running_ids = {seq.seq_id for seq in self.running}
            done = {seq.seq_id for seq in finished}
            self.running = [seq for seq in self.running if seq.seq_id not in done]
            for seq in finished:
                if seq.seq_id in running_ids:
                    self.allocator.free(seq)
                elif seq in self.swapped:  # async: finished by output that was in flight when it was swapped out
                    self.swapped.remove(seq)
                    self._drop_swap(seq)
                else:  # async: preempted for recompute while its last token was in flight
                    self.waiting.remove(seq)
                seq.token_ids = None  # host memory follows live requests, not tokens replayed
        return finished
