"""The CPU tier in the replay (a workload's `offload:`): vLLM 0.33's OffloadingConnector scheduler side over
kvsim.offload, with hand-computed loads, stores and transfer times, and the bad input it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvsim.errors import KvsimError
from kvsim.offload.manager import LookupResult
from kvsim.replay.options import ReplayOptions
from kvsim.replay.run import run_replay
from kvsim.replay.sched.offloading_connector import OffloadingConnector
from kvsim.workload.spec import load_workload

# qwen3-0.6b: 28 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 114,688 B a token; a block of 16: 1,835,008 B
BYTES_PER_TOKEN = 28 * 8 * 128 * 2 * 2
BLOCK_BYTES = 16 * BYTES_PER_TOKEN
H100_HOST_LINK = 64e9  # interconnect.yaml: PCIe Gen5 x16, one direction

WORKLOAD = """
name: offload
seed: 0
model: qwen3-0.6b
hardware: h100-80gb
kv_budget: {budget}
max_model_len: 4096
requests:
  trace: {{path: trace.jsonl}}
allocators:
  - {allocator}
{offload}
"""


def write(tmp_path: Path, rows: list[dict], *, offload: str = "offload: {cpu_bytes: 1GiB, policy: lru}",
          allocator: str = "{kind: paged, block_size: 16}", budget: str = "256MiB") -> Path:
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "offload.yaml"
    path.write_text(WORKLOAD.format(budget=budget, allocator=allocator, offload=offload))
    return path


def same_prompt_twice(gap_ms: int) -> list[dict]:
    """Two requests with one 512-token prompt (one Mooncake hash id), `gap_ms` apart."""
    return [{"timestamp": t, "input_length": 512, "output_length": 4, "hash_ids": [7]} for t in (0, gap_ms)]


def test_a_repeated_prompt_loads_from_the_tier_hand_computed(tmp_path):
    # No GPU prefix cache: the second request's prompt can come only from the CPU tier. The first stores its 32
    # prompt chunks (one 16-token block each); the second finds all 32 and loads them (512 tokens, all but the last
    # token then computed), storing nothing new (its chunks were loaded).
    result = run_replay(load_workload(write(tmp_path, same_prompt_twice(10_000))), ReplayOptions(tensors=False), workers=1)
    (run,) = result.runs
    off = run.offload
    assert off["cpu_hit_tokens"] == 512
    assert off["cpu_stored_bytes"] == 32 * BLOCK_BYTES
    assert off["cpu_loaded_bytes"] == 32 * BLOCK_BYTES
    assert off["cpu_load_wait_s"] == pytest.approx(32 * BLOCK_BYTES / H100_HOST_LINK)
    steps = off["steps"]
    assert steps["cpu_hit_tokens"].sum() == 512 and steps["cpu_stored_bytes"].sum() == 32 * BLOCK_BYTES
    # the second request computes 1 prompt token: 512 + 1 prefill tokens over both
    assert run.steps["num_prefill_tokens"].sum() == 512 + 1
    assert run.num_cached_tokens.tolist() == [0, 512]
    assert not np.isnan(run.finished_s).any()


def test_without_the_tier_the_same_stream_recomputes(tmp_path):
    result = run_replay(load_workload(write(tmp_path, same_prompt_twice(10_000), offload="")), ReplayOptions(tensors=False), workers=1)
    (run,) = result.runs
    assert run.offload is None
    assert run.steps["num_prefill_tokens"].sum() == 2 * 512


def test_a_gpu_prefix_hit_comes_first_and_the_tier_loads_the_last_chunk(tmp_path):
    # With the GPU prefix cache holding the prompt, the GPU hit stops one block short (31 blocks: vLLM's local hit
    # leaves the last token to compute). The connector's limit is the request's whole 512 tokens (no sliding window
    # group), so the 32nd chunk loads from the tier: 16 tokens, one block; then the last token is recomputed.
    path = write(tmp_path, same_prompt_twice(10_000), allocator="{kind: paged, block_size: 16, prefix_caching: true}")
    (run,) = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1).runs
    assert run.offload["cpu_hit_tokens"] == 16 and run.offload["cpu_loaded_bytes"] == BLOCK_BYTES
    assert run.num_cached_tokens.tolist() == [0, 512]
    assert run.steps["num_prefill_tokens"].sum() == 512 + 1


def test_two_requests_in_one_step_store_their_shared_chunks_once(tmp_path):
    # Both arrive at 0 and are admitted in one step: neither finds anything (stores are built at the end of the
    # step), the first's offer takes the 32 chunks and the second's finds them in the tier already (no new keys).
    (run,) = run_replay(load_workload(write(tmp_path, same_prompt_twice(0))), ReplayOptions(tensors=False), workers=1).runs
    assert run.offload["cpu_hit_tokens"] == 0
    assert run.offload["cpu_stored_bytes"] == 32 * BLOCK_BYTES
    assert run.steps["num_prefill_tokens"][0] == 2 * 512


def connector(num_chunks: int, blocks_per_chunk: int = 1) -> OffloadingConnector:
    return OffloadingConnector(block_size=4, blocks_per_chunk=blocks_per_chunk, num_chunks=num_chunks, bytes_per_block=100,
                               host_bandwidth_bytes_per_s=1000.0)


class Seq:
    def __init__(self, seq_id: int, prompt: list[int]):
        self.seq_id = seq_id
        self.token_ids = np.array(prompt, dtype=np.int64)
        self.num_prompt_tokens = len(prompt)
        self.num_tokens = len(prompt)


def test_stores_are_all_or_nothing_and_offered_again_until_they_fit():
    c = connector(num_chunks=3)
    a = Seq(0, list(range(12)))  # 3 chunks
    b = Seq(1, list(range(100, 116)))  # 4 chunks
    assert c.get_num_new_matched_tokens(a, 0) == 0
    c.build_connector_meta([(a, 12)], [], [])  # stores 3 chunks: the tier is full (being written)
    c.submit(0.0, 1.0)
    assert c.cpu_stored_bytes == 300
    assert c.get_num_new_matched_tokens(b, 0) == 0
    c.build_connector_meta([(b, 16)], [], [])  # 4 new chunks cannot fit in 3: refused, nothing stored
    assert c.cpu_stored_bytes == 300 and b.seq_id in c._req_status
    assert c._req_status[1].next_stored_chunk_idx == 0  # offered again next step
    # a lookup of a's prefix while its chunks are written: HIT_PENDING defers the request
    a2 = Seq(2, list(range(12)) + [99, 98, 97, 96])
    assert c.get_num_new_matched_tokens(a2, 0) is None
    c.complete_until(1.0 + 0.3)  # the store took 300 B / 1000 B/s after the step's end
    assert c.manager.lookup(c._req_status[0].offload_keys[0], c._req_status[0].req_context) is LookupResult.HIT
    assert c.get_num_new_matched_tokens(a2, 0) == 12  # 3 chunks hit, the 4th misses


def test_a_load_pins_its_chunks_and_another_request_on_them_waits():
    c = connector(num_chunks=8, blocks_per_chunk=2)  # 8-token chunks
    a = Seq(0, list(range(16)))
    c.get_num_new_matched_tokens(a, 0)
    c.build_connector_meta([(a, 16)], [], [])
    c.submit(0.0, 0.0)
    c.complete_until(10.0)
    b, d = Seq(1, list(range(16)) + [5]), Seq(2, list(range(16)) + [6])
    assert c.get_num_new_matched_tokens(b, 0) == 16
    c.now = 10.0
    c.update_state_after_alloc(b, 16)
    assert c.get_num_new_matched_tokens(d, 0) is None  # its chunks are being loaded by b
    assert c.submit(10.0, 0.0) == 0.0
    assert c.cpu_loaded_bytes == 4 * 100  # 4 GPU blocks
    c.complete_until(10.0 + 0.4)
    assert c.is_load_ready(b)
    assert c.get_num_new_matched_tokens(d, 0) == 16


def test_an_offload_on_a_flat_allocator_is_one_line_naming_the_file_and_field(tmp_path):
    path = write(tmp_path, same_prompt_twice(0), allocator="{kind: flat, reserve: max}")
    with pytest.raises(KvsimError) as exc:
        load_workload(path)
    assert str(path) in str(exc.value) and "offload" in str(exc.value) and exc.value.field == "offload"


# qwen3-next-80b-a3b in align mode (vllm serve's prefix caching): 3 gated delta net state groups + 1 full group of 12
# layers on 576-token blocks; one block id spans 12 pages of 1,179,648 B (a state page padded to the attention page)
STATE_MODEL_BLOCK_BYTES = 12 * 1_179_648


def write_state_model(tmp_path: Path) -> Path:
    """The conformance stream offload-qwen3-next-repeat, copied with its trace: A (5,120 tokens: ten 512-token
    Mooncake blocks), D (ten others), A again, D again, then A's first 4,608 tokens (= 8 x 576) alone, 5 s apart,
    on a pool of 20 blocks (D evicts A's blocks from the GPU)."""
    from kvsim.conformance.stream import STREAMS_DIR

    for suffix in (".yaml", ".jsonl"):
        name = "offload-qwen3-next-repeat" + suffix
        (tmp_path / name).write_text((STREAMS_DIR / name).read_text())
    return tmp_path / "offload-qwen3-next-repeat.yaml"


def test_a_state_model_hands_its_states_to_the_tier_and_loads_them_hand_computed(tmp_path):
    # A's 5,120-token prompt runs in chunks cut at state blocks (0-1,728, -3,456, -5,120). The full group stores its
    # 8 whole chunks as they are computed (3 + 3 + 2 blocks). A state group caches, under vLLM's retention 0, only
    # the state at the prompt's last block boundary ((5,120 - 1) // 576 x 576 = 4,608), and the allocator hands
    # that block to the tier: one store job of one block per state group (3). So 11 blocks stored per prompt.
    # A again, its GPU blocks evicted by D: the hit stops one token short and is rounded down to the state block,
    # 4,608 tokens: 8 full-attention blocks and each group's one state, 11 blocks loaded. The same for D.
    # Last, A's first 4,608 tokens: the hit would end at 4,607, rounded down to 4,032, where no state was stored:
    # no hit (vLLM's `resolve_mamba_align_size`; a state after 4,608 tokens is not the state after 4,607).
    result = run_replay(load_workload(write_state_model(tmp_path)), ReplayOptions(tensors=False), workers=1)
    (run,) = result.runs
    off = run.offload
    assert off["cpu_hit_tokens"] == 2 * 4608
    assert off["cpu_loaded_bytes"] == 2 * 11 * STATE_MODEL_BLOCK_BYTES
    # The last request computes its prompt and caches its states at its reachable boundaries: its last block
    # boundary (4,032) and the junction where A's full-attention blocks still cached on the GPU end (2,304, vLLM's
    # `shared_prefix_boundary`): 6 state blocks, each a new key; its full-attention chunks are all in the tier.
    assert off["cpu_stored_bytes"] == (2 * 11 + 6) * STATE_MODEL_BLOCK_BYTES


def test_a_state_model_without_prefix_caching_with_sync_loads_or_with_tensors_is_one_line(tmp_path):
    path = write_state_model(tmp_path)
    path.write_text(path.read_text().replace("{kind: paged, block_size: 16}",
                                             "{kind: paged, block_size: 16, prefix_caching: false}"))
    with pytest.raises(KvsimError) as exc:
        run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1)
    assert exc.value.field == "offload" and str(path) in str(exc.value)
    assert "only with prefix caching on (mamba_cache_mode align)" in str(exc.value)
    path = write_state_model(tmp_path)
    path.write_text(path.read_text().replace("policy: lru}", "policy: lru, sync_load_budget_bytes: 1GiB}"))
    with pytest.raises(KvsimError) as exc:
        run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1)
    assert exc.value.field == "offload.sync_load_budget_bytes" and str(path) in str(exc.value)
    assert "Cannot get 1 free blocks" in str(exc.value)
    path = write_state_model(tmp_path)
    with pytest.raises(KvsimError) as exc:
        run_replay(load_workload(path), ReplayOptions(tensors=True), workers=1)
    assert exc.value.field == "offload" and str(path) in str(exc.value)
    assert "Mamba state blocks" in str(exc.value) and "--no-tensors" in str(exc.value)


