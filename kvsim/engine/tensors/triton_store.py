"""The fused K+V scatter as a Triton kernel (`kernels.scatter_triton` runs it). A module of its own so that
triton is imported only where this kernel runs: on CUDA, or on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`, read when the kernel is defined, i.e. when this module is imported)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv(
    src_ptr,
    cache_ptr,
    slot_ptr,
    row_size,
    src_kv_stride,
    src_layer_stride,
    src_token_stride,
    cache_kv_stride,
    cache_layer_stride,
    cache_slot_stride,
    BLOCK: tl.constexpr,
):
    """One program per (token, layer): copies that token's K row and V row (H * D elements each)."""
    token = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # slots < 0 are padding: skipped
        src_base = src_ptr + layer * src_layer_stride + token * src_token_stride
        dst_base = cache_ptr + layer * cache_layer_stride + slot * cache_slot_stride
        for start in range(0, row_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < row_size
            k = tl.load(src_base + offs, mask=mask)
            v = tl.load(src_base + src_kv_stride + offs, mask=mask)
            tl.store(dst_base + offs, k, mask=mask)
            tl.store(dst_base + cache_kv_stride + offs, v, mask=mask)
