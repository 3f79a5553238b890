"""The two-tier curve (GPU prefix cache over vLLM's CPU tier) equals a chunk-by-chunk simulation that calls the
CPU tier's manager as vLLM's connector does, request by request."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from conftest import REPO
from kvsim.cache_curve.blocks import block_unit_arrays
from kvsim.cache_curve.two_tier import two_tier_hits, two_tier_requests
from kvsim.cache_curve.two_tier_sim import simulate_two_tiers
from kvsim.workload.requests import RequestSpec


def conversations(seed: int, n: int = 50) -> list[RequestSpec]:
    """Mooncake-like requests: conversations whose turns extend earlier prompts by whole 512-token blocks, each
    prompt ending in a partial block of its own (or on a block boundary)."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    reqs, next_id = [], 0
    for i in range(n):
        if convs and rng.random() < 0.7:
            conv = rng.choice(convs)
        else:
            conv = []
            convs.append(conv)
        for _ in range(rng.randint(0, 3)):
            conv.append(next_id)
            next_id += 1
        ids, tail = list(conv), rng.choice([0, rng.randint(1, 511)])
        if tail or not ids:
            ids.append(next_id)
            next_id += 1
            tail = tail or rng.randint(1, 511)
        reqs.append(RequestSpec(i, 0.0, len(conv) * 512 + tail, 1, hash_ids=tuple(ids)))
    return reqs


def both(reqs, block_size, cpu_block_size, capacity_blocks, cpu_chunks, **sim):
    prompt = np.array([r.num_prompt_tokens for r in reqs])
    gpu_units, cpu_units = block_unit_arrays(reqs, block_size), block_unit_arrays(reqs, cpu_block_size)
    tt = two_tier_requests(*gpu_units, *cpu_units, prompt, block_size=block_size, cpu_block_size=cpu_block_size)
    gpu = tt.gpu_hit_blocks(capacity_blocks * block_size)
    fast = (gpu, two_tier_hits(tt, gpu, cpu_chunks))
    return fast, simulate_two_tiers(gpu_units, cpu_units, prompt, block_size=block_size, cpu_block_size=cpu_block_size,
                                    capacity_blocks=capacity_blocks, cpu_chunks=cpu_chunks, **sim)


@pytest.mark.parametrize("block_size, cpu_block_size", [(64, 64), (64, 128), (32, 96), (512, 512)])
def test_equals_the_chunk_by_chunk_simulation_request_by_request(block_size, cpu_block_size):
    refused = loaded = mismatched = 0
    for seed in range(12):
        reqs = conversations(seed)
        for capacity in (0, 8, 30, 10**6):
            for chunks in (0, 1, 4, 12, 40, 10**6):
                (gpu, cpu), (gpu_ref, cpu_ref) = both(reqs, block_size, cpu_block_size, capacity, chunks)
                mismatched += not (np.array_equal(gpu, gpu_ref) and np.array_equal(cpu, cpu_ref))
                loaded += int((cpu > 0).sum())
                offered = np.array([r.num_prompt_tokens for r in reqs]) // cpu_block_size
                refused += int((offered > chunks).sum())
    assert mismatched == 0
    assert loaded > 100 and refused > 100  # CPU hits, and stores too big for the tier, both exercised


def test_a_larger_gpu_cache_can_lower_the_hit_rate():
    """CPU tier of 2 chunks (512 tokens each): with a 1-block GPU cache, request 1's GPU hit on A means its CPU hit
    starts at B, so A is not refreshed in the CPU tier and request 2's new chunk D evicts it; request 3 then hits
    nothing (the GPU holds only D). Without a GPU cache, request 1 loads A B from the CPU, D evicts B, request 3
    loads A: 3 blocks from cache against 2."""
    ids = [(0, 1, 2), (0, 1, 3), (4, 5), (0, 1, 6)]  # A B c, A B y, D e, A B z
    reqs = [RequestSpec(i, 0.0, 1124 if len(h) == 3 else 612, 1, hash_ids=h) for i, h in enumerate(ids)]
    (gpu0, cpu0), _ = both(reqs, 512, 512, 0, 2)
    (gpu1, cpu1), _ = both(reqs, 512, 512, 1, 2)
    assert gpu0.tolist() == [0, 0, 0, 0] and cpu0.tolist() == [0, 1024, 0, 512]
    assert gpu1.tolist() == [0, 1, 0, 0] and cpu1.tolist() == [0, 512, 0, 0]
    assert int(gpu0.sum()) * 512 + int(cpu0.sum()) > int(gpu1.sum()) * 512 + int(cpu1.sum())


