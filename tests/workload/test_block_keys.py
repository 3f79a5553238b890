"""`make_block_keys`: the exact keys the paged allocator caches a replay's blocks under are equal exactly where
the token ids `make_token_ids` builds are equal, block prefix by block prefix."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO
from kvsim.engine.paged.kv_cache_utils import block_hashes
from kvsim.workload.requests import (RequestSpec, generate_requests, make_block_keys, make_token_ids,
                                    num_shareable_tokens)
from kvsim.workload.spec import load_workload


def assert_keys_match_token_prefixes(requests: list[RequestSpec], block_size: int, seed: int = 0) -> None:
    """For every pair of requests and every block index both have: equal keys <=> equal token-id prefixes
    (compared in full), and the chained hashes of the ids agree with both."""
    # every token id a request has: prompt + max_tokens (its KV holds one less, but the keys cover every id)
    length = {r.request_id: r.num_prompt_tokens + r.max_tokens for r in requests}
    keys = {r.request_id: make_block_keys(r, block_size, length[r.request_id]).tolist() for r in requests}
    ids = {r.request_id: make_token_ids(r, seed) for r in requests}
    hashes = {r.request_id: block_hashes(ids[r.request_id], length[r.request_id], block_size) for r in requests}
    for a, b in itertools.combinations_with_replacement(requests, 2):
        ka, kb = keys[a.request_id], keys[b.request_id]
        for j in range(min(len(ka), len(kb))):
            end = (j + 1) * block_size
            same = bool(np.array_equal(ids[a.request_id][:end], ids[b.request_id][:end]))
            assert (ka[j] == kb[j]) == same, (a, b, j)
            assert (hashes[a.request_id][j] == hashes[b.request_id][j]) == same, (a, b, j)


@st.composite
def mooncake_requests(draw):
    """Requests whose hash ids walk a random tree of chained ids (a node is full, 512 tokens, or a partial
    leaf that always covers the same tokens), with outputs past their prompts."""
    parents: list[int] = []
    covered: list[int] = []
    for k in range(draw(st.integers(1, 8))):
        parents.append(draw(st.sampled_from([-1] + [i for i in range(k) if covered[i] == 512])))
        covered.append(draw(st.sampled_from([512, 512, 1, 200, 511])))
    requests = []
    for i, node in enumerate(draw(st.lists(st.integers(0, len(parents) - 1), min_size=1, max_size=8))):
        path = []
        while node != -1:
            path.append(node)
            node = parents[node]
        path.reverse()
        output = draw(st.integers(0, 40))
        requests.append(RequestSpec(i, 0.0, 512 * (len(path) - 1) + covered[path[-1]], output, hash_ids=tuple(path)))
    return requests


def assert_private_past_shareable(requests: list[RequestSpec], block_size: int) -> None:
    """Every key of a request's blocks from `num_shareable_tokens // block_size` on (prompt and output) is a key
    no other request has: what lets the paged allocator cache them lazily."""
    shareable = num_shareable_tokens(requests)
    keys = [make_block_keys(r, block_size, r.num_prompt_tokens + r.max_tokens).tolist() for r in requests]
    for i, r in enumerate(requests):
        assert 0 <= shareable[i] <= r.num_prompt_tokens
        others = {k for j, ks in enumerate(keys) if j != i for k in ks}
        private = keys[i][shareable[i] // block_size :]
        assert not others.intersection(private), (r, shareable[i], block_size)


@settings(max_examples=40, deadline=None)
@given(mooncake_requests(), st.sampled_from([1, 16, 48, 512, 700]))
def test_mooncake_keys_equal_exactly_where_token_prefixes_are(requests, block_size):
    assert_keys_match_token_prefixes(requests, block_size)
    assert_private_past_shareable(requests, block_size)


def test_num_shareable_tokens_by_hand():
    """Mooncake ids: up to the trailing ids no other request lists (512 tokens each, within the prompt); a group's
    prefix where the group has another member; a whole prompt that parallel samples share; else nothing."""
    requests = [
        RequestSpec(0, 0.0, 1200, 5, hash_ids=(1, 2, 3)),  # 3 is its own: 2 ids shared
        RequestSpec(1, 0.0, 1100, 5, hash_ids=(1, 2, 4)),  # 4 is its own
        RequestSpec(2, 0.0, 1100, 5, hash_ids=(1, 5, 2)),  # 5 its own but 2 is listed by others: its whole prompt
        RequestSpec(3, 0.0, 300, 5, hash_ids=(9,)),  # its own
        RequestSpec(4, 0.0, 90, 20, 3, 50), RequestSpec(5, 0.0, 40, 20, 3, 40),  # group 3: two members
        RequestSpec(6, 0.0, 90, 20, 4, 50),  # group 4: alone
        RequestSpec(7, 0.0, 80, 9), RequestSpec(8, 0.0, 80, 9, prompt_of=7), RequestSpec(9, 0.0, 60, 9),
    ]
    assert num_shareable_tokens(requests) == [1024, 1024, 1100, 0, 50, 40, 0, 80, 80, 0]
    assert_private_past_shareable(requests, 16)


@pytest.mark.parametrize("block_size", [1, 7, 16, 64])
def test_group_prefixes_and_parallel_samples(block_size):
    """Shared-prefix groups (prompts shorter and longer than the prefix), and parallel-sampling children that
    repeat a prompt (`prompt_of`) with outputs of their own."""
    requests = [
        RequestSpec(0, 0.0, 90, 20, 3, 50), RequestSpec(1, 0.0, 120, 10, 3, 50), RequestSpec(2, 0.0, 30, 40, 3, 30),
        RequestSpec(3, 0.0, 90, 20, 4, 50), RequestSpec(4, 0.0, 70, 30),
        RequestSpec(5, 0.0, 90, 20, 3, 50), RequestSpec(6, 0.0, 90, 25, 3, 50, prompt_of=5),
        RequestSpec(7, 0.0, 90, 5, 3, 50, prompt_of=5), RequestSpec(8, 0.0, 64, 9, prompt_of=4),
    ]
    assert_keys_match_token_prefixes(requests, block_size, seed=11)
    assert_private_past_shareable(requests, block_size)


def test_shipped_shared_prefix_workload():
    workload = load_workload(REPO / "workloads" / "shared-prefix.yaml", limit=40)
    assert_keys_match_token_prefixes(generate_requests(workload), 16, seed=workload.seed)
    assert_private_past_shareable(generate_requests(workload), 16)


def test_keys_cover_the_full_blocks_within_num_tokens():
    request = RequestSpec(0, 0.0, 100, 20, hash_ids=None)
    assert len(make_block_keys(request, 16, 100)) == 6 and len(make_block_keys(request, 16, 120)) == 7
    assert make_block_keys(request, 16, 100).tolist() == make_block_keys(request, 16, 120).tolist()[:6]


def test_key_runs_from_the_keys_structure():
    """`make_block_key_runs` gives `make_block_keys`' keys and the runs `key_runs` finds in them, from the keys'
    structure: Mooncake ids repeated back to back (one run across them) or not, block sizes that do not divide
    512 or exceed it, groups, parallel samples whose prompt is their own or another's, any number of tokens."""
    import random

    from kvsim.engine.paged.prefix_table import key_runs
    from kvsim.workload.requests import make_block_key_runs

    rng = random.Random(7)
    for _ in range(4000):
        block_size = rng.choice([1, 3, 16, 32, 48, 100, 256, 512, 600, 2048])
        prompt, output, rid = rng.randint(1, 12000), rng.randint(0, 2000), rng.randint(0, 99)
        if rng.random() < 0.4:
            ids = tuple(rng.randint(0, 2) if rng.random() < 0.6 else rng.randint(0, 10**6) for _ in range(-(-prompt // 512)))
            r = RequestSpec(rid, 0.0, prompt, output, hash_ids=ids)
        else:
            kw = {}
            if rng.random() < 0.5:
                kw.update(prefix_group=rng.randint(0, 9), num_prefix_tokens=rng.randint(1, prompt))
            if rng.random() < 0.5:
                kw.update(prompt_of=rng.choice([rid, rng.randint(0, 99)]))
            r = RequestSpec(rid, 0.0, prompt, output, **kw)
        num_tokens = rng.randint(0, prompt + output)
        keys, runs = make_block_key_runs(r, block_size, num_tokens)
        assert np.array_equal(keys, make_block_keys(r, block_size, num_tokens))
        assert runs == key_runs(keys), (r, block_size, num_tokens)
