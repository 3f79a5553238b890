"""What an allocator needs to know of a model: per-token and per-sequence bytes by layer group, and tensor shape.

Built from a model spec by `kvsim.size.sizing.kv_cache_spec(...)`; the engine never looks at model names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GroupKind = Literal["full", "sliding", "chunked", "state"]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that are allocated alike (vLLM's KV cache group).

    - `full`: full attention and MLA layers: every token's KV is kept for the life of the request.
    - `sliding`: sliding-window layers: only the last `window` tokens are needed; a paged engine frees blocks
      that fall wholly outside the window.
    - `chunked`: chunked local attention layers (Llama 4): only the current `window`-token chunk is attended
      to. vLLM 0.33's hybrid manager keeps them chunked (`VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE`
      defaults to 1), freeing the blocks before the current chunk; the paged allocator does the same.
    - `state`: linear-attention / mamba layers: one constant-size state per request (`state_bytes`).
    """

    kind: GroupKind
    num_layers: int
    bytes_per_token: int = 0  # K+V (or MLA latent) of one token across this group's layers, this rank
    window: int | None = None  # sliding: tokens each layer attends to; chunked: the chunk size
    state_bytes: int = 0  # state only: bytes per request across this group's layers

    def __post_init__(self) -> None:
        assert self.num_layers > 0
        if self.kind == "state":
            assert self.state_bytes > 0 and self.bytes_per_token == 0
        else:
            assert self.bytes_per_token > 0 and self.state_bytes == 0
            assert (self.window is not None and self.window > 0) == (self.kind in ("sliding", "chunked"))


@dataclass(frozen=True)
class VllmGroup:
    """One of vLLM's KV cache groups: layers of one kind sharing a block table, with its own manager in the
    paged pool (`kvsim.size.vllm.vllm_startup` forms them; the replay's paged allocator allocates them).

    `kind` is vLLM's spec kind ("full", "mla", "sliding", "chunked", "state"). Every group's page is equal
    (`page_bytes`, padded where a layer's own page is smaller: `layer_page_bytes`); a group with fewer than
    the pool's `group_size` layers leaves the other layers' pages of its blocks as padding.
    """

    kind: str
    num_layers: int  # real layers; a group with fewer than group_size holds padding
    block_size: int  # tokens per block (a state group's: mamba_block_size; without prefix caching max_model_len)
    page_bytes: int  # one block of one layer (padded)
    layer_page_bytes: int  # one block of one layer as the layer needs it (block_size x bytes per token, or a state)
    blocks_per_request: int  # a request of max_model_len tokens (cdiv(max_memory_usage_bytes, page_size_bytes))
    window: int | None = None  # sliding: the window; chunked: the chunk

    def __post_init__(self) -> None:
        assert 0 < self.layer_page_bytes <= self.page_bytes and self.num_layers > 0 and self.block_size > 0
        assert self.blocks_per_request > 0

    @property
    def max_admission_blocks(self) -> int | None:
        """Sliding and chunked groups: vLLM's `max_admission_blocks_per_request`, the most blocks admitting one
        request may take (its `blocks_per_request`); None for groups that keep every block they are given."""
        return self.blocks_per_request if self.kind in ("sliding", "chunked") else None


@dataclass(frozen=True)
class PoolSpec:
    """vLLM's KV cache config for a model: the groups, in vLLM's order, layers per group, and one block id's bytes.

    One block id is one page in each of `group_size` layer tensors and belongs to one group, so every block
    costs `bytes_per_block` (vLLM's `_get_kv_cache_bytes_per_block`: the pages of the largest group's layers,
    which `kvsim.size.vllm` works out) and `num_gpu_blocks = budget // bytes_per_block`
    (`kvsim.size.vllm_capacity.num_gpu_blocks`).
    """

    groups: tuple[VllmGroup, ...]
    group_size: int
    bytes_per_block: int

    def __post_init__(self) -> None:
        assert self.groups and self.group_size > 0 and self.bytes_per_block >= self.groups[0].page_bytes


@dataclass(frozen=True)
class KVCacheSpec:
    """Everything the allocators and cache tensors need, per tensor-parallel rank.

    `block_size` is tokens per KV block. The tensor fields describe the materialised pool
    `[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]` (nano-vllm's layout); byte accounting
    always uses `groups`, so materialising fewer layers (or none) never changes a byte figure.
    """

    groups: tuple[KVCacheGroupSpec, ...]
    block_size: int
    dtype: str  # kv dtype name, e.g. "bf16"
    dtype_bytes: int
    num_kv_heads: int  # of a representative attention layer (MLA: 1)
    head_dim: int  # of a representative attention layer (MLA: kv_lora_rank + qk_rope_head_dim)
    num_attention_layers: int  # layers holding per-token KV (full + sliding)
    pool: PoolSpec | None = None  # mixed models: vLLM's groups, which the paged allocator follows

    @property
    def bytes_per_token(self) -> int:
        """Every per-token layer keeps every token (uncapped): what an engine without window freeing pays."""
        return sum(g.bytes_per_token for g in self.groups)

    @property
    def full_bytes_per_token(self) -> int:
        return sum(g.bytes_per_token for g in self.groups if g.kind == "full")

    @property
    def state_bytes_per_sequence(self) -> int:
        return sum(g.state_bytes for g in self.groups)

    @property
    def block_bytes(self) -> int:
        """One block of `block_size` tokens across every per-token layer (uncapped)."""
        return self.block_size * self.bytes_per_token

    @property
    def is_uniform(self) -> bool:
        """Only full-attention/MLA layers: one group, nothing freed early, no per-request state."""
        return all(g.kind == "full" for g in self.groups)

    @classmethod
    def uniform(
        cls,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        dtype: str = "bf16",
        dtype_bytes: int = 2,
    ) -> "KVCacheSpec":
        """A plain full-attention model (K and V per head): handy for tests and benchmarks."""
        per_token = 2 * num_layers * num_kv_heads * head_dim * dtype_bytes
        return cls(
            groups=(KVCacheGroupSpec("full", num_layers, bytes_per_token=per_token),),
            block_size=block_size,
            dtype=dtype,
            dtype_bytes=dtype_bytes,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_attention_layers=num_layers,
        )
