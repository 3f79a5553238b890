"""The request stream `kvsim profile` replays, no CUDA needed: FCFS admission onto a device-memory backend, either
per-request tensors (a flat reservation each, refused on OOM) or one paged pool (blocks, preempting for recompute)."""

from __future__ import annotations

import math
from collections import deque
from typing import Callable

from kvsim.engine.sequence import Sequence


class PerRequestTensors:
    """Each admitted request owns one tensor of its flat reservation (`slab_size` tokens of the flat
    allocator's reserve policy), allocated through `empty(nbytes)`; an out-of-memory error refuses it."""

    def __init__(self, flat, empty: Callable[[int], object]):
        self.flat = flat  # kvsim.engine.flat.FlatAllocator: used for its reservation sizes only
        self.empty = empty
        self.tensors: dict[int, object] = {}
        self.in_use_bytes = 0

    def can_ever_fit(self, seq: Sequence) -> bool:
        return self.flat.can_ever_fit(seq)

    def admit(self, seq: Sequence) -> str:
        """'ok', or 'oom' when the device allocator raised out-of-memory."""
        import torch

        nbytes = self.flat.slab_size(seq) * self.flat.bytes_per_token
        try:
            self.tensors[seq.seq_id] = self.empty(nbytes)
        except torch.OutOfMemoryError:
            return "oom"
        self.in_use_bytes += nbytes
        seq.num_computed_tokens = seq.num_prompt_tokens  # the prompt is computed at admission
        return "ok"

    def decode(self, seqs: list[Sequence]) -> list[Sequence]:
        """A reservation covers the request's final length: nobody ever needs to be preempted."""
        return []

    def free(self, seq: Sequence) -> None:
        self.in_use_bytes -= self.flat.slab_size(seq) * self.flat.bytes_per_token
        del self.tensors[seq.seq_id]


class PagedPool:
    """The whole budget allocated once (`empty(pool_bytes)`) and handed out in blocks by the paged allocator.

    A request that cannot grow by a block is preempted for recompute: its blocks are freed and it is
    re-admitted later with room for everything it had computed.
    """

    def __init__(self, paged, pool_bytes: int, empty: Callable[[int], object]):
        self.paged = paged  # kvsim.engine.paged.PagedAllocator
        self.pool = empty(pool_bytes)  # (pool_bytes,) uint8: never freed, never grown
        self.block_bytes = paged.spec.block_bytes

    @property
    def in_use_bytes(self) -> int:
        return (self.paged.pool.num_usable_blocks - self.paged.num_free_blocks) * self.block_bytes

    def can_ever_fit(self, seq: Sequence) -> bool:
        return self.paged.can_ever_fit(seq)

    def admit(self, seq: Sequence) -> str:
        """'ok', or 'full' when the free blocks (minus the watermark) cannot hold what it must compute."""
        target = seq.extra.pop("recompute", seq.num_prompt_tokens)
        if self.paged.allocate(seq, target) is None:
            seq.extra["recompute"] = target
            return "full"
        seq.num_computed_tokens = target
        return "ok"

    def decode(self, seqs: list[Sequence]) -> list[Sequence]:
        """One token each, in admission order; a request that cannot grow preempts the newest (possibly itself)
        until it can (vLLM's running loop). Returns the preempted ones, in admission order."""
        live, preempted, i = list(seqs), [], 0
        while i < len(live):
            seq = live[i]
            if self.paged.append_slots(seq, 1):
                i += 1
                continue
            while True:
                victim = live.pop()
                self.paged.free(victim)
                victim.extra["recompute"] = victim.num_computed_tokens
                victim.num_computed_tokens = 0
                preempted.append(victim)
                if victim is seq or self.paged.append_slots(seq, 1):
                    break
            if victim is seq:
                break
            i += 1
        return preempted[::-1]

    def free(self, seq: Sequence) -> None:
        self.paged.free(seq)


