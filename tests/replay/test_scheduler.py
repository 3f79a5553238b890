"""The continuous-batching scheduler against hand-computed steps, over the real flat and paged allocators."""

from __future__ import annotations

import pytest

from kvsim.engine.factory import AllocatorConfig, make_allocator
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.clock.roofline import Roofline
from kvsim.replay.sched.scheduler import Scheduler
from kvsim.replay.sched.output import SchedSeq

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


def run_steps(sched: Scheduler, max_steps: int = 500) -> list[tuple]:
    """Step `sched` until idle: per step (admitted, prefills, decodes, preempted, finished)."""
    steps = []
    while sched.has_work and len(steps) < max_steps:
        out, rejected = sched.schedule()
        assert not rejected
        admitted, prefills, decodes, preempted = list(out.admitted), list(out.prefills), list(out.decodes), list(out.preempted)
        steps.append((admitted, prefills, decodes, preempted, sched.postprocess(out)))
    assert not sched.has_work
    return steps


def test_hand_computed_steps_sample_at_prefill_end_and_finish_at_max_tokens():
    """5 blocks of 4 tokens (block 0 is the null block: 4 usable), token budget 8. A = 3 + 2, B = 4 + 1,
    C = 6 + 2 (prompt + max_tokens). A request holds KV for prompt + max_tokens - 1 tokens at most.

    step 0: admit A (3 tokens), B (4), C (its first chunk: 1 token; all 6 fit in the 3 free blocks): 3 blocks
            held, 1 free. A's and B's prefills sample their first token; B has its 1 token: finished.
    step 1: A decodes (its 4th token, in its block), C's last chunk (5 tokens: a 2nd block). C samples;
            A has its 2 tokens: finished, never writing the KV of its last.
    step 2: C decodes its 7th token and samples its 2nd: finished. 3 steps, no extra decode step.
    """
    sched = make_scheduler(AllocatorConfig("paged", block_size=4), budget_tokens=20)
    a, b, c = make_seq(0, 3, 2), make_seq(1, 4, 1), make_seq(2, 6, 2)
    for seq in (a, b, c):
        assert sched.add_request(seq) is None

    expected = [
        # (prefills, decodes, finished, (token states, reservation, internal, external, free) in tokens)
        ([(a, 0, 3), (b, 0, 4), (c, 0, 1)], [], [b], (0, 12, 4, 0, 4)),
        ([(c, 1, 5)], [a], [a], (4, 7, 5, 0, 4)),
        ([], [c], [c], (6, 1, 5, 0, 8)),
    ]
    for step, (prefills, decodes, finished, tokens) in enumerate(expected):
        out, rejected = sched.schedule()
        assert not rejected and not out.preempted
        assert out.prefills == prefills, step
        assert out.decodes == decodes, step
        assert categories(out.breakdown) == tuple(t * BPT for t in tokens), step
        assert sched.postprocess(out) == finished, step
    assert not sched.has_work
    assert (a.num_output_tokens, b.num_output_tokens, c.num_output_tokens) == (2, 1, 2)
    assert sched.allocator.num_free_blocks == 4


