"""The request stream of a workload: its spec (synthetic or a trace), the requests it generates, and token ids.

Token ids are made lazily, one request at a time (`make_token_ids`), so a replay holds ids only for the
requests that are live, never for the whole stream.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from kvsim.errors import KvsimError
from kvsim.workload.distributions import MAX_ARRIVAL_S, ArrivalProcess, LengthDistribution
from kvsim.workload.trace_mooncake import MAX_HASH_ID, MOONCAKE_BLOCK_TOKENS
from kvsim.workload.traces import Trace, read_trace

# Synthetic ids are uniform in [0, VOCAB_SIZE): wide enough that two unrelated requests agreeing on even one
# token at the same position is a one-in-two-billion event, so prefix caching finds only the sharing the
# workload asked for, even at block_size 1.
VOCAB_SIZE = 2**31
# Independent random streams of one workload seed (numpy SeedSequence entropy [seed, stream]).
_ARRIVAL, _PROMPT, _OUTPUT, _PREFIX = range(4)
# Token-id streams (hash keys): a shared-prefix group's ids, a request's own ids, a trace block's (hash id's) ids.
_GROUP_IDS, _REQUEST_IDS, _TRACE_BLOCK_IDS = 1, 2, 3
_GOLDEN, _C1, _C2, _MASK64 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 2**64 - 1
_U64 = {k: np.uint64(v) for k, v in {"golden": _GOLDEN, "c1": _C1, "c2": _C2, 27: 27, 30: 30, 31: 31, 33: 33}.items()}
_BLOCK_POSITIONS_GOLDEN = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.uint64) * _U64["golden"]  # (512,) wraps mod 2^64


@dataclass(frozen=True)
class SharedPrefix:
    """A `fraction` of requests start with one of `groups` shared prefixes (system prompts) of `tokens` tokens.

    The prefix is part of the prompt: a request whose prompt is shorter than `tokens` shares only its prompt.
    """

    groups: int
    tokens: int
    fraction: float


@dataclass(frozen=True)
class SyntheticRequests:
    """Requests drawn from distributions: `count` of them, or all arriving within `duration_s` seconds."""

    arrival: ArrivalProcess
    prompt_tokens: LengthDistribution
    output_tokens: LengthDistribution
    count: int | None = None
    duration_s: float | None = None
    shared_prefix: SharedPrefix | None = None
    limit: int | None = None  # at most this many prompts (the first by arrival)
    n: int = 1  # samples per prompt (vLLM's `SamplingParams.n`): each prompt is n requests, parallel sampling

    def __post_init__(self) -> None:
        assert (self.count is None) != (self.duration_s is None) and self.n >= 1


@dataclass(frozen=True)
class TraceRequests:
    """Requests replayed from a trace file (Vidur CSV, Azure CSV, BurstGPT CSV, JSONL, Mooncake JSONL; see kvsim.workload.traces).

    Arrival times are multiplied by `time_scale` (0.5 replays the trace twice as fast); `model` and
    `log_type` keep only the BurstGPT rows of that Model and Log Type.
    """

    path: Path
    time_scale: float = 1.0
    limit: int | None = None  # at most this many (the first by arrival)
    model: str | None = None
    log_type: str | None = None


@dataclass(frozen=True)
class RequestSpec:
    """One request of the stream, before the replay admits it.

    `max_tokens` is how many output tokens it will produce (the simulator knows the future). Requests of one
    `prefix_group` share their first `num_prefix_tokens` token ids (0 when `prefix_group` is None). A Mooncake
    request's `hash_ids` name its 512-token prompt blocks (chained), and its prompt's token ids follow from them.
    A parallel-sampling child (`n` > 1) names the request whose prompt it repeats in `prompt_of`: vLLM v1 fans a
    request with n samples out into n requests of one prompt (`ParentRequest.get_child_info`), which share the
    prompt's blocks through prefix caching; each samples its own output tokens.
    """

    request_id: int  # 0 .. n-1 in arrival order (a trace: its rows sorted by arrival, ties in file order)
    arrival_time: float  # seconds from the first request
    num_prompt_tokens: int
    max_tokens: int
    prefix_group: int | None = None
    num_prefix_tokens: int = 0
    hash_ids: tuple[int, ...] | None = None
    prompt_of: int | None = None  # a parallel-sampling child: the request_id whose prompt token ids it repeats

    def __post_init__(self) -> None:
        assert self.num_prompt_tokens >= 1 and self.max_tokens >= 0 and self.arrival_time >= 0
        assert 0 <= self.num_prefix_tokens <= self.num_prompt_tokens
        assert (self.prefix_group is None) == (self.num_prefix_tokens == 0)
        if self.hash_ids is not None:
            assert self.prefix_group is None and len(self.hash_ids) == -(-self.num_prompt_tokens // MOONCAKE_BLOCK_TOKENS)


class StreamSource(Protocol):
    """What `generate_requests` reads of a workload (a `Workload` is one), named here so that this module does
    not import the workload file's module, which imports this one."""

    seed: int
    requests: SyntheticRequests | TraceRequests
    path: Path  # the workload file, named in errors


