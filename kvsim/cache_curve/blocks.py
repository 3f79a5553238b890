"""Which full prompt blocks requests share, read from their structure (hash ids, prefix groups) rather than
hashed from token ids: the same sharing that `kvsim.workload.requests.make_token_ids` builds into the ids."""

from __future__ import annotations

import numpy as np

from kvsim.workload.requests import RequestSpec
from kvsim.workload.trace_mooncake import MOONCAKE_BLOCK_TOKENS


def prompt_block_units(request: RequestSpec, block_size: int) -> list[tuple[int, int]]:
    """The request's full prompt blocks at `block_size`, in prompt order, as units (key, number of blocks).

    A unit's blocks are always used together: two requests' blocks hold equal token ids (by `make_token_ids`,
    whatever the seed) exactly when they belong to units of one key, at the same place in it. Keys are ints:
    a Mooncake hash id (>= 0) owns the blocks that end inside its 512 tokens; a shared-prefix block t of group
    g is its own unit g * 2^32 + t; the rest of a request's blocks are one unit, -(request_id + 1).
    The partial last block is not a unit: it is never full, so never cached.

        hash_ids [4, 9, 31], 1,100 tokens, block_size 48:   units [(4, 10), (9, 11), (31, 1)]
        blocks ending in (0, 512] belong to 4, in (512, 1024] to 9 (the one over 512 too), in (1024, 1100] to 31
    """
    bs = block_size
    p = request.num_prompt_tokens
    units: list[tuple[int, int]] = []
    if request.hash_ids is not None:
        for j, h in enumerate(request.hash_ids):
            lo = j * MOONCAKE_BLOCK_TOKENS
            count = min(lo + MOONCAKE_BLOCK_TOKENS, p) // bs - lo // bs
            if count:
                units.append((h, count))
        return units
    shared = request.num_prefix_tokens // bs
    if shared:
        base = request.prefix_group << 32
        units.extend((base + t, 1) for t in range(shared))
    if p // bs > shared:
        units.append((-(request.request_id + 1), p // bs - shared))
    return units


def block_unit_arrays(requests: list[RequestSpec], block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`prompt_block_units` of every request, flat: (keys (u,), blocks per unit (u,), offsets (r + 1,)), int64.

    Request i's units are keys[offsets[i]:offsets[i + 1]]. Requests with hash ids are done in whole arrays.
    """
    if requests and all(r.hash_ids is not None for r in requests):
        lengths = np.array([len(r.hash_ids) for r in requests], dtype=np.int64)  # (r,)
        ids = np.fromiter((h for r in requests for h in r.hash_ids), dtype=np.int64, count=int(lengths.sum()))  # (n,)
        starts = np.concatenate([[0], np.cumsum(lengths)])  # (r + 1,)
        prompt = np.repeat(np.array([r.num_prompt_tokens for r in requests], dtype=np.int64), lengths)  # (n,)
        lo = (np.arange(len(ids), dtype=np.int64) - np.repeat(starts[:-1], lengths)) * MOONCAKE_BLOCK_TOKENS  # (n,)
        counts = np.minimum(lo + MOONCAKE_BLOCK_TOKENS, prompt) // block_size - lo // block_size  # (n,)
        keep = counts > 0
        offsets = np.concatenate([[0], np.cumsum(keep)])[starts]
        return ids[keep], counts[keep], offsets.astype(np.int64)
    units = [prompt_block_units(r, block_size) for r in requests]
    offsets = np.concatenate([[0], np.cumsum([len(u) for u in units], dtype=np.int64)]).astype(np.int64)
    flat = [pair for u in units for pair in u]
    keys = np.array([k for k, _ in flat], dtype=np.int64)
    counts = np.array([n for _, n in flat], dtype=np.int64)
    return keys, counts, offsets
