"""Allocator configurations (as a workload names them) and the one place that builds allocators from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvsim.engine.allocator import KVAllocator
from kvsim.size.kv_cache_spec import KVCacheSpec



@dataclass(frozen=True)
class AllocatorConfig:
    """One allocator under test: `{kind: paged, block_size: 16, prefix_caching: true}` in a workload.

    Flat: `reserve` (max = max_model_len tokens, pow2 = next power of two >= num_final_tokens, oracle =
    exactly num_final_tokens) and `placement` of slabs in the arena. Paged: `block_size` (tokens per block),
    `prefix_caching`, `watermark` (fraction of blocks kept free at admission).
    """

    kind: Literal["flat", "paged"]
    block_size: int = 16
    reserve: Reserve = "max"
    placement: Placement = "first-fit"
    prefix_caching: bool = False
    watermark: float = 0.0
    # vLLM's `prefix_cache_retention_interval` (its default 0: a sliding-window group caches only the blocks a
    # replay of the prompt or a shared-prefix junction can hit; None: every full block; k: every k tokens too)
    prefix_cache_retention_interval: int | None = 0

    @property
    def label(self) -> str:
        """A short unique name for tables and report rows, e.g. 'paged-16+prefix', 'flat-max' or, with a
        watermark other than the default 0 (vLLM's), 'paged-16-wm0.05' (so two watermarks can be compared)."""
        if self.kind == "flat":
            suffix = "" if self.placement == "first-fit" else f"-{self.placement}"
            return f"flat-{self.reserve}{suffix}"
        watermark = "" if self.watermark == 0.0 else f"-wm{self.watermark:g}"
        prefix = ""
        if self.prefix_caching:  # a retention interval other than vLLM's default 0 is named: -dense (None), -r<k>
            interval = self.prefix_cache_retention_interval
            prefix = "+prefix" + ("-dense" if interval is None else f"-r{interval}" if interval else "")
        return f"paged-{self.block_size}{watermark}{prefix}"


def make_allocator(config: AllocatorConfig, spec: KVCacheSpec, budget_bytes: int, *, max_model_len: int) -> KVAllocator:
    """Build the allocator `config` describes over `budget_bytes` of KV memory for `spec`: a paged one over
    vLLM's KV cache groups when `spec.pool` carries them (a mixed model), else over its one group."""
    assert spec.block_size == config.block_size or config.kind == "flat"
    if config.kind == "paged" and spec.pool is not None:
        from kvsim.engine.paged.kv_cache_manager import HybridPagedAllocator

        return HybridPagedAllocator(
            spec,
            budget_bytes,
            max_model_len=max_model_len,
            watermark=config.watermark,
            enable_prefix_caching=config.prefix_caching,
            prefix_cache_retention_interval=config.prefix_cache_retention_interval,
        )
    if config.kind == "paged":
        from kvsim.engine.paged.unitary_kv_cache_manager import PagedAllocator

        assert spec.is_uniform, "a mixed model's spec carries vLLM's groups (kvsim.size.vllm_pool.with_pool)"
        if config.prefix_cache_retention_interval:
            from kvsim.errors import KvsimError

            raise KvsimError(f"is {config.prefix_cache_retention_interval} but this model has no sliding-window "
                             "layer group, so retention has no effect (vLLM refuses it): set it to 0",
                             field="prefix_cache_retention_interval")
        return PagedAllocator(
            spec,
            budget_bytes,
            max_model_len=max_model_len,
            enable_prefix_caching=config.prefix_caching,
            watermark=config.watermark,
        )
    from kvsim.engine.flat.flat_allocator import FlatAllocator

    return FlatAllocator(spec, budget_bytes, max_model_len=max_model_len, reserve=config.reserve, placement=config.placement)
