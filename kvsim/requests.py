"""The request stream of a workload: lengths and arrivals (`generate_requests`) and synthetic token ids.

Token ids are made lazily, one request at a time (`make_token_ids`), so a replay holds ids only for the
requests that are live, never for the whole stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvsim.traces import read_trace

if TYPE_CHECKING:
    from kvsim.workload import Workload

# Synthetic ids are uniform in [0, VOCAB_SIZE): wide enough that two unrelated requests agreeing on even one
# token at the same position is a one-in-two-billion event, so prefix caching finds only the sharing the
# workload asked for, even at block_size 1.
VOCAB_SIZE = 2**31
# Independent random streams of one workload seed (numpy SeedSequence entropy [seed, stream]).
_ARRIVAL, _PROMPT, _OUTPUT, _PREFIX = range(4)
# Token-id streams (hash keys): a shared-prefix group's ids, and a request's own ids.
_GROUP_IDS, _REQUEST_IDS = 1, 2


@dataclass(frozen=True)
class RequestSpec:
    """One request of the stream, before the replay admits it.

    `max_tokens` is how many output tokens it will produce (the simulator knows the future). Requests of one
    `prefix_group` share their first `num_prefix_tokens` token ids (0 when `prefix_group` is None).
    """

    request_id: int  # 0 .. n-1 in arrival order
    arrival_time: float  # seconds from the first request
    num_prompt_tokens: int
    max_tokens: int
    prefix_group: int | None = None
    num_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        assert self.num_prompt_tokens >= 1 and self.max_tokens >= 0 and self.arrival_time >= 0
        assert 0 <= self.num_prefix_tokens <= self.num_prompt_tokens
        assert (self.prefix_group is None) == (self.num_prefix_tokens == 0)

    @property
    def num_final_tokens(self) -> int:
        """Prompt + output: the KV this request holds when it finishes."""
        return self.num_prompt_tokens + self.max_tokens


def generate_requests(workload: Workload) -> list[RequestSpec]:
    """The workload's requests, sorted by arrival; the same workload (and seed) gives the same list.

    Synthetic lengths, arrivals and prefix groups each come from their own stream of the workload seed, so
    changing, say, the arrival rate leaves every request's lengths as they were.
    """
    from kvsim.workload import TraceRequests

    spec = workload.requests
    if isinstance(spec, TraceRequests):
        trace = read_trace(spec.path, time_scale=spec.time_scale, limit=spec.limit)
        arrival, prompt, output = trace.arrival_time, trace.num_prompt_tokens, trace.num_output_tokens
        group = np.full(len(trace), -1, dtype=np.int64)
        prefix = np.zeros(len(trace), dtype=np.int64)
    else:
        rng = [np.random.default_rng([workload.seed, stream]) for stream in range(4)]
        arrival = spec.arrival.times(rng[_ARRIVAL], count=spec.count, duration_s=spec.duration_s)
        arrival = arrival[: spec.limit]
        n = len(arrival)
        prompt = spec.prompt_tokens.sample(rng[_PROMPT], n)
        output = spec.output_tokens.sample(rng[_OUTPUT], n)
        group, prefix = _prefix_groups(spec.shared_prefix, prompt, rng[_PREFIX])
    return [
        RequestSpec(i, float(t), int(p), int(o), None if g < 0 else int(g), int(k))
        for i, (t, p, o, g, k) in enumerate(zip(arrival.tolist(), prompt.tolist(), output.tolist(), group.tolist(), prefix.tolist()))
    ]


def _prefix_groups(shared, prompt: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(group or -1, prefix tokens) per request, both (n,) int64: a `fraction` join a uniformly chosen group."""
    n = len(prompt)
    if shared is None or shared.fraction == 0:
        return np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64)
    joins = rng.random(n) < shared.fraction  # (n,) bool
    group = np.where(joins, rng.integers(0, shared.groups, size=n), -1)
    prefix = np.where(joins, np.minimum(prompt, shared.tokens), 0)
    return group.astype(np.int64), prefix.astype(np.int64)


def make_token_ids(request: RequestSpec, seed: int) -> np.ndarray:
    """Synthetic token ids for prompt and output, (num_final_tokens,) int64 in [0, VOCAB_SIZE).

    Position p of a shared-prefix group's ids depends only on (seed, group, p), so every request of the
    group agrees on its first `num_prefix_tokens` ids; every other id depends on (seed, request_id, p).
    Ids are hashes, not draws from a stateful generator: cheap, vectorised and order-independent.

        request 7, group 2:  [ g2[0] g2[1] ... g2[k-1] | r7[k] r7[k+1] ... r7[n-1] ]
        request 9, group 2:  [ g2[0] g2[1] ... g2[k-1] | r9[k] ... ]      k = num_prefix_tokens
    """
    positions = np.arange(request.num_final_tokens, dtype=np.uint64)  # (n,)
    ids = _hash_ids(seed, _REQUEST_IDS, request.request_id, positions)
    if request.prefix_group is not None:
        k = request.num_prefix_tokens
        ids[:k] = _hash_ids(seed, _GROUP_IDS, request.prefix_group, positions[:k])
    return ids


def _hash_ids(seed: int, stream: int, key: int, positions: np.ndarray) -> np.ndarray:
    """splitmix64 of (seed, stream, key, position) for each position, reduced to [0, VOCAB_SIZE): (n,) int64."""
    salt = np.array([seed], dtype=np.uint64)  # (1,) chained, so (stream, key) = (1, 2) differs from (2, 1)
    for part in (stream, key):
        salt = _splitmix64(salt ^ _splitmix64(np.array([part], dtype=np.uint64)))
    mixed = _splitmix64(salt + positions * np.uint64(0x9E3779B97F4A7C15))  # (n,)
    return (mixed % np.uint64(VOCAB_SIZE)).astype(np.int64)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
