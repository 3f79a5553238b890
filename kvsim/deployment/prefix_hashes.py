"""The chained block hashes a prefix-aware router reads: the same hash((parent, block's token bytes)) chain the
paged allocator caches blocks under (kvsim.engine.paged.kv_cache_utils), over a request's full prompt blocks."""

from __future__ import annotations

from kvsim.engine.paged.kv_cache_utils import block_hashes
from kvsim.workload.requests import RequestSpec, make_token_ids


def prompt_block_hashes(request: RequestSpec, seed: int, block_size: int) -> list[int]:
    """Hashes of `request`'s full prompt blocks at `block_size`, in prompt order (one per block; the last one's
    hash names the whole prefix). Equal to the allocator's, so a replica's cache answers them exactly."""
    return block_hashes(make_token_ids(request, seed), request.num_prompt_tokens, block_size)


def leading_hits(hashes: list[int], cached, max_blocks: int) -> int:
    """How many of `hashes`' leading blocks (at most `max_blocks`) `cached` holds: the prefix rule, a miss ends it."""
    n = 0
    for h in hashes[:max_blocks]:
        if h not in cached:
            break
        n += 1
    return n