def generate_requests(workload: StreamSource) -> list[RequestSpec]:
    """The workload's requests, sorted by arrival; the same workload (and seed) gives the same list.

    Synthetic lengths, arrivals and prefix groups each come from their own stream of the workload seed, so
    changing, say, the arrival rate leaves every request's lengths as they were.
    """
    spec = workload.requests
    if isinstance(spec, TraceRequests):
        return trace_requests(read_trace(spec.path, time_scale=spec.time_scale, limit=spec.limit, model=spec.model, log_type=spec.log_type))
    else:
        rng = [np.random.default_rng([workload.seed, stream]) for stream in range(4)]
        arrival = spec.arrival.times(rng[_ARRIVAL], count=spec.count, duration_s=spec.duration_s)
        if len(arrival) and arrival[-1] > MAX_ARRIVAL_S:  # a random process's mean is checked with the file; a draw
            burstier = " or a lower cv" if spec.arrival.process == "gamma" else ""  # can still overshoot it
            raise KvsimError(f"seed {workload.seed} draws the last arrival at {arrival[-1]:.3g} s, past {MAX_ARRIVAL_S:g} s, "
                             f"the latest arrival kvsim replays (a higher rate{burstier} keeps the stream within it)",
                             source=str(workload.path), field=f"requests.arrival.{'cv' if burstier else 'rate'}")
        prompt = spec.prompt_tokens.sample(rng[_PROMPT], len(arrival))
        output = spec.output_tokens.sample(rng[_OUTPUT], len(arrival))
        group, prefix = _prefix_groups(spec.shared_prefix, prompt, rng[_PREFIX])
        # The whole stream is drawn before `limit` cuts it, so a limited run is a prefix of the full one.
        arrival, prompt, output, group, prefix = (x[: spec.limit] for x in (arrival, prompt, output, group, prefix))
    if spec.n == 1:
        return [
            RequestSpec(i, float(t), int(p), int(o), None if g < 0 else int(g), int(k))
            for i, (t, p, o, g, k) in enumerate(zip(arrival.tolist(), prompt.tolist(), output.tolist(), group.tolist(), prefix.tolist()))
        ]
    # Parallel sampling, as vLLM v1's engine adds a request with n samples: n child requests of one prompt,
    # arriving together in sample order, each with the parent's max_tokens (`SamplingParams` copied with n=1).
    n = spec.n
    return [
        RequestSpec(i * n + j, float(t), int(p), int(o), None if g < 0 else int(g), int(k), prompt_of=i * n if j else None)
        for i, (t, p, o, g, k) in enumerate(zip(arrival.tolist(), prompt.tolist(), output.tolist(), group.tolist(), prefix.tolist()))
        for j in range(n)
    ]


