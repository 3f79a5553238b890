"""The continuous-batching scheduler against hand-computed steps, over the real flat and paged allocators."""

from __future__ import annotations

import pytest

from kvsim.engine.factory import AllocatorConfig, make_allocator
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.clock.roofline import Roofline
from kvsim.replay.scheduler import Scheduler
from kvsim.replay.scheduler_output import SchedSeq

# 1 layer, 1 KV head, head_dim 1, bf16: K+V = 4 bytes per token; block_size 4 -> 16-byte blocks.
SPEC = KVCacheSpec.uniform(num_layers=1, num_kv_heads=1, head_dim=1, block_size=4)
BPT = SPEC.bytes_per_token


def make_seq(seq_id: int, prompt: int, output: int) -> SchedSeq:
    return SchedSeq(seq_id, prompt, output, index=seq_id)


def make_scheduler(config: AllocatorConfig, budget_tokens: int, **kwargs) -> Scheduler:
    max_model_len = kwargs.pop("max_model_len", 64)
    allocator = make_allocator(config, SPEC, budget_tokens * BPT, max_model_len=max_model_len)
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=max_model_len)
    defaults.update(kwargs)
    return Scheduler(allocator, **defaults)


def categories(b) -> tuple[int, int, int, int, int]:
    return (b.token_states_bytes, b.reservation_bytes, b.internal_fragmentation_bytes, b.external_fragmentation_bytes, b.free_bytes)


def test_hand_computed_paged_replay_with_recompute_preemption():
    """4 blocks of 4 tokens, token budget 8. A = 3+2, B = 4+1, C = 6+2 tokens (prompt + output).

    step 0: admit A (3 tokens), B (4), C (its first chunk: 1 token); 3 blocks held, 1 free.
    step 1: A and B decode (B takes the last block); C's next chunk (5 tokens) needs a 2nd block: none is
            free, C is the newest, so C preempts itself (recompute). B finishes.
    step 2: A decodes (takes a block), C is admitted again with its whole prompt (6 tokens, 2 blocks). A finishes.
    step 3, 4: C decodes; C finishes at step 4.
    """
    sched = make_scheduler(AllocatorConfig("paged", block_size=4, watermark=0.0), budget_tokens=16)
    a, b, c = make_seq(0, 3, 2), make_seq(1, 4, 1), make_seq(2, 6, 2)
    for seq in (a, b, c):
        assert sched.add_request(seq) is None

    expected = [
        # (prefills, decodes, preempted, finished, (token states, reservation, internal, external, free) in tokens)
        ([(a, 0, 3), (b, 0, 4), (c, 0, 1)], [], [], [], (0, 12, 0, 0, 4)),
        ([], [a, b], [c], [b], (7, 2, 3, 0, 4)),
        ([(c, 0, 6)], [a], [], [a], (4, 9, 3, 0, 0)),
        ([], [c], [], [], (6, 2, 0, 0, 8)),
        ([], [c], [], [c], (7, 1, 0, 0, 8)),
    ]
    for step, (prefills, decodes, preempted, finished, tokens) in enumerate(expected):
        out, rejected = sched.schedule()
        assert not rejected
        assert out.prefills == prefills, step
        assert out.decodes == decodes, step
        assert out.preempted == preempted, step
        assert categories(out.breakdown) == tuple(t * BPT for t in tokens), step
        assert sched.postprocess(out) == finished, step
    assert not sched.has_work
    assert c.num_preemptions == 1 and a.num_preemptions == 0 and b.num_preemptions == 0
    assert sched.allocator.num_free_blocks == 4


