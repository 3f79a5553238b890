"""The one-pass LRU prefix-cache curve equals a brute-force LRU simulation at every capacity."""

from __future__ import annotations

import json
from collections import OrderedDict
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsim.cache_curve.curve as cc
from conftest import REPO, SHARED
from kvsim.cache_curve.curve import flatten, lru_prefix_curve
from kvsim.cache_curve.view import cache_curve_of
from kvsim.workload.requests import RequestSpec, generate_requests, make_token_ids
from kvsim.workload.spec import load_workload

MOONCAKE_CONV = SHARED / "traces" / "mooncake" / "conversation_trace.jsonl"


def brute_force_hits(requests: list[tuple[list, int]], capacity: int) -> int:
    """Hit blocks of an LRU cache holding `capacity` blocks, simulated block by block.

    Each request: its first `counted` blocks are looked up against the cache as it stands, and count while
    they hit (the first miss ends the count); then all its blocks are used, last first (the first is the most
    recent), and the least recently used beyond `capacity` are evicted.
    """
    cache: OrderedDict = OrderedDict()  # least recently used first
    hits = 0
    for blocks, counted in requests:
        for block in blocks[:counted]:
            if block not in cache:
                break
            hits += 1
        for block in reversed(blocks):
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def expand(units) -> list:
    """A unit (key, n) as its n blocks."""
    return [(key, i) for key, n in units for i in range(n)]


def assert_equal_to_brute_force(requests, *, extra: int = 2) -> None:
    curve = lru_prefix_curve(*flatten(requests), block_size=1, prompt_tokens=1)
    blocks = [(expand(units), counted) for units, counted in requests]
    top = len({b for bl, _ in blocks for b in bl}) + extra
    capacities = np.arange(top + 1)
    assert curve.hit_blocks(capacities).tolist() == [brute_force_hits(blocks, int(c)) for c in capacities]
    assert curve.ideal_hit_blocks == brute_force_hits(blocks, top)


def test_hand_computed_curve():
    a, b, c, d, x, z = range(6)
    requests = [
        ([(a, 1), (b, 1), (c, 1)], 3),  # all cold; then the recency order is a, b, c
        ([(a, 1), (b, 1), (d, 1)], 3),  # a at distance 1, b at 2, d cold: 2 hits from capacity 2, 1 at capacity 1
        ([(a, 1), (x, 1)], 2),  # a at distance 1 again: 1 hit from capacity 1
        ([(z, 1), (b, 1)], 2),  # b is cached (distance 3) but z is not: the prefix rule counts nothing
        ([(a, 1), (b, 1)], 1),  # only the first block may count (a whole-block prompt keeps its last block)
    ]
    curve = lru_prefix_curve(*flatten(requests), block_size=16, prompt_tokens=160)
    # request 5 finds a at distance 3 (z, b used since)
    assert curve.hit_blocks(np.array([0, 1, 2, 3, 100])).tolist() == [0, 2, 3, 4, 4]
    assert curve.ideal_hit_blocks == 4 and curve.ideal_hit_rate == 4 * 16 / 160
    assert curve.hit_rate(np.array([31, 32])).tolist() == [0.2, 0.3]  # 31 tokens hold one block of 16
    assert_equal_to_brute_force(requests)


def test_the_docstring_diagram():
    x, y, a, b, c = range(5)
    # uses oldest first, so that the recency order is x B0 B1 A0 A1 A2 y (a request's first block most recent)
    setup = [([(y, 1)], 0), ([(a, 3)], 0), ([(b, 2)], 0), ([(x, 1)], 0)]
    curve = lru_prefix_curve(*flatten(setup + [([(a, 3), (b, 2), (c, 1)], 6)]), block_size=1, prompt_tokens=6)
    assert curve.hit_blocks(np.arange(9)).tolist() == [0, 0, 0, 0, 1, 2, 5, 5, 5]
    assert (curve.ramp_lo.tolist(), curve.ramp_hi.tolist(), curve.step_at.tolist(), curve.step_count.tolist()) == ([4], [6], [6], [2])


