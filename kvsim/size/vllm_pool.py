"""vLLM's KV cache groups as the replay's paged pool (`KVCacheSpec.pool`) for a mixed model."""

from __future__ import annotations

from dataclasses import replace

from kvsim.errors import KvsimError
from kvsim.models.spec import ModelSpec
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.size.vllm import vllm_startup
from kvsim.size.vllm_layers import vllm_layers
from kvsim.size.vllm_settings import VllmSettings
from kvsim.vllm_version import VLLM_VERSION


def with_pool(
    model: ModelSpec, spec: KVCacheSpec, budget_bytes: int, max_model_len: int, settings: VllmSettings, tp: int = 1
) -> KVCacheSpec:
    """`spec` (one of `tp` ranks') with vLLM's groups for a mixed model, their pages per rank; a uniform model's
    spec as it is (one group: the paged allocator's single-group path).

    The paged allocator has one layout, vLLM's: where vLLM 0.33.0's arithmetic cannot build a model's groups
    (or kvsim does not model it), this is a KvsimError naming the layer kinds and the model's file, never a
    replay on some other layout.
    """
    if spec.is_uniform:
        return spec
    source = model.source or model.name
    try:
        startup = vllm_startup(vllm_layers(model, spec, tp), budget_bytes, max_model_len, spec.block_size, settings)
    except KvsimError as exc:
        raise KvsimError(f"{exc}; the paged allocator follows vLLM's KV cache groups only", source=source) from None
    if startup is None:
        kinds = ", ".join(sorted({g.kind for g in spec.groups}))
        raise KvsimError(
            f"vLLM {VLLM_VERSION} cannot unify the KV cache page sizes of this model's layers ({kinds}), so it "
            "builds no KV cache groups for it; the paged allocator follows vLLM's groups only",
            source=source,
            field="layers",
        )
    return replace(spec, pool=startup.pool)
