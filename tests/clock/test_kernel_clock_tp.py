"""The kernels-db clock at tensor (and expert) parallelism: steps against aiconfigurator's engine compiled at
the same tp, the all-reduces inside the step, MoE experts split by tp or ep, errors (skipped without the extra)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvsim.clock import kernels_db as kc
from kvsim.errors import KvsimError
from kvsim.models.catalogue import resolve_model
from kvsim.models.hardware import get_gpu

pytestmark = pytest.mark.skipif(not kc.available(), reason="aiconfigurator-core (the perfdb extra) is not installed")


def _out(prefills=(), decodes=()):
    """A SchedulerOutput's shape: prefills as (seq, start, num), decodes as sequences."""
    return SimpleNamespace(prefills=[(None, s, n) for s, n in prefills],
                           decodes=[SimpleNamespace(num_computed_tokens=c) for c in decodes])


@pytest.mark.parametrize("name,tp,ep", [("llama-3.1-70b", 2, 1), ("qwen3-32b", 8, 1), ("qwen3-30b-a3b", 4, 1),
                                        ("qwen3-30b-a3b", 8, 8)])
def test_a_static_prefill_step_is_the_sdks_context_phase_at_that_tp(name, tp, ep):
    """B prompts of 1024 tokens in one step take what the SDK's static mode at the same tp says its context
    phase takes (the MoE's op list leaves its logits GEMM out of the context phase: added, as at tp 1)."""
    clock = kc.kernel_clock(resolve_model(name), get_gpu("h100-80gb"), tp=tp, ep=ep)
    context_ms, _, _ = clock._handle.run_static(batch_size=8, isl=1024, osl=2)
    logits_ms = 0.0 if clock._ctx[2] else clock._sum(("gl", 8), False, clock._gen[2], batch_size=8, s=1)
    assert clock.output_time(_out(prefills=[(0, 1024)] * 8)) == pytest.approx((context_ms + logits_ms) * 1e-3, rel=1e-9)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_decode_step_is_the_sdks_generation_ops_at_that_tp_all_reduces_included(tp):
    clock = kc.kernel_clock(resolve_model("llama-3.1-70b"), get_gpu("h100-80gb"), tp=tp)
    ops = clock._handle.evaluate_generation_ops(list(range(clock._num_ops[1])), batch_size=16, s=2048)
    names = [op[0] for op in ops]
    assert {"generation_ar_1", "generation_ar_2", "generation_embedding_ar"} <= set(names)
    assert all(op[1] > 0 for op in ops if op[0].endswith("_ar_1"))  # an all-reduce costs time at tp > 1
    assert clock.output_time(_out(decodes=[2047] * 16)) == pytest.approx(sum(op[1] for op in ops) * 1e-3, rel=1e-9)


def test_more_ranks_make_a_step_shorter_and_the_label_says_tp():
    gpu, model = get_gpu("h100-80gb"), resolve_model("llama-3.1-70b")
    times = [kc.kernel_clock(model, gpu, tp=tp).output_time(_out(prefills=[(0, 2048)], decodes=[1000] * 32))
             for tp in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)
    assert kc.kernel_clock(model, gpu, tp=4).label.endswith(", tp 4)")
    assert ", tp" not in kc.kernel_clock(model, gpu).label  # tp 1 reads as before


def test_expert_parallelism_is_its_own_layout():
    gpu, model = get_gpu("h100-80gb"), resolve_model("qwen3-30b-a3b")
    by_tp, by_ep = kc.kernel_clock(model, gpu, tp=4), kc.kernel_clock(model, gpu, tp=4, ep=4)
    assert by_ep.num_experts == 128 and by_ep.label.endswith(", tp 4, ep 4)")
    step = _out(prefills=[(0, 1024)] * 4)
    assert by_ep.output_time(step) != pytest.approx(by_tp.output_time(step), rel=1e-3)


def test_ep_errors_name_the_field():
    gpu = get_gpu("h100-80gb")
    with pytest.raises(KvsimError, match=r"^ep: ep 2 with tp 4: vLLM's expert parallelism spans every tp rank"):
        kc.kernel_clock(resolve_model("qwen3-30b-a3b"), gpu, tp=4, ep=2)
    with pytest.raises(KvsimError, match=r"^ep: ep 2: qwen3-32b has no experts to split"):
        kc.kernel_clock(resolve_model("qwen3-32b"), gpu, tp=2, ep=2)
