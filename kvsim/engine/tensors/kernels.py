"""The cache's kernels: K/V scatter through a slot mapping, paged and contiguous gathers, decode attention.

Every function works on the whole batch with one device op (no per-request or per-token Python loop), so the
timings measure the kernel, not the interpreter. Tensors use nano-vllm's pool layout:

    kv_cache  [2, L, num_blocks, block_size, H, D]    (K = index 0, V = index 1; L materialised layers)
    kv_flat   [2, L, num_blocks * block_size, H, D]   (the same memory: slot = block_id * block_size + offset)

Indexed ops run on 3-D views `[2 * L, rows, row_elems]` indexed along dim 1: on CPU, torch's index_select
along dim 2 of the 6-D pool took 2-8 s for a 64-128 MiB gather that the 3-D view does in ~40-90 ms.
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

try:  # torch.nn.attention (2.2+); older torch has no cuDNN attention to keep out of the reads
    from torch.nn.attention import SDPBackend as _SDPBackend, sdpa_kernel as _sdpa_kernel
except ImportError:  # pragma: no cover
    _SDPBackend = _sdpa_kernel = None

# Triton is optional: present with CUDA builds of torch, absent on CPU-only machines. It is imported when its
# kernel is first used (a CPU replay never does), not with this module: the import costs ~0.1 s per process.
HAS_TRITON = importlib.util.find_spec("triton") is not None

WRITE_KERNELS = ("index_copy", "index_put", "rows", "triton")


def scatter_index_copy(kv_flat: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """kv_flat[:, :, slots[n]] = src[:, :, n] with `index_copy_` along the slot dim (all slots must be valid).

    kv_flat: [2, L, S, H, D]; slots: (N,) int64 on kv_flat's device; src: [2, L, N, H, D].
    """
    two, num_layers, num_slots = kv_flat.shape[:3]
    kv_flat.view(two * num_layers, num_slots, -1).index_copy_(1, slots, src.reshape(two * num_layers, len(slots), -1))


def scatter_index_put(kv_flat: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """The same scatter through `index_put_` on a slot-major view (PyTorch's advanced-indexing path)."""
    two, num_layers, num_slots = kv_flat.shape[:3]
    rows = kv_flat.view(two * num_layers, num_slots, -1).transpose(0, 1)  # [S, 2L, H*D]: slots lead
    rows.index_put_((slots,), src.reshape(two * num_layers, len(slots), -1).transpose(0, 1))


def token_rows(kv: torch.Tensor) -> np.ndarray:
    """A CPU tensor [2, L, N, H, D] as numpy's [2L, N] array of token rows, sharing its memory: each element
    is one K or V row of one layer and token (its H * D values as raw bytes). Each [H, D] row must be
    contiguous (true of the pool and of slices of the write buffer); other strides carry over."""
    two, num_layers, n, h, d = kv.shape
    assert kv.device.type == "cpu" and kv.stride(4) == 1 and kv.stride(3) == d
    row_bytes = h * d * kv.element_size()
    as_bytes = kv.reshape(two * num_layers, n, h * d).view(torch.uint8).numpy()  # [2L, N, row_bytes]
    return as_bytes.view(np.dtype((np.void, row_bytes)))[..., 0]


def scatter_rows(rows: np.ndarray, slots: np.ndarray, src: np.ndarray) -> None:
    """rows[:, slots] = src: the scatter as numpy's indexed assignment of whole token rows (CPU only).

    rows: the pool's `token_rows` [2L, S]; slots: an int array (N,) or (k, N); src: [2L, N] token rows (with
    (k, N) slots they broadcast over the k steps). numpy copies each indexed row as one block of bytes, where
    torch's CPU index_copy_ and index_put_ loop element by element: on the main job's 146 MiB pool the
    replay's writes moved about twice the bytes per second this way (docs/performance.md).
    """
    rows[:, slots] = src if np.ndim(slots) == 1 else src[:, None, :]


def scatter_triton(kv_flat: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """The fused K+V scatter as one Triton kernel; slots < 0 are skipped, any head count works.

    Runs on CUDA, or on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is
    imported), which is how the tests check it without a GPU. Needs each token's [H, D] row contiguous in both
    `src` and `kv_flat` (true of the pool and of slices of the write buffer); other strides are passed to the
    kernel.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    assert kv_flat.device == src.device == slots.device
    assert kv_flat.is_cuda or os.environ.get("TRITON_INTERPRET") == "1", "the triton scatter needs CUDA or the interpreter"
    two, num_layers, num_tokens, h, d = src.shape
    assert two == 2 and kv_flat.shape[3:] == (h, d) and slots.shape == (num_tokens,)
    assert src.stride(4) == 1 and src.stride(3) == d and kv_flat.stride(4) == 1 and kv_flat.stride(3) == d
    if num_tokens == 0 or num_layers == 0:
        return
    row = h * d
    block = min(1 << (row - 1).bit_length(), 2048)  # triton.next_power_of_2
    from kvsim.engine.tensors.triton_store import store_kv  # imports triton on first use

    store_kv[(num_tokens, num_layers)](
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


def pad_block_tables(block_tables: list[np.ndarray], seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    """(B, M) int64: each table cut to the blocks its length needs, padded with block 0 to the longest.

    Built with whole-array numpy ops (one concatenate), so a decode batch costs no per-token Python.
    """
    need = -(-seq_lens // block_size)  # (B,) blocks per sequence
    table = np.zeros((len(seq_lens), int(need.max())), dtype=np.int64)
    flat = np.concatenate([np.asarray(bt[:m], dtype=np.int64) for bt, m in zip(block_tables, need)])
    assert len(flat) == need.sum(), "a block table is shorter than its sequence"
    rows = np.repeat(np.arange(len(seq_lens)), need)
    table[rows, np.arange(len(flat)) - np.repeat(np.cumsum(need) - need, need)] = flat
    return table


def gather_paged(kv_cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every sequence's blocks, in block-table order, gathered with one `index_select` over blocks.

    kv_cache: [2, L, num_blocks, block_size, H, D]; block_tables: (B, M) int64, rows padded with any valid
    block id. Returns [2, L, B, M * block_size, H, D]: token t of sequence b at [:, :, b, t]. `out`, when
    given, is a contiguous buffer of exactly that many elements to gather into (no fresh allocation).
    """
    two, num_layers, num_blocks, block_size, h, d = kv_cache.shape
    b, m = block_tables.shape
    pool = kv_cache.view(two * num_layers, num_blocks, -1)  # [2L, num_blocks, block_size*H*D]
    if out is None:
        blocks = pool.index_select(1, block_tables.reshape(-1))  # [2L, B*M, block_size*H*D]
    else:
        blocks = torch.index_select(pool, 1, block_tables.reshape(-1), out=out.view(two * num_layers, b * m, -1))
    return blocks.view(two, num_layers, b, m * block_size, h, d)


def gather_runs(
    kv_flat: torch.Tensor, starts: torch.Tensor, seq_lens: torch.Tensor, max_len: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Each sequence's contiguous run of slots [start, start + len), padded to `max_len`, with one gather.

    The flat baselines keep a request's KV in one slab, so each row reads a single contiguous range (the
    paged read does the same in runs of `block_size`). Padding repeats the row's last slot (masked later).
    kv_flat: [2, L, S, H, D]; starts, seq_lens: (B,) int64. Returns [2, L, B, max_len, H, D]. `out` as in
    `gather_paged`.
    """
    two, num_layers, num_slots, h, d = kv_flat.shape
    offsets = torch.arange(max_len, device=kv_flat.device)  # (T,)
    index = (starts[:, None] + torch.minimum(offsets[None, :], seq_lens[:, None] - 1)).reshape(-1)  # (B*T,)
    pool = kv_flat.view(two * num_layers, num_slots, -1)  # [2L, S, H*D]
    if out is None:
        rows = pool.index_select(1, index)  # [2L, B*T, H*D]
    else:
        rows = torch.index_select(pool, 1, index, out=out.view(two * num_layers, len(index), -1))
    return rows.view(two, num_layers, starts.shape[0], max_len, h, d)


def slice_run(kv_flat: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """One request's slab as a zero-copy view: [2, L, length, H, D]."""
    return kv_flat[:, :, start : start + length]


def decode_backends(device: torch.device):
    """The SDPA backends a decode read may use on `device`, as a context manager.

    On CUDA: memory-efficient attention, else math; never cuDNN. torch prefers cuDNN attention on Hopper
    where it accepts the padding mask, and cuDNN builds a plan on the host for every new (batch, keys)
    shape (with a mask it reuses none across shapes). A replay's reads take a new shape almost every time
    (over 60,000 distinct shapes across the main job's 276,908 decode steps), so the host would spend its time building
    plans and the "attention" events would time the builds (the H200 run in docs/gpu.md). Elsewhere: torch's
    own choice."""
    if device.type != "cuda" or _SDPBackend is None:
        return nullcontext()
    return _sdpa_kernel([_SDPBackend.EFFICIENT_ATTENTION, _SDPBackend.MATH])


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, *, fold_gqa: bool = True
) -> torch.Tensor:
    """One decode token per sequence attending to its first `seq_lens[n]` keys, batched with torch SDPA.

    q: (N, Hq, D); k, v: (N, T, H, D) padded past each length; seq_lens: (N,) int64, all >= 1.
    Returns (N, Hq, D). Grouped-query attention (Hq = G * H, query head i reads kv head i // G):

    - `fold_gqa=True` (default): the G query heads of a kv head become G query rows of that head, so SDPA
      sees equal head counts, repeats no K/V, and its fused backends accept the padding mask;
    - `fold_gqa=False`: SDPA's own `enable_gqa=True` (on CUDA, with a mask, this may fall back to the math
      backend: the "naive" baseline).
    """
    n, hq, d = q.shape
    t, h = k.shape[1], k.shape[2]
    assert hq % h == 0, (hq, h)
    mask = (torch.arange(t, device=k.device)[None, :] < seq_lens[:, None])[:, None, None, :]  # (N, 1, 1, T)
    if k.dtype != q.dtype:  # fp8 / int8 pools: dequantise (unit scale) to the compute dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # (N, H, T, D)
    with decode_backends(q.device):
        if hq == h or fold_gqa:
            out = F.scaled_dot_product_attention(q.reshape(n, h, hq // h, d), k, v, attn_mask=mask)  # (N, H, G, D)
        else:
            out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, enable_gqa=True)  # (N, Hq, 1, D)
    return out.reshape(n, hq, d)


# --- integrity values ---------------------------------------------------------------------------------
_U64 = np.uint64


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


def prefix_fingerprints(token_ids: np.ndarray) -> np.ndarray:
    """(n,) uint64: fingerprint p identifies the whole prefix token_ids[: p + 1] (a chained hash, like a
    prefix-cache block hash, but per token): XOR-accumulated hashes of (token id, position).

    Two requests that share a prefix get equal fingerprints over it, so a cached block reads the
    same integrity values whoever wrote it, and differ from the first differing token on.
    """
    pos = np.arange(len(token_ids), dtype=_U64)
    with np.errstate(over="ignore"):
        per_token = _mix64(np.asarray(token_ids).astype(_U64) * _U64(0x9E3779B97F4A7C15) + pos)
    return np.bitwise_xor.accumulate(per_token)


def seq_fingerprints(seq_id: int, positions: np.ndarray) -> np.ndarray:
    """(n,) uint64 for a request without token ids: unique per (seq_id, position), shared with nobody."""
    with np.errstate(over="ignore"):
        return _mix64(np.asarray(positions).astype(_U64) + _U64(seq_id) * _U64(0xD6E8FEB86659FD93))


# 64-bit odd constants (splitmix64 / golden ratio) as signed int64, since torch has no uint64 arithmetic.
_INT_DTYPES = {8: torch.int8, 16: torch.int16, 32: torch.int32}


def _to_width(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Low `bits` bits of int64 `x`, bit `bits - 2` cleared (the top exponent bit of bf16/fp16/fp32/fp8, so
    every pattern is a finite float), as a signed integer tensor of that width."""
    x = x & ((1 << bits) - 1) & ~(1 << (bits - 2))
    return (x - ((x >> (bits - 1)) << bits)).to(_INT_DTYPES[bits])  # two's complement


def integrity_lanes(num_layers: int, row: int, bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[2, L, row] fixed pseudo-random patterns, one per (K/V side, layer, element), `bits`-wide ints."""
    lane = torch.from_numpy(_mix64(np.arange(1, 2 * num_layers * row + 1, dtype=_U64)).view(np.int64))
    return _to_width(lane, bits).view(2, num_layers, row).to(device)


def integrity_values(fingerprints: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    """Token-unique element bit patterns: [2, L, N, row] in the lanes' integer dtype.

    fingerprints: (N,) int64, one per token; lanes: [2, L, row] from `integrity_lanes`. The fingerprint is
    cut into W = 64 / bits words and element e holds lane[e] XOR word[e % W]: every element of a token
    depends on it, tokens with different fingerprints differ (in 60+ bits), and K/V sides and layers differ
    by their lanes. Built in the element width, so checking a read costs one tensor the size of the read.
    """
    bits = 8 * lanes.element_size()
    num_words = 64 // bits
    shifts = torch.arange(num_words, device=fingerprints.device) * bits  # (W,)
    words = _to_width(fingerprints[:, None] >> shifts, bits)  # (N, W)
    which = torch.arange(lanes.shape[-1], device=fingerprints.device) % num_words  # (row,)
    per_element = words.index_select(1, which)  # (N, row)
    return lanes[:, :, None, :] ^ per_element[None, None]  # [2, L, N, row]