def test_flat_oracle_admits_while_slabs_fit_and_never_preempts():
    """16 slots, oracle slabs: A (final 8) and B (final 6) fit, C (final 6) waits for a slab to free."""
    sched = make_scheduler(AllocatorConfig("flat", reserve="oracle"), budget_tokens=16, max_num_batched_tokens=16)
    a, b, c = make_seq(0, 4, 4), make_seq(1, 3, 3), make_seq(2, 2, 4)
    for seq in (a, b, c):
        sched.add_request(seq)
    out, _ = sched.schedule()
    assert out.admitted == [a, b] and list(sched.waiting) == [c]
    # 14 slots reserved for tokens to come, 2 free but too few for C's 6-slot slab (and their total is too).
    assert categories(out.breakdown) == (0, 14 * BPT, 0, 0, 2 * BPT)
    finished_at = {}
    step = 0
    while sched.has_work:
        if step:
            out, _ = sched.schedule()
        assert not out.preempted
        for seq in sched.postprocess(out):
            finished_at[seq.seq_id] = step
        step += 1
    # B: prefill at step 0, 3 decodes -> finishes at step 3; C admitted at step 4, done 4 decodes later.
    assert finished_at == {1: 3, 0: 4, 2: 8}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_recovers_under_a_tight_budget(mode):
    """Eight requests that together need 3x the budget all finish; swap never recomputes, recompute does."""
    sched = make_scheduler(
        AllocatorConfig("paged", block_size=4, watermark=0.0),
        budget_tokens=32,
        max_num_batched_tokens=32,
        preemption=mode,
        swap_space_bytes=1 << 20,
    )
    seqs = [make_seq(i, 6 + i, 8) for i in range(8)]
    for seq in seqs:
        sched.add_request(seq)
    prefill_tokens = preemptions = 0
    finished = []
    for _ in range(500):
        if not sched.has_work:
            break
        out, rejected = sched.schedule()
        assert not rejected
        prefill_tokens += out.num_prefill_tokens
        preemptions += len(out.preempted)
        finished += sched.postprocess(out)
    assert sorted(s.seq_id for s in finished) == list(range(8))
    assert preemptions > 0
    prompts = sum(s.num_prompt_tokens for s in seqs)
    if mode == "swap":
        assert prefill_tokens == prompts  # swapped KV comes back; nothing is computed twice
        assert sched.swap_used_bytes == 0
    else:
        assert prefill_tokens > prompts  # preempted requests recompute prompt + output so far
    assert sched.allocator.num_free_blocks == 8


def test_swap_falls_back_to_recompute_without_swap_space():
    sched = make_scheduler(
        AllocatorConfig("paged", block_size=4, watermark=0.0), budget_tokens=16, preemption="swap", swap_space_bytes=0
    )
    for i in range(4):
        sched.add_request(make_seq(i, 4, 8))
    while sched.has_work:
        out, _ = sched.schedule()
        assert not sched.swapped
        sched.postprocess(out)


def test_requests_that_can_never_fit_are_rejected_with_a_reason():
    sched = make_scheduler(AllocatorConfig("paged", block_size=4, watermark=0.0), budget_tokens=16, max_model_len=20)
    too_long = make_seq(0, 15, 10)  # 25 tokens > max_model_len 20
    too_big = make_seq(1, 12, 8)  # 20 tokens: 5 blocks > the 4 there are
    assert "max_model_len 20" in sched.add_request(too_long)
    assert "more than the allocator can ever hold" in sched.add_request(too_big)
    assert not sched.has_work


def test_a_request_that_fits_nowhere_at_admission_is_rejected_not_waited_on():
    """Watermark: 2 of 4 blocks stay free at admission, so a 3-block prompt never gets in even alone."""
    sched = make_scheduler(AllocatorConfig("paged", block_size=4, watermark=0.5), budget_tokens=16, max_num_batched_tokens=16)
    seq = make_seq(0, 12, 0)
    if sched.add_request(seq) is None:  # the allocator may already refuse it up front
        out, rejected = sched.schedule()
        assert rejected == [(seq, "does not fit in the KV budget even when running alone")]
    assert not sched.has_work


def test_chunked_prefill_respects_the_token_budget_and_decodes_go_first():
    sched = make_scheduler(AllocatorConfig("paged", block_size=4, watermark=0.0), budget_tokens=64, max_num_batched_tokens=8)
    a, b = make_seq(0, 2, 5), make_seq(1, 20, 1)
    sched.add_request(a)
    sched.add_request(b)
    chunks = []
    while sched.has_work:
        out, _ = sched.schedule()
        assert out.num_prefill_tokens + len(out.decodes) <= 8
        chunks += [n for seq, _, n in out.prefills if seq is b]
        sched.postprocess(out)
    assert chunks == [6, 7, 7] and sum(chunks) == 20  # 8 minus A's prompt, then 8 minus A's decode token


def roofline() -> Roofline:
    return Roofline(
        weight_bytes=1e9, num_params=5e8, kv_bytes_per_token=4, attn_flops_per_ctx=0.0,
        hbm_bandwidth_bytes_per_s=1e12, peak_flops=1e15,
    )


