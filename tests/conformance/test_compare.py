"""The comparison of two traces, on hand-made traces (no vLLM needed)."""

from __future__ import annotations

from kvsim.conformance.compare import compare
from kvsim.conformance.trace import StepRecord, Trace


def _trace(side, steps, finished, rejected=()):
    t = Trace(side, 100, [StepRecord(0.01 * i, *s) for i, s in enumerate(steps)])
    t.first_scheduled = {0: 0, 1: 0}
    t.first_token = {0: 0, 1: 0}
    t.finished = finished
    t.rejected = set(rejected)
    return t


STEPS = [(2, 20, 0, 0, 0), (2, 0, 2, 0, 0), (1, 0, 1, 0, 0)]


def test_equal_traces_do_not_differ():
    c = compare(_trace("kvsim", STEPS, {0: 1, 1: 2}), _trace("vllm", STEPS, {0: 1, 1: 2}))
    assert not c.differs and c.differing_steps == 0 and c.first_step is None


def test_a_finish_one_step_later_differs_at_both_steps():
    c = compare(_trace("kvsim", STEPS + [(1, 0, 1, 0, 0)], {0: 1, 1: 3}), _trace("vllm", STEPS, {0: 1, 1: 2}))
    assert c.differing_steps == 2  # step 2 (vLLM finishes request 1) and step 3 (only kvsim has it)
    assert c.first_step == 2
    assert c.vllm_state.events["finished"] == (1,) and c.kvsim_state.events["finished"] == ()
    assert "finished=[1]" in c.vllm_state.describe()


def test_a_field_differs_and_a_missing_step_is_described():
    other = [STEPS[0], (2, 0, 2, 1, 0)]
    c = compare(_trace("kvsim", STEPS, {0: 1}), _trace("vllm", other, {0: 1}))
    assert c.first_step == 1 and c.differing_steps == 2
    assert c.vllm_state.describe().split()[4] == "preemptions=1"  # after time_s, running, prefill, decode
    assert compare(_trace("kvsim", STEPS, {}), _trace("vllm", STEPS[:2], {})).vllm_state.describe().startswith("no such step")


def test_rejections_alone_make_a_difference():
    c = compare(_trace("kvsim", STEPS, {}, rejected=[5]), _trace("vllm", STEPS, {}))
    assert c.differing_steps == 0 and c.differs
