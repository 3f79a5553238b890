"""The paper's flat baselines (seed 001's NaiveKVCache): one contiguous slab per request, reserved at admission.

What pre-paging engines (FasterTransformer, Orca) did, as the PagedAttention paper models them: the slab is
sized once, from `max_model_len` (max), the next power of two (pow2) or the true final length (oracle), and
placed in one arena of the same budget, so reservation, internal and external fragmentation all show.
"""

from __future__ import annotations

import sys
from operator import attrgetter
from typing import Literal

import numpy as np

from kvsim.engine.allocator import KVAllocator, MemoryBreakdown
from kvsim.engine.flat.arena import PLACEMENTS, Arena, Placement
from kvsim.engine.sequence import Sequence
from kvsim.size.kv_cache_spec import KVCacheSpec

Reserve = Literal["max", "pow2", "oracle"]  # a flat slab's size: max_model_len, next power of two, or exact

RESERVES: tuple[str, ...] = ("max", "pow2", "oracle")
_computed = attrgetter("num_computed_tokens")


class FlatAllocator(KVAllocator):
    """Contiguous per-request slabs in an arena of `budget_bytes // spec.bytes_per_token` token slots.

    Slab of one request (`num_state_slots` only for models with state layers):

        start                      start + reserved_tokens
        | computed | to produce | never used | state slots |
          token      reservation  internal      ceil(state_bytes / bytes_per_token)
          states                  fragmentation

    - `reserve="max"`: `max_model_len` tokens; `"pow2"`: the next power of two >= `num_final_tokens` (prompt +
      max_tokens - 1), capped at `max_model_len` (no engine reserves past the longest sequence it serves; the
      cap keeps pow2 <= max); `"oracle"`: exactly `num_final_tokens` (it knows the future).
    - Every per-token layer keeps every token (no window freeing: the paper's systems had none).
    - Nothing grows after admission: `append_slots` only checks the request stays inside its slab, so a flat
      allocator never preempts. A request longer than `max_model_len` is never admitted (`can_ever_fit`).

    Byte categories are kept as running totals over live requests, plus one pass over their
    `num_computed_tokens` (owned by the scheduler) per `breakdown`; nothing loops over tokens.
    """

    paged = False

    def __init__(
        self,
        spec: KVCacheSpec,
        budget_bytes: int,
        *,
        max_model_len: int,
        reserve: Reserve = "max",
        placement: Placement = "first-fit",
    ):
        assert reserve in RESERVES, reserve
        assert placement in PLACEMENTS, placement
        assert spec.bytes_per_token > 0 and budget_bytes >= 0 and max_model_len > 0
        self.spec = spec
        self.budget_bytes = budget_bytes
        self.max_model_len = max_model_len
        self.reserve = reserve
        self.placement = placement
        self.bytes_per_token = spec.bytes_per_token
        self.num_slots = budget_bytes // self.bytes_per_token
        self.remainder_bytes = budget_bytes - self.num_slots * self.bytes_per_token
        self.num_state_slots = -(-spec.state_bytes_per_sequence // self.bytes_per_token)
        self.state_padding_bytes = self.num_state_slots * self.bytes_per_token - spec.state_bytes_per_sequence
        self.arena = Arena(self.num_slots, placement)
        # Live requests by seq_id: their slab (start, reserved tokens), and running totals over them, in tokens.
        self._live: dict[int, tuple[int, int]] = {}
        self._seqs: dict[int, Sequence] = {}
        self._reserved_tokens = 0
        self._final_tokens = 0

    # --- sizing -------------------------------------------------------------------------------------

    def reserved_tokens(self, seq: Sequence) -> int:
        """Token slots the reserve policy gives `seq` at admission."""
        final = seq.num_final_tokens
        if self.reserve == "max":
            return self.max_model_len
        if self.reserve == "pow2":
            return min(1 << (final - 1).bit_length(), self.max_model_len)
        return final

    def slab_size(self, seq: Sequence) -> int:
        """Slots `seq`'s slab takes: reserved tokens plus state slots."""
        return self.reserved_tokens(seq) + self.num_state_slots

    def can_ever_fit(self, seq: Sequence) -> bool:
        return seq.num_final_tokens <= self.max_model_len and self.slab_size(seq) <= self.arena.max_extent

    def never_fits_reason(self, seq: Sequence) -> str | None:
        """The reserve policy decides the slab, not the request: the rejection names the slab."""
        if self.can_ever_fit(seq):
            return None
        return f"its slab of {self.slab_size(seq):,} token slots ({self.reserve} reservation), more than the allocator can ever hold"

    def max_decode_run(self, num_seqs: int) -> int:
        """A slab covers its request's final length: growth never fails, so no bound."""
        return sys.maxsize

    # --- admission and growth -----------------------------------------------------------------------

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        *,
        num_tokens: int | None = None,
        full_sequence_must_fit: bool = False,
        apply_watermark: bool = True,
    ) -> int | None:
        """Admit `seq` if its whole slab fits (the flat baselines' own admission rule: the slab covers the final
        length, so `full_sequence_must_fit` always holds and no watermark applies)."""
        assert seq.seq_id not in self._live, seq
        reserved = self.reserved_tokens(seq)
        if num_tokens is not None:  # no prefix cache: the chunk is clamped to the tokens to compute
            num_new_tokens = min(num_new_tokens, num_tokens)
        if seq.num_final_tokens > self.max_model_len or seq.num_computed_tokens + num_new_tokens > reserved:
            return None
        start = self.arena.alloc(reserved + self.num_state_slots)
        if start is None:
            return None
        self._admit(seq, start, reserved)
        return 0

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return seq.num_computed_tokens + num_new_tokens <= self._live[seq.seq_id][1]

    def append_decode_in_order(self, seqs: list[Sequence]) -> int:
        live = self._live
        for i, seq in enumerate(seqs):
            if seq.num_computed_tokens >= live[seq.seq_id][1]:
                return i
        return len(seqs)

    def free(self, seq: Sequence) -> None:
        start, reserved = self._live.pop(seq.seq_id)
        del self._seqs[seq.seq_id]
        self.arena.release(start)
        self._reserved_tokens -= reserved
        self._final_tokens -= seq.num_final_tokens

    def _admit(self, seq: Sequence, start: int, reserved: int) -> None:
        assert seq.num_final_tokens <= reserved
        self._live[seq.seq_id] = (start, reserved)
        self._seqs[seq.seq_id] = seq
        self._reserved_tokens += reserved
        self._final_tokens += seq.num_final_tokens

    # --- where tokens live --------------------------------------------------------------------------

    def slab(self, seq: Sequence) -> tuple[int, int]:
        """(start_slot, num_slots) of `seq`'s slab: tokens at [start, start + reserved), then state slots."""
        start, reserved = self._live[seq.seq_id]
        return start, reserved + self.num_state_slots

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        base, reserved = self._live[seq.seq_id]
        assert 0 <= start <= end <= reserved, (seq, start, end)
        return np.arange(base + start, base + end, dtype=np.int64)  # (end - start,)

    def decode_slot_mapping(self, seqs: list[Sequence], starts: np.ndarray, k: int) -> np.ndarray:
        """Slots of positions [starts[n], starts[n] + k) of each of `seqs`, as (k, N) (see PagedAllocator's)."""
        live = [self._live[s.seq_id] for s in seqs]
        assert all(c + k <= reserved for (_, reserved), c in zip(live, starts.tolist())), "decode run past the slab"
        bases = np.fromiter((base for base, _ in live), dtype=np.int64, count=len(seqs))  # (N,)
        return bases[None, :] + starts[None, :] + np.arange(k, dtype=np.int64)[:, None]  # (k, N)

    @property
    def num_live(self) -> int:
        """Requests holding a slab."""
        return len(self._live)

    # --- accounting ---------------------------------------------------------------------------------

    def breakdown(self, waiting_head: Sequence | None = None) -> MemoryBreakdown:
        """Budget split per the slab diagram; external fragmentation is judged against `waiting_head`'s slab."""
        bpt = self.bytes_per_token
        live = len(self._live)
        computed = sum(map(_computed, self._seqs.values()))
        assert computed <= self._final_tokens
        arena = self.arena
        rounding = arena.used_total - self._reserved_tokens - live * self.num_state_slots  # buddy blocks
        free = arena.free_total * bpt
        external = 0
        if waiting_head is not None and self.can_ever_fit(waiting_head):
            need = self.slab_size(waiting_head)
            if not arena.can_fit(need) and arena.free_total >= arena.footprint(need):
                external, free = free, 0
        return MemoryBreakdown(
            budget_bytes=self.budget_bytes,
            token_states_bytes=computed * bpt + live * self.spec.state_bytes_per_sequence,
            reservation_bytes=(self._final_tokens - computed) * bpt,
            internal_fragmentation_bytes=(self._reserved_tokens - self._final_tokens + rounding) * bpt
            + live * self.state_padding_bytes
            + self.remainder_bytes,
            external_fragmentation_bytes=external,
            free_bytes=free,
        )