def test_decode_runs_cover_identical_steps_and_keep_finishes_exact():
    """With nothing waiting, one row covers decode steps up to the next finish; the steps add up exactly."""
    def replay(allow_runs: bool):
        sched = make_scheduler(
            AllocatorConfig("paged", block_size=4, watermark=0.0), budget_tokens=256, max_num_batched_tokens=64,
            roofline=roofline(), allow_runs=allow_runs,
        )
        seqs = [make_seq(0, 5, 40), make_seq(1, 9, 17)]
        for seq in seqs:
            sched.add_request(seq)
        rows, steps, finish_step = 0, 0, {}
        while sched.has_work:
            out, _ = sched.schedule()
            rows += 1
            steps += out.num_steps
            for seq in sched.postprocess(out):
                finish_step[seq.seq_id] = steps
        return rows, steps, finish_step

    rows, steps, finished = replay(allow_runs=True)
    exact_rows, exact_steps, exact_finished = replay(allow_runs=False)
    assert exact_rows == exact_steps == 41  # 1 prefill step + 40 decode steps of request 0
    assert steps == 41 and finished == exact_finished == {1: 18, 0: 41}
    assert rows == 3  # prefill; a run to request 1's finish; a run to request 0's


def test_decode_run_stops_before_the_paged_pool_could_run_out():
    """A run may only cover steps whose blocks are free now: no preemption is ever skipped inside a run."""
    sched = make_scheduler(
        AllocatorConfig("paged", block_size=4, watermark=0.0), budget_tokens=16, max_num_batched_tokens=64,
        roofline=roofline(),
    )
    seq = make_seq(0, 4, 12)  # 16 tokens: exactly the pool
    sched.add_request(seq)
    out, _ = sched.schedule()
    sched.postprocess(out)
    # The first decode step takes a 2nd block; the 2 left free bound the run to 2 * 4 + 1 steps (each
    # request may need ceil((k - 1) / block_size) new blocks), although the last of them could have waited.
    out, _ = sched.schedule()
    assert out.num_steps == 9 and not out.preempted and sched.allocator.num_free_blocks == 0
    assert sched.postprocess(out) == []
    for last in (False, False, True):  # no free block left: the rest go one step at a time
        out, _ = sched.schedule()
        assert out.num_steps == 1 and sched.postprocess(out) == ([seq] if last else [])


def test_decode_runs_on_a_mixed_sliding_window_model_never_overdraw_the_pool():
    """Blocks of full and sliding layers take several pool pages: a run's bound counts pages, not blocks."""
    from kvsim.size.kv_cache_spec import KVCacheGroupSpec

    spec = KVCacheSpec(
        groups=(KVCacheGroupSpec("full", 1, bytes_per_token=4), KVCacheGroupSpec("sliding", 1, bytes_per_token=4, window=8)),
        block_size=4, dtype="bf16", dtype_bytes=2, num_kv_heads=1, head_dim=1, num_attention_layers=2,
    )
    allocator = make_allocator(AllocatorConfig("paged", block_size=4, watermark=0.0), spec, 40 * 8, max_model_len=64)
    sched = Scheduler(allocator, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, roofline=roofline())
    seqs = [make_seq(i, 5 + i, 20) for i in range(4)]
    for seq in seqs:
        sched.add_request(seq)
    finished, rows, steps = [], 0, 0
    while sched.has_work and rows < 500:
        out, _ = sched.schedule()
        rows += 1
        steps += out.num_steps
        finished += sched.postprocess(out)
    assert sorted(s.seq_id for s in finished) == [0, 1, 2, 3]
    assert rows < steps  # runs happened, and none of them failed an append (that would assert)


def test_a_rejection_names_the_flat_reservation_or_the_watermark_that_refused_it():
    """The reason said only "needs N tokens": true of neither a flat-max slab nor a prompt the watermark shuts out."""
    flat = make_scheduler(AllocatorConfig("flat", reserve="max"), budget_tokens=40, max_model_len=64)
    assert flat.add_request(make_seq(0, 5, 5)) == (
        "its slab of 64 token slots (max reservation), more than the allocator can ever hold")
    paged = make_scheduler(AllocatorConfig("paged", block_size=4, watermark=0.5), budget_tokens=16)
    assert paged.add_request(make_seq(1, 12, 0)) == (
        "needs 12 tokens of KV, more than the allocator can ever hold "
        "(admission keeps 2 of its 4 blocks free: the watermark)")
    assert paged.add_request(make_seq(2, 8, 0)) is None  # 2 blocks: admitted alongside the 2 kept free
