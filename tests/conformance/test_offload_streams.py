"""The CPU tier's conformance streams: vLLM 0.33.0's own OffloadingConnector (scheduler side) beside the replay's.

The streams themselves run in test_streams.py (0 differing steps each); here: that the vLLM side really runs vLLM's
connector and manager, that the streams exercise what they are for (CPU hits, evictions, flushes, deferred
frees), and that the harness fails when one of kvsim's rules is changed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from kvsim.conformance.suite import STREAMS

pytestmark = pytest.mark.conformance


def _resolve(name: str):
    from kvsim.conformance.stream import resolve

    return resolve(next(s for s in STREAMS if s.name == name))


def _events(trace) -> Counter:
    from kvsim.conformance.trace import decode_transfers

    kinds = Counter()
    for step in trace.steps:
        for event in decode_transfers(step.transfers):
            kinds[event.split(" [")[0]] += 1
    return kinds


def test_the_vllm_side_runs_vllms_own_connector_and_manager(vllm_loaded):
    """The scheduler builds vLLM's OffloadingConnector through KVConnectorFactory from `kv_transfer_config`, over
    vLLM's CPUOffloadingManager with the stream's policy, sized as `kvsim size --cpu-offload` sizes it."""
    from kvsim.conformance.vllm_engine import build_scheduler

    for name, policy in (("offload-lru", "LRUCachePolicy"), ("offload-arc", "ARCCachePolicy")):
        rs = _resolve(name)
        sched = build_scheduler(rs.setup)
        connector = sched.connector
        assert type(connector).__module__ == "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"
        assert type(connector).__name__ == "OffloadingConnector"
        manager = connector.connector_scheduler.manager
        assert type(manager).__module__ == "vllm.v1.kv_offload.cpu.manager"
        assert type(manager._policy).__name__ == policy
        assert manager._num_chunks == 160  # 293,601,280 B over 1,835,008 B chunks (448 pages of 4 KiB each)
        assert not sched.defer_block_free  # synchronous: one batch in flight
    assert build_scheduler(replace(_resolve("offload-lru").setup, async_scheduling=True)).defer_block_free


def test_the_streams_exercise_hits_evictions_flushes_and_chunks(vllm_loaded):
    """Counted on vLLM's side: CPU hits and evictions under both policies, a flush (a preempted request's store
    in flight), loads of chunks of 4 blocks."""
    from kvsim.conformance.sides import run_vllm
    from kvsim.conformance.trace import decode_transfers

    seen = {name: _events(run_vllm(_resolve(name))) for name in ("offload-lru", "offload-arc", "offload-gpu-pressure")}
    for name in ("offload-lru", "offload-arc"):
        assert seen[name]["cpu hit"] >= 10 and seen[name]["evict"] >= 50 and seen[name]["store"] >= 50, seen[name]
    assert seen["offload-gpu-pressure"]["flush"] >= 1 and seen["offload-gpu-pressure"]["cpu hit"] >= 50
    chunks = run_vllm(_resolve("offload-chunks"))
    loads = [e for s in chunks.steps for e in decode_transfers(s.transfers) if e.startswith("load")]
    shapes = [(len(gpu), len(cpu)) for _, _, gpu, cpu in (eval(e[5:]) for e in loads)]  # (GPU blocks, CPU chunks)
    assert shapes and all(4 * (c - 1) < g <= 4 * c for g, c in shapes)  # chunks of 4 GPU blocks, the first partial
    assert chunks.num_preemptions > 0


def test_a_cpu_hit_that_re_offers_its_gpu_hit_chunks_is_caught(vllm_loaded, monkeypatch):
    """A changed rule: after a CPU hit, the request offers its GPU-hit chunks to the tier again (vLLM skips them:
    OffloadPolicy.CHUNK_LEVEL). The harness reports a step whose stores differ."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.replay.sched.offloading_connector import OffloadingConnector

    rs = _resolve("offload-lru")
    vllm = run_vllm(rs)
    original = OffloadingConnector.update_state_after_alloc

    def re_offer(self, seq, num_external_tokens):
        original(self, seq, num_external_tokens)
        if num_external_tokens:
            for group in self._req_status[seq.seq_id].groups:
                group.next_stored_chunk_idx = 0

    monkeypatch.setattr(OffloadingConnector, "update_state_after_alloc", re_offer)
    c = compare(run_kvsim(rs), vllm)
    assert c.differs and c.first_step is not None
    assert any(line.startswith("CPU tier, ") for line in c.schedule_difference)


