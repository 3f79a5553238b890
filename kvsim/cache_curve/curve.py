"""The prefix-cache hit rate of an LRU cache of KV blocks at every capacity, exactly, in one pass.

Stack distances (Mattson et al., 1970) over a Fenwick tree of access times, with the prefix rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

# Time slots of a new recency tree; it renumbers its live runs into twice their number whenever it fills.
INITIAL_SLOTS = 1024


@dataclass(frozen=True)
class CacheCurve:
    """Hit blocks of every capacity, as steps and ramps: exact at any capacity, in integers.

    A counted block whose prefix-max stack distance is D hits at every capacity C >= D (in blocks). The
    counted blocks come as `step_at[i]` (with `step_count[i]` blocks at that one D) and as ramps: the blocks
    with D = `ramp_lo[i]`, `ramp_lo[i]` + 1, ..., `ramp_hi[i]`, one each.
    """

    block_size: int
    num_requests: int
    prompt_tokens: int
    step_at: np.ndarray  # (s,) int64, sorted
    step_count: np.ndarray  # (s,) int64, in step_at's order
    ramp_lo: np.ndarray  # (r,) int64, sorted
    ramp_hi: np.ndarray  # (r,) int64, sorted (independently of ramp_lo)

    @property
    def ideal_hit_blocks(self) -> int:
        """Hit blocks of an unbounded cache: every counted block seen before."""
        return int(self.step_count.sum() + (self.ramp_hi - self.ramp_lo + 1).sum())

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_hit_blocks * self.block_size / self.prompt_tokens if self.prompt_tokens else 0.0

    def hit_blocks(self, capacity_blocks: np.ndarray) -> np.ndarray:
        """Hit blocks at each capacity (blocks), (k,) int64: steps at or below it, plus each ramp's part."""
        c = np.asarray(capacity_blocks, dtype=np.int64)  # (k,)
        steps = np.concatenate([[0], np.cumsum(self.step_count)])[np.searchsorted(self.step_at, c, side="right")]
        # a ramp [lo, hi] holds max(0, C - lo + 1) - max(0, C - hi) of its blocks at capacity C
        lo_n = np.searchsorted(self.ramp_lo, c, side="right")  # ramps with lo <= C
        lo_sum = np.concatenate([[0], np.cumsum(self.ramp_lo)])[lo_n]
        hi_n = np.searchsorted(self.ramp_hi, c, side="left")  # ramps with hi < C
        hi_sum = np.concatenate([[0], np.cumsum(self.ramp_hi)])[hi_n]
        return steps + (lo_n * (c + 1) - lo_sum) - (hi_n * c - hi_sum)

    def hit_rate(self, capacity_tokens: np.ndarray) -> np.ndarray:
        """Prompt tokens served from cache / prompt tokens, at each capacity in tokens (whole blocks of it)."""
        blocks = np.asarray(capacity_tokens, dtype=np.int64) // self.block_size
        return self.hit_blocks(blocks) * self.block_size / max(self.prompt_tokens, 1)

    def knots(self) -> np.ndarray:
        """Capacities (blocks) at which the curve bends or steps; it is linear in between (int64, sorted)."""
        points = np.concatenate([self.step_at - 1, self.step_at, self.ramp_lo - 1, self.ramp_hi, [0]])
        return np.unique(points[points >= 0])


