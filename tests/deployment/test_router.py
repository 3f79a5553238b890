"""The prefix policies' cost functions, by hand: Dynamo's KvRouter cost and llm-d's weighted scorers, and the
approximate index's LRU."""

from __future__ import annotations

from kvsim.deployment.router import PrefixApproxPolicy, PrefixPrecisePolicy
from kvsim.workload.spec import Router


class FakeReplica:
    def __init__(self, cached=(), active_blocks=0, num_waiting=0, kv_usage=0.0, num_usable_blocks=100):
        self._cached = {h: None for h in cached}
        self.active_blocks, self.num_waiting, self.kv_usage = active_blocks, num_waiting, kv_usage
        self.num_usable_blocks, self.block_size = num_usable_blocks, 16

    def cached(self):
        return self._cached


HASHES = list(range(10))  # a 10-block prompt: 160 tokens, at most (160 - 1) // 16 = 9 blocks can hit


def test_dynamo_cost_weighs_new_prefill_blocks_against_active_blocks():
    # replica 0: 8 blocks cached, 5 active -> 1 x (10 - 8) + 5 = 7; replica 1: nothing cached, idle -> 10 + 0 = 10
    replicas = [FakeReplica(cached=range(8), active_blocks=5), FakeReplica()]
    assert PrefixPrecisePolicy(Router(policy="prefix-precise"), replicas).pick(0, 160, HASHES) == 0
    # overlap_score_weight 0.25: 0.5 + 5 = 5.5 against 2.5: load wins
    assert PrefixPrecisePolicy(Router(policy="prefix-precise", overlap_score_weight=0.25), replicas).pick(0, 160, HASHES) == 1


def test_llmd_scorers_sum_prefix_kv_and_queue():
    # replica 0: prefix 8/10, kv 0.9 used, 4 waiting (the max) -> 2 x 0.8 + 0.1 + 0 = 1.7
    # replica 1: prefix 0, kv idle, 0 waiting (the min)       -> 0 + 1 + 1 = 2.0
    replicas = [FakeReplica(cached=range(8), kv_usage=0.9, num_waiting=4), FakeReplica()]
    assert PrefixPrecisePolicy(Router(policy="prefix-precise", scorer="llm-d"), replicas).pick(0, 160, HASHES) == 1
    heavy = Router(policy="prefix-precise", scorer="llm-d", prefix_weight=4.0)  # 3.3 against 2.0
    assert PrefixPrecisePolicy(heavy, replicas).pick(0, 160, HASHES) == 0


def test_a_hole_in_the_prefix_ends_the_overlap():
    policy = PrefixPrecisePolicy(Router(policy="prefix-precise"), [FakeReplica(cached=[0, 1, 3, 4, 5])])
    assert policy.overlaps(HASHES, 9) == [2]


def test_the_approximate_index_remembers_what_it_routed_and_forgets_the_oldest():
    replicas = [FakeReplica(), FakeReplica()]
    policy = PrefixApproxPolicy(Router(policy="prefix-approx", approx_blocks=12), replicas)
    first = policy.pick(0, 160, HASHES)
    assert policy.overlaps(HASHES, 9)[first] == 9  # capped at (prompt - 1) // block_size
    policy.routed(first, [100, 101, 102, 103, 104])  # 15 blocks > 12: hashes 0, 1, 2 are evicted
    assert policy.overlaps(HASHES, 9)[first] == 0
    assert list(policy.lrus[first])[:2] == [3, 4]