def test_async_scheduling_without_deferred_frees_is_caught(vllm_loaded, monkeypatch):
    """A changed rule: under async scheduling kvsim frees a finished request's blocks at once, as it does without a
    connector. vLLM's scheduler defers them (defer_block_free), and the harness sees the steps diverge."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.replay.sched.scheduler import Scheduler

    rs = _resolve("offload-lru+async")
    vllm = run_vllm(rs)
    init = Scheduler.__init__

    def no_deferral(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._defer_free = False

    monkeypatch.setattr(Scheduler, "__init__", no_deferral)
    c = compare(run_kvsim(rs), vllm)
    assert c.differs and c.differing_steps > 0


def test_transfers_on_a_faster_host_link_are_caught(vllm_loaded, monkeypatch):
    """A changed rule on the clock: the replay's transfer jobs take half the time vLLM's simulated worker gives
    them; the steps' times and completions then differ."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.replay.sched.offloading_connector import OffloadingConnector

    rs = _resolve("offload-gpu-pressure")
    vllm = run_vllm(rs)
    init = OffloadingConnector.__init__

    def faster(self, **kwargs):
        init(self, **{**kwargs, "host_bandwidth_bytes_per_s": 2 * kwargs["host_bandwidth_bytes_per_s"]})

    monkeypatch.setattr(OffloadingConnector, "__init__", faster)
    c = compare(run_kvsim(rs), vllm)
    assert c.differs and c.differing_steps > 0


