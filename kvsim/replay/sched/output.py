"""What the scheduler schedules and hands on: a request's scheduling state (`SchedSeq`) and one scheduled
row of them (`SchedulerOutput`), which the model runner executes and the replay records."""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter

from kvsim.engine.allocator import MemoryBreakdown
from kvsim.engine.sequence import Sequence

_chunk_tokens = itemgetter(2)  # a prefill chunk's (seq, start, num_tokens): its tokens


@dataclass(eq=False, repr=False)
class SchedSeq(Sequence):
    """A `Sequence` plus the scheduler's bookkeeping, as vLLM v1's `Request` counts tokens.

    `max_tokens` is how many output tokens it samples (vLLM's `max_tokens`, capped by the scheduler so prompt +
    output stays within max_model_len). A step that completes its prefill samples the first; each decode step
    computes the last sampled token and samples the next. It finishes once it has `max_tokens` (vLLM's
    `check_stop`), so the KV of its last sampled token is never written: it holds at most
    `num_final_tokens = prompt + max_tokens - 1` tokens of KV (`Sequence.num_final_tokens`).

    `num_tokens` is prompt + output sampled so far: what it must have computed before it samples again.
    `prefill_target` is `num_tokens` when it was last admitted: the tokens of that (re)admission's prefill
    (after a recompute preemption, prompt + output so far, as vLLM recomputes both).
    """

    index: int = 0  # position in the request stream: the row of the per-request records
    prefill_target: int = 0
    num_output_tokens: int = 0  # sampled so far
    num_output_placeholders: int = 0  # async scheduling: tokens sampled in a step whose output is not back yet
    stale_output: bool = False  # async scheduling: preempted with a step's output still in flight
    num_preemptions: int = 0
    swap_handle: object = None  # the cache's handle of KV swapped to the CPU pool (None: accounting only)
    swap_tokens: int = 0  # computed tokens that sit in the CPU pool while swapped out
    # async scheduling with prefix caching: full blocks (of `KVAllocator.block_size`) the allocator was last asked
    # to cache since its admission; it caches nothing new until a call reaches past them (0 after a preemption)
    num_cache_asked_blocks: int = 0
    num_finish_tokens: int = 0  # prompt + max_tokens: `num_tokens` once it has finished (kept by `set_max_tokens`)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefill_target == 0:
            self.prefill_target = self.num_prompt_tokens
        self.num_finish_tokens = self.num_prompt_tokens + self.max_tokens

    @property
    def num_tokens(self) -> int:
        """Prompt + output sampled so far (vLLM's `Request.num_tokens`)."""
        return self.num_prompt_tokens + self.num_output_tokens

    def set_max_tokens(self, max_tokens: int) -> None:
        """Cap how many tokens it samples (at least one: a prefill always samples)."""
        self.max_tokens = max(1, max_tokens)
        self.num_finish_tokens = self.num_prompt_tokens + self.max_tokens


class SchedulerOutput:
    """One scheduled row: `num_steps` steps of the same batch (1 unless a run of pure decode steps).

    `prefills` are (seq, start, num_tokens) chunks; `decodes` each compute one token per step starting at
    `seq.num_computed_tokens`. `breakdown` is the memory while the row runs (for a run: at its middle step).
    A plain class with slots: one is built per row, on the replay's hot path.
    """

    __slots__ = (
        "prefills", "decodes", "num_steps", "admitted", "preempted", "swapped_in", "swap_bytes", "breakdown",
        "run_time_s", "last_step_start_s", "sampled",
    )

    def __init__(self) -> None:
        self.prefills: list[tuple[SchedSeq, int, int]] = []
        self.decodes: list[SchedSeq] = []
        self.num_steps = 1
        self.admitted: list[SchedSeq] = []
        self.preempted: list[SchedSeq] = []
        self.swapped_in: list[SchedSeq] = []
        self.swap_bytes = 0
        self.breakdown: MemoryBreakdown | None = None
        self.run_time_s: float | None = None  # a decode run's roofline time, computed while sizing it
        self.last_step_start_s = 0.0  # async scheduling: seconds from a decode run's start to its last step's
        self.sampled: list[SchedSeq] = []  # requests that sample a token in this row (set when it has run)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(map(_chunk_tokens, self.prefills)) if self.prefills else 0

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decodes) * self.num_steps
