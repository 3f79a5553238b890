"""The chained block hashes a prefix-aware router reads: the same hash((parent, block's token bytes)) chain the
paged allocator caches blocks under (kvsim.engine.paged_prefix), over a request's full prompt blocks."""

from __future__ import annotations

import numpy as np

from kvsim.engine.paged_prefix import _ROOT_HASH
from kvsim.workload.requests import RequestSpec, make_token_ids


def prompt_block_hashes(request: RequestSpec, seed: int, block_size: int) -> list[int]:
    """Hashes of `request`'s full prompt blocks at `block_size`, in prompt order (one per block; the last one's
    hash names the whole prefix). Equal to the allocator's, so a replica's cache answers them exactly."""
    end = request.num_prompt_tokens // block_size * block_size
    ids = np.ascontiguousarray(make_token_ids(request, seed)[:end], dtype=np.int64)  # (end,)
    hashes = []
    parent = _ROOT_HASH
    for block_bytes in ids.view(np.dtype((np.void, block_size * 8))).tolist():
        parent = hash((parent, block_bytes))
        hashes.append(parent)
    return hashes


def leading_hits(hashes: list[int], cached, max_blocks: int) -> int:
    """How many of `hashes`' leading blocks (at most `max_blocks`) `cached` holds: the prefix rule, a miss ends it."""
    n = 0
    for h in hashes[:max_blocks]:
        if h not in cached:
            break
        n += 1
    return n