def replay_stream(requests, backend, *, bytes_per_token: int, max_num_seqs: int, step_s: float, sample_every: int,
                  stats: Callable[[], dict] = dict) -> tuple[list[dict], dict]:  # fmt: skip
    """Feed `requests` (kvsim.workload.requests.RequestSpec, by arrival) to `backend`, one decode token per running request
    per step of `step_s` simulated seconds; FCFS admission up to `max_num_seqs`.

    After a refusal (OOM or no room) admission waits until something is freed: retrying an allocation that
    just failed would only add OOMs. A refusal with nothing running rejects the request (it never fits). Returns the timeline (a row every `sample_every` steps and at every
    refusal) and the run's totals, including how many requests were admitted before the first OOM.
    `admissions` counts re-admissions after a preemption too (only the paged pool preempts).
    """
    seqs = [Sequence(r.request_id, r.num_prompt_tokens, r.max_tokens, arrival_time=r.arrival_time) for r in requests]
    waiting: deque[Sequence] = deque()
    running: list[Sequence] = []
    totals = dict(admissions=0, finished=0, rejected=0, ooms=0, refusals=0, preemptions=0, peak_running=0,
                  running_steps=0, admitted_before_first_oom=None, first_oom_step=None)  # fmt: skip
    rows: list[dict] = []
    step = nxt = 0
    blocked = False
    while nxt < len(seqs) or waiting or running:
        if not waiting and not running:  # idle: jump to the next arrival
            step = max(step, math.ceil(seqs[nxt].arrival_time / step_s))
        while nxt < len(seqs) and seqs[nxt].arrival_time <= step * step_s:
            waiting.append(seqs[nxt])
            nxt += 1
        refused = False
        while waiting and not blocked and len(running) < max_num_seqs:
            seq = waiting[0]
            if not backend.can_ever_fit(seq):
                waiting.popleft()
                totals["rejected"] += 1
                continue
            outcome = backend.admit(seq)
            if outcome != "ok":
                refused = True
                totals["refusals"] += 1
                if outcome == "oom":
                    totals["ooms"] += 1
                    if totals["admitted_before_first_oom"] is None:
                        totals["admitted_before_first_oom"], totals["first_oom_step"] = totals["admissions"], step
                if not running:  # refused on an idle device: waiting would never help
                    waiting.popleft()
                    totals["rejected"] += 1
                    continue
                blocked = True
                break
            waiting.popleft()
            running.append(seq)
            totals["admissions"] += 1
        totals["peak_running"] = max(totals["peak_running"], len(running))
        totals["running_steps"] += len(running)
        # a request admitted at its final KV (max_tokens 1: its prefill samples its only token) decodes nothing
        preempted = backend.decode([seq for seq in running if seq.num_computed_tokens < seq.num_final_tokens])
        waiting.extendleft(reversed(preempted))  # they go first again, in their admission order
        still = []
        for seq in running:
            if seq in preempted:
                continue
            seq.num_computed_tokens = min(seq.num_computed_tokens + 1, seq.num_final_tokens)
            if seq.num_computed_tokens >= seq.num_final_tokens:
                backend.free(seq)
                totals["finished"] += 1
            else:
                still.append(seq)
        blocked = blocked and len(still) == len(running)  # anything freed (finished or preempted) unblocks
        totals["preemptions"] += len(preempted)
        running = still
        if refused or step % sample_every == 0:
            rows.append(dict(
                step=step, time_s=step * step_s, running=len(running), waiting=len(waiting), **{
                    k: totals[k] for k in ("admissions", "finished", "rejected", "ooms", "refusals", "preemptions")},
                kv_in_use_bytes=backend.in_use_bytes,
                token_bytes=sum(s.num_computed_tokens for s in running) * bytes_per_token, **stats(),
            ))  # fmt: skip
        step += 1
    totals.update(steps=step, sim_time_s=step * step_s, mean_running=totals.pop("running_steps") / max(step, 1))
    return rows, totals
