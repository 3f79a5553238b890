"""Request streams and synthetic token ids: determinism, shared prefixes, and data integrity."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import yaml

from conftest import REPO, SHARED
from kvsim.workload.requests import VOCAB_SIZE, RequestSpec, generate_requests, make_token_ids
from kvsim.workload.spec import load_workload

POISSON = REPO / "workloads" / "poisson.yaml"


def make_request(request_id=0, prompt=100, output=20, group=None, prefix=0) -> RequestSpec:
    return RequestSpec(request_id, 0.0, prompt, output, group, prefix)


def test_same_seed_same_requests_different_seed_different():
    a = generate_requests(load_workload(POISSON))
    b = generate_requests(load_workload(POISSON))
    c = generate_requests(load_workload(POISSON, seed=1))
    assert a == b
    assert len(c) == len(a) == 2000
    assert [r.num_prompt_tokens for r in a] != [r.num_prompt_tokens for r in c]
    assert [r.arrival_time for r in a] != [r.arrival_time for r in c]


def test_poisson_workload_stream_matches_its_spec():
    w = load_workload(POISSON)
    requests = generate_requests(w)
    arrival = np.array([r.arrival_time for r in requests])
    prompt = np.array([r.num_prompt_tokens for r in requests])
    output = np.array([r.max_tokens for r in requests])
    assert [r.request_id for r in requests] == list(range(2000))
    assert arrival[0] == 0.0 and np.all(np.diff(arrival) >= 0)
    rate = w.requests.arrival.rate
    assert abs(2000 / arrival[-1] - rate) < 0.1 * rate
    assert prompt.min() >= 8 and prompt.max() <= 3072 and abs(prompt.mean() - 512) < 25
    assert output.min() >= 16 and output.max() <= 1024 and abs(output.mean() - 520) < 20
    grouped = [r for r in requests if r.prefix_group is not None]
    assert abs(len(grouped) / 2000 - 0.5) < 0.05  # fraction 0.5
    assert {r.prefix_group for r in grouped} == {0, 1, 2, 3}
    assert all(r.num_prefix_tokens == min(256, r.num_prompt_tokens) for r in grouped)
    assert all(r.num_prefix_tokens == 0 for r in requests if r.prefix_group is None)


def test_changing_the_arrival_rate_keeps_the_lengths(tmp_path):
    data = yaml.safe_load(POISSON.read_text())
    data["requests"]["arrival"] = {"process": "gamma", "rate": 3.0, "cv": 2.0}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    a, b = generate_requests(load_workload(POISSON)), generate_requests(load_workload(path))
    assert [r.num_prompt_tokens for r in a] == [r.num_prompt_tokens for r in b]
    assert [r.arrival_time for r in a] != [r.arrival_time for r in b]


def test_limit_keeps_the_first_requests():
    full = generate_requests(load_workload(POISSON))
    assert generate_requests(load_workload(POISSON, limit=25)) == full[:25]


def test_duration_workload(tmp_path):
    data = yaml.safe_load(POISSON.read_text())
    del data["requests"]["count"]
    data["requests"]["duration_s"] = 30
    data["requests"]["arrival"]["rate"] = 10.0
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(data))
    requests = generate_requests(load_workload(path))
    assert requests[-1].arrival_time < 30 and 240 < len(requests) < 360  # ~300 at 10/s


def test_trace_workload(tmp_path):
    (tmp_path / "t.jsonl").write_text(
        '{"arrival_time": 2.0, "prompt_tokens": 30, "output_tokens": 4}\n'
        '{"arrival_time": 1.0, "prompt_tokens": 20, "output_tokens": 0}\n'
    )
    path = tmp_path / "w.yaml"
    path.write_text(POISSON.read_text())
    requests = generate_requests(load_workload(path, trace=str(tmp_path / "t.jsonl")))
    assert requests == [RequestSpec(0, 0.0, 20, 0), RequestSpec(1, 1.0, 30, 4)]  # seconds from the first request


@pytest.mark.skipif(not (SHARED / "traces" / "azure-conv-2023.csv").is_file(), reason="needs ../shared traces")
def test_shipped_trace_workload_replays_the_azure_trace():
    w = load_workload(REPO / "workloads" / "trace.yaml", trace=str(SHARED / "traces" / "azure-conv-2023.csv"))
    requests = generate_requests(w)
    assert len(requests) == 19_366
    assert all(r.num_prompt_tokens + r.max_tokens <= w.max_model_len for r in requests)  # the longest is 14,089 tokens


def test_token_ids_shape_dtype_range_and_determinism():
    r = make_request(request_id=3, prompt=100, output=20)
    ids = make_token_ids(r, seed=0)
    assert ids.shape == (120,) and ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < VOCAB_SIZE
    assert np.array_equal(ids, make_token_ids(r, seed=0))
    assert not np.array_equal(ids, make_token_ids(r, seed=1))
    assert len(np.unique(ids)) == 120  # no repeats inside a request (at 2^31 ids, a repeat is ~1e-6 likely)


def test_shared_prefix_ids_really_match_and_the_rest_differs():
    block_size = 16
    a = make_token_ids(make_request(1, prompt=300, output=50, group=2, prefix=256), seed=5)
    b = make_token_ids(make_request(9, prompt=700, output=10, group=2, prefix=256), seed=5)
    short = make_token_ids(make_request(4, prompt=100, output=10, group=2, prefix=100), seed=5)
    other = make_token_ids(make_request(6, prompt=300, output=50, group=3, prefix=256), seed=5)
    alone = make_token_ids(make_request(7, prompt=300, output=50), seed=5)
    assert np.array_equal(a[:256], b[:256])
    assert np.array_equal(short[:100], a[:100])  # a prompt shorter than the prefix shares what it has
    # Past the prefix, and for other groups or ungrouped requests, no position agrees, so no block is shared.
    for x, y in [(a[256:], b[256:350]), (a, other), (a, alone), (short[100:], a[100:110])]:
        assert not np.any(x == y)
    blocks = {tuple(ids[i : i + block_size]) for ids in (a, b) for i in range(0, 256, block_size)}
    assert len(blocks) == 256 // block_size  # both requests' prefix blocks are the same 16 blocks


def test_group_ids_do_not_depend_on_request_order_or_length():
    """Position p of group g is the same whichever request (id, length) asks for it."""
    ids = [make_token_ids(make_request(i, prompt=p, output=1, group=0, prefix=min(p, 64)), seed=0) for i, p in [(5, 10), (0, 64), (99, 40)]]
    assert np.array_equal(ids[0][:10], ids[1][:10]) and np.array_equal(ids[2][:40], ids[1][:40])


def test_token_ids_of_a_whole_workload_share_only_within_groups():
    requests = generate_requests(load_workload(POISSON, limit=200))
    first_block: dict[tuple, set] = {}
    for r in requests:
        key = tuple(make_token_ids(r, seed=0)[:16])
        first_block.setdefault(key, set()).add(r.prefix_group if r.num_prefix_tokens >= 16 else ("alone", r.request_id))
    # One first block per prefix group, one per other request: exactly as many as the stream implies.
    assert all(len(groups) == 1 for groups in first_block.values())
    expected = {r.prefix_group for r in requests if r.num_prefix_tokens >= 16}
    expected |= {("alone", r.request_id) for r in requests if r.num_prefix_tokens < 16}
    assert len(first_block) == len(expected)


def test_request_spec_is_frozen_and_checked():
    r = make_request()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.max_tokens = 5  # type: ignore[misc]
    with pytest.raises(AssertionError):
        make_request(prompt=10, group=1, prefix=11)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    group=st.integers(0, 1000),
    ids=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)).filter(lambda t: t[0] != t[1]),
    prompts=st.tuples(st.integers(1, 600), st.integers(1, 600)),
    prefix=st.integers(1, 512),
)
def test_any_two_requests_of_a_group_share_exactly_their_common_prefix(seed, group, ids, prompts, prefix):
    reqs = [make_request(i, prompt=p, output=8, group=group, prefix=min(p, prefix)) for i, p in zip(ids, prompts)]
    a, b = (make_token_ids(r, seed) for r in reqs)
    k = min(r.num_prefix_tokens for r in reqs)
    assert np.array_equal(a[:k], b[:k])
    n = min(len(a), len(b))
    # Past the shorter prefix the ids are independent: agreeing at a position has chance 2^-31.
    assert np.count_nonzero(a[k:n] == b[k:n]) <= 1
