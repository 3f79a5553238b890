"""The KV pool tensor as nano-vllm lays it out: shape, strides, total bytes, and one element's byte offset.

Answers "where in memory does layer 3's V for token 5 of block 7, head 2, dim 64 live?" exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.errors import KvsimError

DIM_NAMES = ("kv", "layer", "block", "token", "head", "dim")


@dataclass(frozen=True)
class PoolLayout:
    """One contiguous, row-major KV pool on one TP rank.

    shape (kv, num_layers, num_blocks, block_size, num_kv_heads, head_dim); kv is 2 (K, V) or 1 (MLA's
    single latent, head_dim = kv_lora_rank + qk_rope_head_dim, one "head").

        pool ─┬─ K ─┬─ layer 0 ─┬─ block 0 ─┬─ token 0: [head 0: dim 0..D-1][head 1: ...]...[head H-1]
              │     │           │           ├─ token 1: ...
              │     │           │           └─ token block_size-1
              │     │           └─ block 1 ... block num_blocks-1
              │     └─ layer 1 ... layer L-1
              └─ V ── (same again)

    A block of one layer is `block_size x H x D` contiguous elements; the same block id in every layer
    (and in K and V) belongs to the same request, which is what one `block_table` entry names.
    """

    shape: tuple[int, int, int, int, int, int]
    dtype_bytes: int

    def __post_init__(self) -> None:
        assert len(self.shape) == 6 and all(n > 0 for n in self.shape), self.shape

    @property
    def strides(self) -> tuple[int, ...]:
        """Element strides of each dimension (row-major, as torch.empty(shape).stride())."""
        strides, step = [], 1
        for n in reversed(self.shape):
            strides.append(step)
            step *= n
        return tuple(reversed(strides))

    @property
    def byte_strides(self) -> tuple[int, ...]:
        return tuple(s * self.dtype_bytes for s in self.strides)

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def total_bytes(self) -> int:
        return self.num_elements * self.dtype_bytes

    def byte_offset(self, kv: int, layer: int, block: int, token: int, head: int, dim: int) -> int:
        """Byte offset of one element from the pool's start; KvsimError if an index is out of range."""
        index = (kv, layer, block, token, head, dim)
        for name, i, n in zip(DIM_NAMES, index, self.shape):
            if not 0 <= i < n:
                raise KvsimError(f"{name} index {i} out of range [0, {n})", field="--address")
        return sum(i * s for i, s in zip(index, self.byte_strides))


def pool_layout(spec: KVCacheSpec, num_blocks: int, *, mla: bool = False) -> PoolLayout:
    """The pool for `spec` with `num_blocks` blocks: `[2, layers, blocks, block_size, kv_heads, head_dim]`.

    `mla`: one latent per token (no K/V pair), so the leading dimension is 1. Layers are the per-token
    layers (full, sliding, MLA); state layers live elsewhere.
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise KvsimError(f"must be a positive integer, got {num_blocks!r}", field="--num-blocks")
    if spec.num_attention_layers == 0:
        raise KvsimError("the model has no per-token KV layers, so there is no KV pool to lay out", field="--layout")
    shape = (1 if mla else 2, spec.num_attention_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return PoolLayout(shape=shape, dtype_bytes=spec.dtype_bytes)


def parse_address(text: str) -> tuple[int, int, int, int, int, int]:
    """'kv,layer,block,token,head,dim' -> six ints; KvsimError naming --address otherwise."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 6 or not all(p.lstrip("-").isdigit() for p in parts):
        raise KvsimError(f"expected six integers kv,layer,block,token,head,dim, got {text!r}", field="--address")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]
