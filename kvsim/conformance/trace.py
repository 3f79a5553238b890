"""What one side (vLLM's scheduler or kvsim's replay) did, step by step: the record both sides fill alike.

A step is one batch that computed at least one token, numbered from 0 in the order it was scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepRecord:
    """One step as seen right after it was scheduled; `time_s` is when it starts to run (with async
    scheduling a step is scheduled while the one before runs, and starts when that one ends).

    `running`: requests in the running queue after scheduling; `prefill_tokens`: tokens of (re)prefills, a
    prompt or, after a recompute preemption, every token the request had; `decode_tokens`: one per request
    computing its latest sampled token; `preemptions`: requests preempted while building this step;
    `prefix_hit_tokens`: tokens of admitted requests found in the prefix cache.
    """

    time_s: float
    running: int
    prefill_tokens: int
    decode_tokens: int
    preemptions: int
    prefix_hit_tokens: int

    # time_s too: both sides price a step with kvsim's roofline, so equal steps give equal clocks, bit for bit
    COMPARED = ("time_s", "running", "prefill_tokens", "decode_tokens", "preemptions", "prefix_hit_tokens")

    def compared(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in self.COMPARED)


@dataclass
class Trace:
    """A side's steps and, per request index, the step of its first scheduling, first token and finish.

    `rejected` holds the indices of requests refused at arrival (never scheduled); `num_gpu_blocks` is the
    pool the side ran with, null block included.
    """

    side: str
    num_gpu_blocks: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    first_scheduled: dict[int, int] = field(default_factory=dict)
    first_token: dict[int, int] = field(default_factory=dict)
    finished: dict[int, int] = field(default_factory=dict)
    rejected: set[int] = field(default_factory=set)

    @property
    def num_preemptions(self) -> int:
        return sum(s.preemptions for s in self.steps)

    def events_at(self, step: int) -> dict[str, list[int]]:
        """The requests first scheduled, given their first token, and finished at `step` (sorted indices)."""
        return {
            name: sorted(i for i, s in getattr(self, name).items() if s == step)
            for name in ("first_scheduled", "first_token", "finished")
        }