def lru_prefix_curve(keys: np.ndarray, counts: np.ndarray, offsets: np.ndarray, counted: np.ndarray, *,
                     block_size: int, prompt_tokens: int, pieces: list | None = None) -> CacheCurve:
    """The hit blocks of an LRU cache of blocks at every capacity, over the requests in order, each alone.

    Request i is its full prompt blocks in prompt order, as units keys[offsets[i]:offsets[i + 1]] of
    counts[...] blocks each (a unit's blocks are always used together: kvsim.cache_curve.blocks), of which the
    first counted[i] may count as hits. The cache (C blocks) holds the C most recently used distinct blocks.
    Request by request:
      1. lookup: against the cache as it stands before the request, block j of it counts as a hit if
         j < counted[i] and blocks 0..j are all in the cache (the prefix rule: a hit after a miss is not
         reusable, as in vLLM's find_longest_cache_hit);
      2. use: every full block of the request is then used, hit or not, last block first, so that its first
         block is the most recently used (vLLM frees a request's blocks tail first for this reason: a cached
         prefix outlives its suffix).
    A block's stack distance before a request is its rank by recency (1 = most recent); it is in a cache of C
    blocks exactly when that is <= C. Block j counts at capacity C when D_j = max(distance of blocks 0..j)
    <= C, so one pass that records every D_j gives the curve at every C:

        recency before the request:  rank  1   2   3   4   5   6   7
                                     block x   B0  B1  A0  A1  A2  y
        request A (3 blocks), B (2), C (1, never used before):
            distance   A: 4 5 6   B: 2 3   C: none
            D          A: 4 5 6   B: 6 6   C: misses at every capacity   (a ramp 4..6 and a step of 2 at 6)
            hit blocks at capacity 0..3: 0,  4: 1,  5: 2,  6 and more: 5

    A unit's blocks sit at consecutive
    ranks, first block most recent; so do runs of units that always follow one another, and the pass works
    on those runs (a Mooncake hash id is one unit at any block size, and a conversation's turns share runs of
    ids), with a Fenwick tree of run weights over use times, renumbered when it fills: memory linear in the
    distinct runs, time O(runs used x log).

    `pieces`, if given, receives each request's own share as (request, lo, hi): its blocks with D = lo..hi,
    one each, or (hi < 0) -hi blocks all at D = lo; `request_hit_blocks` turns them into hits per request.
    """
    run_keys, run_weights, run_offsets = _runs(keys, counts, offsets)
    run_keys, run_weights, run_offsets, counted = (x.tolist() for x in (run_keys, run_weights, run_offsets, counted))
    steps: dict[int, int] = {}
    ramps_lo: list[int] = []
    ramps_hi: list[int] = []
    tree = _RecencyTree()
    weight_above, use = tree.weight_above, tree.use
    for i, limit in enumerate(counted):
        lo, hi = run_offsets[i], run_offsets[i + 1]
        m = 0  # prefix max of the distances so far
        start = 0  # index of the run's first block in the request
        for key, weight in zip(run_keys[lo:hi], run_weights[lo:hi]):
            n = min(weight, limit - start)  # this run's blocks that may count
            if n <= 0:
                break
            above = weight_above(key)
            if above is None:  # never used: it and every later block miss at every capacity
                break
            if m >= above + n:
                steps[m] = steps.get(m, 0) + n
                if pieces is not None:
                    pieces.append((i, m, -n))
            else:
                if m > above:  # its first m - above blocks sit above m and take m
                    steps[m] = steps.get(m, 0) + (m - above)
                    if pieces is not None:
                        pieces.append((i, m, above - m))
                ramps_lo.append(max(m + 1, above + 1))
                ramps_hi.append(above + n)
                if pieces is not None:
                    pieces.append((i, max(m + 1, above + 1), above + n))
                m = above + n
            start += weight
        for j in range(hi - 1, lo - 1, -1):
            use(run_keys[j], run_weights[j])
    at = np.array(sorted(steps), dtype=np.int64)
    return CacheCurve(
        block_size=block_size,
        num_requests=len(counted),
        prompt_tokens=prompt_tokens,
        step_at=at,
        step_count=np.array([steps[a] for a in at.tolist()], dtype=np.int64),
        ramp_lo=np.sort(np.array(ramps_lo, dtype=np.int64)),
        ramp_hi=np.sort(np.array(ramps_hi, dtype=np.int64)),
    )


def flatten(requests: Sequence[tuple[Sequence[tuple[int, int]], int]]) -> tuple[np.ndarray, ...]:
    """[(units [(key, blocks)], counted)] as lru_prefix_curve's arrays (keys, counts, offsets, counted)."""
    offsets = np.concatenate([[0], np.cumsum([len(u) for u, _ in requests])]).astype(np.int64)
    keys = np.array([k for u, _ in requests for k, _ in u], dtype=np.int64)
    counts = np.array([n for u, _ in requests for _, n in u], dtype=np.int64)
    return keys, counts, offsets, np.array([c for _, c in requests], dtype=np.int64)


