"""The interface every KV allocator implements, and the byte breakdown it reports.

An allocator manages a fixed KV budget (bytes) and maps (request, token position) to a *slot* in one
token-slot space of `num_slots` slots that indexes the cache tensors. "Doesn't fit" is a value (`None` or
`False`), never an exception.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import numpy as np

from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.engine.sequence import Sequence


@dataclass(frozen=True)
class MemoryBreakdown:
    """Where every byte of the budget is at one moment. The five categories sum to `budget_bytes`.

    - token_states: holds KV of tokens already computed (shared blocks counted once);
    - reservation: allocated for tokens the owning request will still produce;
    - internal_fragmentation: allocated but never to be used (a flat slab past the final length, the tail
      of a last block past the final token, block padding, the budget's remainder smaller than one block);
    - external_fragmentation: free bytes that could not admit the waiting request at the head of the queue
      although their total would fit it (always 0 for paged);
    - free: the rest (cached-but-unreferenced prefix blocks count as free: they are reusable).
    `shared_saved_bytes` is not a category: the bytes that sharing (prefix cache, forks) avoided allocating.
    `padding_bytes` is not a category either: the part of internal fragmentation that is vLLM's page padding
    (the pages of a mixed model's padding layers, and pages padded past what their layer needs).
    """

    budget_bytes: int
    token_states_bytes: int
    reservation_bytes: int
    internal_fragmentation_bytes: int
    external_fragmentation_bytes: int
    free_bytes: int
    shared_saved_bytes: int = 0
    padding_bytes: int = 0

    def __post_init__(self) -> None:
        parts = (
            self.token_states_bytes,
            self.reservation_bytes,
            self.internal_fragmentation_bytes,
            self.external_fragmentation_bytes,
            self.free_bytes,
        )
        assert min(parts) >= 0, self
        assert sum(parts) == self.budget_bytes, (sum(parts), self)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class KVAllocator(ABC):
    """Shared interface of the flat and paged allocators.

    Capacity protocol (the scheduler's side): a request is admitted with `allocate(seq, n)`, which makes room
    for its first `n` tokens past any prefix-cache hit and returns the hit in tokens; the scheduler then sets
    `seq.num_computed_tokens` to the hit, computes `n` tokens and advances it. Later chunks and decode steps
    call `append_slots(seq, n)`, which makes room for `seq.num_computed_tokens + n` tokens. `free(seq)`
    returns everything (finish or preemption).
    """

    spec: KVCacheSpec
    budget_bytes: int
    num_slots: int  # size of the token-slot space the cache tensors must index

    @abstractmethod
    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        *,
        num_tokens: int | None = None,
        full_sequence_must_fit: bool = False,
        apply_watermark: bool = True,
    ) -> int | None:
        """Admit `seq` with room for `num_new_tokens` past its prefix-cache hit.

        `num_tokens` is how many leading tokens the request needs computed now (its prompt, or everything it
        had computed when it was preempted); the hit is looked up within them, capped so that at least one is
        computed, and `num_new_tokens` is clamped to what remains after the hit (vLLM: the scheduler's token
        budget never buys slots past the tokens to compute). Default: max(prompt, num_new_tokens).
        `full_sequence_must_fit`: admit only if room for all `num_tokens` is free now (vLLM's
        `scheduler_reserve_full_isl`); `apply_watermark`: keep the watermark free (vLLM: only while a request
        runs). Allocators with their own admission rule (flat: a slab must fit) may ignore both.
        Returns the prefix-cache hit in tokens (0 without caching), or None when it does not fit now,
        in which case nothing changed.
        """

    @abstractmethod
    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `seq.num_computed_tokens + num_new_tokens` tokens; False (nothing changed) if it can't."""

    def append_decode(self, seqs: list[Sequence]) -> list[Sequence]:
        """One decode token for each of `seqs`, in order; returns those that could not grow.

        Allocators override this with a batched version: it is the hot path of a replay.
        """
        return [seq for seq in seqs if not self.append_slots(seq, 1)]

    def append_decode_in_order(self, seqs: list[Sequence]) -> int:
        """One decode token for each of `seqs`, in order, stopping at the first that cannot grow: returns its
        index (`len(seqs)` when all grew). vLLM's running loop grows requests one at a time and preempts at the
        first failure, before the requests after it grow.
        """
        for i, seq in enumerate(seqs):
            if not self.append_slots(seq, 1):
                return i
        return len(seqs)

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release everything `seq` holds (finished or preempted)."""

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Let `child` share `parent`'s KV so far (parallel sampling). False if not supported or no room."""
        return False

    @abstractmethod
    def can_ever_fit(self, seq: Sequence) -> bool:
        """Whether `seq` could run to its final length on an otherwise empty allocator."""

    @abstractmethod
    def slot_mapping(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Slots of token positions [start, end) of `seq`, int64, shape (end - start,)."""

    def decode_slot_mapping(self, seqs: list[Sequence], starts: np.ndarray, k: int) -> np.ndarray:
        """Slots of positions [starts[n], starts[n] + k) of each of `seqs`, (k, N) int64: a decode run's
        `slot_mapping` for the whole batch (allocators override it with array arithmetic)."""
        return np.stack([self.slot_mapping(s, c, c + k) for s, c in zip(seqs, np.asarray(starts).tolist())], axis=1)

    @abstractmethod
    def breakdown(self, waiting_head: Sequence | None = None) -> MemoryBreakdown:
        """The budget split into the five categories now; `waiting_head` decides external fragmentation."""
