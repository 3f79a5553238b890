"""`kvsim size --cpu-offload` equals vLLM 0.33.0's own `build_offloading_config` and `CPUOffloadingSpec`."""

from __future__ import annotations

import pytest

from kvsim.conformance.offload_size_check import OffloadCase, check, default_cases

pytestmark = pytest.mark.conformance


def test_uniform_sliding_chunked_hybrid_and_mla_models_equal_vllm(vllm_loaded):
    results = [check(case) for case in default_cases()]
    assert [r.case.label for r in results if r.skipped] == []
    assert [f"{r.case.label}: {r.differing}" for r in results if r.differing] == []
    assert all(len(r.compared) == 9 for r in results)


def test_the_check_sees_a_wrong_chunk_size(vllm_loaded, monkeypatch):
    from kvsim.size import cpu_offload

    monkeypatch.setattr(cpu_offload, "HOST_PAGE_BYTES", 2 * 2**20)  # pad chunks to 2 MiB pages instead of 4 KiB
    r = check(OffloadCase("gemma-3-27b", tp=2))
    assert "vllm_num_cpu_blocks" in r.differing