def test_a_sliding_window_model_replays_its_tier(tmp_path):
    """gemma-3-27b (6 sliding groups of window 1,024 + 1 full group): the 512-token prompt seen again loads from
    every group."""
    path = write(tmp_path, same_prompt_twice(10_000), budget="2GiB")
    path.write_text(path.read_text().replace("qwen3-0.6b", "gemma-3-27b"))
    (run,) = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1).runs
    # Under vLLM's default retention (0) a sliding group stores only the chunks a hit can reach: the window's 64
    # blocks before the prompt's reachable boundary, (512 - 1) // 16 * 16 = 496 tokens, i.e. chunks 0-30. The full
    # group stores all 32. The lookup stops one token short (511); the full group hits 32 chunks, the sliding ones
    # 31 (chunk 31 misses), so the hit is 31 chunks, 496 tokens, and the last 16 are computed again.
    assert run.offload["cpu_hit_tokens"] == 496
    assert run.steps["num_prefill_tokens"].sum() == 512 + 16
    # blocks moved: stored 32 + 6 x 31 = 218, loaded 7 x 31 = 217 (no block lies before a window of 1,024)
    assert run.offload["cpu_stored_bytes"] * 217 == run.offload["cpu_loaded_bytes"] * 218 > 0


def test_a_tier_beyond_the_host_memory_is_refused_with_tensors(tmp_path):
    path = write(tmp_path, same_prompt_twice(0), offload="offload: {cpu_bytes: 64GiB}")
    with pytest.raises(KvsimError) as exc:
        run_replay(load_workload(path), ReplayOptions(tensors=True, device="cpu"), workers=1)
    assert exc.value.field == "--max-host-memory"


