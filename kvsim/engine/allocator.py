"""The interface every KV allocator implements, and the byte breakdown it reports.

An allocator manages a fixed KV budget (bytes) and maps (request, token position) to a *slot* in one
token-slot space of `num_slots` slots that indexes the cache tensors. "Doesn't fit" is a value (`None` or
`False`), never an exception.
"""

from __future__ import annotations

from collections.abc import Container

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
    `shared_saved_bytes` is not a category: the bytes that sharing (prefix cache) avoided allocating.
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
    """The one interface the scheduler, the tensor runner and the replay loop use: flat, paged and hybrid
    allocators implement all of it, and nobody asks an allocator what it is otherwise.

    Capacity protocol (the scheduler's side): a request is admitted with `allocate(seq, n)`, which makes room
    for its first `n` tokens past any prefix-cache hit and returns the hit in tokens; the scheduler then sets
    `seq.num_computed_tokens` to the hit, computes `n` tokens and advances it. Later chunks call
    `append_slots(seq, n)`, which makes room for `seq.num_computed_tokens + n` tokens, and decode steps
    `append_decode_in_order(seqs)`. `free(seq)` returns everything (finish or preemption).
    """

    spec: KVCacheSpec
    budget_bytes: int
    max_model_len: int
    num_slots: int  # size of the token-slot space the cache tensors must index
    paged: bool  # True: block tables (`block_table`); False: one slab per request (`slab`)
    prefix_query_tokens: int = 0  # tokens looked up in the prefix cache at admission, summed
    prefix_hit_tokens: int = 0  # of those, tokens found cached
    enable_prefix_caching: bool = False  # False: `cache_blocks` caches nothing
    decode_frees_blocks: bool = False  # True: decoding returns blocks (a sliding or chunked window's), so free memory grows
    # vLLM's mamba_cache_mode align (a hybrid model with prefix caching): the block size a prefill chunk must end
    # on (`Scheduler._mamba_block_aligned_split`; 0: chunks end anywhere), and the state layers' prefill
    # checkpoint alignment (0: they export none)
    mamba_block_size: int = 0
    mamba_checkpoint_alignment: int = 0
    # prefix caching of a request's private blocks (keyed by its own streams: past its prompt, or past its
    # `num_shareable_tokens`; no other request asks for them):
    # True where they may be cached only when the request's blocks are freed, up to where vLLM's caching as
    # tokens settle would have taken them (the paged allocator of a uniform model)
    caches_private_blocks_at_free: bool = False

    @property
    def needs_settled_caching(self) -> bool:
        """Whether async scheduling must call `cache_blocks` as each request's tokens settle (False: every
        admitted request's blocks past its prompt are cached when its blocks are freed)."""
        return self.enable_prefix_caching

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

    def append_decode_in_order(self, seqs: list[Sequence]) -> int:
        """One decode token for each of `seqs`, in order, stopping at the first that cannot grow: returns its
        index (`len(seqs)` when all grew). vLLM's running loop grows requests one at a time and preempts at the
        first failure, before the requests after it grow. The replay's hot path: allocators inline it.
        """
        for i, seq in enumerate(seqs):
            if not self.append_slots(seq, 1):
                return i
        return len(seqs)

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release everything `seq` holds (finished or preempted)."""

    def free_finished(self, seq: Sequence) -> None:
        """`free` for a request that has finished (it will not be admitted again)."""
        self.free(seq)

    def new_step_starts(self) -> None:
        """A scheduler step begins (vLLM's `KVCacheManager.new_step_starts`)."""

    def get_computed_blocks(self, seq: Sequence, num_tokens: int) -> tuple[int, int]:
        """The prefix-cache hit `allocate` would find for `seq` within `num_tokens`, and where a longer shared
        prefix some KV cache group caches ends (vLLM's `shared_prefix_boundary`, else 0), in tokens, changing
        nothing. Without a prefix cache: (0, 0)."""
        return 0, 0

    def shared_prefix_boundary(self, seq: Sequence) -> int:
        """vLLM's `Request.shared_prefix_boundary` of admitted `seq` (0: none)."""
        return 0

    def remove_skipped_blocks(self, seq: Sequence, processed_computed_tokens: int) -> None:
        """Free admitted `seq`'s blocks no window reads once `processed_computed_tokens` are settled (vLLM's
        `KVCacheManager.remove_skipped_blocks`); nothing for models without sliding or chunked windows."""

    def pop_blocks_for_free(self, seq: Sequence) -> list:
        """Forget `seq` and hand back its blocks without returning them (vLLM's `pop_blocks_for_free`, for the
        frees a KV connector defers under async scheduling); `free_popped_blocks` returns them later. Paged
        allocators only (the CPU tier's connector needs one)."""
        raise NotImplementedError(f"{type(self).__name__} does not defer frees")

    def free_popped_blocks(self, blocks: list) -> None:
        """Return blocks `pop_blocks_for_free` handed back, the last first (vLLM's `_drain_deferred_frees`)."""
        raise NotImplementedError(f"{type(self).__name__} does not defer frees")

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Cache `seq`'s full blocks within its first `num_tokens` tokens now (vLLM's `KVCacheManager.cache_blocks`,
        which async scheduling calls once a step's sampled tokens are known). Nothing without a prefix cache."""

    def full_sequence_fits(self, seq: Sequence, apply_watermark: bool) -> bool:
        """Whether admitted `seq` has room for all its tokens now, the watermark kept free with `apply_watermark`:
        vLLM's `allocate_slots(full_sequence_must_fit=True)` first check, for a request that resumes from the
        waiting queue with blocks already held (its CPU-tier load finished). Paged allocators only (they give
        `num_blocks_to_finish`, `watermark_blocks` and `num_free_blocks`), as only they take a CPU tier."""
        watermark = self.watermark_blocks if apply_watermark else 0
        return self.num_blocks_to_finish(seq) + watermark <= self.num_free_blocks

    @abstractmethod
    def can_ever_fit(self, seq: Sequence) -> bool:
        """Whether `seq` could run to its final length on an otherwise empty allocator."""

    def never_fits_reason(self, seq: Sequence) -> str | None:
        """Why `seq` can never run here (what the scheduler rejects it with at arrival), or None if it can."""
        if self.can_ever_fit(seq):
            return None
        return f"needs {seq.num_final_tokens} tokens of KV, more than the allocator can ever hold"

    @abstractmethod
    def max_decode_run(self, num_seqs: int) -> int:
        """The most identical decode steps `num_seqs` running requests can take in one scheduled row, each
        growing every step, such that no step inside the run could fail to grow (no preemption is skipped)."""

    @abstractmethod
    def slot_mapping(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Slots of token positions [start, end) of `seq`, int64, shape (end - start,)."""

    def decode_slot_mapping(self, seqs: list[Sequence], starts: np.ndarray, k: int) -> np.ndarray:
        """Slots of positions [starts[n], starts[n] + k) of each of `seqs`, (k, N) int64: a decode run's
        `slot_mapping` for the whole batch (allocators override it with array arithmetic)."""
        return np.stack([self.slot_mapping(s, c, c + k) for s, c in zip(seqs, np.asarray(starts).tolist())], axis=1)

    def block_table(self, seq: Sequence) -> list[int | None]:
        """Paged (`paged` True): block ids of `seq`'s block table (the group slots follow); None where a block
        left a sliding window. The tensor runner's paged reads take it."""
        raise NotImplementedError(f"{type(self).__name__} keeps no block tables")

    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """Paged: every KV cache group's block ids as vLLM's `KVCacheBlocks.get_block_ids()` shows them (0: the
        null block). The conformance harness compares them with vLLM's, step by step."""
        raise NotImplementedError(f"{type(self).__name__} keeps no block tables")

    def kv_cache_usage(self) -> float:
        """vLLM's `KVCacheManager.usage`: the fraction of the KV memory requests hold (a router's KV-utilization
        scorer reads it). Paged allocators count blocks; this default counts the budget's bytes not free."""
        b = self.breakdown()
        return 1 - b.free_bytes / b.budget_bytes

    def cached_block_hashes(self) -> Container[int]:
        """The prefix hashes the pool caches now (a precise prefix router reads them, as llm-d's scorer reads
        vLLM's KV events); empty without prefix caching."""
        return ()

    def slab(self, seq: Sequence) -> tuple[int, int]:
        """Flat (`paged` False): (start_slot, num_slots) of `seq`'s slab. The tensor runner's flat reads take it."""
        raise NotImplementedError(f"{type(self).__name__} keeps no slabs")

    @property
    def slot_window(self) -> int | None:
        """The sliding window of the layers slots follow (positions before it are never read again), or None."""
        return None

    @abstractmethod
    def breakdown(self, waiting_head: Sequence | None = None) -> MemoryBreakdown:
        """The budget split into the five categories now; `waiting_head` decides external fragmentation."""