def _runs(keys: np.ndarray, counts: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Units merged into runs: (first unit's key (m,), summed blocks (m,), run offsets per request (r + 1,)).

    Neighbours a, b in a request merge where every use of a is followed by b and every use of b follows a:
    their blocks are then always used together, in one order, and sit together in the recency order.
    """
    n = len(keys)
    if n < 2:
        return keys, counts, offsets
    distinct, dense, uses = np.unique(keys, return_inverse=True, return_counts=True)  # dense: (n,)
    first = np.zeros(n, dtype=bool)
    first[offsets[:-1][offsets[:-1] < n]] = True  # a request's first unit follows nothing
    prev, nxt = dense[:-1], dense[1:]  # (n - 1,) neighbour pairs
    paired = ~first[1:]
    code = prev.astype(np.int64) * len(distinct) + nxt  # one int per (a, b)
    _, inverse, pair_uses = np.unique(code[paired], return_inverse=True, return_counts=True)
    times = np.zeros(n - 1, dtype=np.int64)
    times[paired] = pair_uses[inverse]
    merge = paired & (times == uses[prev]) & (times == uses[nxt]) & (prev != nxt)
    starts = np.flatnonzero(np.concatenate([[True], ~merge]))  # (m,)
    return keys[starts], np.add.reduceat(counts, starts), np.searchsorted(starts, offsets).astype(np.int64)


class _RecencyTree:
    """Runs by last use: a Fenwick tree of weights over use times, so "blocks used since" is a prefix sum."""

    def __init__(self) -> None:
        self.size = INITIAL_SLOTS
        self.tree = [0] * (self.size + 1)
        self.last: dict[int, int] = {}  # key -> time slot (1-based) of its last use
        self.weight: dict[int, int] = {}
        self.now = 0
        self.total = 0

    def weight_above(self, key: int) -> int | None:
        """Blocks used after `key`'s last use (more recent than it), or None if it was never used."""
        slot = self.last.get(key)
        if slot is None:
            return None
        tree, s = self.tree, 0
        while slot:
            s += tree[slot]
            slot &= slot - 1
        return self.total - s

    def use(self, key: int, weight: int) -> None:
        """`key` becomes the most recently used run."""
        old = self.last.pop(key, None)  # out of the tree, and out of a renumbering below
        if old is not None:
            self._add(old, -self.weight[key])
        else:
            self.total += weight
        self.weight[key] = weight
        if self.now == self.size:
            self._renumber()
        self.now += 1
        self.last[key] = self.now
        self._add(self.now, weight)

    def _add(self, slot: int, delta: int) -> None:
        tree, size = self.tree, self.size
        while slot <= size:
            tree[slot] += delta
            slot += slot & -slot

    def _renumber(self) -> None:
        """Live runs renumbered 1..L in recency order, in a tree of twice that size (amortised O(1) a use)."""
        live = sorted(self.last, key=self.last.__getitem__)
        self.size = max(INITIAL_SLOTS, 2 * len(live))
        self.tree = tree = [0] * (self.size + 1)
        for slot, key in enumerate(live, start=1):
            self.last[key] = slot
            tree[slot] = self.weight[key]
        for slot in range(1, self.size + 1):  # O(size) Fenwick build
            parent = slot + (slot & -slot)
            if parent <= self.size:
                tree[parent] += tree[slot]
        self.now = len(live)


def request_hit_blocks(pieces: list, num_requests: int, capacity_blocks: int) -> np.ndarray:
    """Each request's hit blocks at one capacity (blocks), (r,) int64, from `lru_prefix_curve`'s pieces."""
    if not pieces:
        return np.zeros(num_requests, dtype=np.int64)
    arr = np.asarray(pieces, dtype=np.int64)  # (p, 3): request, lo, hi (or -count for a step)
    req, lo, hi = arr[:, 0], arr[:, 1], arr[:, 2]
    c = capacity_blocks
    step = hi < 0
    hits = np.where(step, np.where(lo <= c, -hi, 0), np.clip(c - lo + 1, 0, np.maximum(hi - lo + 1, 0)))
    return np.bincount(req, weights=hits, minlength=num_requests).astype(np.int64)