def test_a_cli_offload_error_is_one_line_and_exit_2(cli, tmp_path):
    path = write(tmp_path, same_prompt_twice(0), offload="offload: {cpu_bytes: 1GiB, policy: mru}")
    result = cli(["replay", str(path), "--no-tensors", "-q", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "offload.policy" in result.output and "Traceback" not in result.output


def test_the_prefill_sources_chart_is_drawn_with_a_tier(tmp_path):
    from kvsim.plots import plot_report
    from kvsim.plots.report import load_report
    from kvsim.replay.reports import write_reports

    result = run_replay(load_workload(write(tmp_path, same_prompt_twice(10_000))), ReplayOptions(tensors=False), workers=1)
    out = tmp_path / "report"
    write_reports(result, out)
    paths = plot_report(load_report(out), "png", note=lambda _: None)
    assert "prefill-sources.png" in [p.name for p in paths]
    import pandas as pd

    steps = pd.read_parquet(out / "steps.parquet")
    assert steps["cpu_hit_tokens"].sum() == 512 and steps["gpu_hit_tokens"].sum() == 0


def test_a_tier_that_never_hits_changes_nothing_on_the_gpu(tmp_path):
    # Distinct prompts (one hash id each) and no preemption: every lookup misses and every store goes to the host
    # link beside compute, so admissions, steps and latencies are the replay's without a tier.
    rows = []
    for i in range(30):
        length = 300 + 37 * i
        rows.append({"timestamp": 40 * i, "input_length": length, "output_length": 20 + i,
                     "hash_ids": [100 * i + k for k in range(-(-length // 512))]})
    path = write(tmp_path, rows, allocator="{kind: paged, block_size: 16, prefix_caching: true}")
    (with_tier,) = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1).runs
    path.write_text(path.read_text().replace("offload: {cpu_bytes: 1GiB, policy: lru}", ""))
    (without,) = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1).runs
    assert with_tier.offload["cpu_hit_tokens"] == 0 and with_tier.offload["cpu_stored_bytes"] > 0
    assert without.offload is None
    for name in ("admitted_s", "first_token_s", "finished_s"):
        np.testing.assert_allclose(getattr(with_tier, name), getattr(without, name), rtol=1e-9, err_msg=name)
    assert with_tier.steps["num_prefill_tokens"].sum() == without.steps["num_prefill_tokens"].sum()


def _loads_checked(monkeypatch) -> list:
    """Record every integrity check made right after a load from the host pool: (request id, positions, group)."""
    from kvsim.engine.tensors.cache import KVCache

    checked, loading = [], []
    verify, copy = KVCache.verify, OffloadingConnector._copy

    def tracked_copy(self, job):
        loading.append(not job.is_store)
        try:
            return copy(self, job)
        finally:
            loading.pop()

    def tracked_verify(self, seq_id, slots, positions, group=0):
        if loading and loading[-1]:
            checked.append((seq_id, np.asarray(positions).copy(), group))
        return verify(self, seq_id, slots, positions, group)

    monkeypatch.setattr(OffloadingConnector, "_copy", tracked_copy)
    monkeypatch.setattr(KVCache, "verify", tracked_verify)
    return checked


def test_with_tensors_the_blocks_go_to_the_host_pool_and_come_back_intact(tmp_path, monkeypatch):
    """Cache tensors with integrity: the first request's 32 blocks are copied to the host pool when stored, and
    the second request's load copies them back into its own blocks, where they hold exactly what the first
    request's tokens wrote (checked right after the load, and again when the request finishes)."""
    from kvsim.engine.tensors.host_pool import HostKVPool

    pools = []
    init = HostKVPool.__init__
    monkeypatch.setattr(HostKVPool, "__init__", lambda self, *a: (init(self, *a), pools.append(self))[0])
    checked = _loads_checked(monkeypatch)
    path = write(tmp_path, same_prompt_twice(10_000))
    result = run_replay(load_workload(path), ReplayOptions(tensors=True, device="cpu", integrity=True), workers=1)
    (run,) = result.runs
    assert run.offload["cpu_hit_tokens"] == 512
    (pool,) = pools
    assert pool.rows.shape[1] == 585 * 16  # 1 GiB over 1,835,008 B chunks, 16 token rows each
    assert pool.rows[:, : 32 * 16].abs().sum() > 0  # the stored chunks hold data (slots 0..31, fresh)
    # the load's check: request 1 (the second), positions 0..511, its whole prompt
    assert [(seq_id, list(pos), group) for seq_id, pos, group in checked] == [(1, list(range(512)), 0)]


def test_a_host_pool_that_loses_data_fails_the_integrity_check(tmp_path):
    """The check can fail: chunks stored one row off (a wrong host row mapping) come back as other tokens' KV."""
    from kvsim.engine.tensors.host_pool import HostKVPool

    path = write(tmp_path, same_prompt_twice(10_000))
    store = HostKVPool.store
    try:
        HostKVPool.store = lambda self, gpu, chunks: (store(self, gpu, chunks), self.rows.copy_(self.rows.roll(1, dims=1)))
        with pytest.raises(AssertionError, match=r"integrity: seq 1 position 0 .* does not hold what that request's tokens wrote"):
            run_replay(load_workload(path), ReplayOptions(tensors=True, device="cpu", integrity=True), workers=1)
    finally:
        HostKVPool.store = store


def test_with_tensors_a_load_within_the_step_lands_before_the_step_computes(tmp_path, monkeypatch):
    """`sync_load_budget_bytes`: the second request (the first one's 512-token prompt and 188 more tokens) loads its
    512-token hit within the step and computes its last 188 prompt tokens in that same step. The worker waits for
    the load before the forward pass, so the blocks hold the first request's KV when the step reads them: the
    admission's check of positions 0-511 passes."""
    checked = _loads_checked(monkeypatch)
    rows = [{"timestamp": 0, "input_length": 512, "output_length": 4, "hash_ids": [7]},
            {"timestamp": 10_000, "input_length": 700, "output_length": 4, "hash_ids": [7, 9]}]
    path = write(tmp_path, rows, offload="offload: {cpu_bytes: 1GiB, sync_load_budget_bytes: 64MiB}")
    (run,) = run_replay(load_workload(path), ReplayOptions(tensors=True, device="cpu", integrity=True), workers=1).runs
    assert run.offload["cpu_hit_tokens"] == 512 and run.offload["cpu_load_wait_s"] == pytest.approx(32 * BLOCK_BYTES / H100_HOST_LINK)
    hit_row = int(np.flatnonzero(run.offload["steps"]["cpu_hit_tokens"])[0])
    assert run.steps["num_prefill_tokens"][hit_row] == 188  # the load's step computes the rest of the prompt
    assert run.steps["num_prefill_tokens"].sum() == 512 + 188
    assert [(seq_id, list(pos), group) for seq_id, pos, group in checked] == [(1, list(range(512)), 0)]


def mixed_prompt_twice(tmp_path: Path, **kwargs) -> Path:
    """gpt-oss-20b (KV cache group 0: 12 sliding-window layers of 128 tokens; group 1: 12 full-attention layers),
    the 512-token prompt seen twice."""
    path = write(tmp_path, same_prompt_twice(10_000), budget="2GiB", **kwargs)
    path.write_text(path.read_text().replace("qwen3-0.6b", "gpt-oss-20b"))
    return path


def test_with_tensors_a_mixed_models_groups_go_to_the_host_pool_and_come_back_intact(tmp_path, monkeypatch):
    """Each group's blocks move to the host pool and back into the second request's blocks of that group. The
    tier (vLLM's rules, as without tensors): the full group stores its 32 chunks, the sliding one only the window
    before the reachable boundary ((512 - 1) // 16 = 31 blocks: blocks 23-30, positions 368-495); the hit is 496
    tokens (the sliding lookup stops one token short), so the full group loads blocks 0-30 and the sliding group
    blocks 23-30 (its blocks before the window are null: skipped). Each load is checked per group, and at the
    finish every group's blocks are checked again (the runner writes every group's blocks under a tier)."""
    from kvsim.engine.tensors.cache import KVCache
    from kvsim.engine.tensors.host_pool import HostKVPool

    pools, finish_checks = [], []
    init = HostKVPool.__init__
    monkeypatch.setattr(HostKVPool, "__init__", lambda self, *a: (init(self, *a), pools.append(self))[0])
    checked = _loads_checked(monkeypatch)
    verify = KVCache.verify

    def tracked_verify(self, seq_id, slots, positions, group=0):
        finish_checks.append((seq_id, int(positions[0]), int(positions[-1]), group))
        return verify(self, seq_id, slots, positions, group)

    monkeypatch.setattr(KVCache, "verify", tracked_verify)
    (run,) = run_replay(load_workload(mixed_prompt_twice(tmp_path)),
                        ReplayOptions(tensors=True, device="cpu", integrity=True), workers=1).runs
    block_bytes = 24 * 8 * 64 * 2 * 2 * 16 // 2  # one block id: a 16-token page of each of the 12 layer tensors
    assert run.offload["cpu_hit_tokens"] == 496
    assert run.offload["cpu_stored_bytes"] == (8 + 32) * block_bytes  # 15,728,640
    assert run.offload["cpu_loaded_bytes"] == (8 + 31) * block_bytes
    assert [(seq_id, list(pos), group) for seq_id, pos, group in checked] == [
        (1, list(range(368, 496)), 0), (1, list(range(496)), 1)]
    # at the finish (512 prompt + 4 - 1 tokens computed): the sliding group from its first held block, the full one whole
    assert (1, 384, 514, 0) in finish_checks and (1, 0, 514, 1) in finish_checks
    # the pool: vLLM's CPU blocks, shared by the groups (`kvsim size -m gpt-oss-20b --cpu-offload 1GiB`: 2,730 of
    # 393,216 B), each 16 token rows of the one materialised layer (K and V, 8 heads x 64, bf16)
    (pool,) = pools
    assert pool.num_chunks == (1 << 30) // block_bytes == 2730
    assert pool.nbytes == 2730 * 16 * 2 * 8 * 64 * 2


@pytest.mark.parametrize("model, groups, hit", [
    ("gemma-3-27b", 7, 496),  # 6 sliding groups (window 1,024: nothing skipped) + 1 full; the lookup stops at 511
    ("llama-4-scout", 4, 511),  # 3 chunked local attention groups (8,192) + 1 full: the hit stops one token short
])
def test_with_tensors_every_group_kind_the_tier_serves_comes_back_intact(tmp_path, monkeypatch, model, groups, hit):
    """Sliding windows (several groups) and chunked local attention: each group's load is checked in its group,
    every block from 0 (no window reaches back past the prompt), and the requests pass their finish checks."""
    checked = _loads_checked(monkeypatch)
    path = write(tmp_path, same_prompt_twice(10_000), budget="2GiB")
    path.write_text(path.read_text().replace("qwen3-0.6b", model))
    (run,) = run_replay(load_workload(path), ReplayOptions(tensors=True, device="cpu", integrity=True), workers=1).runs
    assert run.offload["cpu_hit_tokens"] == hit
    loaded = -(-hit // 16) * 16  # whole blocks: a partial last one loads whole
    assert [(seq_id, list(pos), group) for seq_id, pos, group in checked] == [
        (1, list(range(loaded)), g) for g in range(groups)]


def test_a_mixed_models_host_pool_that_loses_data_fails_the_integrity_check(tmp_path):
    """Chunks stored one row off fail at the first position loaded: the sliding group's 368 (its blocks before the
    window are skipped)."""
    from kvsim.engine.tensors.host_pool import HostKVPool

    store = HostKVPool.store
    try:
        HostKVPool.store = lambda self, gpu, host: (store(self, gpu, host), self.rows.copy_(self.rows.roll(1, dims=1)))
        with pytest.raises(AssertionError, match=r"integrity: seq 1 position 368 .* does not hold what that request's tokens wrote"):
            run_replay(load_workload(mixed_prompt_twice(tmp_path)),
                       ReplayOptions(tensors=True, device="cpu", integrity=True), workers=1)
    finally:
        HostKVPool.store = store


def test_a_load_into_another_groups_blocks_fails_the_integrity_check(tmp_path, monkeypatch):
    """A group's layers hold their own K/V of a token: the full group's chunks of positions 368-495 loaded into the
    sliding group's blocks at the same positions (and back) fail the check, in the group they reach."""
    copy = OffloadingConnector._copy

    def swapped_groups(self, job):
        if not job.copied and not job.is_store:
            host, n = job.host_block_ids, job.group_sizes[0]  # the sliding group's blocks 23-30 come first
            host[:n], host[n + 23:n + 31] = host[n + 23:n + 31], host[:n]
        return copy(self, job)

    monkeypatch.setattr(OffloadingConnector, "_copy", swapped_groups)
    with pytest.raises(AssertionError, match=r"integrity: seq 1 position 368 .* does not hold what that request's tokens wrote"):
        run_replay(load_workload(mixed_prompt_twice(tmp_path)),
                   ReplayOptions(tensors=True, device="cpu", integrity=True), workers=1)


def test_a_mixed_models_tier_beyond_the_host_memory_is_refused_with_tensors(tmp_path):
    """The host-memory refusal counts the whole tier, every group's chunks (they share its CPU blocks)."""
    path = mixed_prompt_twice(tmp_path, offload="offload: {cpu_bytes: 1GiB}")
    with pytest.raises(KvsimError) as exc:
        run_replay(load_workload(path), ReplayOptions(tensors=True, device="cpu", max_host_bytes=(1 << 30) - 1), workers=1)
    assert exc.value.field == "--max-host-memory" and "1,073,741,824 B" in str(exc.value)
    (run,) = run_replay(load_workload(path), ReplayOptions(tensors=True, device="cpu", max_host_bytes=1 << 30), workers=1).runs
    assert run.offload["cpu_hit_tokens"] == 496


def test_a_mixed_model_with_swap_preemption_and_tensors_is_refused_naming_the_field(tmp_path):
    path = mixed_prompt_twice(tmp_path)
    path.write_text(path.read_text() + "scheduler: {preemption: swap}\n")
    with pytest.raises(KvsimError) as exc:
        run_replay(load_workload(path), ReplayOptions(tensors=True, device="cpu"), workers=1)
    assert exc.value.field == "scheduler.preemption" and str(path) in str(exc.value) and "--no-tensors" in str(exc.value)
    (run,) = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1).runs
    assert run.offload["cpu_hit_tokens"] == 496


def test_the_sync_load_budget_is_read_in_bytes_and_checked(tmp_path):
    path = write(tmp_path, same_prompt_twice(0), offload="offload: {cpu_bytes: 1GiB, sync_load_budget_bytes: 64MiB}")
    assert load_workload(path).offload.sync_load_budget_bytes == 64 << 20
    assert load_workload(write(tmp_path, same_prompt_twice(0))).offload.sync_load_budget_bytes == 0
    path = write(tmp_path, same_prompt_twice(0), offload="offload: {cpu_bytes: 1GiB, sync_load_budget_bytes: -1}")
    with pytest.raises(KvsimError) as exc:
        load_workload(path)
    assert "sync_load_budget_bytes" in str(exc.value) and str(path) in str(exc.value)


@pytest.mark.parametrize("async_scheduling", ["true", "false"])
def test_a_lone_request_that_cannot_grow_beside_a_load_is_recomputed_not_swapped(tmp_path, async_scheduling):
    # 256 MiB: 146 blocks of 16 tokens, 145 usable. A (2048 tokens) puts its 128 chunks in the tier. R (16 + 1000)
    # runs alone; B (2048 tokens from the tier + 120 new: 136 blocks) arrives when R holds 9 blocks: its prompt
    # fits, its load holds 128 blocks and leaves 8 free. R takes its 10th block during the load, so B's 8 more no
    # longer fit and B waits, holding its blocks; R grows into the 8 and at 272 tokens preempts itself with
    # nothing else running. Swapping it out brought it back to the same 17 blocks, ahead of B: no step ever ran
    # again. It is recomputed instead: B is admitted, then R recomputes its 273 tokens past its first block (16
    # tokens from the tier).
    rows = [{"timestamp": 0, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 500, "input_length": 16, "output_length": 1000, "hash_ids": [9]},
            {"timestamp": 545, "input_length": 2048 + 120, "output_length": 2, "hash_ids": [1, 2, 3, 4, 5]}]
    path = write(tmp_path, rows)
    path.write_text(path.read_text() + f"scheduler: {{preemption: swap, swap_space: 1GiB, async_scheduling: {async_scheduling}}}\n")
    (run,) = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1).runs
    assert not np.isnan(run.finished_s).any()
    assert run.num_preemptions.tolist() == [0, 1, 0]
    assert run.offload["cpu_hit_tokens"] == 2048 + 16
    assert run.steps["num_prefill_tokens"].sum() == 2048 + 16 + 120 + (273 - 16)
    assert run.finished_s[2] < run.finished_s[1]  # B, admitted once R made room, finishes first