def test_a_store_whose_blocks_are_reused_is_flushed_and_waited_for(vllm_loaded, monkeypatch):
    """offload-fence: requests finish while the store of their last prompt chunks is in flight, and the next step
    reallocates the blocks it reads. vLLM flushes those stores (`_block_id_to_pending_jobs`, no preemption in the
    stream) and the worker waits for them. Without the fence, kvsim's steps start earlier: the harness sees it."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.replay.sched.offloading_connector import OffloadingConnector

    rs = _resolve("offload-fence")
    vllm = run_vllm(rs)
    assert vllm.num_preemptions == 0 and _events(vllm)["flush"] >= 3
    assert not compare(run_kvsim(rs), vllm).differs
    monkeypatch.setattr(OffloadingConnector, "request_finished", lambda self, seq: None)
    monkeypatch.setattr(OffloadingConnector, "_flush_jobs", lambda self, job_ids: None)
    c = compare(run_kvsim(rs), vllm)
    assert c.differs and c.differing_steps > 0


def test_cli_checks_a_workload_file(vllm_loaded, cli, tmp_path):
    """`kvsim conformance WORKLOAD.yaml` runs that file (named by its stem) instead of the built-in streams; a
    missing file is one line, exit code 2."""
    from kvsim.conformance.stream import STREAMS_DIR

    path = tmp_path / "mine.yaml"
    path.write_text((STREAMS_DIR / "plenty.yaml").read_text())
    result = cli(["conformance", str(path)])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines() if line.startswith("mine")]
    assert rows == [["mine", "252", "/", "252", "0", "/", "0", "0"]]
    assert result.output.splitlines()[-1] == "1 of 1 streams conform (0 differing steps)"
    missing = cli(["conformance", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2
    assert "no such workload file" in missing.output


def test_the_sliding_window_streams_load_and_store_every_group(vllm_loaded):
    """offload-gpt-oss and offload-gemma3, counted on vLLM's side: CPU hits, evictions and flushes, and loads whose
    GPU blocks span both kinds of group (a sliding group's blocks before its window are not loaded)."""
    from kvsim.conformance.sides import run_vllm

    for name, hits in (("offload-gpt-oss", 40), ("offload-gemma3", 10)):
        seen = _events(run_vllm(_resolve(name)))
        assert seen["cpu hit"] >= hits and seen["evict"] >= 50 and seen["flush"] >= 1, (name, seen)


def test_a_sliding_window_that_stores_every_chunk_is_caught(vllm_loaded, monkeypatch):
    """A changed rule: kvsim's sliding groups store every chunk (a dense mask), where vLLM's default retention 0
    keeps only the window before the prompt's reachable boundary. The stores differ."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.replay.sched import offloading_connector

    rs = _resolve("offload-gpt-oss")
    vllm = run_vllm(rs)
    assert not compare(run_kvsim(rs), vllm).differs
    monkeypatch.setattr(offloading_connector, "reachable_block_mask", lambda *args: None)
    c = compare(run_kvsim(rs), vllm)
    assert c.differs and any(line.startswith("CPU tier, ") for line in c.schedule_difference)


def test_a_sliding_window_looked_up_as_a_prefix_is_caught(vllm_loaded, monkeypatch):
    """A changed rule: the sliding group is looked up as a prefix from the GPU hit on (as a full-attention group)
    rather than a run of window chunks from the right. The CPU hits differ."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.offload.manager import LookupResult
    from kvsim.replay.sched import offloading_connector

    def as_prefix(lookup, keys, window_chunks, req_context, initial_window):
        hits = 0
        for key in keys:
            if lookup(key, req_context) is LookupResult.MISS:
                break
            hits += 1
        return hits

    rs = _resolve("offload-gemma3")
    vllm = run_vllm(rs)
    monkeypatch.setattr(offloading_connector, "sliding_window_lookup", as_prefix)
    c = compare(run_kvsim(rs), vllm)
    assert c.differs and c.differing_steps > 0


def test_loads_within_the_step_follow_the_sync_load_budget(vllm_loaded, monkeypatch):
    """offload-sync: vLLM's connector marks most hits as synchronous loads (`TransferJob.sync`, within the step's
    `sync_load_budget_bytes`), some as asynchronous. kvsim ignoring the budget (every load asynchronous) is caught."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.conformance.vllm_import import import_vllm
    from kvsim.replay.sched.offloading_connector import OffloadingConnector

    worker = import_vllm("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
    sync = Counter()
    build = worker.OffloadingConnectorScheduler._build_connector_meta

    def counting(self, scheduler_output):
        meta = build(self, scheduler_output)
        sync.update(bool(job.sync) for job in meta.load_jobs.values())
        return meta

    rs = _resolve("offload-sync")
    monkeypatch.setattr(worker.OffloadingConnectorScheduler, "_build_connector_meta", counting)
    vllm = run_vllm(rs)
    monkeypatch.undo()
    assert sync[True] >= 30 and sync[False] >= 3, sync
    assert not compare(run_kvsim(rs), vllm).differs
    monkeypatch.setattr(OffloadingConnector, "_reserve_sync_load", lambda self, seq, computed, hit: None)
    c = compare(run_kvsim(rs), vllm)
    assert c.differs and c.differing_steps > 0


def test_the_state_model_streams_hand_states_to_the_tier_and_load_them(vllm_loaded, monkeypatch):
    """offload-qwen3-next and offload-nemotron-h, counted on vLLM's side: its connector takes the state groups as
    copy-on-write sources (`requires_cow_source`, hits rounded to the state block), their states reach the tier only
    as one-block jobs of `_build_aligned_boundary_store_jobs`, and CPU hits load every group; GPU pressure
    preempts."""
    from kvsim.conformance.sides import run_vllm
    from kvsim.conformance.vllm_engine import build_scheduler
    from kvsim.conformance.vllm_import import import_vllm

    worker = import_vllm("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
    boundary_jobs = Counter()
    build = worker.OffloadingConnectorScheduler._build_aligned_boundary_store_jobs

    def counting(self, handoffs):
        jobs = build(self, handoffs)
        boundary_jobs["jobs"] += len(jobs)
        boundary_jobs["blocks"] += sum(len(job.src_spec.block_ids) for job in jobs.values())
        return jobs

    monkeypatch.setattr(worker.OffloadingConnectorScheduler, "_build_aligned_boundary_store_jobs", counting)
    for name, num_state_groups, block in (("offload-qwen3-next", 3, 576), ("offload-nemotron-h", 6, 1040)):
        scheduler = build_scheduler(_resolve(name).setup).connector.connector_scheduler
        assert len(scheduler._cow_source_groups) == num_state_groups and scheduler._mamba_align_size == block
        assert not scheduler.config.supports_partial_tail  # hashes at the block size: no sub-block tails
        boundary_jobs.clear()
        trace = run_vllm(_resolve(name))
        seen = _events(trace)
        assert boundary_jobs["jobs"] >= 100 and boundary_jobs["blocks"] == boundary_jobs["jobs"], (name, boundary_jobs)
        assert seen["store"] > boundary_jobs["jobs"]  # the full-attention group's prompt chunks besides
        assert seen["cpu hit"] >= 10 and seen["evict"] >= 10 and trace.num_preemptions >= 5, (name, seen)


def test_states_stored_without_the_boundary_hand_off_are_caught(vllm_loaded, monkeypatch):
    """A changed rule: the state groups' chunks are offered with the prompt chunks (as a window of one chunk whose
    block is the table's), rather than from the allocator's hand-off of each committed state. The stores differ."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.replay.sched.offloading_connector import OffloadingConnector

    rs = _resolve("offload-qwen3-next")
    vllm = run_vllm(rs)
    assert not compare(run_kvsim(rs), vllm).differs
    init = OffloadingConnector.__init__

    def as_windows(self, **kwargs):
        groups = kwargs["groups"]
        init(self, **{**kwargs, "groups": tuple(replace(g, kind="chunked") if g.kind == "state" else g for g in groups)})
        self._state_groups, self.mamba_align_size = (), groups[0].tokens_per_chunk

    monkeypatch.setattr(OffloadingConnector, "__init__", as_windows)
    c = compare(run_kvsim(rs), vllm)
    assert c.differs and any(line.startswith("CPU tier, ") for line in c.schedule_difference)


def test_a_hit_not_rounded_to_the_state_block_is_caught(vllm_loaded, monkeypatch):
    """offload-qwen3-next-repeat: two prompts each loaded whole (4,608 tokens) on vLLM's side, and a last request
    whose hit vLLM rounds down to a state block holding no state. A changed rule: the CPU hit of a state model is
    not rounded down to the state block (`resolve_mamba_align_size`); kvsim then loads 4,607 tokens there."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.conformance.trace import decode_transfers
    from kvsim.replay.sched.offloading_connector import OffloadingConnector

    rs = _resolve("offload-qwen3-next-repeat")
    vllm = run_vllm(rs)
    hits = [e for step in vllm.steps for e in decode_transfers(step.transfers) if e.startswith("cpu hit")]
    assert hits == ["cpu hit [2, 4608]", "cpu hit [3, 4608]"], hits
    assert not compare(run_kvsim(rs), vllm).differs
    init = OffloadingConnector.__init__

    def unrounded(self, **kwargs):
        init(self, **kwargs)
        self.mamba_align_size = None

    monkeypatch.setattr(OffloadingConnector, "__init__", unrounded)
    c = compare(run_kvsim(rs), vllm)
    assert c.differs and "CPU tier, kvsim only: cpu hit [4, 4607]" in c.schedule_difference


@pytest.mark.parametrize("rule", ["full sequence", "reservation"])
def test_a_loaded_state_request_resuming_without_vllms_checks_is_caught(vllm_loaded, monkeypatch, rule):
    """offload-nemotron-h: a request whose load finished resumes from vLLM's waiting queue with
    `allocate_slots(full_sequence_must_fit=True)`, and the loads' reservation (`_request_remaining_blocks`) judges a
    state group's prefill checkpoint from the request's computed tokens. Either rule changed is caught."""
    from kvsim.conformance.compare import compare
    from kvsim.conformance.sides import run_kvsim, run_vllm
    from kvsim.engine.paged.kv_cache_manager import HybridPagedAllocator

    rs = _resolve("offload-nemotron-h")
    vllm = run_vllm(rs)
    assert not compare(run_kvsim(rs), vllm).differs
    if rule == "full sequence":
        monkeypatch.setattr(HybridPagedAllocator, "full_sequence_fits", lambda self, seq, apply_watermark: True)
    else:
        def from_zero(self, seq):
            req = self._reqs[seq]
            return self.coordinator.get_num_blocks_to_allocate(req.tables, min(seq.num_tokens, self.max_model_len),
                                                               True, prefill_end=req.prefill_end)

        monkeypatch.setattr(HybridPagedAllocator, "num_blocks_to_finish", from_zero)
    c = compare(run_kvsim(rs), vllm)
    assert c.differs and c.differing_steps > 0


def test_vllm_itself_fails_on_a_load_within_the_step_of_a_state_model(vllm_loaded, tmp_path):
    """Why kvsim refuses `sync_load_budget_bytes` on a state model: offload-nemotron-h with a sync-load budget makes
    vLLM 0.33's own scheduler raise. For a hit loaded within the step, `MambaManager.get_num_blocks_to_allocate`
    (align) caps each state group at one new block (plus a checkpoint), but `allocate_external_computed_blocks`
    takes one for the loaded state and `allocate_new_blocks` one more for the chunk's running state."""
    from kvsim.conformance.sides import run_vllm
    from kvsim.conformance.stream import STREAMS_DIR, Stream, resolve

    path = tmp_path / "sync.yaml"
    text = (STREAMS_DIR / "offload-nemotron-h.yaml").read_text()
    path.write_text(text.replace("policy: arc}", "policy: arc, sync_load_budget_bytes: 200000000}"))
    with pytest.raises(ValueError, match="Cannot get 1 free blocks from the pool"):
        run_vllm(resolve(Stream("sync", path, async_scheduling=False)))
