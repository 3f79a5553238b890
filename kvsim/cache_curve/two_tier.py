"""Two tiers: the GPU prefix cache (LRU of blocks) over vLLM 0.33.0's CPU tier (the OffloadingConnector with an
LRU `CPUOffloadingManager`), request by request, exactly, at each (GPU capacity, CPU capacity).

The GPU tier does not depend on the CPU tier (every prompt block passes through the GPU cache either way), so
its hits at every capacity come from the one-pass curve (`kvsim.cache_curve.curve`). The CPU tier depends on
the GPU hits, and not monotonically: a request with a CPU hit offers only the chunks after it, so the chunks
its GPU hit covered are not refreshed in the CPU tier, while the same request without a CPU hit offers (and
refreshes) every prompt chunk. One pass per CPU capacity and GPU capacity, over runs of chunks (see `CpuTier`);
`two_tier_sim` is the chunk-by-chunk reference that drives kvsim.offload's manager call by call.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvsim.cache_curve.curve import _runs, lru_prefix_curve, request_hit_blocks


@dataclass(frozen=True)
class TwoTierRequests:
    """Requests as the two tiers see them: GPU blocks of `block_size` tokens, CPU chunks of `cpu_block_size`."""

    block_size: int
    cpu_block_size: int
    prompt: np.ndarray  # (r,) prompt tokens
    gpu_pieces: list  # lru_prefix_curve's per-request pieces
    run_keys: list[int]  # CPU runs of chunks: key (dense), weight (chunks); request i: runs run_offsets[i]..[i+1]
    run_weights: list[int]
    run_offsets: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompt)

    @functools.cached_property
    def request_runs(self) -> list[list[tuple[int, int, int]]]:
        """Each request's CPU runs as (run, chunks, the request's chunk where it starts)."""
        out = []
        keys, weights, offsets = self.run_keys, self.run_weights, self.run_offsets
        for i in range(self.num_requests):
            pos, runs = 0, []
            for j in range(offsets[i], offsets[i + 1]):
                runs.append((keys[j], weights[j], pos))
                pos += weights[j]
            out.append(runs)
        return out

    def gpu_hit_blocks(self, capacity_tokens: int) -> np.ndarray:
        """Each request's GPU prefix-cache hit in blocks at this capacity, (r,) int64."""
        return request_hit_blocks(self.gpu_pieces, self.num_requests, capacity_tokens // self.block_size)


def two_tier_requests(keys_b, counts_b, offsets_b, keys_t, counts_t, offsets_t, prompt: np.ndarray, *,
                      block_size: int, cpu_block_size: int) -> TwoTierRequests:
    """From the block units at the GPU block size (`_b`) and at the CPU chunk size (`_t`, kvsim.cache_curve.blocks)."""
    pieces: list = []
    lru_prefix_curve(keys_b, counts_b, offsets_b, (prompt - 1) // block_size, block_size=block_size,
                     prompt_tokens=int(prompt.sum()), pieces=pieces)
    run_keys, run_weights, run_offsets = _runs(keys_t, counts_t, offsets_t)
    _, dense = np.unique(run_keys, return_inverse=True)
    return TwoTierRequests(block_size, cpu_block_size, prompt, pieces, dense.astype(np.int64).tolist(),
                           run_weights.tolist(), run_offsets.tolist())


class CpuTier:
    """vLLM's LRU CPU tier of `capacity` chunks for requests one at a time, each load and store complete before
    the next request, on runs of chunks.

    The tier's recency order is a list of segments, oldest first; a segment [run, lo, hi] is one run's chunks
    lo..hi-1 with its head (lo) most recent, so eviction takes the oldest segment's last chunk. A request touches
    its runs as suffixes (a run is used whole, but a hit boundary may fall inside one), so a run's resident chunks
    are a few ranges. For a request whose GPU hit ends at chunk `start` (vLLM's calls, in
    `OffloadingConnectorScheduler`: get_num_new_matched_tokens, update_state_after_alloc, _build_store_jobs,
    then `on_request_finished`):

      1. lookup: the resident run of chunks from `start` (`_maximal_prefix_lookup`); a hit that ends less than a
         chunk past the GPU hit loads nothing;
      2. with a hit, the loaded chunks and the chunks after them are the request's ("seen"); without, every
         prompt chunk is offered again (`next_stored_chunk_idx` stays 0), so the seen range starts at chunk 0;
      3. the store: every offered chunk the tier lacks, all or nothing (it fits when the offer is at most the
         capacity); the oldest chunks outside the seen range go first, then loaded chunks, tail first;
      4. the seen range's resident chunks become the most recent, head first (`on_request_finished`).

        request: runs A(4) B(3); GPU hit 2 chunks; tier holds A2 A3 B0 (from older requests)
        1. lookup from chunk 2: A2 A3 B0 hit, B1 misses: 3 chunks loaded
        2. seen: chunks 2..6 (A2 A3 B0 loaded, B1 B2 offered); A0 A1 keep their old recency
        3. store B1 B2 (evicting the oldest chunks outside 2..6 if the tier is full)
        4. order, oldest first: ... [B, 0, 3] [A, 2, 4]  (A2 most recent)
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: deque[list[int]] = deque()  # segments [run, lo, hi], oldest first; a taken one is emptied
        self.runs: dict[int, list[list[int]]] = {}  # run -> its segments in the order
        self.resident = 0

    def covered_from(self, run: int, x: int, w: int) -> int:
        """How many chunks from x on (up to w) are resident without a gap."""
        segs = self.runs.get(run)
        if not segs:
            return 0
        end = x
        for seg in sorted(segs, key=lambda seg: seg[1]):
            if seg[2] <= end:
                continue
            if seg[1] > end:
                break
            end = seg[2]
        return min(end, w) - x

    def _detach(self, run: int, x: int, offset: int, into: list[tuple[int, int]]) -> None:
        """Take the run's chunks from x on out of the order; add their resident ranges (request chunks) to `into`."""
        segs = self.runs.get(run)
        if not segs:
            return
        for seg in list(segs):
            lo, hi = seg[1], seg[2]
            if hi <= x:
                continue
            if lo < x:
                into.append((offset + x, offset + hi))
                seg[2] = x
            else:
                into.append((offset + lo, offset + hi))
                seg[2] = lo  # empty: the order drops it when eviction reaches it
                segs.remove(seg)

    def _append(self, run: int, lo: int, hi: int) -> None:
        seg = [run, lo, hi]
        self.order.append(seg)
        segs = self.runs.get(run)
        if segs is None:
            self.runs[run] = [seg]
        else:
            segs.append(seg)

    def _evict_oldest(self, n: int) -> None:
        order = self.order
        while n:
            seg = order[0]
            k = seg[2] - seg[1]
            if k > n:
                seg[2] -= n
                return
            order.popleft()
            if k:
                n -= k
                self.runs[seg[0]].remove(seg)

    def request(self, runs: list[tuple[int, int, int]], num_chunks: int, gpu_hit_tokens: int, chunk_tokens: int) -> int:
        """One request of `runs` [(run, chunks, first chunk)] and `num_chunks` prompt chunks; returns the chunks loaded."""
        start = gpu_hit_tokens // chunk_tokens
        hits = 0
        if num_chunks * chunk_tokens - gpu_hit_tokens >= chunk_tokens and self.resident:
            for run, w, pos in runs:
                if pos + w > start:
                    x = start - pos if start > pos else 0
                    got = self.covered_from(run, x, w)
                    hits += got
                    if x + got < w:
                        break
            if chunk_tokens * (start + hits) - gpu_hit_tokens < chunk_tokens:
                hits = 0
        seen_from = start if hits else 0
        offered_from = start + hits if hits else 0
        present: list[tuple[int, int]] = []  # 2. the seen range's resident chunks, out of the order
        if self.resident:
            for run, w, pos in runs:
                if pos + w > seen_from:
                    self._detach(run, seen_from - pos if seen_from > pos else 0, pos, present)
        num_present = 0
        present_offered = 0
        for lo, hi in present:
            num_present += hi - lo
            if hi > offered_from:
                present_offered += hi - (lo if lo > offered_from else offered_from)
        rest = self.resident - num_present
        if num_chunks - offered_from <= self.capacity:  # 3. the store fits
            need = num_chunks - offered_from - present_offered - (self.capacity - self.resident)
            lost = 0
            if need > 0:
                if need > rest:
                    lost = need - rest  # loaded chunks, tail first
                    need = rest
                self._evict_oldest(need)
                rest -= need
            present = [(seen_from, offered_from - lost), (offered_from, num_chunks)]
        else:
            present.sort()
        # 4. resident seen chunks, head most recent: appended tail first
        resident = rest
        for run, w, pos in reversed(runs):
            end = pos + w
            for lo, hi in reversed(present):
                a = lo if lo > pos else pos
                b = hi if hi < end else end
                if a < b:
                    self._append(run, a - pos, b - pos)
                    resident += b - a
        self.resident = resident
        return hits


def two_tier_hits(reqs: TwoTierRequests, gpu_hit_blocks: np.ndarray, cpu_capacity_chunks: int) -> np.ndarray:
    """Each request's CPU hit in tokens (beyond its GPU hit; a hit to the prompt's end leaves its last token
    to compute), (r,) int64."""
    tier = CpuTier(cpu_capacity_chunks)
    t, b = reqs.cpu_block_size, reqs.block_size
    prompt = reqs.prompt.tolist()
    out = [0] * reqs.num_requests
    for i, (runs, g) in enumerate(zip(reqs.request_runs, gpu_hit_blocks.tolist())):
        g *= b
        hits = tier.request(runs, prompt[i] // t, g, t)
        if hits:
            out[i] = min(t * (g // t + hits) - g, prompt[i] - 1 - g)
    return np.array(out, dtype=np.int64)
