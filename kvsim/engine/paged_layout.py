"""The paged allocator's layout and per-request state: how a model's layer groups share one pool of equal-size
pages (lanes), and the block tables and counters it keeps for each admitted request."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsim.engine.block_pool import Block
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.engine.sequence import Sequence

MAX_PAGES_PER_BLOCK = 64  # beyond this a gcd page is too small to be worth it: pad instead


@dataclass(frozen=True)
class Lane:
    """Per-token layers allocated alike: all full-attention groups, or the sliding groups of one window."""

    bytes_per_token: int
    window: int | None  # None: full attention (kept for the request's life)
    pages_per_block: int
    pad_bytes: int  # per block: pages_per_block * page_bytes - block_size * bytes_per_token


@dataclass(frozen=True)
class PageLayout:
    """One pool of `page_bytes` pages: a block of each lane takes `pages_per_block` pages, each state group
    `state_pages[i]` pages once per request. Uniform models have one lane and page = one block."""

    page_bytes: int
    lanes: tuple[Lane, ...]  # the full-attention lane first, then sliding lanes by window
    state_pages: tuple[int, ...]


def page_layout(spec: KVCacheSpec) -> PageLayout:
    """One lane for the full groups, one per distinct window; pages sized by the gcd of their bytes per token
    (or, when that would take more than MAX_PAGES_PER_BLOCK pages a block, by the smallest lane, padded)."""
    bs = spec.block_size
    by_window: dict[int | None, int] = {}
    for g in spec.groups:
        if g.kind != "state":  # chunked layers are allocated as full ones, as vLLM 0.33 does by default
            window = g.window if g.kind == "sliding" else None
            by_window[window] = by_window.get(window, 0) + g.bytes_per_token
    assert by_window, "the paged allocator needs at least one attention layer group"
    windows = sorted(by_window, key=lambda w: (w is not None, w or 0))
    page_token_bytes = math.gcd(*by_window.values())
    if max(by_window.values()) // page_token_bytes > MAX_PAGES_PER_BLOCK:
        page_token_bytes = min(by_window.values())
    page_bytes = bs * page_token_bytes
    lanes = []
    for w in windows:
        k = -(-by_window[w] // page_token_bytes)
        lanes.append(Lane(by_window[w], w, k, k * page_bytes - bs * by_window[w]))
    state_pages = tuple(-(-g.state_bytes // page_bytes) for g in spec.groups if g.kind == "state")
    return PageLayout(page_bytes, tuple(lanes), state_pages)


class PagedRequest:
    """The allocator's state for one admitted request (mutable, owned by PagedAllocator)."""

    __slots__ = (
        "seq", "final", "tables", "freed", "state_pages", "hashes", "num_hashed", "quiet_until", "hit",
        "cap", "used",
    )

    def __init__(self, seq: Sequence, num_lanes: int, hashes: list[int] | None):
        self.seq = seq
        self.final = seq.num_final_tokens
        self.tables: list[list[Block | None]] = [[] for _ in range(num_lanes)]  # pages, per lane
        self.freed = [0] * num_lanes  # leading blocks returned to the pool (sliding lanes)
        self.state_pages: list[Block] = []
        self.hashes = hashes  # chained hashes of every full block of the final tokens; None: no prefix caching
        self.num_hashed = 0  # leading blocks registered in the prefix cache
        self.quiet_until = -1  # an append up to this many computed + new tokens is one compare; -1: slow path
        self.hit = 0  # prefix-cache hit (or forked tokens) at admission
        self.cap = 0  # token slots allocated: num_blocks * block_size (same in every lane)
        self.used = 0  # min(cap, num_final_tokens): slots this request will ever use
