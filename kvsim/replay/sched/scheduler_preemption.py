"""Preemption: recompute (vLLM v1) or swap to a CPU pool (beyond vLLM v1, as vLLM v0), and resuming swapped
requests (a mixin of `kvsim.replay.scheduler.Scheduler`: the state is the scheduler's)."""

from __future__ import annotations

from kvsim.replay.sched.output import SchedSeq, SchedulerOutput


class Preemption:
    """Scheduler's preemption and swap steps."""

    def _preempt(self, seq: SchedSeq, out: SchedulerOutput) -> None:
        """Take `seq` (the running tail) off the GPU: to the CPU pool (swap) or back to waiting (recompute)."""
        assert self.running[-1] is seq
        self.running.pop()
        seq.num_preemptions += 1
        if self.async_scheduling:  # vLLM drops its placeholders; output in flight is delivered as stale
            flight = self._in_flight
            seq.stale_output = flight is not None and (seq in flight.decodes or any(c[0] is seq for c in flight.prefills))
            seq.num_output_placeholders = 0
        out.preempted.append(seq)
        out.prefills = [chunk for chunk in out.prefills if chunk[0] is not seq]
        computed = seq.num_computed_tokens
        swap_bytes = computed * self.bytes_per_token
        if self.preemption == "swap" and computed and self.swap_used_bytes + swap_bytes <= self.swap_space_bytes:
            if self.cache is not None:
                slots = self.allocator.slot_mapping(seq, 0, computed)  # (computed,)
                seq.swap_handle = self.cache.swap_out(slots)
            self.swap_used_bytes += swap_bytes
            seq.swap_tokens = computed
            out.swap_bytes += swap_bytes
            self.allocator.free(seq)
            self.swapped.appendleft(seq)  # victims go out newest first, so the oldest ends up at the head
            return
        self.allocator.free(seq)
        seq.num_computed_tokens = 0  # vLLM recomputes prompt + output so far when it is admitted again
        self.waiting.appendleft(seq)

    def _drop_swap(self, seq: SchedSeq) -> None:
        """Turn a swapped request into one to recompute: its CPU copy is dropped."""
        self.swap_used_bytes -= seq.swap_tokens * self.bytes_per_token
        seq.swap_tokens = 0
        seq.swap_handle = None
        seq.num_computed_tokens = 0

    def _swap_in(self, seq: SchedSeq, out: SchedulerOutput) -> bool:
        """Bring a swapped request back if room for its KV fits now; its KV returns from the CPU pool."""
        computed = seq.swap_tokens
        seq.num_computed_tokens = 0
        hit = self.allocator.allocate(seq, computed, num_tokens=computed, apply_watermark=bool(self.running))
        if hit is None:
            seq.num_computed_tokens = computed
            return False
        seq.num_computed_tokens = computed
        if self.cache is not None and seq.swap_handle is not None:
            slots = self.allocator.slot_mapping(seq, 0, computed)  # (computed,)
            self.cache.swap_in(seq.swap_handle, slots)
            seq.swap_handle = None
        swap_bytes = computed * self.bytes_per_token
        self.swap_used_bytes -= swap_bytes
        seq.swap_tokens = 0
        out.swap_bytes += swap_bytes
        out.swapped_in.append(seq)
        self.running.append(seq)
        return True
