"""What one side (vLLM's scheduler or kvsim's replay) did, step by step: the record both sides fill alike.

A step is one batch that computed at least one token, numbered from 0 in the order it was scheduled.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepRecord:
    """One step as seen right after it was scheduled; `time_s` is when it starts to run (with async
    scheduling a step is scheduled while the one before runs, and starts when that one ends).

    `running`: requests in the running queue after scheduling; `prefill_tokens`: tokens of (re)prefills, a
    prompt or, after a recompute preemption, every token the request had; `decode_tokens`: one per request
    computing its latest sampled token; `preemptions`: requests preempted while building this step;
    `prefix_hit_tokens`: tokens of admitted requests found in the prefix cache; `scheduled`: which requests ran,
    the tokens each computed and their block ids (`encode_schedule`).
    """

    time_s: float
    running: int
    prefill_tokens: int
    decode_tokens: int
    preemptions: int
    prefix_hit_tokens: int
    scheduled: bytes = b""
    transfers: bytes = b""  # the CPU tier's events since the step before (`encode_transfers`); empty without one

    # time_s too: both sides price a step with kvsim's roofline, so equal steps give equal clocks, bit for bit
    COMPARED = ("time_s", "running", "prefill_tokens", "decode_tokens", "preemptions", "prefix_hit_tokens", "scheduled",
                "transfers")
    SHOWN = COMPARED[:-2]  # `scheduled` and `transfers` are described event by event where the sides differ

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


def tail_blocks(num_tokens: int, block_size: int, admitted: bool) -> int | None:
    """How many trailing block ids of each group's table a step records for a request: all of them when the
    request was (re)admitted (its prefix-cache hits included), else those the step's tokens can touch."""
    return None if admitted else -(-num_tokens // block_size) + 1


def encode_schedule(entries: list[tuple[int, int, list[list[int]]]]) -> bytes:
    """A step's schedule as one compact value: per request (sorted by index) its index, tokens computed, and each
    KV cache group's recorded block ids. Bytes: a long stream holds one per step, compared whole."""
    flat = array("q")
    for index, num_tokens, tables in sorted(entries, key=lambda e: e[0]):
        flat.extend((index, num_tokens, len(tables)))
        for ids in tables:
            flat.append(len(ids))
            flat.extend(ids)
    return flat.tobytes()


def decode_schedule(data: bytes) -> dict[int, tuple[int, tuple[tuple[int, ...], ...]]]:
    """`encode_schedule`'s inverse: request index -> (tokens computed, block ids per group)."""
    flat = array("q")
    flat.frombytes(data)
    out, k = {}, 0
    while k < len(flat):
        index, num_tokens, num_groups = flat[k : k + 3]
        k += 3
        tables = []
        for _ in range(num_groups):
            n = flat[k]
            tables.append(tuple(flat[k + 1 : k + 1 + n]))
            k += 1 + n
        out[index] = (num_tokens, tuple(tables))
    return out


# The CPU tier's events, as both sides record them (kvsim's connector; vLLM's connector metadata, its worker's
# reports and its manager's answers): a load or store job (its id, request index, GPU block ids and CPU chunk ids),
# a job to flush, a job reported finished, chunks evicted by a store, and a request's CPU hit in tokens.
LOAD, STORE, FLUSH, DONE, EVICT, HIT = 1, 2, 3, 4, 5, 6
EVENT_NAMES = {LOAD: "load", STORE: "store", FLUSH: "flush", DONE: "done", EVICT: "evict", HIT: "cpu hit"}


def encode_transfers(events: list[tuple]) -> bytes:
    """Events (tuples of ints and int lists, the kind first) as one compact value, in a canonical order."""
    flat = array("q")
    for event in sorted(events, key=lambda e: tuple(x if isinstance(x, int) else -1 for x in e)):
        flat.append(len(event))
        for x in event:
            if isinstance(x, int):
                flat.extend((0, x))
            else:
                flat.extend((1, len(x)))
                flat.extend(x)
    return flat.tobytes()


def decode_transfers(data: bytes) -> list[str]:
    """`encode_transfers`' events, one line each ("load job 3 request 7 gpu [..] cpu [..]")."""
    flat = array("q")
    flat.frombytes(data)
    out, k = [], 0
    while k < len(flat):
        n, k = flat[k], k + 1
        fields = []
        for _ in range(n):
            if flat[k] == 0:
                fields.append(flat[k + 1])
                k += 2
            else:
                m = flat[k + 1]
                fields.append(list(flat[k + 2 : k + 2 + m]))
                k += 2 + m
        out.append(f"{EVENT_NAMES.get(fields[0], fields[0])} {fields[1:]}")
    return out