def test_decode_preemption_takes_the_newest_only_while_the_same_request_cannot_grow():
    """8 blocks of 4 (7 usable), token budget 32. A, B, C = 4 + 3 (one block each), D = 12 + 2 (three).

    step 0: all four admitted: 6 blocks held, 1 free. Each prefill samples a token.
    step 1: A's decode takes the free block. B's cannot grow: the newest running request, D, is preempted
            (3 blocks back), and B grows. C grows too: one victim (collecting every request that could not
            grow and preempting for each would also have taken C).
    step 2: A, B, C decode and finish. D waits: all its 13 tokens (prompt + the token it sampled) need 4
            blocks and 1 is free.
    step 3: D is admitted again with nothing computed and prefills all 13 tokens; that prefill samples its
            2nd token, so it finishes without a decode step.
    """
    sched = make_scheduler(AllocatorConfig("paged", block_size=4), budget_tokens=32, max_num_batched_tokens=32)
    a, b, c, d = make_seq(0, 4, 3), make_seq(1, 4, 3), make_seq(2, 4, 3), make_seq(3, 12, 2)
    for seq in (a, b, c, d):
        assert sched.add_request(seq) is None
    steps = run_steps(sched)
    assert steps == [
        # (admitted, prefills, decodes, preempted, finished)
        ([a, b, c, d], [(a, 0, 4), (b, 0, 4), (c, 0, 4), (d, 0, 12)], [], [], []),
        ([], [], [a, b, c], [d], []),
        ([], [], [a, b, c], [], [a, b, c]),
        ([d], [(d, 0, 13)], [], [], [d]),
    ]
    assert (d.num_preemptions, d.num_output_tokens, d.num_cached_tokens) == (1, 2, 0)
    assert [s.num_preemptions for s in (a, b, c)] == [0, 0, 0]
    assert sched.allocator.num_free_blocks == 7


def test_a_request_that_cannot_grow_and_is_the_newest_preempts_itself_and_ends_the_loop():
    """4 usable blocks, budget 8: A = 4 + 6, B = 8 + 2. Step 0 admits both (3 blocks). Step 1: A decodes
    into a 2nd block (the last free one); B cannot grow and is itself the newest: it preempts itself, and
    nothing is admitted in a step that preempted. Step 2: A decodes; B's 9 tokens need 3 blocks, 2 are free.
    A finishes at step 5 (6 tokens sampled); B is admitted at step 6, prefills 9 tokens and finishes."""
    sched = make_scheduler(AllocatorConfig("paged", block_size=4), budget_tokens=20, max_num_batched_tokens=16)
    a, b = make_seq(0, 4, 6), make_seq(1, 8, 2)
    sched.add_request(a)
    sched.add_request(b)
    steps = run_steps(sched)
    assert steps[1] == ([], [], [a], [b], [])
    assert steps[2] == ([], [], [a], [], [])
    assert steps[5] == ([], [], [a], [], [a])
    assert steps[6] == ([b], [(b, 0, 9)], [], [], [b])
    assert len(steps) == 7 and b.num_preemptions == 1


