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


def test_every_catalogue_model_equals_vllm_where_kvsim_sizes_it(vllm_loaded):
    from kvsim.conformance.offload_size_check import catalogue_cases

    results = [check(case) for case in catalogue_cases()]
    assert [f"{r.case.label}: {r.differing}" for r in results if r.differing] == []
    compared = [r for r in results if not r.skipped]
    assert len(compared) > 200
    # skipped only where kvsim refuses the model or the tier, each with its one line
    reasons = {r.skipped.split(": ", 1)[1].split(":")[0] for r in results if r.skipped}
    assert reasons <= {"--tp", "--mamba-cache-mode", "--cpu-offload", "layers"}, reasons
