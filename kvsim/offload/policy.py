"""The cache policy interface: where chunks live and which one goes when room is needed (vLLM's `CachePolicy`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

from kvsim.offload.chunk import ChunkStatus
from kvsim.offload.request_context import OffloadKey, ReqContext


def order_request_keys(key_groups: Sequence[Sequence[OffloadKey]], req_context: ReqContext) -> list[OffloadKey]:
    """A request's keys of every group in one head-to-tail order: by end-token position where every key has one,
    else group by group as given (vLLM's `order_request_keys`; the sort is stable, so equal positions keep
    their group order)."""
    keys = [key for group in key_groups for key in group]
    positions = {key: p for key in keys if (p := req_context.get_offload_key_position(key)) is not None}
    if len(positions) == len(keys):
        keys.sort(key=positions.__getitem__)
    return keys


class CachePolicy(ABC):
    """Chunk organisation and replacement together (ARC's ghost lists sit at their intersection)."""

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        """The chunk of `key`, or None if the tier does not hold it."""

    @abstractmethod
    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        """A newly allocated chunk (its store in flight), stored by `req_context`'s request."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Drop a chunk whose store failed."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Mark keys as recently used, the first of them most recently."""

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Keys offered for store that the tier lacks, seen once per request before they are inserted."""
        self.touch(keys, req_context)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Keys a request reads or offers for the first time, while it runs."""

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        """The request's whole access, applied once when it finishes: one touch per group by default."""
        del insertion_only_keys, reused_keys
        for keys in key_groups:
            self.touch(keys, req_context)

    @abstractmethod
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Evict exactly n idle chunks not in `protected`, or change nothing and return None."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every chunk and all adaptive state."""

    def mark_evictable(self, key: OffloadKey) -> None:
        """The chunk's ref_cnt became 0."""

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """The chunk's ref_cnt left 0."""
