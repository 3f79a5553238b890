"""Continuous batching over one allocator as vLLM v1 0.33.0 schedules: admission, chunked prefill, decode,
preemption, decode runs, sampling and finishing, in one class as vLLM keeps `Scheduler`.

One `Scheduler` per allocator config. Each `schedule()` builds one step's batch and makes room for it through
the allocator's capacity protocol; `postprocess()` advances the computed tokens and frees finished requests.
Data flows one way: replay -> scheduler -> allocator (-> cache for swaps) -> back to replay's records.
"""

from __future__ import annotations

from collections import deque

from kvsim.engine.allocator import KVAllocator
from kvsim.engine.paged.single_type_kv_cache_manager import (
    is_mamba_prefill_checkpoint_valid,
    mamba_prefill_checkpoint_position,
)
from kvsim.replay.sched.output import SchedSeq, SchedulerOutput

# Longest run of identical decode steps one `schedule()` may cover (one row of the step records).
MAX_DECODE_RUN = 256


class Scheduler:
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
        connector=None,
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
        self._settled_row: SchedulerOutput | None = None  # the row whose outputs the last `postprocess` processed
        self.swap_used_bytes = 0
        self.cache = cache
        self.roofline = roofline
        self.allow_runs = allow_runs and roofline is not None
        # async runs where decoding frees blocks: the middle step's breakdown after nulling what left the windows
        # there, as stepping shows it (sliding windows only: a run is shorter than twice the smallest, so the
        # first step's block stays; a chunk boundary could drop it before the run's KV is written)
        self._null_at_run_middle = async_scheduling and allocator.decode_frees_blocks and all(
            g.kind != "chunked" for g in getattr(allocator, "groups", ()))
        self.make_token_ids = make_token_ids  # SchedSeq -> (prompt + max_tokens,) ids, made at admission
        self.bytes_per_token = allocator.spec.bytes_per_token
        self.block_size = allocator.spec.block_size
        # async scheduling: the block size prefix caching hashes at, which `_cache_settled` counts (0: no caching)
        self._hash_block_size = allocator.block_size if allocator.enable_prefix_caching else 0
        # mamba_cache_mode align: prefill chunks end where a state must be cached (0: off)
        self.mamba_block_size = allocator.mamba_block_size
        self.waiting: deque[SchedSeq] = deque()
        self.swapped: deque[SchedSeq] = deque()
        self.running: list[SchedSeq] = []  # in admission order: the tail is preempted first
        # The CPU tier (kvsim.replay.sched.offloading_connector, vLLM's OffloadingConnector scheduler side): requests
        # holding blocks while their load runs (vLLM's kv_holding_waiting, WAITING_FOR_REMOTE_KVS), the ids of
        # those whose load finished and was taken, and the requests finished since the last schedule().
        self.connector = connector
        self.loading: deque[SchedSeq] = deque()
        self._kv_loaded: set[int] = set()
        self._finished_for_connector: list[SchedSeq] = []
        # connector: with two batches in flight, a step may still write a finished request's blocks while the
        # connector loads into them, so vLLM defers their free until the steps that scheduled it are processed
        # (Scheduler.defer_block_free: a kv_both connector under async scheduling). Steps that computed are
        # numbered as scheduled and as processed; deferred frees wait for their fence.
        self._defer_free = connector is not None and async_scheduling
        self._sched_step_seq = self._processed_step_seq = 0
        self._last_sched_seq: dict[int, int] = {}  # request id -> the last step that scheduled it
        self._deferred_frees: deque[tuple[int, list]] = deque()

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
        # connector: vLLM's has_requests() keeps the engine stepping while requests finished since the last step
        # are not yet handed to the connector, or while its transfers are in flight (has_pending_push_work)
        return bool(self.running or self.waiting or self.swapped or self._in_flight is not None or self.loading
                    or (self.connector is not None and (self._finished_for_connector or self.connector.has_jobs())))

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
        alloc.new_step_starts()
        split = self.mamba_block_size > 0

        # 1. Running requests, in order (vLLM's running loop).
        async_scheduling = self.async_scheduling
        last = self.max_model_len - 2  # async: the most computed tokens that leave room for one more
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            j = i  # the decodes from i on: running[i:j]
            if seq.num_computed_tokens >= seq.prefill_target:
                end = i + budget  # (a slice stops at the list's end)
                if not async_scheduling:
                    for s in running[i + 1:end]:
                        if s.num_computed_tokens < s.prefill_target:
                            break
                        j += 1
                    j += 1
                else:  # those the branch below would give exactly one token (the async hot path): the step in
                    # flight does not sample its last token, it lacks one token (num_known_tokens: prompt + output
                    # so far under async scheduling), and max_model_len leaves room for it
                    for s in running[i:end]:
                        computed = s.num_computed_tokens
                        placeholders = s.num_output_placeholders
                        if placeholders == 1:  # the common case: its last step is in flight (the same tests)
                            if (computed != s.num_known_tokens or computed < s.prefill_target or computed > last
                                    or computed + 1 >= s.num_finish_tokens):
                                break
                        elif (computed < s.prefill_target or s.num_known_tokens + placeholders - computed != 1
                              or computed > last or (placeholders and computed + 2 - placeholders >= s.num_finish_tokens)):
                            break
                        j += 1
            if j > i:  # decoding: a run of decodes grows in one call
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
                if placeholders and computed + 2 - placeholders >= seq.num_finish_tokens:
                    i += 1  # async: the step in flight samples its last token; nothing more to schedule
                    continue
                n = min(seq.num_tokens + placeholders - computed, budget, self.max_model_len - computed - 1)
                if n <= 0:
                    i += 1
                    continue
                if split:
                    n = self._mamba_block_aligned_split(seq, computed, n, alloc.shared_prefix_boundary(seq))
                    if n == 0:  # no block-aligned chunk fits the budget
                        i += 1
                        continue
                if alloc.append_slots(seq, n):
                    self._book(out, seq, n)
                    budget -= n
                    i += 1
                    continue
            # `seq` cannot grow: preempt the newest running request until it can, or it was itself preempted.
            stuck = False
            while True:
                victim = running[-1]
                if self._defer_free and not self._blocks_can_be_freed(victim):  # connector: a deferred free
                    stuck = True  # would not help now: `seq` waits
                    break
                self._preempt(victim, out)
                if victim is seq or alloc.append_slots(seq, n):
                    break
            if stuck or victim is seq:
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
            skipped: list[SchedSeq] = []  # connector: requests it skips this step keep their place
            stop = False
            if self.connector is not None and not self.swapped:  # connector: finished loads go first
                budget, stop = self._admit_loaded(out, budget)
            while not stop and not self.swapped and self.waiting and len(running) < self.max_num_seqs and budget > 0:
                seq = self.waiting[0]
                if seq.token_ids is None and self.make_token_ids is not None:
                    seq.token_ids = self.make_token_ids(seq)
                num_tokens = seq.num_tokens
                ext, load, sync = 0, {}, False
                if self.connector is not None:  # connector: the CPU tier's hit past the GPU hit, or skip now
                    ext = self.connector.get_num_new_matched_tokens(seq, alloc.get_computed_tokens(seq, num_tokens))
                    if ext is None:
                        skipped.append(self.waiting.popleft())
                        continue
                    sync = bool(ext) and self.connector.is_sync_load(seq)
                    if sync:  # a load within the step (sync_load_budget_bytes): the hit counts as computed now
                        load = {"num_external_computed_tokens": ext}
                    elif ext:  # an asynchronous load: blocks for the hit, none for new tokens, cached once loaded,
                        # leaving free what the prefills in flight still need (vLLM's reserved_blocks)
                        load = {"num_external_computed_tokens": ext, "delay_cache_blocks": True,
                                "reserved_blocks": self._inflight_prefill_reserved_blocks(out)}
                num_new = budget
                if split and not ext:  # vLLM looks the prefix up, then ends the chunk where a state is cached
                    start, junction = alloc.get_computed_blocks(seq, num_tokens)
                    num_new = self._mamba_block_aligned_split(seq, start, min(num_tokens - start, budget), junction)
                    if num_new == 0:
                        break
                hit = alloc.allocate(
                    seq,
                    0 if ext and not sync else num_new,
                    num_tokens=num_tokens,
                    full_sequence_must_fit=self.reserve_full_isl,
                    apply_watermark=bool(running),
                    **load,
                )
                if hit is None:
                    if not running and not self.swapped and not self.loading:  # fits nowhere, even alone: reject
                        self.waiting.popleft()
                        rejected.append((seq, "does not fit in the KV budget even when running alone"))
                        continue
                    break
                self.waiting.popleft()
                if ext and not sync:  # connector: the request waits for its load (WAITING_FOR_REMOTE_KVS)
                    self._start_load(seq, hit + ext, ext, out)
                    continue
                if sync:  # connector: its load runs within this step, before the forward pass
                    self.connector.update_state_after_alloc(seq, ext)
                    hit += ext
                seq.num_computed_tokens = hit
                seq.prefill_target = num_tokens
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = hit
                n = min(num_new, num_tokens - hit)
                assert n > 0, (seq, hit)
                running.append(seq)
                out.admitted.append(seq)
                out.prefills.append((seq, hit, n))
                budget -= n
            if skipped:  # connector: skipped requests back at the head, in order
                self.waiting.extendleft(reversed(skipped))

        waiting_head = self.swapped[0] if self.swapped else (self.waiting[0] if self.waiting else None)
        if (decodes and len(decodes) == len(running) and not out.prefills and not out.preempted
                and not out.swapped_in and self.allow_runs):
            if not self.async_scheduling:
                self._extend_decode_run(out, time_to_next_arrival, waiting_head)
            elif self._in_flight is not None and len(self._in_flight.sampled) == len(decodes):
                self._extend_async_decode_run(out, time_to_next_arrival, waiting_head)
        if out.breakdown is None:
            out.breakdown = alloc.breakdown(waiting_head)
        if self.connector is not None:  # connector: flushes, stores and finishes at the end of schedule()
            self._build_connector_meta(out)
        if self._defer_free and (out.prefills or out.decodes):  # connector: this step's fence
            self._sched_step_seq = n = self._sched_step_seq + 1
            for seq, _, _ in out.prefills:
                self._last_sched_seq[seq.seq_id] = n
            for seq in out.decodes:
                self._last_sched_seq[seq.seq_id] = n
        return out, rejected

    def _mamba_block_aligned_split(self, seq: SchedSeq, start: int, n: int, junction: int) -> int:
        """Clip a prefill chunk of `n` tokens from `start` so it ends where a state must be cached (vLLM's
        `Scheduler._mamba_block_aligned_split` in mamba_cache_mode align, hashes at the block size, no EAGLE):
        a state is written only at a chunk's end, so a chunk before the prefill's last one ends on a block
        boundary, and stops at the last block boundary before the request's end (the prompt's reusable state)
        unless the state layers export that checkpoint from inside the chunk, and at a shared-prefix
        `junction` inside it. 0: no block-aligned chunk fits.

            block 576, prompt 1,000, budget 2,048:
            checkpoints (gated delta net, FlashInfer):  [0, 1,000)              the 576 state exported inside
            none (Triton's kernel):                     [0, 576) then [576, 1,000)
        """
        bs = self.mamba_block_size
        num_tokens = seq.num_tokens
        prefill_end = max(seq.num_prompt_tokens, num_tokens - 1)
        if start >= prefill_end:
            return n
        last_cache_position = mamba_prefill_checkpoint_position(num_tokens, bs)
        end = start + n
        internal = end >= prefill_end and is_mamba_prefill_checkpoint_valid(
            start, end, mamba_prefill_checkpoint_position(prefill_end, bs), bs, self.allocator.mamba_checkpoint_alignment)
        if internal:
            last_cache_position = 0
        if end < prefill_end:
            aligned_end = end // bs * bs
            if aligned_end > start or bs <= self.max_num_batched_tokens:
                end = aligned_end
        stops = (
            (start // bs + 1) * bs if start % bs and not internal else 0,
            last_cache_position,
            start + (junction - start) // bs * bs if start < junction < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    @staticmethod
    def _book(out: SchedulerOutput, seq: SchedSeq, n: int) -> None:
        """Put `n` tokens of running `seq` in `out`: a decode (one token past its prefill) or a prefill chunk."""
        if n == 1 and seq.num_computed_tokens >= seq.prefill_target:
            out.decodes.append(seq)
        else:
            out.prefills.append((seq, seq.num_computed_tokens, n))

    # --- the CPU tier's connector (vLLM's KV connector hooks in Scheduler.schedule) -------------------------

    def _blocks_can_be_freed(self, seq: SchedSeq) -> bool:
        """vLLM's `_request_blocks_can_be_freed`: every step that scheduled `seq` has been processed."""
        return self._last_sched_seq.get(seq.seq_id, 0) <= self._processed_step_seq

    def _free_finished(self, seq: SchedSeq) -> None:
        """A finished request's blocks back to the pool, or held until its last step is processed
        (`_free_request_blocks`)."""
        if not self._defer_free:
            self.allocator.free_finished(seq)
            return
        if self._blocks_can_be_freed(seq):
            self.allocator.free_finished(seq)
        else:
            blocks = self.allocator.pop_blocks_for_free(seq)
            if blocks:
                self._deferred_frees.append((self._sched_step_seq, blocks))
        self._last_sched_seq.pop(seq.seq_id, None)

    def _drain_deferred_frees(self) -> None:
        """A step's output is processed: the deferred frees whose fence it passed go back, oldest first
        (`_drain_deferred_frees`)."""
        self._processed_step_seq += 1
        deferred = self._deferred_frees
        while deferred and deferred[0][0] <= self._processed_step_seq:
            self.allocator.free_popped_blocks(deferred.popleft()[1])

    def _start_load(self, seq: SchedSeq, num_computed_tokens: int, num_external_tokens: int, out: SchedulerOutput) -> None:
        """An admitted request whose CPU hit loads asynchronously: it holds its blocks and waits for the load."""
        seq.num_computed_tokens = num_computed_tokens  # as vLLM sets it before the KV arrives
        seq.prefill_target = seq.num_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_computed_tokens
        self.connector.update_state_after_alloc(seq, num_external_tokens)
        self.loading.append(seq)
        out.admitted.append(seq)

    def _admit_loaded(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Requests whose load finished, in queue order, before any waiting one (vLLM drains kv_holding_waiting
        first; `_update_waiting_for_remote_kv` caches the loaded blocks and recomputes a full hit's last token).
        Returns the budget left and whether admission stops (a loaded request that does not fit)."""
        alloc, running = self.allocator, self.running
        for seq in list(self.loading):
            if budget <= 0 or len(running) >= self.max_num_seqs:
                return budget, True
            if seq.seq_id not in self._kv_loaded:
                if not self.connector.is_load_ready(seq):
                    continue
                self._kv_loaded.add(seq.seq_id)
                alloc.cache_blocks(seq, seq.num_computed_tokens)
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.num_computed_tokens -= 1
            computed = seq.num_computed_tokens
            n = min(budget, seq.num_tokens - computed)
            if self.mamba_block_size:  # its prefill chunk ends where a state is cached
                n = self._mamba_block_aligned_split(seq, computed, n, alloc.shared_prefix_boundary(seq))
                if n == 0:
                    return budget, True
            if self.reserve_full_isl and not alloc.full_sequence_fits(seq, apply_watermark=bool(running)):
                return budget, True
            if not alloc.append_slots(seq, n):
                return budget, True
            self.loading.remove(seq)
            self._kv_loaded.discard(seq.seq_id)
            running.append(seq)
            out.prefills.append((seq, computed, n))
            budget -= n
        return budget, False

    def _inflight_prefill_reserved_blocks(self, out: SchedulerOutput) -> int:
        """Blocks the requests still prefilling after this step (loads waiting included) need to hold all their
        tokens (vLLM's `_inflight_prefill_reserved_blocks` over `_inflight_prefills`)."""
        after = {seq.seq_id: start + n for seq, start, n in out.prefills}
        alloc = self.allocator
        reserved = 0
        for seq in (*self.running, *self.loading):
            if after.get(seq.seq_id, seq.num_computed_tokens) < seq.num_tokens:
                reserved += alloc.num_blocks_to_finish(seq)
        return reserved

    def _build_connector_meta(self, out: SchedulerOutput) -> None:
        """The connector's end of schedule(): each scheduled request with the tokens it has computed by the end
        of this step, in scheduling order (running order), then the requests finished since the last one."""
        after = {seq.seq_id: start + n for seq, start, n in out.prefills}
        for seq in out.decodes:
            after[seq.seq_id] = seq.num_computed_tokens + out.num_steps
        scheduled = [(seq, after[seq.seq_id]) for seq in self.running if seq.seq_id in after]
        finished, self._finished_for_connector = self._finished_for_connector, []
        self.connector.build_connector_meta(scheduled, finished, out.preempted)

    # --- decode runs ---------------------------------------------------------------------------------

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
        k, ctx_sum = MAX_DECODE_RUN, 0  # one pass: the fewest tokens left to sample, the contexts' sum
        for seq in decodes:
            r = seq.max_tokens - seq.num_output_tokens
            if r < k:
                k = r
            ctx_sum += seq.num_computed_tokens
        k = min(k, self.allocator.max_decode_run(n))
        if k < 2:
            return
        if waiting_head is None:
            k, run_time = self.roofline.decode_steps_before(n, ctx_sum, k, time_to_next_arrival)
            if k < 2:
                return
        else:
            run_time = self.roofline.decode_run(n, ctx_sum, k)
        self._grow_decode_run(out, k, run_time, waiting_head)

    def _extend_async_decode_run(self, out: SchedulerOutput, time_to_next_arrival: float, waiting_head) -> None:
        """`_extend_decode_run` under async scheduling, with one step in flight while the next is scheduled.

        Stepping, step j of the run is scheduled while step j - 1 runs: it sees the arrivals up to step j - 1's
        start and the outputs up to step j - 2's. So the run may cover k steps when the row in flight sampled
        exactly these requests (every one decodes, none finishes: each has a placeholder), no output processed
        before the k-th step finishes a request (num_output_tokens + k < max_tokens: a request whose in-flight
        step samples its last token is not scheduled again), and no arrival comes before the (k - 1)-th step
        starts. `postprocess` settles the outputs of the run's first k - 1 steps at once; its last step stays
        in flight, starting `last_step_start_s` after the run.

        A queue head that failed to fit stays out while memory does not grow. Where decoding frees blocks
        (sliding or chunked windows) the run then covers only the steps in which stepping would leave no more
        blocks free than now (`_steps_while_free_blocks_do_not_grow`), and once it has run, what left the
        windows by its last step is nulled (`_null_left_windows`). There runs also leave prefix caching alone
        (the run's growth would take the window past blocks its settled steps cache only afterwards: tests
        found fewer hits than stepping).
        """
        decodes = out.decodes
        alloc = self.allocator
        if alloc.decode_frees_blocks and alloc.enable_prefix_caching:
            return  # the run's growth would free blocks leaving a window before its settled steps cache them
        left, ctx_sum = MAX_DECODE_RUN + 1, 0  # one pass: the fewest tokens left to sample, the contexts' sum
        for seq in decodes:
            if seq.num_output_placeholders != 1:
                return
            r = seq.max_tokens - seq.num_output_tokens
            if r < left:
                left = r
            ctx_sum += seq.num_computed_tokens
        n = len(decodes)
        k = left - 1
        k = min(k, alloc.max_decode_run(n))
        if k >= 2 and waiting_head is not None and alloc.decode_frees_blocks:
            k = self._steps_while_free_blocks_do_not_grow(decodes, k)
        if k < 2:
            return
        if waiting_head is None:
            if time_to_next_arrival <= 0:  # arrived while the step in flight ran: the next step admits it
                return
            k1, _ = self.roofline.decode_steps_before(n, ctx_sum, k - 1, time_to_next_arrival)  # steps 1..k - 1
            k = k1 + 1
        out.last_step_start_s = self.roofline.decode_run(n, ctx_sum, k - 1)
        self._grow_decode_run(out, k, self.roofline.decode_run(n, ctx_sum, k), waiting_head)

    def _steps_while_free_blocks_do_not_grow(self, decodes: list[SchedSeq], k: int) -> int:
        """Async scheduling with a refused queue head where decoding frees blocks (sliding or chunked windows):
        the most steps, at most `k`, of a run over `decodes` in which stepping would never leave more blocks
        free after a step's running loop than there are now, when the head was refused. Admission is monotone
        in free blocks (nothing else it checks changes inside a run: seats, budget, and without prefix caching
        the head's need), so the head stays refused through them.

        Stepping, step j (1-based, this row being step 1) of request i grows it to c_i + j tokens (c_i its
        computed tokens now) and first nulls what left each window at its settled tokens, c_i + j - 2 from the
        second step on (one step in flight); each token group then holds ceil(total / block_size) blocks less
        the whole blocks skipped (`remove_skipped_blocks`). Steps 2.. are compared with this step's blocks.
        """
        import numpy as np

        alloc = self.allocator
        mml = self.max_model_len
        c = np.fromiter((s.num_computed_tokens for s in decodes), np.int64, len(decodes))
        settled_now = np.maximum(c - np.fromiter((s.num_in_flight_tokens for s in decodes), np.int64, len(decodes)), 0)
        total = np.minimum(c[:, None] + np.arange(2, k + 1), mml)  # (n, k - 1): tokens after steps 2..k
        settled = c[:, None] + np.arange(0, k - 1)  # their settled tokens
        total_now = np.minimum(c + 1, mml)
        delta = np.zeros(k - 1, np.int64)
        for g in alloc.groups:
            if g.kind == "state":
                continue  # a state group's blocks do not move while decoding (align mode runs no runs)
            bs = g.block_size
            if g.kind == "sliding":
                skip, skip_now = np.maximum(settled - g.window + 1, 0), np.maximum(settled_now - g.window + 1, 0)
            elif g.kind == "chunked":
                skip, skip_now = settled // g.window * g.window, settled_now // g.window * g.window
            else:
                skip, skip_now = 0 * settled, 0 * settled_now
            opened, opened_now = -(-total // bs), -(-total_now // bs)
            held = opened - np.minimum(skip // bs, opened)
            held_now = opened_now - np.minimum(skip_now // bs, opened_now)
            delta += (held - held_now[:, None]).sum(axis=0)
        grown = np.flatnonzero(delta < 0)  # fewer blocks held than now: more free
        return k if not len(grown) else int(grown[0]) + 1  # steps 1 .. first such step - 1

    def _grow_decode_run(self, out: SchedulerOutput, k: int, run_time: float, waiting_head) -> None:
        """Make `out` a run of `k` decode steps of `run_time`: room for all, the breakdown at its middle step.

        Room for the middle step, the memory breakdown there, then room for the whole run: each request's
        `append_slots(seq, mid + 1)`, then `append_slots(seq, k - mid)` from `mid` tokens further, in running order.
        Where decoding frees no blocks, a request's growth depends on its own tokens alone, so each of the two
        passes is one `append_decode_in_order` (one token past computed tokens moved forward first): the same
        calls in the same order, without a call per request."""
        decodes = out.decodes
        out.num_steps = k
        out.run_time_s = run_time
        mid = (k - 1) // 2
        alloc = self.allocator
        if not alloc.decode_frees_blocks:
            n = len(decodes)
            if mid:
                for seq in decodes:
                    seq.num_computed_tokens += mid
            grown = alloc.append_decode_in_order(decodes)  # room for mid + 1 steps
            assert grown == n, decodes[grown]
            out.breakdown = alloc.breakdown(waiting_head)
            rest = k - 1 - mid
            for seq in decodes:
                seq.num_computed_tokens += rest
            grown = alloc.append_decode_in_order(decodes)  # room for all k steps
            assert grown == n, decodes[grown]
            for seq in decodes:
                seq.num_computed_tokens -= k - 1
            return
        for seq in decodes:
            ok = alloc.append_slots(seq, mid + 1)
            assert ok, seq
            seq.num_computed_tokens += mid
        if self._null_at_run_middle and mid:
            for seq in decodes:  # async: the middle step's settled tokens are computed - 1 there
                in_flight, seq.num_in_flight_tokens = seq.num_in_flight_tokens, 1
                ok = alloc.append_slots(seq, 1)  # nulls, and needs no new block
                assert ok, seq
                seq.num_in_flight_tokens = in_flight
        out.breakdown = alloc.breakdown(waiting_head)
        for seq in decodes:
            ok = alloc.append_slots(seq, k - mid)
            assert ok, seq
            seq.num_computed_tokens -= mid

    # --- preemption and swap -------------------------------------------------------------------------

    def _preempt(self, seq: SchedSeq, out: SchedulerOutput) -> None:
        """Take `seq` (the running tail) off the GPU: to the CPU pool (swap) or back to waiting (recompute)."""
        assert self.running[-1] is seq
        self.running.pop()
        seq.num_preemptions += 1
        seq.num_cache_asked_blocks = 0  # its blocks go: a new admission caches afresh
        if self.async_scheduling:  # vLLM drops its placeholders; output in flight is delivered as stale
            flight = self._in_flight
            seq.stale_output = flight is not None and (seq in flight.decodes or any(c[0] is seq for c in flight.prefills))
            seq.num_output_placeholders = 0
        out.preempted.append(seq)
        out.prefills = [chunk for chunk in out.prefills if chunk[0] is not seq]
        if seq.num_in_flight_tokens and self._hash_block_size and self.allocator.caches_private_blocks_at_free:
            # async, a step in flight computing its tokens, an allocator that may cache them lazily (which caches
            # up to the settled tokens at the free): if no output of it was processed since that step was
            # scheduled, vLLM's allocate_slots cached that step's blocks then, as far as its tokens were known
            settled = self._settled_row
            if settled is None or not any(s is seq for s in settled.sampled):
                self.allocator.cache_blocks(seq, seq.num_computed_tokens)
        computed = seq.num_computed_tokens
        swap_bytes = computed * self.bytes_per_token
        # Swap only while another request still runs: a request that preempts itself with nothing else running
        # would come back to the same free blocks (those it gave up) and could not grow there either, while the
        # blocks it lacks are held by requests that do not run (the connector's loads, which wait behind swapped
        # requests); it is recomputed, as vLLM does, and the loaded requests are admitted first.
        if (self.preemption == "swap" and computed and self.running
                and self.swap_used_bytes + swap_bytes <= self.swap_space_bytes):
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

    # --- after a step has run: vLLM's `_update_after_schedule` and `update_from_output` --------------

    def postprocess(self, out: SchedulerOutput) -> list[SchedSeq]:
        """After `out` has run: advance computed tokens by what it computed, then process sampled tokens (vLLM's
        `update_from_output`) and free and return the requests that finished (`check_stop`).

        Synchronous: `out`'s own samples. Async scheduling: those of the step before it, which was in flight
        while `out` was scheduled; `out` stays in flight until the next `postprocess` or `flush`.
        """
        if not self.async_scheduling:
            self._advance(out)
            return self._update_from_output(out)
        previous, self._in_flight = self._in_flight, out
        self._settled_row = previous
        # the same requests decoding in both rows (and no connector's frees between): `out`'s decodes advance
        # while `previous`'s outputs settle, in one pass (their placeholder and token in flight stay as they are)
        decodes = out.decodes
        merge = (previous is not None and not self._defer_free and decodes
                 and len(decodes) == len(previous.decodes) and decodes == previous.decodes)
        self._advance(out, decodes=not merge)
        if previous is not None and self._defer_free:
            self._drain_deferred_frees()
        # and where nothing is cached as tokens settle (no prefix caching, or every request's decode blocks
        # cached when its blocks are freed), a decode run's steps before its last settle in that pass too
        caching = self._hash_block_size and self._settled_caching_block_size()
        settle = out.num_steps - 1 if merge and not caching else 0
        finished = (self._update_from_output(previous, out.num_steps if merge else 0, settle, caching)
                    if previous is not None else [])
        if out.num_steps > 1:
            if not settle:
                self._settle_run(out)
            if self.allocator.decode_frees_blocks:
                self._null_left_windows(out)
        return finished

    def _settle_run(self, out: SchedulerOutput) -> None:
        """Async scheduling: the outputs of a decode run's steps before its last (in flight), processed as the
        steps after them would have (`_extend_async_decode_run` made sure none finishes a request)."""
        hash_bs = self._hash_block_size and self._settled_caching_block_size()
        inner = out.num_steps - 1
        for seq in out.decodes:
            seq.num_output_tokens += inner
            seq.num_known_tokens = known = seq.num_prompt_tokens + seq.num_output_tokens
            assert seq.num_output_tokens < seq.max_tokens, seq
            if hash_bs:  # what the steps processed so far computed; the last one is in flight
                settled = seq.num_computed_tokens - 1
                if (settled if settled < known else known) // hash_bs > seq.num_cache_asked_blocks:
                    self._cache_settled(seq, settled)

    def _null_left_windows(self, out: SchedulerOutput) -> None:
        """Async scheduling, after a decode run has run (its KV written): null what left the windows by its last
        step, as stepping would have (each step nulls at its settled tokens, computed - 2 at the run's last step
        now that the run has advanced). `_grow_decode_run` nulled up to the run's middle step only; without this
        the next row's earlier requests would miss blocks that later ones still hold (a preemption stepping
        does not have)."""
        remove_skipped_blocks = self.allocator.remove_skipped_blocks
        for seq in out.decodes:  # settled: the tokens before the run's last step's
            remove_skipped_blocks(seq, max(0, seq.num_computed_tokens - 2))

    def _settled_caching_block_size(self) -> int:
        """Async scheduling: the block size at which settled tokens' blocks are cached (`_cache_settled`), or 0
        where nothing needs it: no prefix caching, or every admitted request's blocks past its prompt are cached
        when its blocks are freed (the allocator's `needs_settled_caching`; its prompt's blocks are all cached
        when scheduled, their tokens known)."""
        if not self._hash_block_size or not self.allocator.needs_settled_caching:
            return 0
        return self._hash_block_size

    def _cache_settled(self, seq: SchedSeq, num_tokens: int) -> None:
        """Async prefix caching: `allocator.cache_blocks(seq, num_tokens)`, as vLLM caches the full blocks of the
        tokens settled so far. The callers skip it where it would cache nothing: where the full blocks within
        `num_tokens` and the known tokens were all asked for before (`SchedSeq.num_cache_asked_blocks`; the
        allocator caches up to the same bound, capped by its own), and for every request while the allocator
        caches each request's decode blocks when its blocks are freed (`_settled_caching_block_size`)."""
        seq.num_cache_asked_blocks = min(num_tokens, seq.num_known_tokens) // self._hash_block_size
        self.allocator.cache_blocks(seq, num_tokens)

    def flush(self) -> list[SchedSeq]:
        """Async scheduling: process the step in flight (nothing else was scheduled to overlap it)."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None and self._defer_free:
            self._drain_deferred_frees()
        return self._update_from_output(previous) if previous is not None else []

    def _advance(self, out: SchedulerOutput, decodes: bool = True) -> None:
        """What vLLM's `_update_after_schedule` does: computed tokens advance; a request whose tokens are all
        computed samples one (async: an output placeholder until its output is processed). Async, `decodes`
        False: the decodes are left to `_update_from_async_output`'s merged pass (they still sample)."""
        sampled = out.sampled
        k = out.num_steps
        if not self.async_scheduling:
            for seq, _, n in out.prefills:
                seq.num_computed_tokens += n
                if seq.num_computed_tokens >= seq.num_tokens:
                    sampled.append(seq)
            for seq in out.decodes:
                seq.num_computed_tokens += k
            sampled += out.decodes
            return
        # Async: a decode run's last step is in flight (its earlier ones settle at once): one placeholder each.
        for seq, _, n in out.prefills:
            seq.num_computed_tokens += n
            seq.num_in_flight_tokens += n
            if seq.num_computed_tokens >= seq.num_prompt_tokens + seq.num_output_tokens + seq.num_output_placeholders:
                sampled.append(seq)
                seq.num_output_placeholders += 1
        if decodes:
            for seq in out.decodes:
                seq.num_computed_tokens += k
                seq.num_in_flight_tokens += 1
                seq.num_output_placeholders += 1
        sampled += out.decodes

    def _update_from_output(self, out: SchedulerOutput, advance_decodes: int = 0, settle_steps: int = 0,
                            hash_bs: int | None = None) -> list[SchedSeq]:
        """Append `out`'s sampled tokens and finish requests that reached `max_tokens`. A request preempted while
        `out` was in flight (async) still gets its token (vLLM delivers stale output) and may finish waiting.
        `advance_decodes`, `settle_steps`, `hash_bs` (async): see `_update_from_async_output`."""
        if self.async_scheduling:
            finished = self._update_from_async_output(out, advance_decodes, settle_steps, hash_bs)
        else:
            finished = []
            k = out.num_steps
            num_prefill_samples = len(out.sampled) - len(out.decodes)
            for j, seq in enumerate(out.sampled):
                seq.num_output_tokens += 1 if j < num_prefill_samples else k
                if seq.num_output_tokens >= seq.max_tokens:
                    finished.append(seq)
        if finished:
            if len(finished) > 1:
                finished = self._in_scheduled_order(finished)
            running_ids = {seq.seq_id for seq in self.running}
            done = {seq.seq_id for seq in finished}
            self.running = [seq for seq in self.running if seq.seq_id not in done]
            if self.connector is not None:  # connector: they reach it at the next schedule()
                self._finished_for_connector += finished
            for seq in finished:
                if self.connector is not None:  # connector: `_connector_finished` frees the blocks that left a window
                    if seq.seq_id in running_ids:  # (settled tokens), then fences the stores in flight
                        self.allocator.remove_skipped_blocks(seq, max(0, seq.num_computed_tokens - seq.num_in_flight_tokens))
                    self.connector.request_finished(seq)
                if seq.seq_id in running_ids:
                    self._free_finished(seq)
                elif seq in self.swapped:  # async: finished by output that was in flight when it was swapped out
                    self.swapped.remove(seq)
                    self._drop_swap(seq)
                else:  # async: preempted for recompute while its last token was in flight
                    self.waiting.remove(seq)
                seq.token_ids = None  # host memory follows live requests, not tokens replayed
        return finished

    def _in_scheduled_order(self, finished: list[SchedSeq]) -> list[SchedSeq]:
        """One step's finished requests in the order vLLM's `update_from_output` frees them: the step's scheduled
        order, which is the running list's (admitted requests last), not sampling's (completed prefills first).
        Those no longer running (async: preempted while the step ran) free no blocks; they come first."""
        position = {seq.seq_id: i for i, seq in enumerate(self.running)}
        return sorted(finished, key=lambda seq: position.get(seq.seq_id, -1))

    def _update_from_async_output(self, out: SchedulerOutput, advance_decodes: int = 0, settle_steps: int = 0,
                                  hash_bs: int | None = None) -> list[SchedSeq]:
        """`_update_from_output` under async scheduling, for the step of `out` (a decode run's last step: the
        others settled with it). Each sampled request settles one token; the placeholder goes unless its output
        is stale (preempted while `out` ran), and with prefix caching the blocks its settled tokens fill are
        cached: computed less what the newer step in flight still computes (`num_in_flight_tokens`, once
        `out`'s tokens are taken off). Finishes in sampling order: completed prefills, then decodes.

        `advance_decodes` > 0: the row scheduled after `out` decodes the same requests in `advance_decodes`
        steps, and `_advance` left them to this pass: each advances that far and keeps its token in flight and
        its placeholder (one leaves, one comes), as `_advance` then this pass one after the other would.
        `settle_steps` > 0 (nothing cached as tokens settle): that next row is a decode run, and its steps but the
        last settle here as `_settle_run` would after this pass (none finishes a request). `hash_bs`: the caller's
        `_settled_caching_block_size()`, where it has it."""
        finished: list[SchedSeq] = []
        if hash_bs is None:
            hash_bs = self._hash_block_size and self._settled_caching_block_size()
        stale = set()
        for seq, _, n in out.prefills:  # settled now, preempted or not (vLLM's update_from_output)
            seq.num_in_flight_tokens -= n
            if seq.stale_output:
                seq.stale_output = False
                stale.add(seq.seq_id)
        for seq in out.sampled[:len(out.sampled) - len(out.decodes)]:  # prefills that sampled
            seq.num_output_tokens += 1
            seq.num_known_tokens = known = seq.num_prompt_tokens + seq.num_output_tokens
            if seq.num_output_placeholders and seq.seq_id not in stale:
                seq.num_output_placeholders -= 1
                if hash_bs:  # vLLM caches what the steps processed so far computed
                    settled = seq.num_computed_tokens - seq.num_in_flight_tokens
                    if (settled if settled < known else known) // hash_bs > seq.num_cache_asked_blocks:
                        self._cache_settled(seq, settled)
            if seq.num_output_tokens >= seq.max_tokens:
                finished.append(seq)
        k = advance_decodes
        if k and not hash_bs:  # merged with the next row's advance (see above), nothing cached as tokens settle
            inner = settle_steps
            for seq in out.decodes:
                seq.num_computed_tokens += k
                num_output = seq.num_output_tokens + 1
                if seq.stale_output:
                    seq.stale_output = False
                    seq.num_output_placeholders += 1
                if num_output >= seq.max_tokens:
                    finished.append(seq)
                if inner:  # `_settle_run`
                    num_output += inner
                    assert num_output < seq.max_tokens, seq
                seq.num_output_tokens = num_output
                seq.num_known_tokens = seq.num_prompt_tokens + num_output
            return finished
        if k:  # the same with prefix caching
            for seq in out.decodes:
                seq.num_computed_tokens = computed = seq.num_computed_tokens + k
                seq.num_output_tokens = num_output = seq.num_output_tokens + 1
                seq.num_known_tokens = known = seq.num_prompt_tokens + num_output
                if seq.stale_output:
                    seq.stale_output = False
                    seq.num_output_placeholders += 1
                else:
                    settled = computed - seq.num_in_flight_tokens
                    if (settled if settled < known else known) // hash_bs > seq.num_cache_asked_blocks:
                        self._cache_settled(seq, settled)
                if num_output >= seq.max_tokens:
                    finished.append(seq)
            return finished
        for seq in out.decodes:
            seq.num_in_flight_tokens = in_flight = seq.num_in_flight_tokens - 1
            seq.num_output_tokens = num_output = seq.num_output_tokens + 1
            seq.num_known_tokens = known = seq.num_prompt_tokens + num_output
            if seq.stale_output:
                seq.stale_output = False
            elif seq.num_output_placeholders:
                seq.num_output_placeholders -= 1
                if hash_bs:
                    settled = seq.num_computed_tokens - in_flight
                    if (settled if settled < known else known) // hash_bs > seq.num_cache_asked_blocks:
                        self._cache_settled(seq, settled)
            if num_output >= seq.max_tokens:
                finished.append(seq)
        return finished
