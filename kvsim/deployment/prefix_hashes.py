"""The block keys a prefix-aware router reads: the same exact keys the paged allocator caches a replay's blocks
under (`kvsim.workload.requests.make_block_keys`), over a request's full prompt blocks."""

from __future__ import annotations

from kvsim.workload.requests import RequestSpec, make_block_keys


def prompt_block_hashes(request: RequestSpec, seed: int, block_size: int) -> list[int]:
    """Keys of `request`'s full prompt blocks at `block_size`, in prompt order (one per block; the last one's
    key names the whole prefix). Equal to the allocator's, so a replica's cache answers them exactly. `seed`
    makes the token ids, which the keys do not depend on."""
    return make_block_keys(request, block_size, request.num_prompt_tokens).tolist()


def leading_hits(hashes: list[int], cached, max_blocks: int) -> int:
    """How many of `hashes`' leading blocks (at most `max_blocks`) `cached` holds: the prefix rule, a miss ends it."""
    n = 0
    for h in hashes[:max_blocks]:
        if h not in cached:
            break
        n += 1
    return n
