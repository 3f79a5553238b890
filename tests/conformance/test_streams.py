"""Every conformance stream: kvsim's replay and vLLM 0.33.0's own scheduler agree on every step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvsim.conformance.suite import STREAMS, run_stream

pytestmark = pytest.mark.conformance

# Streams kvsim does not yet follow, each with the reason (strict: one that starts to conform fails here).
KNOWN_DIFFERENCES: dict[str, str] = {}


def _params():
    for stream in STREAMS:
        marks = []
        if stream.name in KNOWN_DIFFERENCES:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_DIFFERENCES[stream.name]))
        yield pytest.param(stream, id=stream.name, marks=marks)


@pytest.mark.parametrize("stream", _params())
def test_stream_has_no_differing_step(vllm_loaded, stream):
    result = run_stream(stream)
    assert result.error is None, result.error
    c = result.comparison
    assert c.rejected_kvsim == c.rejected_vllm
    assert c.differing_steps == 0, (c.first_step, c.kvsim_state.describe(), c.vllm_state.describe())
    assert c.kvsim_steps == c.vllm_steps > 0
    assert c.blocks_kvsim == c.blocks_vllm


def test_the_harness_sees_a_smaller_pool(vllm_loaded):
    """A check that can fail: vLLM given 1,000 fewer blocks than kvsim preempts where kvsim does not."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.conformance.stream import resolve

    rs = resolve(next(s for s in STREAMS if s.name == "pressure"))
    kvsim = run_kvsim(rs)
    rs.setup = replace(rs.setup, num_gpu_blocks=rs.setup.num_gpu_blocks - 1000)
    c = compare(kvsim, run_vllm(rs))
    assert c.differs and c.first_step is not None
    assert c.vllm_preemptions > c.kvsim_preemptions
    assert (c.blocks_kvsim, c.blocks_vllm) == (2048, 1048)