def trace_requests(trace: Trace) -> list[RequestSpec]:
    """A trace's requests in arrival order (with their Mooncake hash ids, if any)."""
    ids = trace.hash_ids
    return [
        RequestSpec(i, t, p, o, hash_ids=None if ids is None else ids[i])
        for i, (t, p, o) in enumerate(zip(trace.arrival_time.tolist(), trace.num_prompt_tokens.tolist(), trace.num_output_tokens.tolist()))
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
    """Synthetic token ids for the prompt and every sampled token, (prompt + max_tokens,) int64 in [0, VOCAB_SIZE)
    (the last sampled token included, though its KV is never written: vLLM's engine returns it).

    Position p of a shared-prefix group's ids depends only on (seed, group, p), so every request of the
    group agrees on its first `num_prefix_tokens` ids; every other id depends on (seed, request_id, p).
    Ids are hashes, not draws from a stateful generator: cheap, vectorised and order-independent.

        request 7, group 2:  [ g2[0] g2[1] ... g2[k-1] | r7[k] r7[k+1] ... r7[n-1] ]
        request 9, group 2:  [ g2[0] g2[1] ... g2[k-1] | r9[k] ... ]      k = num_prefix_tokens

    A Mooncake request's prompt token at position p is h[p % 512] of its hash id hash_ids[p // 512] (the
    id's own stream, positions from 0 within the block); its output tokens are its own:

        hash_ids [4, 9, 31], 1,100-token prompt:  [ h4[0] .. h4[511] | h9[0] .. h9[511] | h31[0] .. h31[75] | r[1100] .. ]

    Ids are chained, so requests that share their first j ids share their first 512 j prompt token ids and no
    more (the next id differs, and so do its tokens). A partial last block (76 tokens of id 31 here) is the
    first tokens of that id's stream: a trace names a partial block by an id of its own, which always covers
    the same tokens (kvsim.workload.trace_mooncake checks it), so requests ending in the same id share those tokens too.
    At block size B, two requests share every full B-token block that lies inside their common prefix;
    whole 512-token blocks are whole B-blocks when B divides 512 (every power of two up to 512), and any other
    B shares floor(512 j / B) blocks, a straddling block only when both ids under it are shared.
    """
    k, n = request.num_prefix_tokens, request.num_prompt_tokens + request.max_tokens
    ids = np.empty(n, dtype=np.int64)  # (n,)
    if request.hash_ids is not None:
        k = request.num_prompt_tokens
        ids[:k] = _trace_block_ids(seed, request.hash_ids, k)
    elif k:
        ids[:k] = _hash_ids(_salt(seed, _GROUP_IDS, request.prefix_group), 0, k)
    if request.prompt_of is not None:  # a parallel-sampling child: the first sample's prompt, its own output
        p = request.num_prompt_tokens
        ids[k:p] = _hash_ids(_salt(seed, _REQUEST_IDS, request.prompt_of), k, p)
        k = p
    ids[k:] = _hash_ids(_salt(seed, _REQUEST_IDS, request.request_id), k, n)
    return ids


# make_block_keys: a key is tag << 61 | stream << 21 | block index (every field in range, so keys are exact)
_KEY_REQUEST, _KEY_GROUP, _KEY_TRACE = 0, 1, 2
_KEY_STREAM_BITS, _KEY_BLOCK_BITS = 40, 21
assert MAX_HASH_ID < 1 << _KEY_STREAM_BITS  # every id a trace may carry is a stream of its own


def make_block_keys(request: RequestSpec, block_size: int, num_tokens: int) -> np.ndarray:
    """Exact prefix keys of the full blocks within the first `num_tokens` token ids of `make_token_ids(request)`,
    (num_tokens // block_size,) int64: what the paged allocator caches blocks under instead of hashing the ids.

    Block j's key names the stream its last token e = (j + 1) * block_size - 1 comes from, and j:

        a Mooncake prompt token:      (trace,   hash_ids[e // 512], j)   ids are chained: the id names the prefix
        a shared-prefix group token:  (group,   prefix_group,       j)   e < num_prefix_tokens
        any other token:              (request, prompt_of or request_id (e past the prompt: request_id), j)

    Two requests' blocks j have equal keys exactly when `make_token_ids` builds equal ids for their first
    (j + 1) * block_size tokens from the same streams: a key is one int, compared in full, so keys never
    collide. (Ids drawn from different streams agree only by chance, 2^-31 per token: block hashes of the
    ids would count that chance as a hit, keys do not.)
    """
    return _block_keys(request, block_size, num_tokens, None)


def make_block_key_runs(request: RequestSpec, block_size: int, num_tokens: int) -> tuple[np.ndarray, list[int]]:
    """`make_block_keys(request, block_size, num_tokens)` and where its runs of keys start
    (`kvsim.engine.paged.prefix_table.key_runs` of the keys, the same list), from the keys' structure: a run
    breaks where a stream's blocks start (unless the stream before is the same) and at every 32nd block (a key's
    low bits are its block index). What a replay's requests carry as `Sequence.block_keys`."""
    starts: list[int] = []
    keys = _block_keys(request, block_size, num_tokens, starts)
    nb = len(keys)
    if not nb:
        return keys, [0]
    runs = list(range(0, nb, 1 << _RUN_BITS))
    if len(starts) == 1:  # (a trace's or a group's stream, then the request's own: the common case)
        if starts[0] & _RUN_MASK:
            insort(runs, starts[0])
    elif starts:
        runs = sorted({*runs, *starts})
    runs.append(nb)
    return keys, runs


def num_shareable_tokens(requests: list[RequestSpec]) -> list[int]:
    """Per request of `requests`, the leading tokens whose blocks another request of `requests` may share: from
    there on, every block's key (`make_block_keys`) names a stream no other request has, at any block size.

        a Mooncake prompt       up to the trailing hash ids no other request lists: 512 tokens each
        a shared-prefix group   its prefix tokens, where another request is in the group (else 0)
        a parallel sample       its whole prompt (the n samples share it), the first sample's too
        any other               0: every block is its own stream's

    Counted over the requests' streams, not their keys (a stream two requests name counts as shared even where
    their lengths leave them no common full block), so the answer errs only towards sharing. A request's output
    blocks are its own always. What the paged allocator caches lazily (`Sequence.num_shareable_tokens`)."""
    from collections import Counter
    from itertools import chain

    out = [0] * len(requests)
    traced = [i for i, r in enumerate(requests) if r.hash_ids is not None]
    if traced:  # every request's ids in one array: how many requests list each, then each one's trailing own ids
        lengths = np.fromiter((len(requests[i].hash_ids) for i in traced), np.int64, len(traced))  # (t,)
        ids = np.fromiter(chain.from_iterable(requests[i].hash_ids for i in traced), np.int64, int(lengths.sum()))
        _, where, counts = np.unique(ids, return_inverse=True, return_counts=True)
        # (an id a request lists twice counts as shared: the answer only errs towards sharing)
        shared_at = np.where(counts[where] > 1, np.arange(len(ids)), -1)  # (ids,) its position where shared
        last_shared = np.maximum.accumulate(shared_at)  # the last shared id so far
        ends = np.cumsum(lengths)  # (every request lists at least one id: one per 512 prompt tokens)
        num_shared_ids = np.maximum(last_shared[ends - 1] - (ends - lengths) + 1, 0)  # (t,)
        for i, m in zip(traced, num_shared_ids.tolist()):
            out[i] = min(requests[i].num_prompt_tokens, m * MOONCAKE_BLOCK_TOKENS)  # 512 prompt tokens an id
    groups = Counter(r.prefix_group for r in requests if r.prefix_group is not None and r.num_prefix_tokens)
    sampled = {r.prompt_of for r in requests if r.prompt_of is not None}
    for i, r in enumerate(requests):
        if r.hash_ids is not None:
            continue
        if r.prompt_of is not None or r.request_id in sampled:
            out[i] = r.num_prompt_tokens
        elif r.num_prefix_tokens and groups[r.prefix_group] > 1:
            out[i] = min(r.num_prompt_tokens, r.num_prefix_tokens)
    return out


_RUN_BITS = 5  # the prefix table's chunk: 32 consecutive keys (`kvsim.engine.paged.prefix_table.SLOT_BITS`)
_RUN_MASK = (1 << _RUN_BITS) - 1


def _block_keys(request: RequestSpec, block_size: int, num_tokens: int, starts: list[int] | None) -> np.ndarray:
    """`make_block_keys`; with `starts`, also where a stream's blocks start after a different stream's."""
    nb = num_tokens // block_size
    p = request.num_prompt_tokens
    assert num_tokens <= request.num_prompt_tokens + request.max_tokens and nb < 1 << _KEY_BLOCK_BITS  # its token ids
    # Each stream covers one run of blocks: block j's last token is before token t exactly when j < t // block_size.
    keys = np.arange(nb, dtype=np.int64)  # (nb,) j, each run's (tag, stream) or-ed in below
    prompt_end = min(p // block_size, nb)  # blocks whose tokens are all prompt tokens
    start = 0  # blocks before it are keyed
    if request.hash_ids is not None:
        assert request.prompt_of is None
        per_id = MOONCAKE_BLOCK_TOKENS // block_size if MOONCAKE_BLOCK_TOKENS % block_size == 0 else 0
        if per_id and prompt_end:  # hash id m's blocks are m * per_id .. (m + 1) * per_id - 1
            ids = request.hash_ids[: -(-prompt_end // per_id)]
            assert 0 <= min(ids) and max(ids) < 1 << _KEY_STREAM_BITS, "stream id out of key range"
            stream = np.array(ids, dtype=np.int64)  # (ids,)
            stream <<= _KEY_BLOCK_BITS
            stream |= _KEY_TRACE << (_KEY_STREAM_BITS + _KEY_BLOCK_BITS)
            keys[:prompt_end] |= np.repeat(stream, per_id)[:prompt_end]
        elif prompt_end:  # block j's last token (j + 1) * block_size - 1 is in hash id that // 512
            last = np.arange(block_size - 1, prompt_end * block_size, block_size, dtype=np.int64)  # (prompt_end,)
            stream = np.asarray(request.hash_ids, dtype=np.int64)[last // MOONCAKE_BLOCK_TOKENS]  # (prompt_end,)
            assert 0 <= int(stream.min()) and int(stream.max()) < 1 << _KEY_STREAM_BITS, "stream id out of key range"
            keys[:prompt_end] |= (stream << _KEY_BLOCK_BITS) | (_KEY_TRACE << (_KEY_STREAM_BITS + _KEY_BLOCK_BITS))
        start = prompt_end
        if starts is not None and (MOONCAKE_BLOCK_TOKENS % block_size or MOONCAKE_BLOCK_TOKENS // block_size & _RUN_MASK):
            # hash id m's blocks start at block 512 m // block_size (within the chunk breaks when 32 blocks or
            # a multiple of them make 512 tokens): a break where the id differs from the one before
            ids = request.hash_ids
            for m in range(1, -(-prompt_end * block_size // MOONCAKE_BLOCK_TOKENS)):
                first = MOONCAKE_BLOCK_TOKENS * m // block_size
                if (first < prompt_end and first & _RUN_MASK and ids[((first + 1) * block_size - 1) // MOONCAKE_BLOCK_TOKENS]
                        != ids[(first * block_size - 1) // MOONCAKE_BLOCK_TOKENS]):
                    starts.append(first)
    else:
        group_end = 0
        if request.num_prefix_tokens:
            start = group_end = min(request.num_prefix_tokens // block_size, nb)
            keys[:start] |= _block_key_base(_KEY_GROUP, request.prefix_group)
        if request.prompt_of is not None and prompt_end > start:
            keys[start:prompt_end] |= _block_key_base(_KEY_REQUEST, request.prompt_of)
            start = prompt_end
            if starts is not None and group_end:
                starts.append(group_end)  # a group's stream, then a request's
        if starts is not None and start and start < nb and (start == group_end or request.prompt_of != request.request_id):
            starts.append(start)
        return _key_tail(keys, start, nb, request.request_id)
    if starts is not None and start and start < nb:
        starts.append(start)  # a trace's stream, then the request's own
    return _key_tail(keys, start, nb, request.request_id)


def _key_tail(keys: np.ndarray, start: int, nb: int, request_id: int) -> np.ndarray:
    """Blocks `start`.. are the request's own stream's."""
    if start < nb:
        keys[start:] |= _block_key_base(_KEY_REQUEST, request_id)
    return keys


def _block_key_base(tag: int, stream: int) -> int:
    """The key of block 0 of `stream` under `tag` (a block's key adds its index)."""
    assert 0 <= stream < 1 << _KEY_STREAM_BITS, "stream id out of key range"
    return tag << (_KEY_STREAM_BITS + _KEY_BLOCK_BITS) | stream << _KEY_BLOCK_BITS


def _trace_block_ids(seed: int, hash_ids, num_tokens: int) -> np.ndarray:
    """A Mooncake prompt's ids in one pass, (num_tokens,) int64: position p is id p % 512 of the stream of
    hash_ids[p // 512], salted as `_salt(seed, _TRACE_BLOCK_IDS, id)` (every step of `_salt` and
    `_hash_ids` on arrays; the same bits as calling them block by block)."""
    num_blocks = -(-num_tokens // MOONCAKE_BLOCK_TOKENS)
    salt = _splitmix64_array(np.full(num_blocks, seed & _MASK64, dtype=np.uint64) ^ np.uint64(_splitmix64(_TRACE_BLOCK_IDS)))
    keys = np.asarray(hash_ids[:num_blocks], dtype=np.int64).astype(np.uint64)  # (num_blocks,) trace ids, >= 0
    salt = _splitmix64_array(salt ^ _splitmix64_array(keys))  # (num_blocks,) one salt per 512-token block
    x = salt[:, None] + _BLOCK_POSITIONS_GOLDEN  # (num_blocks, 512): salt + position * golden, as _hash_ids
    _splitmix64_array(x)
    x >>= _U64[33]
    return x.reshape(-1)[:num_tokens].view(np.int64)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """`_splitmix64` on a uint64 array, in place (wrapping mod 2^64 as the Python version masks)."""
    tmp = np.empty_like(x)
    for shift, mul in ((30, "c1"), (27, "c2")):
        np.right_shift(x, _U64[shift], out=tmp)
        x ^= tmp
        x *= _U64[mul]
    np.right_shift(x, _U64[31], out=tmp)
    x ^= tmp
    return x


def _salt(seed: int, stream: int, key: int) -> int:
    """One 64-bit key per (seed, stream, key), chained so that (stream, key) = (1, 2) differs from (2, 1)."""
    salt = seed & _MASK64
    for part in (stream, key):
        salt = _splitmix64(salt ^ _splitmix64(part))
    return salt


def _hash_ids(salt: int, start: int, stop: int) -> np.ndarray:
    """Ids of positions [start, stop): the top 31 bits of splitmix64(salt + position * golden), (stop - start,) int64."""
    x = np.arange(start, stop, dtype=np.uint64)  # (m,) positions; every op below wraps mod 2^64, in place
    x *= _U64["golden"]
    x += np.uint64(salt)
    x ^= x >> _U64[30]
    x *= _U64["c1"]
    x ^= x >> _U64[27]
    x *= _U64["c2"]
    x ^= x >> _U64[31]
    x >>= _U64[33]  # the top 31 bits: [0, 2^31) = [0, VOCAB_SIZE)
    return x.view(np.int64)


def _splitmix64(x: int) -> int:
    """The splitmix64 finaliser on a Python int (the same steps `_hash_ids` applies to arrays)."""
    x = ((x ^ (x >> 30)) * _C1) & _MASK64
    x = ((x ^ (x >> 27)) * _C2) & _MASK64
    return x ^ (x >> 31)
