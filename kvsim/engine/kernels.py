"""The cache's kernels: K/V scatter through a slot mapping, paged and contiguous gathers, decode attention.

Every function works on the whole batch with one device op (no per-request or per-token Python loop), so the
timings measure the kernel, not the interpreter. Tensors use nano-vllm's pool layout:

    kv_cache  [2, L, num_blocks, block_size, H, D]    (K = index 0, V = index 1; L materialised layers)
    kv_flat   [2, L, num_blocks * block_size, H, D]   (the same memory: slot = block_id * block_size + offset)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton is optional: present with CUDA builds of torch, absent on CPU-only machines.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False

WRITE_KERNELS = ("index_copy", "index_put", "triton")


def scatter_index_copy(kv_flat: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """kv_flat[:, :, slots[n]] = src[:, :, n] with `index_copy_` along the slot dim (all slots must be valid).

    kv_flat: [2, L, S, H, D]; slots: (N,) int64 on kv_flat's device; src: [2, L, N, H, D].
    """
    kv_flat.index_copy_(2, slots, src)


def scatter_index_put(kv_flat: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """The same scatter through `index_put_` on a slot-major view (PyTorch's advanced-indexing path)."""
    # [S, 2, L, H, D] view so that the slot index is the leading indexed dim
    kv_flat.permute(2, 0, 1, 3, 4).index_put_((slots,), src.permute(2, 0, 1, 3, 4))


if HAS_TRITON:

    @triton.jit
    def _store_kv_kernel(
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


def scatter_triton(kv_flat: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """The fused K+V scatter as one Triton kernel (CUDA only); slots < 0 are skipped, any head count works.

    Needs each token's [H, D] row contiguous in both `src` and `kv_flat` (true of the pool and of slices of
    the write buffer); other strides are passed to the kernel.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    assert kv_flat.is_cuda and src.is_cuda and slots.is_cuda
    two, num_layers, num_tokens, h, d = src.shape
    assert two == 2 and kv_flat.shape[3:] == (h, d) and slots.shape == (num_tokens,)
    assert src.stride(4) == 1 and src.stride(3) == d and kv_flat.stride(4) == 1 and kv_flat.stride(3) == d
    if num_tokens == 0 or num_layers == 0:
        return
    row = h * d
    block = min(triton.next_power_of_2(row), 2048)
    _store_kv_kernel[(num_tokens, num_layers)](
        src,
        kv_flat,
        slots,
        row,
        src.stride(0),
        src.stride(1),
        src.stride(2),
        kv_flat.stride(0),
        kv_flat.stride(1),
        kv_flat.stride(2),
        BLOCK=block,
    )


def gather_paged(kv_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Every sequence's blocks, in block-table order, gathered with one `index_select` over blocks.

    kv_cache: [2, L, num_blocks, block_size, H, D]; block_tables: (B, M) int64, rows padded with any valid
    block id. Returns [2, L, B, M * block_size, H, D]: token t of sequence b at [:, :, b, t].
    """
    two, num_layers, _, block_size, h, d = kv_cache.shape
    b, m = block_tables.shape
    blocks = kv_cache.index_select(2, block_tables.reshape(-1))  # [2, L, B*M, block_size, H, D]
    return blocks.view(two, num_layers, b, m * block_size, h, d)


def gather_runs(kv_flat: torch.Tensor, starts: torch.Tensor, seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """Each sequence's contiguous run of slots [start, start + len), padded to `max_len`, with one gather.

    The flat baselines keep a request's KV in one slab, so each row reads a single contiguous range (the
    paged read does the same in runs of `block_size`). Padding repeats the row's last slot (masked later).
    kv_flat: [2, L, S, H, D]; starts, seq_lens: (B,) int64. Returns [2, L, B, max_len, H, D].
    """
    two, num_layers, _, h, d = kv_flat.shape
    offsets = torch.arange(max_len, device=kv_flat.device)  # (T,)
    index = starts[:, None] + torch.minimum(offsets[None, :], seq_lens[:, None] - 1)  # (B, T)
    rows = kv_flat.index_select(2, index.reshape(-1))  # [2, L, B*T, H, D]
    return rows.view(two, num_layers, starts.shape[0], max_len, h, d)


def slice_run(kv_flat: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """One request's slab as a zero-copy view: [2, L, length, H, D]."""
    return kv_flat[:, :, start : start + length]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """One decode token per sequence attending to its first `seq_lens[n]` keys, batched with torch SDPA.

    q: (N, Hq, D); k, v: (N, T, H, D) padded past each length; seq_lens: (N,) int64, all >= 1.
    Returns (N, Hq, D). Grouped-query attention (Hq a multiple of H) uses SDPA's `enable_gqa`.
    """
    n, hq, d = q.shape
    t, h = k.shape[1], k.shape[2]
    assert hq % h == 0, (hq, h)
    mask = torch.arange(t, device=k.device)[None, :] < seq_lens[:, None]  # (N, T)
    if k.dtype != q.dtype:  # fp8 / int8 pools: dequantise (unit scale) to the compute dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # (N, Hq, 1, D)
        k.transpose(1, 2),  # (N, H, T, D)
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],  # (N, 1, 1, T)
        enable_gqa=hq != h,
    )  # (N, Hq, 1, D)
    return out.squeeze(2)


# --- integrity values ---------------------------------------------------------------------------------
# 64-bit odd constants (splitmix64 / golden ratio) as signed int64, since torch has no uint64 arithmetic.
_LANE = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def integrity_values(fingerprints: torch.Tensor, num_layers: int, row: int, bits: int) -> torch.Tensor:
    """Token-unique element bit patterns: [2, L, N, row] int64 holding signed `bits`-wide integers.

    fingerprints: (N,) int64, one per token (see `KVCache.register`). Element e of layer l, side kv (K/V)
    is a splitmix64-style hash of (fingerprint, kv, l, e), truncated to the element width. Bit `bits - 2`
    (the top exponent bit of bf16/fp16/fp32/fp8) is cleared so every pattern is a finite float.
    """
    lanes = torch.arange(2 * num_layers * row, device=fingerprints.device, dtype=torch.int64)
    x = fingerprints.view(1, 1, -1, 1) ^ (lanes.view(2, num_layers, 1, row) * _LANE)  # [2, L, N, row]
    x = x * _MIX1
    x = x ^ (x >> 31)
    x = x * _MIX2
    x = x ^ (x >> 29)
    x = x & ((1 << bits) - 1) & ~(1 << (bits - 2))
    return x - ((x >> (bits - 1)) << bits)  # two's complement of the low `bits` bits
