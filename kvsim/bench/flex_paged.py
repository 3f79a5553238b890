"""Paged decode attention with FlexAttention: a block table becomes a BlockMask over the whole KV pool.

The same builder also serves the contiguous control (an identity block table), so the paged and the
contiguous FlexAttention runs differ only in where the blocks live, which is the cost being measured.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# FlexAttention tiles queries in blocks of this many rows; decode has one query row, padded to one tile.
Q_BLOCK_SIZE = 128


def decode_block_mask(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, kv_len: int) -> BlockMask:
    """A decode BlockMask whose KV blocks are the physical blocks of each sequence, in logical order.

    The pool is viewed as one long sequence of `kv_len = num_blocks * block_size` slots (batch 1, broadcast
    over the decode batch), and each sequence visits only its own blocks:

        pool slots   | blk 0 | blk 1 | blk 2 | blk 3 | blk 4 |      block_size slots each
        seq 0: len 2.5 blocks, block table [3, 0, 4] -> full [3, 0], partial [4] (first half valid)
        seq 1: len 2 blocks,   block table [1, 2]    -> full [1, 2], no partial block

    Full blocks skip the mask function in the compiled kernel, which evaluates it only on a sequence's last,
    partial block. Eager FlexAttention ignores the block lists and evaluates the mask everywhere, so the mask
    is complete on its own: a slot is valid for sequence b iff its block is one of b's (through the inverse
    table `logical[b, physical]`, -1 elsewhere) and its logical position is below b's length. The table is per
    sequence, so a block that several sequences share (prefix caching) is read by each. Padding entries of
    `block_tables` beyond a sequence's blocks are never read.

    block_tables: (B, max_blocks_per_seq) int, physical block ids; seq_lens: (B,) int, tokens per sequence.
    """
    assert block_tables.dim() == 2 and seq_lens.shape == (block_tables.shape[0],)
    assert kv_len % block_size == 0
    device = block_tables.device
    batch, max_cols = block_tables.shape
    seq_lens = seq_lens.to(device=device, dtype=torch.int32)
    num_pool_blocks = kv_len // block_size
    num_full = seq_lens // block_size  # (B,)
    has_partial = seq_lens % block_size > 0  # (B,)
    num_used = num_full + has_partial.to(torch.int32)  # (B,) blocks each sequence holds
    assert int(num_used.max()) <= max_cols <= num_pool_blocks

    cols = torch.arange(max_cols, device=device, dtype=torch.int32)  # (max_blocks_per_seq,)
    tables = block_tables.to(torch.int32)
    used = cols < num_used[:, None]  # (B, max_blocks_per_seq)
    # Inverse table: logical block index of each physical block for each sequence, -1 if not its block.
    # Unused table entries scatter into a spare last column, dropped after.
    logical = torch.full((batch, num_pool_blocks + 1), -1, dtype=torch.int32, device=device)
    targets = torch.where(used, tables, num_pool_blocks).long()  # (B, max_blocks_per_seq)
    logical.scatter_(1, targets, cols.expand(batch, -1).contiguous())
    logical = logical[:, :num_pool_blocks]
    # Full blocks: the first num_full[b] entries; partial: the one at num_full[b]. Padded with zeros (never read).
    full_indices = torch.zeros(batch, 1, 1, num_pool_blocks, dtype=torch.int32, device=device)
    full_indices[:, 0, 0, :max_cols] = torch.where(cols < num_full[:, None], tables, 0)
    last_col = num_full.clamp(max=max_cols - 1).long()
    partial_indices = torch.zeros(batch, 1, 1, num_pool_blocks, dtype=torch.int32, device=device)
    partial_indices[:, 0, 0, 0] = torch.where(has_partial, tables.gather(1, last_col[:, None]).squeeze(1), 0)

    def mask_mod(b, h, q_idx, kv_idx):
        block = logical[b, kv_idx // block_size]
        return (block >= 0) & (block * block_size + kv_idx % block_size < seq_lens[b])

    return BlockMask.from_kv_blocks(
        has_partial.to(torch.int32).view(batch, 1, 1),
        partial_indices,
        num_full.view(batch, 1, 1),
        full_indices,
        BLOCK_SIZE=(Q_BLOCK_SIZE, block_size),
        mask_mod=mask_mod,
        seq_lengths=(1, kv_len),
        compute_q_blocks=False,
    )


def pool_as_sequence(cache: torch.Tensor) -> torch.Tensor:
    """View one layer's K (or V) pool as FlexAttention's key: a batch-1 sequence of every slot.

    cache: (num_blocks, block_size, num_kv_heads, head_dim) -> (1, num_kv_heads, num_slots, head_dim), no copy.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    return cache.view(1, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


# Compiled FlexAttention on CUDA runs Triton kernels whose KV tile is at most one KV block (BLOCK_N = min(64,
# block_size)), and `tl.dot` needs a reduction dimension of at least 16 elements for 16-bit inputs (8 for fp32):
# the P @ V product reduces over BLOCK_N, so smaller blocks fail to compile. Tiles are powers of two.
MIN_CUDA_BLOCK_SIZE = {1: 32, 2: 16, 4: 8}  # element size in bytes -> smallest KV block compiled flex takes


def unsupported_block_size(block_size: int, dtype: torch.dtype, device: torch.device, compiled: bool) -> str | None:
    """Why compiled FlexAttention cannot run KV blocks of `block_size` on `device`, or None when it can.

    Only the CUDA (Triton) kernels have the limit; eager FlexAttention and the CPU kernels take any block size.
    """
    if not compiled or device.type != "cuda":
        return None
    least = MIN_CUDA_BLOCK_SIZE.get(dtype.itemsize, 16)
    if block_size >= least and block_size & (block_size - 1) == 0:
        return None
    return (f"skipped: compiled FlexAttention on CUDA needs KV blocks of a power of two >= {least} tokens in "
            f"{str(dtype).removeprefix('torch.')} (Triton's tl.dot over a {block_size}-token tile)")


def pool_split_kv(batch: int, num_kv_heads: int, kv_len: int, max_seq_len: int, device: torch.device) -> int | None:
    """The SPLIT_KV that gives paged decode the parallelism a contiguous cache of `max_seq_len` gets (CUDA only).

    Inductor's flex-decoding kernel splits each (sequence, KV head) over SPLIT_KV programs, 2 per SM over
    batch * heads, and with full blocks each program takes a tile of KV_LEN / SPLIT_KV positions of the
    sequence's block list. KV_LEN is the whole pool here (every sequence's blocks), so with the default split
    one program per (sequence, head) would read the whole sequence while the others idle: decode at small
    batch would look several times slower paged than contiguous for a reason that is not paging. Scaling
    SPLIT_KV by kv_len / max_seq_len gives each sequence the tiles a contiguous cache of its length gets; the
    extra programs find no blocks and exit. None (Inductor's default) off CUDA or when the default is 1.
    """
    if device.type != "cuda":
        return None
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    default = max(num_sms // max(batch * num_kv_heads, 1) * 2, 1)  # Inductor's get_split_k
    if default == 1:
        return None
    return default * -(-kv_len // max_seq_len)


_COMPILED = None


def compile_flex_attention(backend: str | object = "inductor"):
    """`torch.compile(flex_attention)` with static shapes; a recompile limit hit raises instead of running eager.

    Static (dynamic=False): after a second batch size, automatic dynamic shapes would make the batch
    symbolic, and Inductor picks its flex-decoding kernel only for a static batch; the fallback kernel pads
    the single query row to a whole tile, reads K/V once per query head, and rejects KV blocks smaller than
    its tile. Every (shape, block size) compiles once instead.
    """
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, backend=backend, dynamic=False)


def compiled_flex_attention():
    """`compile_flex_attention()`, built once."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = compile_flex_attention()
    return _COMPILED


def flex_decode(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask, *, compiled: bool,
                split_kv: int | None = None) -> torch.Tensor:
    """One decode step of attention through `block_mask`; GQA is handled by FlexAttention itself.

    q: (B, num_heads, 1, head_dim); key/value: (1 or B, num_kv_heads, kv_len, head_dim) -> (B, num_heads, 1, head_dim).
    Eager FlexAttention materialises the scores (slow, but exact): use it only where compiling is too costly (CPU).
    `split_kv` (compiled only, see `pool_split_kv`) sets the decoding kernel's SPLIT_KV.
    """
    if compiled:
        options = {"SPLIT_KV": split_kv} if split_kv else None
        return compiled_flex_attention()(q, key, value, block_mask=block_mask, enable_gqa=True, kernel_options=options)
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(q, key, value, block_mask=block_mask, enable_gqa=True)
