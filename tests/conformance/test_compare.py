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


def test_a_schedule_round_trips_through_its_bytes():
    from kvsim.conformance.trace import decode_schedule, encode_schedule

    entries = [(7, 1, [[5, 6]]), (2, 300, [[1, 2, 3], [0, 0, 9]])]
    assert decode_schedule(encode_schedule(entries)) == {2: (300, ((1, 2, 3), (0, 0, 9))), 7: (1, ((5, 6),))}
    assert encode_schedule(entries) == encode_schedule(entries[::-1])  # request order does not matter


def test_equal_counts_with_other_requests_tokens_or_blocks_differ():
    """Same running count and token totals, but a request ran with other blocks, or other requests ran."""
    from dataclasses import replace

    from kvsim.conformance.trace import encode_schedule

    ran = encode_schedule([(0, 1, [[3, 4]]), (1, 1, [[7]])])
    other_blocks = encode_schedule([(0, 1, [[3, 5]]), (1, 1, [[7]])])
    other_request = encode_schedule([(0, 1, [[3, 4]]), (2, 1, [[7]])])
    other_split = encode_schedule([(0, 2, [[3, 4]]), (1, 0, [[7]])])  # 2 tokens in all, as before
    a = _trace("kvsim", STEPS, {0: 1, 1: 2})
    for changed, says in [(other_blocks, "request 0: kvsim 1 tokens, blocks [[3, 4]]; vLLM 1 tokens, blocks [[3, 5]]"),
                          (other_request, "request 1: kvsim 1 tokens, blocks [[7]]; vLLM did not run"),
                          (other_split, "request 0: kvsim 1 tokens, blocks [[3, 4]]; vLLM 2 tokens, blocks [[3, 4]]")]:
        a.steps[1] = replace(a.steps[1], scheduled=ran)
        b = _trace("vllm", STEPS, {0: 1, 1: 2})
        b.steps[1] = replace(b.steps[1], scheduled=changed)
        c = compare(a, b)
        assert c.differs and c.first_step == 1 and c.differing_steps == 1
        assert c.kvsim_state.record.compared()[:-2] == c.vllm_state.record.compared()[:-2]  # the counts agree
        assert says in c.schedule_difference