def test_units_of_several_blocks_sit_together():
    # a unit of 4 blocks at distance 2 puts its blocks at 2..5: hits grow one block per capacity step
    requests = [([(1, 4)], 4), ([(2, 1)], 1), ([(1, 4)], 4)]
    curve = lru_prefix_curve(*flatten(requests), block_size=1, prompt_tokens=9)
    assert curve.hit_blocks(np.arange(8)).tolist() == [0, 0, 1, 2, 3, 4, 4, 4]
    assert_equal_to_brute_force(requests)


@pytest.mark.parametrize("name, requests", [
    ("cyclic scan longer than most capacities", [([(k, 1) for k in range(6)], 6)] * 5),
    ("prefixes of one another, growing", [([(k, 1) for k in range(n)], n) for n in range(1, 9)]),
    ("prefixes of one another, shrinking", [([(k, 1) for k in range(n)], n) for n in range(8, 0, -1)]),
    ("cached suffix behind an evicted head", [([(0, 1), (1, 3)], 4), ([(9, 5)], 5), ([(2, 1), (1, 3)], 4), ([(0, 1), (1, 3)], 4)]),
    ("one key twice in a request", [([(0, 2), (1, 1), (0, 2)], 5), ([(0, 2), (1, 1)], 3), ([(1, 1), (0, 2)], 3)]),
    ("identical requests", [([(0, 3), (1, 2)], 5)] * 4),
    ("empty requests between", [([], 0), ([(0, 2)], 2), ([], 0), ([(0, 2)], 1)]),
])
def test_adversarial_streams(name, requests):
    assert_equal_to_brute_force(requests)
    with patch.object(cc, "INITIAL_SLOTS", 1):  # the recency tree renumbers at every other use
        assert_equal_to_brute_force(requests)


weights = st.dictionaries(st.integers(0, 7), st.integers(1, 3), min_size=8, max_size=8)


@st.composite
def unit_streams(draw):
    """Requests over 8 keys of fixed sizes, keys repeating anywhere (in or across requests)."""
    w = draw(weights)
    requests = []
    for _ in range(draw(st.integers(0, 10))):
        keys = draw(st.lists(st.integers(0, 7), max_size=6))
        units = [(k, w[k]) for k in keys]
        requests.append((units, draw(st.integers(0, sum(n for _, n in units) + 1))))
    return requests


@settings(max_examples=300, deadline=None)
@given(unit_streams(), st.sampled_from([1, 2, 1024]))
def test_random_streams_equal_brute_force(requests, slots):
    with patch.object(cc, "INITIAL_SLOTS", slots):
        assert_equal_to_brute_force(requests)


@st.composite
def mooncake_requests(draw):
    """Requests whose hash ids walk a random tree of chained ids (equal ids, equal prefix); a node is full
    (512 tokens, may have children) or a partial leaf that always covers the same tokens."""
    parents: list[int] = []
    covered: list[int] = []
    for k in range(draw(st.integers(1, 10))):
        parents.append(draw(st.sampled_from([-1] + [i for i in range(k) if covered[i] == 512])))
        covered.append(draw(st.sampled_from([512, 512, 1, 200, 511])))
    requests = []
    for i, node in enumerate(draw(st.lists(st.integers(0, len(parents) - 1), min_size=1, max_size=10))):
        path = []
        while node != -1:
            path.append(node)
            node = parents[node]
        path.reverse()
        requests.append(RequestSpec(i, 0.0, 512 * (len(path) - 1) + covered[path[-1]], 3, hash_ids=tuple(path)))
    return requests


