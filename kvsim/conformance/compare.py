"""Compare two traces step by step: which steps differ, and both sides' state at the first that does."""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.conformance.trace import StepRecord, Trace, decode_schedule, decode_transfers

EVENTS = ("first_scheduled", "first_token", "finished")


@dataclass(frozen=True)
class StepState:
    """One side at one step: its record (None past its last step) and the requests' events there."""

    record: StepRecord | None
    events: dict[str, tuple[int, ...]]

    def describe(self) -> str:
        if self.record is None:
            return "no such step (finished earlier)"
        r = self.record
        parts = [f"{name}={getattr(r, name)!r}" for name in StepRecord.SHOWN]
        parts += [f"{name}={list(ids)}" for name, ids in self.events.items() if ids]
        return " ".join(parts)


@dataclass(frozen=True)
class Comparison:
    """The outcome for one stream: step counts, preemptions, differing steps, the first one's states."""

    kvsim_steps: int
    vllm_steps: int
    kvsim_preemptions: int
    vllm_preemptions: int
    differing_steps: int
    first_step: int | None  # the first differing step
    kvsim_state: StepState | None
    vllm_state: StepState | None
    rejected_kvsim: tuple[int, ...]  # request indices refused at arrival
    rejected_vllm: tuple[int, ...]
    blocks_kvsim: int  # the pools, null block included
    blocks_vllm: int
    # at the first differing step, the requests whose schedule differs: "request 7: kvsim 16 tokens, blocks ..."
    schedule_difference: tuple[str, ...] = ()

    @property
    def differs(self) -> bool:
        return self.differing_steps > 0 or self.rejected_kvsim != self.rejected_vllm or self.blocks_kvsim != self.blocks_vllm


def _events_by_step(trace: Trace) -> dict[int, dict[str, tuple[int, ...]]]:
    by_step: dict[int, dict[str, list[int]]] = {}
    for name in EVENTS:
        for index, step in getattr(trace, name).items():
            by_step.setdefault(step, {e: [] for e in EVENTS})[name].append(index)
    return {step: {e: tuple(sorted(ids)) for e, ids in events.items()} for step, events in by_step.items()}


def compare(kvsim: Trace, vllm: Trace) -> Comparison:
    """Every step where the compared fields or the requests' events differ, or only one side has the step."""
    empty = {e: () for e in EVENTS}
    ek, ev = _events_by_step(kvsim), _events_by_step(vllm)
    differing, first = 0, None
    for step in range(max(len(kvsim.steps), len(vllm.steps))):
        a = kvsim.steps[step] if step < len(kvsim.steps) else None
        b = vllm.steps[step] if step < len(vllm.steps) else None
        same = a is not None and b is not None and a.compared() == b.compared()
        if same and ek.get(step, empty) == ev.get(step, empty):
            continue
        differing += 1
        if first is None:
            first = step
    state = (lambda t, e, s: StepState(t.steps[s] if s < len(t.steps) else None, e.get(s, empty)))
    first_pair = [t.steps[first] if first is not None and first < len(t.steps) else None for t in (kvsim, vllm)]
    return Comparison(
        kvsim_steps=len(kvsim.steps),
        vllm_steps=len(vllm.steps),
        kvsim_preemptions=kvsim.num_preemptions,
        vllm_preemptions=vllm.num_preemptions,
        differing_steps=differing,
        first_step=first,
        kvsim_state=state(kvsim, ek, first) if first is not None else None,
        vllm_state=state(vllm, ev, first) if first is not None else None,
        rejected_kvsim=tuple(sorted(kvsim.rejected)),
        rejected_vllm=tuple(sorted(vllm.rejected)),
        blocks_kvsim=kvsim.num_gpu_blocks,
        blocks_vllm=vllm.num_gpu_blocks,
        schedule_difference=schedule_difference(*first_pair),
    )


def schedule_difference(a: StepRecord | None, b: StepRecord | None, limit: int = 4) -> tuple[str, ...]:
    """The requests that ran in only one of two steps, or with other token counts or block ids (at most
    `limit` of them, then how many more)."""
    if a is None or b is None:
        return ()
    lines = transfer_difference(a, b, limit)
    if a.scheduled == b.scheduled:
        return lines
    ka, kb = decode_schedule(a.scheduled), decode_schedule(b.scheduled)
    show = lambda e: "did not run" if e is None else f"{e[0]} tokens, blocks {[list(t) for t in e[1]]}"  # noqa: E731
    rows = [f"request {i}: kvsim {show(ka.get(i))}; vLLM {show(kb.get(i))}"
            for i in sorted(ka.keys() | kb.keys()) if ka.get(i) != kb.get(i)]
    more = [f"... and {len(rows) - limit} more requests"] if len(rows) > limit else []
    return lines + tuple(rows[:limit] + more)


def transfer_difference(a: StepRecord, b: StepRecord, limit: int = 4) -> tuple[str, ...]:
    """The CPU tier's events (loads, stores, flushes, completions, evictions, CPU hits) of a step that only one
    side has (at most `limit` a side)."""
    if a.transfers == b.transfers:
        return ()
    ea, eb = decode_transfers(a.transfers), decode_transfers(b.transfers)
    only_a = [e for e in ea if e not in eb]
    only_b = [e for e in eb if e not in ea]
    return tuple([f"CPU tier, kvsim only: {e}" for e in only_a[:limit]] + [f"CPU tier, vLLM only: {e}" for e in only_b[:limit]])
