"""vLLM's KV cache groups as the replay's paged pool (`KVCacheSpec.pool`) for a mixed model."""

from __future__ import annotations

from dataclasses import replace

from kvsim.errors import KvsimError
from kvsim.models.spec import ModelSpec
from kvsim.size.kv_cache_spec import KVCacheSpec, PoolGroupSpec, PoolSpec
from kvsim.size.vllm import vllm_startup
from kvsim.size.vllm_capacity import VllmStartup
from kvsim.size.vllm_layers import vllm_layers
from kvsim.size.vllm_settings import VllmSettings


def pool_spec(startup: VllmStartup) -> PoolSpec:
    """vLLM's groups as the replay's paged pool allocates them (`KVCacheSpec.pool`)."""
    groups = tuple(
        PoolGroupSpec(
            g.kind,
            g.num_layers,
            g.block_size,
            g.page_bytes,
            g.layer_page_bytes,
            window=g.window,
            max_admission_blocks=g.blocks_per_request if g.kind in ("sliding", "chunked") else None,
        )
        for g in startup.groups
    )
    return PoolSpec(groups, startup.group_size)


def with_pool(model: ModelSpec, spec: KVCacheSpec, budget_bytes: int, max_model_len: int, settings: VllmSettings) -> KVCacheSpec:
    """`spec` with vLLM's groups for a mixed model (uniform models and models whose arithmetic vLLM
    0.33.0 would not run, or kvsim does not model, keep the spec as it is: one pool of kvsim's lanes)."""
    if spec.is_uniform:
        return spec
    try:
        startup = vllm_startup(vllm_layers(model, spec), budget_bytes, max_model_len, spec.block_size, settings)
    except KvsimError:
        return spec
    if startup is None or startup.num_blocks < 2:
        return spec
    return replace(spec, pool=pool_spec(startup))
