"""The model runner's read groups: a decode batch's sampled read is split by length so that no sequence is
padded to more than twice its tokens, and every sequence is read exactly once."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvsim.replay.runner import read_groups


def test_read_groups_by_hand():
    lens = np.array([100, 4000, 30, 2100, 1999, 51])
    groups = [g.tolist() for g in read_groups(lens)]
    assert groups == [[1, 3], [4], [0, 5], [2]]  # 4000, 2100 | 1999 | 100, 51 | 30
    assert [g.tolist() for g in read_groups(lens, one=True)] == [[0, 1, 2, 3, 4, 5]]


@given(st.lists(st.integers(1, 10**6), min_size=1, max_size=300))
def test_read_groups_partition_the_batch_and_bound_the_padding(values):
    lens = np.array(values)
    groups = read_groups(lens)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(lens)))
    for group in groups:
        assert 2 * lens[group].min() >= lens[group].max()  # padded to the group's longest: at most 2x each
    padded = sum(len(g) * int(lens[g].max()) for g in groups)
    assert padded <= 2 * int(lens.sum()) and padded <= len(lens) * int(lens.max())


def test_worker_plans_balance_the_estimated_cost():
    from types import SimpleNamespace

    from kvsim.replay.workers import plan_workers

    kinds = ["flat", "flat", "flat", "paged", "paged"]  # the main job's five configs
    configs = [SimpleNamespace(kind=k) for k in kinds]
    # One process takes both paged replays (1.6 + 1.6), the other the three flat ones: handing them out in
    # order would leave a paged replay running alone at the end.
    assert plan_workers(configs, 2) == [[3, 4], [0, 1, 2]]
    assert plan_workers(configs, 1) == [[3, 4, 0, 1, 2]]
    assert plan_workers(configs, 4) == [[3], [4], [0, 2], [1]]  # longest first onto the least loaded
    assert plan_workers(configs[:1], 2) == [[0]]
    plan = plan_workers([SimpleNamespace(kind="paged")] * 12, 2)
    assert sorted(len(p) for p in plan) == [6, 6] and sorted(sum(plan, [])) == list(range(12))
