"""The two-tier curve's CPU tier equals the chunk-by-chunk simulation driving vLLM 0.33.0's own
CPUOffloadingManager (LRU), unmodified, as the connector calls it."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.conformance


def test_fast_pass_equals_vllms_manager(vllm_loaded):
    from cache_curve.test_two_tier import both, conversations  # tests/ is on the path (its conftest)

    from kvsim.conformance.offload_check import vllm_manager_modules

    vm, base = vllm_manager_modules()
    factory = lambda n: vm.CPUOffloadingManager(num_chunks=n, cache_policy="lru")  # noqa: E731
    for seed in range(6):
        reqs = conversations(seed)
        for capacity, chunks in ((0, 4), (8, 12), (30, 40), (0, 10**4)):
            (gpu, cpu), (gpu_ref, cpu_ref) = both(reqs, 64, 128, capacity, chunks, manager_factory=factory,
                                                  context_factory=base.ReqContext)
            assert np.array_equal(gpu, gpu_ref) and np.array_equal(cpu, cpu_ref), (seed, capacity, chunks)
