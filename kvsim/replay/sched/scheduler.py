"""Continuous batching over one allocator as vLLM v1 0.33.0 schedules: admission, chunked prefill, decode,
preemption (`scheduler_preemption`), decode runs (`scheduler_runs`), sampling and finishing (`scheduler_update`).

One `Scheduler` per allocator config. Each `schedule()` builds one step's batch and makes room for it through
the allocator's capacity protocol; `postprocess()` advances the computed tokens and frees finished requests.
Data flows one way: replay -> scheduler -> allocator (-> cache for swaps) -> back to replay's records.
"""

from __future__ import annotations

from collections import deque

from kvsim.engine.allocator import KVAllocator
from kvsim.replay.sched.output import SchedSeq, SchedulerOutput
from kvsim.replay.sched.scheduler_preemption import Preemption
from kvsim.replay.sched.scheduler_runs import MAX_DECODE_RUN, DecodeRuns
from kvsim.replay.sched.scheduler_update import OutputUpdate


class Scheduler(Preemption, DecodeRuns, OutputUpdate):
    """FCFS continuous batching of `SchedSeq`s over `allocator`, one step (or one decode run) at a time, with
    vLLM v1's semantics (`vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule`; see docs/scheduler.md).

    - Running requests in order, each given the tokens it lacks (one for a decode, the rest of its prefill)
      within `max_num_batched_tokens`. When one cannot grow, the newest running request is preempted (possibly
      itself) and the same request retried, only while it still cannot grow; preempting itself ends the loop.
      `recompute` frees a victim and puts it back at the head of the waiting queue with nothing computed;
      `swap` (beyond vLLM v1) copies its KV to the CPU pool and resumes it when it fits again.
    - If nobody was preempted: swapped requests, then waiting ones, are admitted in order while
      `max_num_seqs` and the token budget allow and the allocator accepts all their tokens (vLLM's
      `scheduler_reserve_full_isl`) plus the watermark while something runs; the first refusal stops it.
    - A step that completes a request's prefill samples its next token; a request finishes once it has
      `max_tokens` output tokens (vLLM's `check_stop`; `max_tokens` is capped at max_model_len - prompt).
    - A request that can never fit is rejected at arrival with a reason, never waited on.
    - When a step is pure decode of every running request and nothing could be admitted, `schedule` covers a
      run of identical decode steps at once (up to the next finish or arrival): what makes long traces cheap.
    """

    def __init__(
        self,
        allocator: KVAllocator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        preemption: str = "recompute",
        swap_space_bytes: int = 0,
        reserve_full_isl: bool = True,
        async_scheduling: bool = False,
        cache=None,
        roofline=None,
        allow_runs: bool = True,
        make_token_ids=None,
    ):
        assert preemption in ("recompute", "swap"), preemption
        assert max_num_seqs > 0 and max_num_batched_tokens > 0
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.preemption = preemption
        self.swap_space_bytes = swap_space_bytes
        self.reserve_full_isl = reserve_full_isl
        # vLLM's AsyncScheduler under the engine core's batch queue of two: step n + 1 is scheduled before
        # step n's sampled tokens are processed (`postprocess` keeps one step in flight).
        self.async_scheduling = async_scheduling
        self._in_flight: SchedulerOutput | None = None
        self.swap_used_bytes = 0
        self.cache = cache
        self.roofline = roofline
        self.allow_runs = allow_runs and roofline is not None and not async_scheduling
        self.make_token_ids = make_token_ids  # SchedSeq -> (num_final_tokens,) ids, made at admission
        self.bytes_per_token = allocator.spec.bytes_per_token
        self.block_size = allocator.spec.block_size
        self.waiting: deque[SchedSeq] = deque()
        self.swapped: deque[SchedSeq] = deque()
        self.running: list[SchedSeq] = []  # in admission order: the tail is preempted first

    # --- queues -------------------------------------------------------------------------------------

    def add_request(self, seq: SchedSeq) -> str | None:
        """Queue `seq` (FCFS); returns why it is rejected instead, if it can never run.

        As vLLM: a prompt of max_model_len tokens or more is refused (no room for one output token), and
        `max_tokens` is capped so prompt + output stays within max_model_len (the request then finishes
        length-capped).
        """
        if seq.num_prompt_tokens >= self.max_model_len:
            return (f"prompt of {seq.num_prompt_tokens} tokens leaves no room for an output token within "
                    f"max_model_len {self.max_model_len}")
        seq.set_max_tokens(min(seq.max_tokens, self.max_model_len - seq.num_prompt_tokens))
        if self.async_scheduling:  # prefix caching hashes a block once its tokens are known (sampled)
            seq.num_known_tokens = seq.num_tokens
        reason = self.allocator.never_fits_reason(seq)
        if reason is not None:
            return reason
        self.waiting.append(seq)
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped or self._in_flight is not None)

    @property
    def has_in_flight(self) -> bool:
        """Async scheduling: a step has run whose sampled tokens are not processed yet."""
        return self._in_flight is not None

    # --- one step -----------------------------------------------------------------------------------

    def schedule(self, time_to_next_arrival: float = float("inf")) -> tuple[SchedulerOutput, list[tuple[SchedSeq, str]]]:
        """Build the next row and make room for it; returns it and the requests rejected while building it."""
        out = SchedulerOutput()
        rejected: list[tuple[SchedSeq, str]] = []
        budget = self.max_num_batched_tokens
        alloc = self.allocator
        running = self.running
        decodes = out.decodes

        # 1. Running requests, in order (vLLM's running loop).
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.num_computed_tokens >= seq.prefill_target and not self.async_scheduling:
                # decoding: a run of decodes grows in one call
                j = i + 1
                end = min(len(running), i + budget)
                while j < end and running[j].num_computed_tokens >= running[j].prefill_target:
                    j += 1
                batch = running[i:j]
                grown = alloc.append_decode_in_order(batch)
                decodes += batch[:grown] if grown < len(batch) else batch
                budget -= grown
                i += grown
                if grown == len(batch):
                    continue
                seq, n = running[i], 1
            else:
                computed, placeholders = seq.num_computed_tokens, seq.num_output_placeholders
                if placeholders and computed + 2 - placeholders >= seq.num_prompt_tokens + seq.max_tokens:
                    i += 1  # async: the step in flight samples its last token; nothing more to schedule
                    continue
                n = min(seq.num_tokens + placeholders - computed, budget, self.max_model_len - computed - 1)
                if n <= 0:
                    i += 1
                    continue
                if alloc.append_slots(seq, n):
                    self._book(out, seq, n)
                    budget -= n
                    i += 1
                    continue
            # `seq` cannot grow: preempt the newest running request until it can, or it was itself preempted.
            while True:
                victim = running[-1]
                self._preempt(victim, out)
                if victim is seq or alloc.append_slots(seq, n):
                    break
            if victim is seq:
                break
            self._book(out, seq, n)
            budget -= n
            i += 1

        # 2. If nobody was preempted: resume swapped requests, then admit waiting ones, FCFS, while they fit.
        if not out.preempted:
            while self.swapped and len(running) < self.max_num_seqs:
                seq = self.swapped[0]
                if not self._swap_in(seq, out):
                    if not running:  # its KV fit before but not alone now: recompute
                        self.swapped.popleft()
                        self._drop_swap(seq)
                        self.waiting.appendleft(seq)
                        continue
                    break
                self.swapped.popleft()
            while not self.swapped and self.waiting and len(running) < self.max_num_seqs and budget > 0:
                seq = self.waiting[0]
                if seq.token_ids is None and self.make_token_ids is not None:
                    seq.token_ids = self.make_token_ids(seq)
                num_tokens = seq.num_tokens
                hit = alloc.allocate(
                    seq,
                    budget,
                    num_tokens=num_tokens,
                    full_sequence_must_fit=self.reserve_full_isl,
                    apply_watermark=bool(running),
                )
                if hit is None:
                    if not running and not self.swapped:  # fits nowhere, even alone: reject, don't hang
                        self.waiting.popleft()
                        rejected.append((seq, "does not fit in the KV budget even when running alone"))
                        continue
                    break
                self.waiting.popleft()
                seq.num_computed_tokens = hit
                seq.prefill_target = num_tokens
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = hit
                n = min(budget, num_tokens - hit)
                assert n > 0, (seq, hit)
                running.append(seq)
                out.admitted.append(seq)
                out.prefills.append((seq, hit, n))
                budget -= n

        waiting_head = self.swapped[0] if self.swapped else (self.waiting[0] if self.waiting else None)
        if (decodes and len(decodes) == len(running) and not out.prefills and not out.preempted
                and not out.swapped_in and self.allow_runs):
            self._extend_decode_run(out, time_to_next_arrival, waiting_head)
        if out.breakdown is None:
            out.breakdown = alloc.breakdown(waiting_head)
        return out, rejected

    @staticmethod
    def _book(out: SchedulerOutput, seq: SchedSeq, n: int) -> None:
        """Put `n` tokens of running `seq` in `out`: a decode (one token past its prefill) or a prefill chunk."""
        if n == 1 and seq.num_computed_tokens >= seq.prefill_target:
            out.decodes.append(seq)
        else:
            out.prefills.append((seq, seq.num_computed_tokens, n))
