"""vLLM 0.33.0's KV cache groups and start-up config: num_gpu_blocks, and the capacity line
"GPU KV cache size: N tokens, Maximum concurrency for L tokens per request: X.XXx"."""

from __future__ import annotations

from typing import NamedTuple

from kvsim.size.kv_cache_spec import KVCacheSpec, PoolSpec, VllmGroup
from kvsim.size.vllm_hybrid import HybridPages
from kvsim.size.vllm_settings import VllmSettings


def bytes_per_block(spec: KVCacheSpec | PoolSpec) -> int:
    """One block id of the paged pool: vLLM's groups' (a `PoolSpec`, or a mixed model's `spec.pool`: a page in
    each of `group_size` layer tensors), or one block of `block_size` tokens across a uniform model's layers."""
    pool = spec if isinstance(spec, PoolSpec) else spec.pool
    return spec.block_bytes if pool is None else pool.bytes_per_block


def num_gpu_blocks(spec: KVCacheSpec | PoolSpec, budget_bytes: int) -> int:
    """vLLM's `num_gpu_blocks` for `budget_bytes` of KV memory (`get_kv_cache_configs`: the budget over the bytes
    of one block id), the null block included: the one place the paged pool's size is computed, for
    `kvsim size` (`vllm_startup`), the allocators and conformance alike."""
    return budget_bytes // bytes_per_block(spec)


class VllmStartup(NamedTuple):  # not a frozen dataclass: ~6x cheaper to define (kvsim size's start-up)
    """vLLM's KV cache config for a model and budget, and the line it logs at start-up."""

    pool: PoolSpec  # the groups, layers per group (group_size tensors, one block id spans each group), bytes_per_block
    budget_bytes: int
    max_model_len: int
    settings: VllmSettings
    hybrid: HybridPages | None = None

    @property
    def groups(self) -> tuple[VllmGroup, ...]:
        return self.pool.groups

    @property
    def group_size(self) -> int:
        return self.pool.group_size

    @property
    def bytes_per_block(self) -> int:
        """One block id across a group's layers."""
        return bytes_per_block(self.pool)

    @property
    def num_blocks(self) -> int:
        """num_gpu_blocks (the null block included)."""
        return num_gpu_blocks(self.pool, self.budget_bytes)

    @property
    def block_size(self) -> int:
        """`cache_config.block_size` after start-up: the smallest group block size."""
        return min(g.block_size for g in self.groups)

    @property
    def page_bytes(self) -> int:
        return self.groups[0].page_bytes

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request of max_model_len tokens needs, summed over groups (they share one pool)."""
        return sum(g.blocks_per_request for g in self.groups)

    @property
    def concurrency(self) -> float:
        """`get_max_concurrency_for_kv_cache_config`: 'Maximum concurrency for L tokens per request: X.XXx'."""
        return self.num_blocks / self.blocks_per_request

    @property
    def tokens(self) -> int:
        """`get_kv_cache_capacity`: 'GPU KV cache size: N tokens' = int(concurrency x max_model_len)."""
        return int(self.concurrency * self.max_model_len)

    @property
    def starts(self) -> bool:
        """`_check_enough_kv_cache_memory`: one request of max_model_len fits beside the null block, else vLLM refuses to start."""
        return self.bytes_per_block * self.blocks_per_request <= self.budget_bytes - self.bytes_per_block
