"""kvsim's CPUOffloadingManager equals vLLM 0.33.0's, unmodified, call by call; a changed rule is caught."""

from __future__ import annotations

import pytest

from kvsim.conformance.offload_check import OffloadScenario, default_scenarios, run_scenario

pytestmark = pytest.mark.conformance


def test_both_policies_equal_vllm_call_by_call(vllm_loaded):
    results = [run_scenario(s) for s in default_scenarios()]
    assert [(r.scenario.label, r.difference) for r in results if r.difference] == []
    assert all(r.steps > 200 for r in results)
    assert sum(r.refused_stores for r in results) > 0 and sum(r.evictions for r in results) > 0
    arc = [r for r in results if r.scenario.policy == "arc"]
    assert max(r.most_reused for r in arc) > 0 and max(r.highest_target for r in arc) > 0


def _lru_head_last(self, key_groups, insertion_only_keys, reused_keys, req_context):
    from kvsim.offload.policy import order_request_keys

    self._refresh(order_request_keys(key_groups, req_context))  # tail most recent: the wrong way round


def _arc_wrong_sign(self, key):
    if key in self.b1:
        self.target_t1_size = max(self.target_t1_size - 1, 0)
        self.b1.move_to_end(key)
    elif key in self.b2:
        self.target_t1_size = min(self.target_t1_size + 1, self.cache_capacity)
        self.b2.move_to_end(key)


@pytest.mark.parametrize("policy, target, attr, replacement", [
    ("lru", "kvsim.offload.lru.LRUCachePolicy", "on_request_finished", _lru_head_last),
    ("arc", "kvsim.offload.arc.ARCCachePolicy", "_adapt_to_ghost_hit", _arc_wrong_sign),
    ("lru", "kvsim.offload.lru.LRUCachePolicy", "on_request_access", lambda self, keys, ctx: None),
])
def test_a_changed_rule_is_caught(vllm_loaded, monkeypatch, policy, target, attr, replacement):
    monkeypatch.setattr(f"{target}.{attr}", replacement)
    found = [run_scenario(s).difference for s in default_scenarios() if s.policy == policy]
    assert any(found)


def test_offering_keys_unprotected_is_caught(vllm_loaded, monkeypatch):
    from kvsim.offload.lru import LRUCachePolicy

    evict = LRUCachePolicy.evict
    monkeypatch.setattr(LRUCachePolicy, "evict", lambda self, n, protected: evict(self, n, set()))
    assert any(run_scenario(s).difference for s in default_scenarios() if s.policy == "lru")


def test_a_scenario_reports_its_first_difference(vllm_loaded, monkeypatch):
    from kvsim.offload.manager import CPUOffloadingManager

    monkeypatch.setattr(CPUOffloadingManager, "_allocate", lambda self, n: [
        __import__("kvsim.offload.chunk", fromlist=["ChunkStatus"]).ChunkStatus(self.num_chunks - 1 - i) for i in range(n)])
    r = run_scenario(OffloadScenario(seed=1))
    assert r.difference is not None and "prepare_store" in r.difference
