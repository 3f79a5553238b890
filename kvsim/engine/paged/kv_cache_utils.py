"""Block hashes for prefix caching, as vLLM 0.33.0's `kv_cache_utils.hash_block_tokens`: block j's hash is taken of
its parent's hash and its token ids, so one hash names the whole prefix up to the block's end."""

from __future__ import annotations

import numpy as np

ROOT_HASH = 0x6B7673696D  # parent hash of a request's first block (vLLM's NONE_HASH)


def block_token_bytes(token_ids: np.ndarray, num_tokens: int, block_size: int) -> list[bytes]:
    """The token ids of the full blocks within the first `num_tokens`, as int64 bytes, one object per block:
    what a block's hash is taken of. One C call cuts them all (a void-dtype view's tolist)."""
    end = num_tokens // block_size * block_size
    ids = np.ascontiguousarray(token_ids[:end], dtype=np.int64)  # (end,)
    return ids.view(np.dtype((np.void, block_size * 8))).tolist()  # end // block_size bytes objects


def chain_block_hashes(hashes: list[int], token_blocks: list[bytes]) -> list[int]:
    """`hashes` (of the leading blocks) extended in place to every block of `token_blocks`:
    hash((parent hash, block bytes)), the first block's parent `ROOT_HASH`."""
    h = hashes[-1] if hashes else ROOT_HASH
    append = hashes.append
    for chunk in token_blocks[len(hashes) :]:
        h = hash((h, chunk))
        append(h)
    return hashes


def block_hashes(token_ids: np.ndarray, num_tokens: int, block_size: int) -> list[int]:
    """Chained hashes of the full blocks within the first `num_tokens` of `token_ids`."""
    return chain_block_hashes([], block_token_bytes(token_ids, num_tokens, block_size))
