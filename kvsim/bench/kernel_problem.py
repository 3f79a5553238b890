"""The problem `kvsim bench kernels` sets up: one attention layer's shapes and algorithmic byte counts, and a
paged layout of its tokens (random block tables, the slot mapping a write scatters through)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsim.errors import KvsimError

BENCH_DTYPES = ("bf16", "fp16", "fp32")  # SDPA and FlexAttention compute in these


@dataclass(frozen=True)
class KernelShape:
    """One attention layer as the kernels see it (per TP rank): KV heads, query heads, head dim, dtype."""

    model: str
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    kv_dtype: str
    dtype_bytes: int

    def kv_bytes(self, num_tokens: int) -> int:
        """K and V of `num_tokens` tokens of one layer."""
        return 2 * num_tokens * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def write_bytes(self, num_tokens: int) -> int:
        """A scatter's algorithmic traffic: read the new K/V, write it to the pool, read int64 slots."""
        return 2 * self.kv_bytes(num_tokens) + 8 * num_tokens

    def decode_bytes(self, batch: int, context_len: int, index_bytes: int = 0) -> int:
        """One decode step: read every sequence's K/V, read q and write the output (+ the block table read)."""
        return self.kv_bytes(batch * context_len) + 2 * batch * self.num_q_heads * self.head_dim * self.dtype_bytes + index_bytes


def model_shape(model: str, kv_dtype: str = "bf16") -> KernelShape:
    """The first attention layer of `model` (catalogue name, HF id or config.json). MLA reads one latent head."""
    from kvsim.models.catalogue import resolve_model
    from kvsim.size.sizing import kv_cache_spec

    if kv_dtype not in BENCH_DTYPES:
        raise KvsimError(f"the kernel benchmark runs {', '.join(BENCH_DTYPES)}, got {kv_dtype!r}", field="--kv-dtype")
    spec = resolve_model(model)
    kv = kv_cache_spec(spec, kv_dtype=kv_dtype)
    if kv.num_kv_heads == 0:
        raise KvsimError(f"{spec.name} has no attention layer to benchmark", field="--model")
    return KernelShape(spec.name, kv.num_kv_heads, spec.num_attention_heads, kv.head_dim, kv_dtype, kv.dtype_bytes)


def random_block_tables(batch: int, context_len: int, block_size: int, generator: torch.Generator) -> torch.Tensor:
    """(B, ceil(context_len / block_size)) int64: a random permutation of the pool's blocks, as a long-running
    allocator leaves them (no two neighbouring logical blocks are physically adjacent on purpose)."""
    blocks_per_seq = -(-context_len // block_size)
    perm = torch.randperm(batch * blocks_per_seq, generator=generator)
    return perm.view(batch, blocks_per_seq)


def slot_mapping(block_tables: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """(B * context_len,) int64: the pool slot of every token of every sequence, sequence-major."""
    positions = torch.arange(context_len, device=block_tables.device)  # (T,)
    blocks = block_tables[:, positions // block_size]  # (B, T)
    return (blocks * block_size + positions % block_size).reshape(-1)
