"""What the scheduler schedules and hands on: a request's scheduling state (`SchedSeq`) and one scheduled
row of them (`SchedulerOutput`), which the model runner executes and the replay records."""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.engine.allocator import MemoryBreakdown
from kvsim.engine.sequence import Sequence


@dataclass(eq=False, repr=False)
class SchedSeq(Sequence):
    """A `Sequence` plus the scheduler's bookkeeping.

    `prefill_target` is how many tokens must be computed before the request decodes: its prompt, or after a
    recompute preemption everything it had computed (prompt + output so far), as vLLM recomputes both.
    """

    index: int = 0  # position in the request stream: the row of the per-request records
    prefill_target: int = 0
    num_preemptions: int = 0
    swap_handle: object = None  # the cache's handle of KV swapped to the CPU pool (None: accounting only)
    swap_tokens: int = 0  # computed tokens that sit in the CPU pool while swapped out
    final_tokens: int = 0  # num_final_tokens as a plain attribute: read on every step

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefill_target == 0:
            self.prefill_target = self.num_prompt_tokens
        self.final_tokens = self.num_prompt_tokens + self.max_tokens


class SchedulerOutput:
    """One scheduled row: `num_steps` steps of the same batch (1 unless a run of pure decode steps).

    `prefills` are (seq, start, num_tokens) chunks; `decodes` each compute one token per step starting at
    `seq.num_computed_tokens`. `breakdown` is the memory while the row runs (for a run: at its middle step).
    A plain class with slots: one is built per row, on the replay's hot path.
    """

    __slots__ = ("prefills", "decodes", "num_steps", "admitted", "preempted", "swapped_in", "swap_bytes", "breakdown", "run_time_s")

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

    @property
    def num_prefill_tokens(self) -> int:
        return sum(chunk[2] for chunk in self.prefills)

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decodes) * self.num_steps
