"""One request as the scheduler and the allocators see it (vLLM's `Request`, nano-vllm's `Sequence`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass(eq=False)
class Sequence:
    """A request's lengths, its synthetic token ids, and how far its KV has been computed.

    The simulator knows the future: `num_final_tokens` is the most KV it will ever hold, which allocators
    size reservations and hashes by. It counts as vLLM v1 does: a request samples `max_tokens` tokens and
    finishes on its last (`check_stop`), whose KV is never written, so it holds prompt + max_tokens - 1 tokens
    of KV (`max_tokens` 0 counts as 1: a prefill always samples, as vLLM's `Request` gives a pooling request
    `max_tokens` 1). `token_ids` covers prompt and every sampled token (at least `num_final_tokens` ids), so
    prefix-cache hashes of full blocks are well defined for every block.

    `num_computed_tokens` is owned by the scheduler: it is advanced after the tokens of a step are computed
    (written to the cache) and reset to 0 when the request is preempted for recompute. Allocators read it to
    know how much capacity a request already needs; they never advance it.
    """

    seq_id: int
    num_prompt_tokens: int
    max_tokens: int
    token_ids: np.ndarray | None = None  # (prompt + max_tokens,) int64, synthetic but consistent
    arrival_time: float = 0.0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at admission, in tokens
    # Tokens whose ids are known so far; None: all of them. Prefix caching hashes only known tokens' blocks
    # (vLLM's async scheduling computes a token before the step that samples it has returned it).
    num_known_tokens: int | None = None
    # Async scheduling: computed tokens of steps whose output has not returned yet (vLLM's
    # `num_in_flight_tokens`); a sliding window frees only blocks before the settled tokens, computed - these.
    num_in_flight_tokens: int = 0
    # Exact prefix keys of full blocks, in place of hashing `token_ids`: (block_size, num_tokens) -> (keys of the
    # full blocks within the first num_tokens, (num_tokens // block_size,) int64, equal exactly where the token
    # prefixes are built equal (`kvsim.workload.requests.make_block_keys`), and where their runs start, as
    # `kvsim.engine.paged.prefix_table.key_runs` finds them): `make_block_key_runs`. None: prefix caching hashes token_ids.
    block_keys: Callable[[int, int], tuple[np.ndarray, list[int]]] | None = None
    # With `block_keys`: its leading tokens whose blocks another request may share; the blocks past them are keyed
    # by streams no other request has (`kvsim.workload.requests.num_shareable_tokens`). None: its prompt.
    num_shareable_tokens: int | None = None
    extra: dict = field(default_factory=dict)  # scheduler / report bookkeeping, never read by allocators

    def __post_init__(self) -> None:
        assert self.num_prompt_tokens > 0 and self.max_tokens >= 0
        if self.token_ids is not None:
            assert len(self.token_ids) >= self.num_final_tokens

    @property
    def num_final_tokens(self) -> int:
        """Prompt + max_tokens - 1: the most KV it holds (the last sampled token's KV is never written)."""
        return self.num_prompt_tokens + max(self.max_tokens, 1) - 1

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, prompt={self.num_prompt_tokens}, max_tokens={self.max_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