def chained_blocks(request: RequestSpec, block_size: int, seed: int) -> list:
    """The request's full prompt blocks as keys made from its token ids alone (vLLM's chained block hash)."""
    ids = make_token_ids(request, seed)[: request.num_prompt_tokens]
    keys, parent = [], None
    for j in range(request.num_prompt_tokens // block_size):
        parent = hash((parent, ids[j * block_size:(j + 1) * block_size].tobytes()))
        keys.append(parent)
    return keys


def assert_curve_matches_token_ids(requests: list[RequestSpec], block_size: int, seed: int = 0) -> None:
    curve = cache_curve_of(requests, block_size=block_size)
    blocks = [(chained_blocks(r, block_size, seed), (r.num_prompt_tokens - 1) // block_size) for r in requests]
    top = sum(len(b) for b, _ in blocks) + 1
    capacities = np.unique(np.linspace(0, top, 40).astype(int))
    assert curve.hit_blocks(capacities).tolist() == [brute_force_hits(blocks, int(c)) for c in capacities]
    assert curve.prompt_tokens == sum(r.num_prompt_tokens for r in requests)


@settings(max_examples=60, deadline=None)
@given(mooncake_requests(), st.sampled_from([16, 48, 64, 512, 700]))
def test_mooncake_units_match_block_hashes_of_token_ids(requests, block_size):
    """Units from hash ids (any block size, dividing 512 or not) agree with blocks hashed from the token ids."""
    assert_curve_matches_token_ids(requests, block_size)


def test_shared_prefix_workload_matches_block_hashes_of_token_ids():
    workload = load_workload(REPO / "workloads" / "shared-prefix.yaml", limit=60)
    requests = generate_requests(workload)
    assert_curve_matches_token_ids(requests, 16, seed=workload.seed)
    assert_curve_matches_token_ids(requests, 64, seed=workload.seed)


def test_cli_json_keys_and_errors(cli, tmp_path):
    trace = REPO / "workloads" / "traces" / "mooncake-conversation-500.jsonl"
    result = cli(["cache-curve", str(trace), "--block-size", "512", "--capacities", "0,1e4,1e9", "--json", "--model", "llama-3.1-8b"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert set(data) == {"ideal_hit_rate", "block_size", "num_requests", "prompt_tokens", "curve"}
    assert data["block_size"] == 512 and data["num_requests"] == 500
    assert [set(row) for row in data["curve"]] == [{"capacity_tokens", "capacity_bytes", "hit_rate"}] * 3
    assert data["curve"][0]["hit_rate"] == 0 and data["curve"][2]["hit_rate"] == data["ideal_hit_rate"] > 0
    assert data["curve"][1]["capacity_bytes"] == 10_000 * 131_072  # llama-3.1-8b: 128 KiB of bf16 KV per token
    bad = cli(["cache-curve", str(trace), "--capacities", "1e4,lots"])
    assert bad.exit_code == 2 and "--capacities" in bad.output
    out = cli(["cache-curve", str(trace), "--out", str(tmp_path / "c"), "--model", "llama-3.1-8b", "--gpu", "h100-80gb"])
    assert out.exit_code == 0, out.output
    rows = (tmp_path / "c" / "cache-curve.csv").read_text().splitlines()
    assert rows[0] == "capacity_blocks,capacity_tokens,capacity_bytes,hit_blocks,hit_rate" and len(rows) > 10
    assert (tmp_path / "c" / "cache-curve.png").stat().st_size > 10_000
    assert "KV budget of llama-3.1-8b on h100-80gb" in out.output


def test_a_hash_id_past_the_block_keys_is_one_line_naming_the_file_line_and_key(cli, tmp_path):
    trace = tmp_path / "big.jsonl"  # an id >= 2^63 was an OverflowError traceback
    trace.write_text('{"timestamp":0,"input_length":100,"output_length":10,"hash_ids":[9223372036854775808]}\n')
    result = cli(["cache-curve", str(trace)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"kvsim: error: {trace}: line 1, key hash_ids: hash id 9223372036854775808 is past")
    assert result.output.count("\n") == 1


@pytest.mark.skipif(not MOONCAKE_CONV.is_file(), reason="needs ../shared/traces/mooncake")
def test_conversation_trace_ideal_is_block_size_independent_for_divisors():
    """At block sizes dividing 512 the ideal differs only by partial blocks; at 512 it counts whole ids."""
    from kvsim.workload.requests import trace_requests
    from kvsim.workload.traces import read_trace

    requests = trace_requests(read_trace(MOONCAKE_CONV, limit=2000))
    c512 = cache_curve_of(requests, block_size=512)
    c16 = cache_curve_of(requests, block_size=16)
    assert c16.ideal_hit_rate >= c512.ideal_hit_rate  # a shared partial id adds its full 16-token blocks
    # hit blocks never fall as the cache grows
    assert np.all(np.diff(c16.hit_blocks(c16.knots())) >= 0)


@settings(max_examples=60, deadline=None)
@given(mooncake_requests(), st.sampled_from([1, 16, 48, 512, 700, 1100]))
def test_unit_arrays_of_hash_ids_equal_the_per_request_units(requests, block_size):
    from kvsim.cache_curve.blocks import block_unit_arrays, prompt_block_units

    keys, counts, offsets = block_unit_arrays(requests, block_size)
    for i, request in enumerate(requests):
        lo, hi = offsets[i], offsets[i + 1]
        assert list(zip(keys[lo:hi].tolist(), counts[lo:hi].tolist())) == prompt_block_units(request, block_size)
        assert counts[lo:hi].sum() == request.num_prompt_tokens // block_size


def test_engine_alone_with_room_for_everything_hits_the_ideal(tmp_path):
    """Requests far apart (each finishes before the next arrives) and a budget that never evicts: the paged
    allocator's prefix hits at admission are the curve's unbounded ideal, token for token."""
    from kvsim.replay.run import run_replay
    from kvsim.replay.options import ReplayOptions
    from kvsim.workload.requests import trace_requests
    from kvsim.workload.traces import read_trace

    lines = (REPO / "workloads" / "traces" / "mooncake-conversation-500.jsonl").read_text().splitlines()[:40]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({**json.loads(line), "timestamp": 10**7 * i, "output_length": 2}) + "\n"
                             for i, line in enumerate(lines)))
    (tmp_path / "w.yaml").write_text(
        "model: llama-3.1-8b\nhardware: h100-80gb\nkv_budget: 70GiB\nmax_model_len: 131072\n"
        "requests: {trace: t.jsonl}\nallocators: [{kind: paged, block_size: 16, prefix_caching: true}]\n")
    run = run_replay(load_workload(tmp_path / "w.yaml"), ReplayOptions(tensors=False), workers=1).runs[0]
    curve = cache_curve_of(trace_requests(read_trace(trace)), block_size=16)
    assert run.num_cached_tokens.sum() == curve.ideal_hit_blocks * 16 > 0
    assert run.prefix_hit_tokens == run.num_cached_tokens.sum()


def test_shared_prefix_workload_ideal_by_hand(cli):
    """Every request of a group after its first finds the group's 1,024-token prefix: 64 blocks of 16."""
    requests = generate_requests(load_workload(REPO / "workloads" / "shared-prefix.yaml"))
    joined = [r.prefix_group for r in requests if r.prefix_group is not None]
    expected = (len(joined) - len(set(joined))) * 1024 / sum(r.num_prompt_tokens for r in requests)
    result = cli(["cache-curve", str(REPO / "workloads" / "shared-prefix.yaml"), "--capacities", "0,16,1e9", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["num_requests"] == 1000 and data["ideal_hit_rate"] == pytest.approx(expected, rel=1e-12)
    assert data["curve"][2]["hit_rate"] == data["ideal_hit_rate"]
    assert data["curve"][1]["capacity_bytes"] == 16 * 131_072  # the workload's model, llama-3.1-8b


def test_the_charts_legend_sits_below_the_axes_off_the_ideal_line():
    """Inside the axes at the upper left, the legend covered the dashed ideal line (the curve's ceiling)."""
    import matplotlib.pyplot as plt

    from kvsim.cache_curve.view import CurveContext
    from kvsim.plots.cache_curve import cache_curve_chart
    from kvsim.workload.traces import read_trace
    from kvsim.workload.requests import trace_requests

    trace = REPO / "workloads" / "traces" / "mooncake-conversation-500.jsonl"
    curve = cache_curve_of(trace_requests(read_trace(trace)), block_size=16)
    ctx = CurveContext("mooncake-conversation", "llama-3.1-8b", 131_072, "h100-80gb", 61_248_888_832, "memory x 0.9 - weights")
    fig = cache_curve_chart(curve, ctx)
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_legend() is None and len(fig.legends) == 1
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[1] == "unbounded cache (ideal): 16.4%" and labels[2].endswith("467,291 tokens, 3.6%")
    legend, axes = fig.legends[0].get_window_extent(), ax.get_window_extent()
    assert legend.y1 <= axes.y0  # wholly under the plot, whose top holds the ideal line
    plt.close(fig)
