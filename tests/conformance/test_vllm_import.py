"""The loader imports vLLM's scheduler and KV cache modules unmodified from the cached wheel."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvsim.conformance.vllm_import import StubModule, import_vllm
from kvsim.conformance.vllm_wheel import vllm_source_root

pytestmark = pytest.mark.conformance

MODULES = [
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.core.sched.async_scheduler",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.kv_cache_interface",
    "vllm.config.scheduler",
    "vllm.config.cache",
]


@pytest.mark.parametrize("name", MODULES)
def test_module_is_vllms_own_file(vllm_loaded, name):
    module = import_vllm(name)
    assert not isinstance(module, StubModule)
    expected = vllm_source_root().joinpath(*name.split(".")).with_suffix(".py")
    assert Path(module.__file__) == expected
    assert expected.read_bytes() == Path(module.__file__).read_bytes()


def test_unrelated_modules_are_stubs_and_third_party_stubs_do_not_leak(vllm_loaded):
    import_vllm("vllm.v1.core.sched.scheduler")
    assert isinstance(sys.modules["vllm.model_executor"], StubModule)
    assert isinstance(sys.modules["vllm.config"], StubModule)  # hollow: its submodules are real
    assert not isinstance(sys.modules["vllm.config.scheduler"], StubModule)
    for name, module in sys.modules.items():
        if not name.startswith("vllm"):
            assert not isinstance(module, StubModule), name


def test_kv_cache_manager_allocates_like_vllm(vllm_loaded):
    """Real objects work: 11 usable blocks (block 0 is the null block), 3 per 40-token request."""
    import torch

    kvi = import_vllm("vllm.v1.kv_cache_interface")
    kvm = import_vllm("vllm.v1.core.kv_cache_manager")
    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert spec.page_size_bytes == 2 * 16 * 8 * 128 * 2
    config = kvi.KVCacheConfig(
        num_blocks=12, kv_cache_tensors=[],
        kv_cache_groups=[kvi.KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)])
    manager = kvm.KVCacheManager(config, max_model_len=1024, scheduler_block_size=16,
                                 hash_block_size=16, enable_caching=False)
    assert manager.block_pool.get_num_free_blocks() == 11


# What vLLM's scheduler touches of the stubs while it runs, and why that is harmless.
HARMLESS_STUB_USES = {
    "vllm.distributed.parallel_state.is_local_first_rank()",  # logger's *_once: which rank logs
    "vllm.distributed.kv_events.EventPublisherFactory.create",  # the KV-event publisher: events are off
    "vllm.distributed.kv_events.EventPublisherFactory.create()",
    "vllm.config.get_current_vllm_config_or_none()",  # KVCacheSpecRegistry's built-in registration ignores it
    "vllm.multimodal.utils.strip_covered_mm_data()",  # NewRequestData.mm_features of text-only requests
}


def test_a_scheduler_run_touches_only_harmless_stubs(vllm_loaded):
    from dataclasses import replace

    from kvsim.conformance.sides import run_vllm
    from kvsim.conformance.stream import resolve
    from kvsim.conformance.suite import select
    from kvsim.conformance.vllm_import import stub_uses

    import_vllm("vllm.v1.core.sched.async_scheduler")
    before = dict(stub_uses)
    rs = resolve(select(["prefix-pressure"])[0])  # prefix caching and preemptions
    rs.setup = replace(rs.setup, async_scheduling=True)
    trace = run_vllm(rs)
    assert trace.num_preemptions > 0 and sum(s.prefix_hit_tokens for s in trace.steps) > 0
    touched = {name for name, count in stub_uses.items() if count != before.get(name, 0)}
    assert touched <= HARMLESS_STUB_USES, touched - HARMLESS_STUB_USES