def test_flat_oracle_admits_while_slabs_fit_and_never_preempts():
    """16 slots, oracle slabs of prompt + max_tokens - 1: A (4 + 4: 7) and B (3 + 3: 5) fit, C (2 + 4: 5)
    waits for a slab to free."""
    sched = make_scheduler(AllocatorConfig("flat", reserve="oracle"), budget_tokens=16, max_num_batched_tokens=16)
    a, b, c = make_seq(0, 4, 4), make_seq(1, 3, 3), make_seq(2, 2, 4)
    for seq in (a, b, c):
        sched.add_request(seq)
    out, _ = sched.schedule()
    assert out.admitted == [a, b] and list(sched.waiting) == [c]
    # 12 slots reserved for tokens to come, 4 free but too few for C's 5-slot slab (and their total is too).
    assert categories(out.breakdown) == (0, 12 * BPT, 0, 0, 4 * BPT)
    finished_at = {}
    step = 0
    while sched.has_work:
        if step:
            out, _ = sched.schedule()
        assert not out.preempted
        for seq in sched.postprocess(out):
            finished_at[seq.seq_id] = step
        step += 1
    # B: its prefill samples at step 0, 2 decodes -> finishes at step 2; A at step 3; C admitted at step 3
    # into B's freed slab, done 3 decodes later.
    assert finished_at == {1: 2, 0: 3, 2: 6}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_recovers_under_a_tight_budget(mode):
    """Eight requests that together need 3x the budget all finish; swap never recomputes, recompute does."""
    sched = make_scheduler(
        AllocatorConfig("paged", block_size=4),
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
    assert sched.allocator.num_free_blocks == 7  # 8 blocks, one the null block


def test_swap_falls_back_to_recompute_without_swap_space():
    sched = make_scheduler(
        AllocatorConfig("paged", block_size=4), budget_tokens=16, preemption="swap", swap_space_bytes=0
    )
    for i in range(4):
        sched.add_request(make_seq(i, 4, 8))
    while sched.has_work:
        out, _ = sched.schedule()
        assert not sched.swapped
        sched.postprocess(out)


def test_requests_that_can_never_fit_are_rejected_with_a_reason():
    """max_model_len 20, 3 usable blocks. vLLM refuses a prompt of max_model_len tokens or more (no room for
    an output token); a shorter one that would outgrow it is capped instead."""
    sched = make_scheduler(AllocatorConfig("paged", block_size=4), budget_tokens=16, max_model_len=20)
    too_long = make_seq(0, 20, 10)
    too_big = make_seq(1, 12, 2)  # 13 tokens of KV: 4 blocks > the 3 usable
    assert "max_model_len 20" in sched.add_request(too_long)
    assert sched.add_request(too_big) == "needs 13 tokens of KV, more than the allocator can ever hold"
    assert sched.add_request(make_seq(2, 19, 1)) == "needs 19 tokens of KV, more than the allocator can ever hold"
    assert not sched.has_work


def test_max_model_len_caps_the_output_and_the_request_finishes_length_capped():
    """max_model_len 20: a 15-token prompt asking for 10 tokens samples 5 (prompt + output reaches 20,
    vLLM's check_stop), holding 19 tokens of KV at most; a 19-token prompt samples one, at its prefill."""
    sched = make_scheduler(AllocatorConfig("paged", block_size=4), budget_tokens=64, max_model_len=20, max_num_batched_tokens=64)
    a, b = make_seq(0, 15, 10), make_seq(1, 19, 1000)
    assert sched.add_request(a) is None and sched.add_request(b) is None
    assert (a.max_tokens, a.num_final_tokens, b.max_tokens, b.num_final_tokens) == (5, 19, 1, 19)
    steps = run_steps(sched)
    assert steps[0][4] == [b]  # b's prefill sampled its only token
    assert [i for i, step in enumerate(steps) if a in step[4]] == [4]  # a: prefill + 4 decodes
    assert a.num_output_tokens == 5 and a.num_computed_tokens == 19


def test_whole_prompt_admission_waits_for_blocks_for_all_its_tokens():
    """5 usable blocks, budget 4 tokens. A = 12 + 2 prefills in 3 chunks, then decodes into a 4th block,
    leaving 1 free. B = 8 + 1 needs 2 blocks for its prompt: with scheduler_reserve_full_isl (vLLM's default)
    it waits for A to finish; without, its first chunk (3 tokens, 1 block) is admitted at step 3."""
    def admitted_at(reserve_full_isl: bool) -> dict[int, int]:
        sched = make_scheduler(
            AllocatorConfig("paged", block_size=4), budget_tokens=24, max_num_batched_tokens=4,
            reserve_full_isl=reserve_full_isl,
        )
        a, b = make_seq(0, 12, 2), make_seq(1, 8, 1)
        sched.add_request(a)
        sched.add_request(b)
        steps = run_steps(sched)
        assert not any(step[3] for step in steps)
        return {seq.seq_id: i for i, step in enumerate(steps) for seq in step[0]}

    assert admitted_at(True) == {0: 0, 1: 4}
    assert admitted_at(False) == {0: 0, 1: 3}


def test_watermark_applies_only_to_waiting_requests_while_something_runs():
    """5 blocks (4 usable), watermark 0.5: 2 blocks kept free when admitting next to a running request.

    A = 16 + 1 needs all 4 usable blocks: it can run alone (the watermark is not part of can_ever_fit and
    does not apply with nothing running). Then B = 4 + 3 (2 blocks at most) runs alone; C = 4 + 1 is
    admitted beside it (1 block + 2 kept free <= 3 free); D = 4 + 1 is not (2 free), although it would fit.
    B's decode then grows into a block below the watermark: growth is not held to it.
    """
    sched = make_scheduler(AllocatorConfig("paged", block_size=4, watermark=0.5), budget_tokens=20, max_num_batched_tokens=32)
    assert sched.allocator.watermark_blocks == 2
    a, b, c, d = make_seq(0, 16, 1), make_seq(1, 4, 3), make_seq(2, 4, 1), make_seq(3, 4, 1)
    for seq in (a, b, c, d):
        assert sched.add_request(seq) is None
    steps = run_steps(sched)
    admitted = {seq.seq_id: i for i, step in enumerate(steps) for seq in step[0]}
    # step 0: A alone (B would need 1 + 2 blocks, none free); step 1: B, C; step 2: B grows, D waits (1 free);
    # step 3: B finishes; step 4: D.
    assert admitted == {0: 0, 1: 1, 2: 1, 3: 4}
    assert steps[2] == ([], [], [b], [], [])
    assert not any(step[3] for step in steps)


def test_chunked_prefill_respects_the_token_budget_and_decodes_go_first():
    sched = make_scheduler(AllocatorConfig("paged", block_size=4), budget_tokens=64, max_num_batched_tokens=8)
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
            AllocatorConfig("paged", block_size=4), budget_tokens=256, max_num_batched_tokens=64,
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
    assert exact_rows == exact_steps == 40  # request 0: its prefill samples the 1st token, 39 decodes the rest
    assert steps == 40 and finished == exact_finished == {1: 17, 0: 40}
    assert rows == 3  # prefill; a run to request 1's finish; a run to request 0's


def test_decode_run_stops_before_the_paged_pool_could_run_out():
    """A run may only cover steps whose blocks are free now: no preemption is ever skipped inside a run."""
    sched = make_scheduler(
        AllocatorConfig("paged", block_size=4), budget_tokens=20, max_num_batched_tokens=64,
        roofline=roofline(),
    )
    seq = make_seq(0, 4, 13)  # 16 tokens of KV: exactly the 4 usable blocks
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
    """vLLM's groups (as the replay builds them: a full and a sliding group) each open a block per block_size
    tokens, from one pool: a run's bound counts the blocks of every group, and the window's."""
    from kvsim.size.kv_cache_spec import KVCacheGroupSpec, PoolSpec, VllmGroup

    pool = PoolSpec((VllmGroup("full", 1, 4, 16, 16, blocks_per_request=16), VllmGroup("sliding", 1, 4, 16, 16, blocks_per_request=3, window=8)), 1, 16)
    spec = KVCacheSpec(
        groups=(KVCacheGroupSpec("full", 1, bytes_per_token=4), KVCacheGroupSpec("sliding", 1, bytes_per_token=4, window=8)),
        block_size=4, dtype="bf16", dtype_bytes=2, num_kv_heads=1, head_dim=1, num_attention_layers=2, pool=pool,
    )
    allocator = make_allocator(AllocatorConfig("paged", block_size=4), spec, 40 * 8, max_model_len=64)
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


def test_a_rejection_names_the_flat_reservation_or_the_kv_the_request_needs():
    """The reason names a flat-max slab, or the KV a paged request needs; the watermark never rejects."""
    flat = make_scheduler(AllocatorConfig("flat", reserve="max"), budget_tokens=40, max_model_len=64)
    assert flat.add_request(make_seq(0, 5, 5)) == (
        "its slab of 64 token slots (max reservation), more than the allocator can ever hold")
    paged = make_scheduler(AllocatorConfig("paged", block_size=4, watermark=0.5), budget_tokens=16)
    assert paged.add_request(make_seq(1, 13, 1)) == "needs 13 tokens of KV, more than the allocator can ever hold"
    assert paged.add_request(make_seq(2, 12, 1)) is None  # all 3 usable blocks: it runs alone


def test_decode_runs_equal_stepping_one_by_one_under_pressure():
    """Random streams on a small pool, with preemptions: the rows with decode runs and the step-by-step
    replay agree on every request's finish step, preemptions and computed tokens, and on the total steps."""
    import random

    def replay(seqs, allow_runs: bool):
        sched = make_scheduler(
            AllocatorConfig("paged", block_size=4), budget_tokens=120, max_num_batched_tokens=24, max_num_seqs=6,
            roofline=roofline(), allow_runs=allow_runs, max_model_len=128,
        )
        seqs = [make_seq(i, p, o) for i, (p, o) in enumerate(seqs)]
        for seq in seqs:
            assert sched.add_request(seq) is None
        steps, finish, preempted, tokens = 0, {}, 0, 0
        while sched.has_work:
            out, _ = sched.schedule()
            rows.append(out.num_steps)
            steps += out.num_steps
            preempted += len(out.preempted)
            tokens += out.num_prefill_tokens + out.num_decode_tokens
            for seq in sched.postprocess(out):
                finish[seq.seq_id] = steps
        return steps, finish, preempted, tokens, [s.num_preemptions for s in seqs]

    rng = random.Random(0)
    rows: list[int] = []
    coalesced = preempted = 0
    for _ in range(20):
        seqs = [(rng.randint(1, 40), rng.randint(1, 60)) for _ in range(rng.randint(2, 10))]
        rows.clear()
        with_runs = replay(seqs, True)
        coalesced += max(rows) > 1
        exact = replay(seqs, False)
        assert with_runs == exact, seqs
        preempted += exact[2] > 0
    assert coalesced >= 15 and preempted >= 5  # the comparison covered runs and preemptions


def run_async_steps(sched: Scheduler, max_steps: int = 500) -> list[tuple]:
    """Step an async `sched` until idle: per row (admitted, prefills, decodes, preempted, finished), where
    `finished` comes from the row before (its output was in flight); ("flush", finished) where nothing was
    scheduled and the step in flight came back; ("empty", []) for a step that only preempted."""
    rows = []
    while sched.has_work and len(rows) < max_steps:
        out, rejected = sched.schedule()
        assert not rejected
        if not out.prefills and not out.decodes:  # only preemptions, or nothing to schedule
            rows.append(("flush", sched.flush()) if sched.has_in_flight else ("empty", []))
            continue
        admitted, prefills, decodes, preempted = list(out.admitted), list(out.prefills), list(out.decodes), list(out.preempted)
        rows.append((admitted, prefills, decodes, preempted, sched.postprocess(out)))
    assert not sched.has_work
    return rows


def test_async_scheduling_schedules_the_next_step_before_the_last_output_is_back():
    """5 blocks (4 usable), budget 16. A = 8 + 1 (2 blocks), C = 4 + 5 (2 blocks at most), B = 8 + 1 waits
    for A's blocks. vLLM's AsyncScheduler with a batch queue of two: step n + 1 is scheduled before step n's
    tokens are processed, so A's blocks come back one step later and B is admitted one step later than in
    the synchronous loop. A request whose last token is in flight is not scheduled again (its placeholder
    already reaches max_tokens); with nothing else to run, the step in flight comes back (a flush).
    """
    def requests():
        return make_seq(0, 8, 1), make_seq(1, 4, 5), make_seq(2, 8, 1)

    sync = make_scheduler(AllocatorConfig("paged", block_size=4), budget_tokens=20, max_num_batched_tokens=16)
    a, c, b = requests()
    for seq in (a, c, b):
        sync.add_request(seq)
    assert run_steps(sync) == [
        ([a, c], [(a, 0, 8), (c, 0, 4)], [], [], [a]),
        ([b], [(b, 0, 8)], [c], [], [b]),
        ([], [], [c], [], []),
        ([], [], [c], [], []),
        ([], [], [c], [], [c]),
    ]

    sched = make_scheduler(AllocatorConfig("paged", block_size=4), budget_tokens=20, max_num_batched_tokens=16,
                           async_scheduling=True)
    a, c, b = requests()
    for seq in (a, c, b):
        sched.add_request(seq)
    assert run_async_steps(sched) == [
        ([a, c], [(a, 0, 8), (c, 0, 4)], [], [], []),
        ([], [], [c], [], [a]),  # A's token is in flight: not scheduled; C decodes into the last free block
        ([b], [(b, 0, 8)], [c], [], []),  # A's blocks are back: B is admitted
        ([], [], [c], [], [b]),
        ([], [], [c], [], []),
        ("flush", [c]),  # C's 5th token was in flight: nothing left to schedule
    ]
    assert c.num_output_tokens == 5 and c.num_computed_tokens == 8 and c.num_output_placeholders == 0
    assert sched.allocator.num_free_blocks == 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_scheduling_under_pressure_finishes_everything_and_leaks_nothing(mode):
    """Random streams with preemptions while a step is in flight: a preempted request's in-flight token is
    still delivered (it may even finish while waiting), and every request ends with exactly max_tokens."""
    import random

    rng = random.Random(1)
    preempted = 0
    for _ in range(20):
        sched = make_scheduler(
            AllocatorConfig("paged", block_size=4), budget_tokens=80, max_num_batched_tokens=24, max_num_seqs=6,
            max_model_len=128, async_scheduling=True, preemption=mode, swap_space_bytes=1 << 20,
        )
        seqs = [make_seq(i, rng.randint(1, 30), rng.randint(1, 40)) for i in range(rng.randint(2, 10))]
        for seq in seqs:
            assert sched.add_request(seq) is None
        rows = run_async_steps(sched, max_steps=5000)
        finished = [seq for row in rows for seq in row[-1]]
        assert sorted(s.seq_id for s in finished) == [s.seq_id for s in seqs]
        assert all(s.num_output_tokens == s.max_tokens for s in seqs)
        assert sched.allocator.num_free_blocks == 19 and sched.swap_used_bytes == 0
        preempted += sum(len(row[3]) for row in rows if len(row) == 5)
    assert preempted > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_block_is_cached_once_its_last_token_is_known(async_scheduling):
    """Prefix caching, blocks of 4: A = 3 + 3. Step 0 prefills positions 0-2 and samples the token at 3;
    step 1 computes position 3, filling block 0. Synchronous: that token is known when step 1 is scheduled,
    so block 0 is cached then. Async: step 1 is scheduled before step 0's output is back; block 0 is cached
    once the output of step 1 (which computed its last token) is processed, after step 2 is scheduled."""
    import numpy as np

    sched = make_scheduler(
        AllocatorConfig("paged", block_size=4, prefix_caching=True), budget_tokens=32, async_scheduling=async_scheduling,
        make_token_ids=lambda seq: 1000 * seq.seq_id + np.arange(seq.num_prompt_tokens + seq.max_tokens, dtype=np.int64),
    )
    a = make_seq(0, 3, 3)
    sched.add_request(a)
    alloc = sched.allocator

    cached_after, block0 = [], None
    for _ in range(3):
        out, _ = sched.schedule()
        block0 = block0 or alloc.pool.blocks[alloc.block_table(a)[0]]
        sched.postprocess(out)
        cached_after.append(block0.block_hash is not None)  # a freed cached block keeps its hash
    assert cached_after == ([False, True, True] if not async_scheduling else [False, False, True])


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_async_decode_runs_equal_stepping_one_by_one_under_pressure(prefix_caching):
    """Async scheduling with one step in flight: rows with decode runs and the step-by-step replay agree on every
    request's finish step, preemptions, computed tokens and cached prefix tokens, and on the total steps."""
    import random

    import numpy as np

    def replay(seqs, allow_runs: bool):
        config = AllocatorConfig("paged", block_size=4, prefix_caching=prefix_caching)
        sched = make_scheduler(
            config, budget_tokens=120, max_num_batched_tokens=24, max_num_seqs=6, roofline=roofline(),
            allow_runs=allow_runs, max_model_len=128, async_scheduling=True,
        )
        seqs = [make_seq(i, p, o) for i, (p, o) in enumerate(seqs)]
        for seq in seqs:  # every 7 to 9 requests' ids repeat with the same period: some share blocks
            seq.token_ids = np.arange(seq.num_prompt_tokens + seq.max_tokens, dtype=np.int64) % (7 + seq.seq_id % 3)
            assert sched.add_request(seq) is None
        steps, finish, preempted, tokens = 0, {}, 0, 0
        while sched.has_work:
            out, _ = sched.schedule()
            if not out.prefills and not out.decodes:
                for seq in sched.flush() if sched.has_in_flight else []:
                    finish[seq.seq_id] = steps
                continue
            rows.append(out.num_steps)
            steps += out.num_steps
            preempted += len(out.preempted)
            tokens += out.num_prefill_tokens + out.num_decode_tokens
            for seq in sched.postprocess(out):
                finish[seq.seq_id] = steps
        hits = sched.allocator.prefix_hit_tokens
        return steps, finish, preempted, tokens, hits, [(s.num_preemptions, s.num_cached_tokens) for s in seqs]

    rng = random.Random(1)
    rows: list[int] = []
    coalesced = preempted = 0
    for _ in range(20):
        seqs = [(rng.randint(1, 40), rng.randint(1, 60)) for _ in range(rng.randint(2, 10))]
        rows.clear()
        with_runs = replay(seqs, True)
        coalesced += max(rows) > 1
        exact = replay(seqs, False)
        assert with_runs == exact, seqs
        preempted += exact[2] > 0
    assert coalesced >= 15 and preempted >= 5  # the comparison covered runs and preemptions


class _AlwaysAsksToCache(SchedSeq):
    """A request for which the scheduler never skips `cache_blocks` (it never records what it asked for)."""

    @property
    def num_cache_asked_blocks(self) -> int:
        return -1

    @num_cache_asked_blocks.setter
    def num_cache_asked_blocks(self, value: int) -> None:
        pass


@pytest.mark.parametrize("allow_runs", [False, True])
def test_async_cache_blocks_is_skipped_only_where_it_would_cache_nothing(allow_runs):
    """Async prefix caching asks `cache_blocks` only when a settled token fills a block not asked for before.
    Against the same streams asking at every processed output: after every row, the same hashes on every
    running request's blocks, and the same prefix hits; under preemption, with and without decode runs."""
    import random

    import numpy as np

    def replay(specs, seq_type):
        sched = make_scheduler(
            AllocatorConfig("paged", block_size=4, prefix_caching=True), budget_tokens=120, max_num_batched_tokens=24,
            max_num_seqs=6, roofline=roofline(), allow_runs=allow_runs, max_model_len=128, async_scheduling=True,
        )
        alloc = sched.allocator
        seqs = [seq_type(i, p, o, index=i) for i, (p, o) in enumerate(specs)]
        for seq in seqs:  # every 7 to 9 requests' ids repeat with the same period: some share blocks
            seq.token_ids = np.arange(seq.num_prompt_tokens + seq.max_tokens, dtype=np.int64) % (7 + seq.seq_id % 3)
            assert sched.add_request(seq) is None
        rows, asked = [], 0
        cache_blocks = alloc.cache_blocks

        def counting(seq, num_tokens):
            nonlocal asked
            asked += 1
            cache_blocks(seq, num_tokens)

        alloc.cache_blocks = counting
        while sched.has_work:
            out, _ = sched.schedule()
            if out.prefills or out.decodes:
                sched.postprocess(out)
            elif sched.has_in_flight:
                sched.flush()
            rows.append([(seq.seq_id, [alloc.pool.blocks[b].block_hash for b in alloc.block_table(seq)])
                         for seq in sched.running])
        return rows, alloc.prefix_hit_tokens, sum(seq.num_preemptions for seq in seqs), asked

    rng = random.Random(3)
    preempted = fewer_asks = 0
    for _ in range(15):
        specs = [(rng.randint(1, 40), rng.randint(1, 60)) for _ in range(rng.randint(2, 10))]
        skipping, always = replay(specs, SchedSeq), replay(specs, _AlwaysAsksToCache)
        assert skipping[:3] == always[:3], specs
        preempted += skipping[2] > 0
        fewer_asks += skipping[3] < always[3]
    assert preempted >= 3 and fewer_asks >= 10  # the comparison covered preemptions and skipped calls


def _sliding_window_scheduler(budget_bytes: int, window: int, **kwargs) -> Scheduler:
    """A mixed model as the replay builds it: a full and a sliding group of block size 4 in one pool (a block of
    each group per 16 bytes of `budget_bytes`)."""
    from kvsim.size.kv_cache_spec import KVCacheGroupSpec, PoolSpec, VllmGroup

    pool = PoolSpec((VllmGroup("full", 1, 4, 16, 16, blocks_per_request=32),
                     VllmGroup("sliding", 1, 4, 16, 16, blocks_per_request=window // 4 + 1, window=window)), 1, 16)
    spec = KVCacheSpec(
        groups=(KVCacheGroupSpec("full", 1, bytes_per_token=4), KVCacheGroupSpec("sliding", 1, bytes_per_token=4, window=window)),
        block_size=4, dtype="bf16", dtype_bytes=2, num_kv_heads=1, head_dim=1, num_attention_layers=2, pool=pool,
    )
    allocator = make_allocator(AllocatorConfig("paged", block_size=4), spec, budget_bytes, max_model_len=128)
    return Scheduler(allocator, max_num_batched_tokens=24, max_model_len=128, roofline=roofline(),
                     async_scheduling=True, **kwargs)


def test_async_decode_runs_on_a_sliding_window_model_wait_out_a_refused_head_exactly():
    """Async scheduling on a full + sliding-window model, a request waiting for memory: a run is booked only over
    steps in which stepping frees no more blocks than the step that refused the queue head (blocks leaving the
    window could admit it inside the run otherwise). Rows with runs and the step-by-step replay agree on every
    request's admission and finish step, preemptions and computed tokens, and a run's memory breakdown is its
    middle step's, blocks that left the windows by then nulled."""
    import random

    def replay(seqs, allow_runs: bool, window: int):
        sched = _sliding_window_scheduler(640, window, max_num_seqs=6, allow_runs=allow_runs)  # 39 blocks
        bound = sched._steps_while_free_blocks_do_not_grow

        def counted(decodes, k):
            k1 = bound(decodes, k)
            capped[0] += k1 < k
            return k1

        sched._steps_while_free_blocks_do_not_grow = counted
        seqs = [make_seq(i, p, o) for i, (p, o) in enumerate(seqs)]
        for seq in seqs:
            assert sched.add_request(seq) is None
        steps, events, preempted, tokens = 0, [], 0, 0
        while sched.has_work:
            out, _ = sched.schedule()
            if not out.prefills and not out.decodes:
                for seq in sched.flush() if sched.has_in_flight else []:
                    events.append(("finish", seq.seq_id, steps))
                continue
            events += [("admit", seq.seq_id, steps) for seq in out.admitted]
            if out.num_steps > 1 and sched.waiting:
                waited_out[0] += 1
            memory[allow_runs][steps + (out.num_steps - 1) // 2] = out.breakdown  # a run's: its middle step's
            steps += out.num_steps
            preempted += len(out.preempted)
            tokens += out.num_prefill_tokens + out.num_decode_tokens
            events += [("finish", seq.seq_id, steps) for seq in sched.postprocess(out)]
        return steps, sorted(events), preempted, tokens, [s.num_preemptions for s in seqs]

    rng = random.Random(2)
    waited_out, capped = [0], [0]
    preempted = 0
    for window in (8, 10):  # 10: blocks leave the window in steps that open none
        for _ in range(15):
            seqs = [(rng.randint(4, 40), rng.randint(8, 70)) for _ in range(rng.randint(4, 10))]
            memory = {True: {}, False: {}}
            with_runs = replay(seqs, True, window)
            exact = replay(seqs, False, window)
            assert with_runs == exact, (window, seqs)
            assert all(memory[False][step] == b for step, b in memory[True].items()), (window, seqs)
            preempted += exact[2] > 0
    # runs waited out a refused head, some cut short where stepping would free blocks; preemptions covered
    assert waited_out[0] >= 20 and capped[0] >= 10 and preempted >= 3

