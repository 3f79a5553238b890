"""The scheduler's prefill chunks on a hybrid model in mamba_cache_mode align (vLLM's
`Scheduler._mamba_block_aligned_split`), by hand over the real allocator."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.engine.factory import AllocatorConfig
from kvsim.engine.paged.kv_cache_manager import HybridPagedAllocator
from kvsim.errors import KvsimError
from kvsim.models.catalogue import resolve_model
from kvsim.replay.sched.output import SchedSeq
from kvsim.replay.sched.scheduler import Scheduler
from tests.engine.test_paged_mamba_align import SPEC  # a state group and a full group, block_size 4


def make_scheduler(alignment: int, budget: int, *, caching: bool = True, num_blocks: int = 33) -> Scheduler:
    alloc = HybridPagedAllocator(SPEC, num_blocks * 64, max_model_len=64, enable_prefix_caching=caching,
                                 mamba_checkpoint_alignment=alignment if caching else 0)
    return Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64)


def seq(seq_id: int, prompt: int, output: int = 2) -> SchedSeq:
    s = SchedSeq(seq_id, prompt, output, index=seq_id)
    s.token_ids = np.arange(prompt + output, dtype=np.int64)  # every request the same prefix
    return s


def chunks(sched: Scheduler, *seqs: SchedSeq) -> list[list[tuple[int, int, int]]]:
    """Step until idle: per step, its prefill chunks as (request, start, tokens)."""
    for s in seqs:
        assert sched.add_request(s) is None
    steps = []
    while sched.has_work and len(steps) < 100:
        out, rejected = sched.schedule()
        assert not rejected
        steps.append([(s.seq_id, start, n) for s, start, n in out.prefills])
        sched.postprocess(out)
    return steps


@pytest.mark.parametrize("alignment, expected", [
    (2, [[(0, 0, 10)]]),  # the state after 8 exported from inside the chunk (8 - 0 is a multiple of 2)
    (0, [[(0, 0, 8)], [(0, 8, 2)]]),  # no checkpoints: the chunk stops at 8 so that state is a chunk's end
])
def test_a_prompt_stops_at_its_last_block_boundary_unless_the_layers_export_it(alignment, expected):
    assert chunks(make_scheduler(alignment, budget=64), seq(0, 10))[:len(expected)] == expected


def test_without_mamba_align_the_prompt_runs_in_one_chunk():
    """The case the alignment changes: prefix caching off (mamba_cache_mode none) computes the prompt at once."""
    assert chunks(make_scheduler(0, budget=64, caching=False), seq(0, 10))[0] == [(0, 0, 10)]


def test_a_chunk_before_the_prefill_end_is_cut_to_a_block_boundary():
    # budget 6: [0, 6) ends mid-block -> [0, 4); then [4, 10) reaches the end, exporting the state after 8
    assert chunks(make_scheduler(2, budget=6), seq(0, 10))[:2] == [[(0, 0, 4)], [(0, 4, 6)]]


def test_a_block_wider_than_the_budget_runs_on_and_realigns_at_the_next_boundary():
    # budget 3 < block 4: [0, 3) cannot reach a boundary and runs on; [3, 4) re-aligns; [4, 7); [7, 8); then
    # [8, 10) (no checkpoints: 8 is the last boundary, already a chunk's end)
    steps = chunks(make_scheduler(0, budget=3), seq(0, 10))
    assert [c for step in steps for c in step][:5] == [(0, 0, 3), (0, 3, 1), (0, 4, 3), (0, 7, 1), (0, 8, 2)]


def test_the_same_prompt_hits_the_cached_state_a_step_later():
    """A caches the state after 8 (its prompt's last boundary) in step 0; B, the same 10 tokens admitted in the
    same step, cannot hit a state cached in this step (vLLM's `cached_blocks_this_step`): admission stops; in
    step 1 B hits 8 tokens and computes the last 2."""
    steps = chunks(make_scheduler(2, budget=64), seq(0, 10), seq(1, 10))
    assert steps[0] == [(0, 0, 10)] and steps[1] == [(1, 8, 2)]


def test_a_chunk_stops_at_a_shared_prefix_junction_whose_state_no_one_cached():
    """A (13 tokens) caches full-attention blocks 0-2 but, under retention 0, only the state after 12. B shares
    A's first 10 tokens: full attention hits 8 tokens, the state group nothing, so B's hit is 0 and the shared
    prefix ends at 8 (vLLM's `shared_prefix_boundary`): B's first chunk stops there, so that state is cached for
    the next request sharing the prefix (Marconi's junction), then B runs the rest."""
    b = seq(1, 20)
    b.token_ids[10:] += 1000
    sched = make_scheduler(2, budget=64)
    steps = chunks(sched, seq(0, 13), b)
    assert steps[0] == [(0, 0, 13), (1, 0, 8)] and steps[1] == [(1, 8, 12)]


def test_with_serve_defaults_follows_vllm_serve_per_model_and_gpu():
    qwen3_next, llama = resolve_model("qwen3-next-80b-a3b"), resolve_model("llama-3.1-8b")
    paged = AllocatorConfig("paged")
    hopper = paged.with_serve_defaults(qwen3_next, "h200")
    assert (hopper.prefix_caching, hopper.mamba_checkpoint_alignment, hopper.mamba_cache_mode) == (True, 64, "align")
    ampere = paged.with_serve_defaults(qwen3_next, "a100-80gb")  # Triton's gated delta net prefill: no checkpoints
    assert (ampere.prefix_caching, ampere.mamba_checkpoint_alignment) == (True, 0)
    off = AllocatorConfig("paged", prefix_caching=False).with_serve_defaults(qwen3_next, "h200")
    assert (off.prefix_caching, off.mamba_checkpoint_alignment, off.mamba_cache_mode) == (False, 0, "none")
    dense = paged.with_serve_defaults(llama, "h200")  # kvsim's default for a model without state layers: off
    assert (dense.prefix_caching, dense.mamba_checkpoint_alignment) == (False, 0)
    given = AllocatorConfig("paged", mamba_checkpoint_alignment=1).with_serve_defaults(qwen3_next, "a100-80gb")
    assert given.mamba_checkpoint_alignment == 1
    with pytest.raises(KvsimError, match="mamba_checkpoint_alignment"):
        AllocatorConfig("paged", prefix_caching=False, mamba_checkpoint_alignment=64).with_serve_defaults(qwen3_next, "h200")
