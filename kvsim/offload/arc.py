"""Adaptive Replacement Cache over CPU chunks (vLLM's `ARCCachePolicy`; Megiddo and Modha, FAST 2003)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from kvsim.offload.chunk import ChunkStatus
from kvsim.offload.policy import CachePolicy, order_request_keys
from kvsim.offload.request_context import OffloadKey, ReqContext


class ARCCachePolicy(CachePolicy):
    """Two resident lists and two ghost lists, oldest first:

        t1  chunks stored and not yet reused        b1  keys evicted from t1 (no data)
        t2  chunks reused by a later request         b2  keys evicted from t2

    A store goes to t1's tail; a request that reads a ready t1 chunk moves it to t2 (once per request, when the
    request finishes). `target_t1_size` adapts: a key offered for store that sits in b1 (evicted from t1 too
    soon) grows it by max(1, |b2|/|b1|), one in b2 shrinks it by max(1, |b1|/|b2|). Eviction takes t1's oldest
    idle chunk while t1 holds at least the target, else t2's, else t1's; each ghost list keeps at most
    `cache_capacity` keys.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        chunk = self.t1.get(key)
        return chunk if chunk is not None else self.t2.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def _adapt_to_ghost_hit(self, key: OffloadKey) -> None:
        """A key in a ghost list is wanted again: move the t1 target towards the list it was evicted from."""
        if key in self.b1:
            self.target_t1_size = min(self.target_t1_size + max(1, len(self.b2) / len(self.b1)), self.cache_capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            self.target_t1_size = max(self.target_t1_size - max(1, len(self.b1) / len(self.b2)), 0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(list(keys)):
            self._adapt_to_ghost_hit(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                chunk = self.t1.pop(key)
                # a chunk still being stored was offered, not reused: it stays in t1, as most recent
                (self.t2 if chunk.is_ready else self.t1)[key] = chunk
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._adapt_to_ghost_hit(key)

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(order_request_keys(key_groups, req_context)):
            if key in insertion_only_keys:  # a store is not a reuse: recency only
                for resident in (self.t1, self.t2):
                    if key in resident:
                        resident.move_to_end(key)
                        break
            elif key in reused_keys and key in self.t1:
                self.t2[key] = self.t1.pop(key)
            elif key in reused_keys and key in self.t2:
                self.t2.move_to_end(key)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []

        def idle(entries: Iterator[tuple[OffloadKey, ChunkStatus]]) -> tuple[OffloadKey, ChunkStatus] | None:
            """The next idle, unprotected chunk of one list's scan (scans only go forward, so n picks cost one pass)."""
            return next(((k, c) for k, c in entries if c.ref_cnt == 0 and k not in protected), None)

        t1_scan, t2_scan = iter(self.t1.items()), iter(self.t2.items())
        t1_left = len(self.t1)  # t1's size as the picks so far would leave it
        picks: list[tuple[OffloadKey, ChunkStatus, bool]] = []  # (key, chunk, from t1)
        for _ in range(n):
            pick = None
            if t1_left >= int(self.target_t1_size):
                pick = idle(t1_scan)
                from_t1 = pick is not None
            if pick is None:
                pick, from_t1 = idle(t2_scan), False
            if pick is None:
                pick, from_t1 = idle(t1_scan), True
                if pick is None:
                    return None
            t1_left -= from_t1
            picks.append((*pick, from_t1))
        for key, _, from_t1 in picks:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.cache_capacity:
                ghost.popitem(last=False)
        return [(key, chunk) for key, chunk, _ in picks]

    def clear(self) -> None:
        for lst in (self.t1, self.t2, self.b1, self.b2):
            lst.clear()
        self.target_t1_size = 0.0