def test_a_full_hit_leaves_the_last_token_to_compute():
    reqs = [RequestSpec(0, 0.0, 1024, 1, hash_ids=(0, 1)), RequestSpec(1, 0.0, 1024, 1, hash_ids=(0, 1))]
    (gpu, cpu), _ = both(reqs, 512, 512, 0, 10)
    assert cpu.tolist() == [0, 1023]  # vLLM loads both chunks, then recomputes the prompt's last token


def test_an_offer_larger_than_the_tier_stores_nothing():
    reqs = [RequestSpec(i, 0.0, 3 * 512 + 5, 1, hash_ids=(0, 1, 2, 3 + i)) for i in range(2)]
    (_, cpu_small), _ = both(reqs, 512, 512, 0, 2)  # 3 chunks offered, 2 slots: all or nothing
    (_, cpu_fit), _ = both(reqs, 512, 512, 0, 3)
    assert cpu_small.tolist() == [0, 0] and cpu_fit.tolist() == [0, 3 * 512]


def test_cli_tiers_json_csv_chart_and_errors(cli, tmp_path):
    trace = REPO / "workloads" / "traces" / "mooncake-conversation-500.jsonl"
    r = cli(["cache-curve", str(trace), "--block-size", "512", "--capacities", "0,1e5,1e9", "--cpu-capacities", "0,1e5,1e9",
             "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["cpu_block_size"] == 512 and len(data["tiers"]) == 9
    assert set(data["tiers"][0]) == {"capacity_tokens", "cpu_capacity_tokens", "hit_rate", "cpu_hit_rate", "total_hit_rate"}
    at = {(t["capacity_tokens"], t["cpu_capacity_tokens"]): t for t in data["tiers"]}
    assert at[(0, 0)]["total_hit_rate"] == 0 and at[(0, 10**9)]["total_hit_rate"] == pytest.approx(data["ideal_hit_rate"])
    assert all(t["cpu_hit_rate"] == 0 for (c, m), t in at.items() if m == 0)
    assert at[(10**5, 0)]["hit_rate"] == data["curve"][1]["hit_rate"]  # the GPU tier is the one-tier curve
    out = cli(["cache-curve", str(trace), "--block-size", "512", "--cpu-capacities", "1e5,1e6", "--out", str(tmp_path / "c")])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "c" / "cache-curve-tiers.csv").read_text().startswith("capacity_tokens,capacity_bytes,cpu_capacity_tokens")
    assert (tmp_path / "c" / "cache-curve-tiers.png").stat().st_size > 10_000
    for args, field in ((["--cpu-capacities", "1e5", "--cpu-block-size", "100"], "--cpu-block-size"),
                        (["--cpu-block-size", "32"], "--cpu-block-size"), (["--cpu-capacities", "lots"], "--cpu-capacities")):
        bad = cli(["cache-curve", str(trace), *args])
        assert bad.exit_code == 2 and field in bad.output and "Traceback" not in bad.output


def test_the_exactness_test_sees_a_changed_rule(monkeypatch):
    """Refreshing the GPU-hit chunks after a CPU hit (a monotone model vLLM does not follow) is caught."""
    from kvsim.cache_curve.two_tier import CpuTier

    request = CpuTier.request

    def refresh_all(self, runs, num_chunks, gpu_hit_tokens, chunk_tokens):
        hits = request(self, runs, num_chunks, gpu_hit_tokens, chunk_tokens)
        if hits:  # touch the whole prompt again, as if every chunk were re-offered
            request(self, runs, num_chunks, 0, chunk_tokens)
        return hits

    monkeypatch.setattr(CpuTier, "request", refresh_all)
    differs = 0
    for seed in range(6):
        (gpu, cpu), (gpu_ref, cpu_ref) = both(conversations(seed), 64, 64, 8, 12)
        differs += not np.array_equal(cpu, cpu_ref)
    assert differs
