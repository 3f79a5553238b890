"""Least recently used, with a request's keys ordered head to tail (vLLM's `LRUCachePolicy`)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvsim.offload.chunk import ChunkStatus
from kvsim.offload.policy import CachePolicy, order_request_keys
from kvsim.offload.request_context import OffloadKey, ReqContext

Rank = tuple[int, int]  # (a counter value, -end position of the key in its request, or 0)


@dataclass(slots=True)
class _RequestRank:
    owner: object
    generation: int
    rank: int


class LRUCachePolicy(CachePolicy):
    """Evicts the idle chunk of lowest rank; ranks only grow, so the lowest is the least recently used.

    A rank is a pair. One counter hands out every new rank. While a request runs, every key it reads or
    stores takes (its request's rank, -end position): one rank for the whole request, taken at its first
    access, with the tail below the head, so a request's tail goes before its head. When the request
    finishes, its keys take fresh ranks (counter, 0) tail first, so the head ends most recent:

        request R reads A0 A1 A2:   while running  A0 (7, -16)  A1 (7, -32)  A2 (7, -48)   evicted first: A2
                                    after finish   A2 (8, 0)    A1 (9, 0)    A0 (10, 0)

    Ranks move while a chunk is pinned by a load; it competes with them once idle again. As vLLM, a lazy heap
    of (rank, key) entries finds the idle chunks of lowest rank (ties by key): an entry is pushed whenever an
    idle chunk takes a rank or a chunk becomes idle, and one whose chunk has since moved, been pinned or gone
    is skipped when it surfaces; the heap is rebuilt from the idle chunks once stale entries outnumber them.
    An eviction pops what it takes instead of scanning every idle chunk (a 256 GiB tier holds ~130,000).
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.ranks: dict[OffloadKey, Rank] = {}
        self.evictable: set[OffloadKey] = set()
        self._heap: list[tuple[Rank, OffloadKey]] = []  # (rank, key) of idle chunks, stale entries included
        self._counter = 0
        self._generation = 0

    def _next_rank(self) -> Rank:
        self._counter += 1
        return (self._counter, 0)

    def _request_rank(self, req_context: ReqContext) -> int:
        """The running request's one rank, taken from the counter at its first access (again after a clear)."""
        state = req_context.get_state(_RequestRank)
        if state is None or state.owner is not self or state.generation != self._generation:
            self._counter += 1
            state = _RequestRank(self, self._generation, self._counter)
            req_context.set_state(state)
        return state.rank

    def _set_rank(self, key: OffloadKey, rank: Rank) -> None:
        self.ranks[key] = rank
        if key in self.evictable:
            self._push(key, rank)

    def _push(self, key: OffloadKey, rank: Rank) -> None:
        heap = self._heap
        heapq.heappush(heap, (rank, key))
        if len(heap) > 2 * len(self.evictable) + 1024:  # mostly stale: rebuild from the idle chunks
            self._heap = heap = [(self.ranks[k], k) for k in self.evictable]
            heapq.heapify(heap)

    def _refresh(self, keys: Iterable[OffloadKey]) -> None:
        """Fresh ranks in the order given, for the keys the tier holds: the last one is the most recent."""
        for key in keys:
            if key in self.chunks:
                self._set_rank(key, self._next_rank())

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.chunks[key] = chunk
        position = req_context.get_offload_key_position(key)
        if chunk.ref_cnt == 0:
            self.evictable.add(key)
        self._set_rank(key, self._next_rank() if position is None else (self._request_rank(req_context), -position))

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self.ranks.pop(key, None)
        self.evictable.discard(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._refresh(reversed(list(keys)))

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        request_rank = self._request_rank(req_context)
        for key in keys:
            position = req_context.get_offload_key_position(key)
            if position is None or key not in self.chunks:
                continue
            rank = (request_rank, -position)
            if self.ranks[key] < rank:  # never lower a rank: a later request may already have raised it
                self._set_rank(key, rank)

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        self._refresh(reversed(order_request_keys(key_groups, req_context)))

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        heap, ranks, evictable = self._heap, self.ranks, self.evictable
        chosen: list[tuple[Rank, OffloadKey]] = []
        kept: list[tuple[Rank, OffloadKey]] = []  # live entries of protected chunks, pushed back
        taken: set[OffloadKey] = set()
        while len(chosen) < n and heap:
            entry = heapq.heappop(heap)
            rank, key = entry
            if key not in evictable or ranks[key] != rank or key in taken:
                continue  # stale: the chunk moved, was pinned or has gone (or a duplicate entry)
            taken.add(key)
            (kept if key in protected else chosen).append(entry)
        for entry in kept:
            heapq.heappush(heap, entry)
        if len(chosen) < n:
            for entry in chosen:
                heapq.heappush(heap, entry)
            return None
        out = []
        for _, key in chosen:
            chunk = self.chunks.pop(key)
            assert chunk.ref_cnt == 0
            del self.ranks[key]
            self.evictable.remove(key)
            out.append((key, chunk))
        return out

    def clear(self) -> None:
        self.chunks.clear()
        self.ranks.clear()
        self.evictable.clear()
        self._heap.clear()
        self._counter = 0
        self._generation += 1

    def mark_evictable(self, key: OffloadKey) -> None:
        self.evictable.add(key)
        self._push(key, self.ranks[key])

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.evictable.remove(key)
