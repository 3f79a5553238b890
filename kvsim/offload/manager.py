"""The CPU tier's scheduler-side manager: which chunks it holds, which it is writing, which loads pin them
(vLLM's `CPUOffloadingManager`, vllm/v1/kv_offload/cpu/manager.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from enum import Enum, auto

from kvsim.errors import KvsimError
from kvsim.offload.arc import ARCCachePolicy
from kvsim.offload.chunk import ChunkStatus
from kvsim.offload.lru import LRUCachePolicy
from kvsim.offload.policy import CachePolicy
from kvsim.offload.request_context import OffloadKey, ReqContext, offload_group_idx

POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUCachePolicy, "arc": ARCCachePolicy}


class LookupResult(Enum):
    """`lookup`: the tier lacks the key, holds it, or is still writing it."""

    MISS = auto()
    HIT = auto()
    HIT_PENDING = auto()


@dataclass(frozen=True)
class PrepareStoreOutput:
    """What a store will write: the keys new to the tier, the chunk slot of each, and the keys evicted for them."""

    keys_to_store: list[OffloadKey]
    chunk_ids: list[int]
    evicted_keys: list[OffloadKey]


@dataclass(slots=True)
class _RequestCacheAccess:
    """The keys one request used, by group in first-use order, and how: inserted, reused, offered missing."""

    owner: object
    generation: int
    key_groups: dict[int, list[OffloadKey]] = field(default_factory=dict)
    seen_keys: set[OffloadKey] = field(default_factory=set)
    inserted_keys: set[OffloadKey] = field(default_factory=set)
    reused_keys: set[OffloadKey] = field(default_factory=set)
    store_miss_keys: set[OffloadKey] = field(default_factory=set)
    finished: bool = False


class CPUOffloadingManager:
    """`num_chunks` chunk slots, a policy that orders them, and the life of a chunk:

        prepare_store -> ref_cnt -1 (being written; lookup says HIT_PENDING; never evicted)
        complete_store -> 0 (ready, evictable)    or, on failure, dropped and its slot freed
        prepare_load -> +1 per load reading it (pinned)    complete_load -> -1

    A store is all or nothing: when the idle chunks outside the offered keys cannot make room for every key new
    to the tier, `prepare_store` returns None and changes nothing but the policy's view of the offer (vLLM's
    connector offers the same keys again next step). A request's reads and stores reach the policy's
    recency once more, in prefix order, at `on_request_finished`.
    """

    def __init__(self, num_chunks: int, cache_policy: str = "lru", store_threshold: int = 0,
                 max_tracker_size: int = 64_000) -> None:
        if cache_policy not in POLICIES:
            raise KvsimError(f"expected one of {', '.join(POLICIES)}, got {cache_policy!r}", field="policy")
        self.num_chunks = num_chunks
        self.policy: CachePolicy = POLICIES[cache_policy](cache_capacity=num_chunks)
        self._num_allocated = 0  # slots ever handed out, 0..num_chunks-1 in order
        self._free_list: list[int] = []  # slots freed by evictions and failed stores, reused last-in first-out
        self.num_evictable = 0  # ready chunks no load pins
        self.num_write_pending = 0
        self._generation = 0
        # store_threshold >= 2: a key is stored only once it was offered that many times (an LRU table of counts)
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.counts: OrderedDict[OffloadKey, int] | None = OrderedDict() if store_threshold >= 2 else None

    # --- chunk slots ---

    @property
    def num_free_chunks(self) -> int:
        return len(self._free_list) + self.num_chunks - self._num_allocated

    def _allocate(self, n: int) -> list[ChunkStatus]:
        """Fresh slots first, then freed ones (most recently freed first)."""
        fresh = min(n, self.num_chunks - self._num_allocated)
        chunks = [ChunkStatus(self._num_allocated + i) for i in range(fresh)]
        self._num_allocated += fresh
        chunks += [ChunkStatus(self._free_list.pop()) for _ in range(n - fresh)]
        return chunks

    # --- a request's accesses ---

    def _access(self, req_context: ReqContext) -> _RequestCacheAccess:
        state = req_context.get_state(_RequestCacheAccess)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = _RequestCacheAccess(owner=self, generation=self._generation)
            req_context.set_state(state)
        return state

    def _record_access(self, keys: Iterable[OffloadKey], req_context: ReqContext,
                       reused_keys: Iterable[OffloadKey] = ()) -> None:
        """Note keys the request uses for the first time (and tell the policy), and which it reused."""
        state = self._access(req_context)
        new_keys = []
        for key in keys:
            if key in state.seen_keys:
                continue
            assert not state.finished, "a finished request used a new key"
            state.key_groups.setdefault(offload_group_idx(key), []).append(key)
            state.seen_keys.add(key)
            new_keys.append(key)
        if new_keys:
            self.policy.on_request_access(new_keys, req_context)
        state.reused_keys.update(key for key in reused_keys if key not in state.inserted_keys)

    def _count_offers(self, keys: list[OffloadKey]) -> None:
        """store_threshold's table: one more offer of each key; new keys push out the oldest unoffered ones."""
        counts = self.counts
        offered = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                offered.add(key)
        unprotected = len(counts) - len(offered)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if unprotected == 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[key] = 1

    # --- the OffloadingManager interface ---

    def on_new_request(self, req_context: ReqContext) -> None:
        self._access(req_context)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        chunk = self.policy.get(key)
        if chunk is None:
            return LookupResult.MISS
        return LookupResult.HIT if chunk.is_ready else LookupResult.HIT_PENDING

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> list[int]:
        """Pin the ready chunks of `keys` for a load; their slots, in order."""
        chunk_ids = []
        for key in keys:
            chunk = self.policy.get(key)
            assert chunk is not None and chunk.is_ready, f"load of a chunk the tier cannot read: {key!r}"
            if chunk.ref_cnt == 0:
                self.policy.mark_non_evictable(key)
                self.num_evictable -= 1
            chunk.ref_cnt += 1
            chunk_ids.append(chunk.chunk_id)
        self._record_access(keys, req_context, reused_keys=keys)
        return chunk_ids

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.policy.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            chunk = self.policy.get(key)
            assert chunk is not None and chunk.ref_cnt > 0, f"load completion of an unpinned chunk: {key!r}"
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self.num_evictable += 1
                self.policy.mark_evictable(key)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Slots for the keys the tier lacks, evicting idle chunks outside `keys` as needed; None if they do not all fit."""
        keys = list(keys)
        if self.counts is not None:
            self._count_offers(keys)
        missing = [key for key in keys if self.policy.get(key) is None]
        ready = [key for key in keys if (c := self.policy.get(key)) is not None and c.is_ready]
        if self.counts is not None:
            missing = [key for key in missing if self.counts.get(key, 0) >= self.store_threshold]
        state = self._access(req_context)
        new_misses = [key for key in missing if key not in state.store_miss_keys]
        if new_misses:
            self.policy.on_store_miss(new_misses, req_context)  # before insert() takes them out of ARC's ghosts
            state.store_miss_keys.update(new_misses)
        recorded = set(missing) | set(ready)
        self._record_access((key for key in keys if key in recorded), req_context, reused_keys=ready)
        if not missing:
            return PrepareStoreOutput([], [], [])

        to_evict = len(missing) - self.num_free_chunks
        evicted: list[OffloadKey] = []
        if to_evict > 0:
            if to_evict > self.num_evictable:
                return None
            victims = self.policy.evict(to_evict, set(keys))  # an offered key stays, stored or not
            if victims is None:
                return None
            self.num_evictable -= len(victims)
            for key, chunk in victims:
                self._free_list.append(chunk.chunk_id)
                evicted.append(key)
        chunks = self._allocate(len(missing))
        for key, chunk in zip(missing, chunks):
            self.policy.insert(key, chunk, req_context)
        self.num_write_pending += len(missing)
        state.inserted_keys.update(missing)
        return PrepareStoreOutput(missing, [c.chunk_id for c in chunks], evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """The store's chunks become ready (evictable), or on failure leave the tier."""
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is None or chunk.is_ready:
                continue
            self.num_write_pending -= 1
            if success:
                chunk.ref_cnt = 0
                self.num_evictable += 1
                self.policy.mark_evictable(key)
            else:
                self.policy.remove(key)
                self._free_list.append(chunk.chunk_id)

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Hand the request's whole access to the policy, in prefix order per group (once per request)."""
        state = req_context.get_state(_RequestCacheAccess)
        if state is None or state.owner is not self or state.generation != self._generation or state.finished:
            return
        state.finished = True
        key_groups = []
        for group_idx in sorted(state.key_groups):
            keys = state.key_groups[group_idx]
            positions = {k: p for k in keys if (p := req_context.get_offload_key_position(k)) is not None}
            if len(positions) == len(keys):
                keys = sorted(keys, key=positions.__getitem__)
            key_groups.append(tuple(keys))
        self.policy.on_request_finished(tuple(key_groups), state.inserted_keys - state.reused_keys,
                                        state.reused_keys, req_context)

    def reset_cache(self) -> None:
        """Forget every chunk (vLLM's reset_prefix_cache reaches the tier too)."""
        self.policy.clear()
        self._generation += 1
        self.num_evictable = self.num_write_pending = 0
        self._free_list.clear()
        self._num_allocated = 0