def test_mixed_model_streams_run_vllms_group_managers_and_a_pool_without_null_blocks_differs(vllm_loaded, monkeypatch):
    """gemma-3-27b's stream runs vLLM's coordinator over 7 groups (6 sliding, 1 full; without prefix caching
    vLLM's `KVCacheCoordinatorNoPrefixCache`, which holds the same per-group managers); kvsim's
    replay with its sliding groups never nulling a block holds more blocks and preempts where vLLM does not."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.conformance.stream import resolve
    from kvsim.conformance.vllm_engine import build_scheduler
    from kvsim.engine.paged.single_type_kv_cache_manager import SlidingWindowManager

    rs = resolve(next(s for s in STREAMS if s.name == "gemma3-pressure"))
    manager = build_scheduler(rs.setup).kv_cache_manager
    assert type(manager.coordinator).__name__ == "KVCacheCoordinatorNoPrefixCache"
    kinds = [type(m).__name__ for m in manager.coordinator.single_type_managers]
    assert kinds == ["SlidingWindowManager"] * 6 + ["FullAttentionManager"]
    vllm = run_vllm(rs)
    monkeypatch.setattr(SlidingWindowManager, "get_num_skipped_tokens", lambda self, num_computed_tokens: 0)
    c = compare(run_kvsim(rs), vllm)
    assert c.differs and c.kvsim_preemptions > c.vllm_preemptions


def test_prefix_streams_run_vllms_hybrid_coordinator_and_a_cache_of_one_block_a_key_differs(vllm_loaded, monkeypatch):
    """gpt-oss-20b with prefix caching runs vLLM's `HybridKVCacheCoordinator` (full attention looked up
    first, then the sliding window) with kvsim's hits at every admission. kvsim with one block per key
    (a block that repeats a cached prefix left uncached, as the uniform pool does) frees those duplicates to
    the free queue's head, evicts other prefixes than vLLM, and differs."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.conformance.stream import resolve
    from kvsim.conformance.vllm_engine import build_scheduler
    from kvsim.engine.paged.block_pool import BlockPool

    rs = resolve(next(s for s in STREAMS if s.name == "gpt-oss-prefix-dense"))
    manager = build_scheduler(rs.setup).kv_cache_manager
    assert type(manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    kvsim, vllm = run_kvsim(rs), run_vllm(rs)
    assert compare(kvsim, vllm).differing_steps == 0 and sum(r.prefix_hit_tokens for r in kvsim.steps) > 0
    first_only = BlockPool.cache_full_block

    def cache_first_only(self, block, key, group=0):
        if self.get_cached_block(key, group) is None:
            first_only(self, block, key, group)

    monkeypatch.setattr(BlockPool, "cache_full_block", cache_first_only)
    c = compare(run_kvsim(rs), vllm)
    assert c.differs and c.first_step is not None


def test_align_streams_run_vllms_mamba_align_and_kvsim_without_the_chunk_split_or_the_same_step_refusal_differs(
        vllm_loaded, monkeypatch):
    """qwen3-next-prefix-pressure runs vLLM's scheduler in mamba_cache_mode align as vllm serve does on an H200
    (block 576, FlashInfer's checkpoints every 64 tokens, chunks split at block boundaries) and agrees with
    kvsim's replay, prefix hits included. kvsim's replay whose chunks ignore the state boundaries, or whose
    requests may hit a state cached in the same step, differs."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.conformance.stream import resolve
    from kvsim.conformance.vllm_engine import build_scheduler
    from kvsim.engine.paged.single_type_kv_cache_manager import MambaManager
    from kvsim.replay.sched.scheduler import Scheduler

    rs = resolve(next(s for s in STREAMS if s.name == "qwen3-next-prefix-pressure"))
    sched = build_scheduler(rs.setup)
    assert sched.need_mamba_block_aligned_split and (sched.block_size, sched.hash_block_size) == (576, 576)
    assert sched.mamba_has_prefill_checkpoint_blocks and sched.mamba_prefill_checkpoint_alignment == 64
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    assert [type(m).__name__ for m in managers] == ["MambaManager"] * 3 + ["FullAttentionManager"]
    assert all(m.mamba_cache_mode == "align" for m in managers[:3])
    kvsim, vllm = run_kvsim(rs), run_vllm(rs)
    assert compare(kvsim, vllm).differing_steps == 0 and sum(r.prefix_hit_tokens for r in kvsim.steps) > 0
    with monkeypatch.context() as m:
        m.setattr(Scheduler, "_mamba_block_aligned_split", lambda self, seq, start, n, junction: n)
        assert compare(run_kvsim(rs), vllm).differs
    get_num = MambaManager.get_num_blocks_to_allocate
    monkeypatch.setattr(MambaManager, "get_num_blocks_to_allocate",
                        lambda self, *a, **kw: get_num(self, *a, **{**kw, "cached_this_step": None}))
    assert compare(run_kvsim(rs), vllm).differs


def test_a_preemption_in_a_call_that_schedules_nothing_is_counted_on_vllms_side(vllm_loaded, monkeypatch):
    """block-32-long (async, 32-token blocks, prompts near max_model_len): vLLM's scheduler once preempts in a
    call that schedules no token. The harness counts it with the next step, as kvsim does (dropped: 15 vs 16)."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.conformance.stream import resolve
    from kvsim.conformance.vllm_engine import VllmEngine

    rs = resolve(next(s for s in STREAMS if s.name == "block-32-long"))
    schedule = VllmEngine._schedule
    preempted_in_empty_calls = []

    def look(self, now):
        result = schedule(self, now)
        so = result[0]
        if so.total_num_scheduled_tokens == 0 and so.preempted_req_ids:
            preempted_in_empty_calls.append(len(so.preempted_req_ids))
        return result

    monkeypatch.setattr(VllmEngine, "_schedule", look)
    kvsim, vllm = run_kvsim(rs), run_vllm(rs)
    assert sum(preempted_in_empty_calls) >= 1  # the case is exercised
    c = compare(kvsim, vllm)
    assert c.differing_steps == 0 and c.kvsim_preemptions == c.vllm_preemptions == 16


def test_a_stream_files_async_scheduling_runs_vllms_async_scheduler(vllm_loaded):
    """block-32-long says `scheduler: {async_scheduling: true}`: both sides run async (vLLM's AsyncScheduler);
    vLLM run synchronously against kvsim's async replay differs, as the harness once ran it."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.conformance.stream import resolve
    from kvsim.conformance.vllm_engine import build_scheduler

    stream = next(s for s in STREAMS if s.name == "block-32-long")
    assert stream.async_scheduling is None  # not forced by the suite: the file's own setting
    rs = resolve(stream)
    assert rs.workload.scheduler.async_scheduling and rs.setup.async_scheduling
    assert type(build_scheduler(rs.setup)).__name__ == "AsyncScheduler"
    kvsim = run_kvsim(rs)
    assert compare(kvsim, run_vllm(rs)).differing_steps == 0
    rs.setup = replace(rs.setup, async_scheduling=False)
    assert compare(kvsim, run_vllm(rs)).differs


def test_sync_streams_run_vllms_synchronous_scheduler_though_a_workload_defaults_to_async(vllm_loaded):
    """A workload without `async_scheduling` is async (vllm serve's default), so the suite pins each stream's loop:
    `pressure` runs vLLM's synchronous Scheduler on both sides, `pressure+async` its AsyncScheduler."""
    from kvsim.conformance.stream import resolve
    from kvsim.conformance.vllm_engine import build_scheduler
    from kvsim.workload.spec import load_workload

    by_name = {s.name: s for s in STREAMS}
    assert load_workload(by_name["pressure"].workload).scheduler.async_scheduling  # the file says nothing: async
    for name, expected, kind in (("pressure", False, "Scheduler"), ("pressure+async", True, "AsyncScheduler")):
        rs = resolve(by_name[name])
        assert rs.workload.scheduler.async_scheduling is expected and rs.setup.async_scheduling is expected
        assert type(build_scheduler(rs.setup)).__name__ == kind
    assert sum(s.async_scheduling is False for s in STREAMS) == sum(s.async_scheduling is True for s in STREAMS)  # each sync stream has its +async twin


def test_blocks_handed_out_in_another_order_differ_though_every_count_agrees(vllm_loaded, monkeypatch):
    """kvsim freeing a request's blocks in the opposite order reuses other block ids: every count of every step
    still agrees with vLLM's, and the harness reports the steps whose block ids differ."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.conformance.stream import resolve
    from kvsim.engine.paged.block_pool import BlockPool

    rs = resolve(next(s for s in STREAMS if s.name == "pressure"))  # a uniform model: the single-group pool
    vllm = run_vllm(rs)
    free_blocks = BlockPool.free_blocks

    def reversed_free(self, blocks, num_uncached=None):  # each kind's blocks in the opposite order
        blocks = list(blocks)
        if num_uncached is None:
            return free_blocks(self, blocks[::-1])
        return free_blocks(self, blocks[:num_uncached][::-1] + blocks[num_uncached:][::-1], num_uncached)

    monkeypatch.setattr(BlockPool, "free_blocks", reversed_free)
    kvsim = run_kvsim(rs)
    counts = lambda t: [s.compared()[:-2] for s in t.steps]  # noqa: E731  every field but the schedule and transfers
    assert counts(kvsim) == counts(vllm)
    c = compare(kvsim, vllm)
    assert c.differs and c.differing_steps > 0
    assert c.schedule_difference and c.schedule_difference[0].startswith("request ")
    assert "blocks" in c.schedule_difference[0]


def test_cli_prints_the_table_and_exits_0(vllm_loaded, cli):
    result = cli(["conformance", "--stream", "plenty"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["stream", "steps", "kvsim", "/", "vLLM", "preemptions", "kvsim", "/", "vLLM", "differing", "steps"]
    assert lines[2].split() == ["plenty", "252", "/", "252", "0", "/", "0", "0"]
    assert lines[-1] == "1 of 1 streams conform (0 differing steps)"


def test_cli_unknown_stream_is_a_user_error(cli):
    result = cli(["conformance", "--stream", "nope"])
    assert result.exit_code == 2
    assert "unknown stream 'nope'" in result.output


def test_a_long_stream_reports_its_progress(vllm_loaded):
    """max-num-seqs runs 1,139 steps: each side says where it is at step 1,024, and the line is cleared before
    the stream's row."""
    from kvsim.conformance.suite import run_suite

    events = []
    code = run_suite(["max-num-seqs"], echo=lambda line: events.append(("row", line)),
                     progress=lambda text: events.append(("progress", text)))
    assert code == 0
    shown = [text for kind, text in events if kind == "progress"]
    assert shown == ["max-num-seqs (1 of 1): kvsim's replay", "max-num-seqs (1 of 1): kvsim's replay, step 1,024",
                     "max-num-seqs (1 of 1): vLLM's scheduler", "max-num-seqs (1 of 1): vLLM's scheduler, step 1,024", ""]
    row = next(k for k, (kind, line) in enumerate(events) if kind == "row" and line.startswith("max-num-seqs"))
    assert events[row - 1] == ("progress", "")


def test_default_retention_streams_give_vllm_retention_0_and_dense_retention_on_kvsims_side_differs(vllm_loaded):
    """gpt-oss-prefix-pressure runs vLLM 0.33's default prefix_cache_retention_interval 0 on both sides and
    conforms; kvsim's side alone under dense retention (None, every sliding block cached) differs."""
    import dataclasses

    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.conformance.stream import resolve
    from kvsim.conformance.vllm_engine import build_scheduler

    rs = resolve(next(s for s in STREAMS if s.name == "gpt-oss-prefix-pressure"))
    assert rs.config.prefix_cache_retention_interval == 0 == rs.setup.prefix_cache_retention_interval
    assert build_scheduler(rs.setup).kv_cache_manager.coordinator.retention_interval == 0
    vllm = run_vllm(rs)
    assert compare(run_kvsim(rs), vllm).differing_steps == 0
    dense = dataclasses.replace(rs, config=dataclasses.replace(rs.config, prefix_cache_retention_interval=None))
    c = compare(run_kvsim(dense), vllm)
    assert c.differs and c.first_step is not None


def test_the_harness_sees_finishes_freed_in_sampling_order(vllm_loaded, monkeypatch):
    """short-answers conforms; freeing one step's finished requests in sampling order (completed prefills first)
    instead of vLLM's scheduled order gives other blocks to later requests, and the harness sees it."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.conformance.stream import resolve
    from kvsim.replay.sched.scheduler import Scheduler

    rs = resolve(next(s for s in STREAMS if s.name == "short-answers"))
    vllm = run_vllm(rs)
    monkeypatch.setattr(Scheduler, "_in_scheduled_order", lambda self, finished: finished)
    c = compare(run_kvsim(rs), vllm)
    assert c.differs and c.differing_steps > 0
    assert c.schedule_difference and "blocks" in c.schedule_difference[0]
