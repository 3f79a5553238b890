"""N engines on one simulated clock behind a router: each replica is the replay's engine (its own scheduler and
allocator over one rank's budget, `kvsim.replay.loop.engine_rows`), and each request is routed at its arrival
time from what the replicas look like then.

    arrivals:   a0 ----- a1 -- a2 ------------ a3 ...          (in order; each routed when its time comes)
    replica 0:  [row][row][row]  [row]   [row][row] ...         every row scheduled before a_i has run
    replica 1:       [row]    [row][row][row] ...               when a_i is routed; rows at a_i see it
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

import numpy as np

from kvsim.deployment.prefix_hashes import prompt_block_hashes
from kvsim.deployment.router import ReplicaView, make_policy
from kvsim.errors import KvsimError
from kvsim.replay.loop import Arrivals, engine_rows
from kvsim.replay.options import ReplayOptions
from kvsim.replay.records import STEP_COLUMNS, AllocatorRun, ReplayResult


@dataclass
class FleetRun:
    """One allocator config's fleet: every replica's run, the replica of each request, and the deployment's run
    (per-request arrays merged, step rows of every replica one after another)."""

    label: str
    replicas: list[AllocatorRun]
    replica_of: np.ndarray  # (num_requests,) int64
    deployment: AllocatorRun


@dataclass
class FleetResult:
    """A fleet replay: the replay's result (its `runs` are the deployments'), one `FleetRun` per allocator."""

    result: ReplayResult
    num_replicas: int
    router: object  # kvsim.workload.spec.Router
    context: object  # kvsim.replay.options.ReplayContext: model, one rank's budget, clocks
    requests: list  # the request stream (RequestSpec), in arrival order
    fleets: list[FleetRun] = field(default_factory=list)

    @property
    def num_gpus(self) -> int:
        return self.num_replicas * self.result.tp


def replay_fleet(workload, options: ReplayOptions = ReplayOptions(tensors=False), *, replicas: int | None = None,
                 router=None) -> FleetResult:
    """Replay `workload` on `replicas` engines (default its `deployment.replicas`) behind `router` (default its
    `router`), each allocator config in turn. Accounting only: a fleet materialises no cache tensors."""
    from kvsim.replay.run import resolve_replay

    if options.tensors:
        raise KvsimError("a fleet replays accounting only: add --no-tensors", field="--tensors")
    num = replicas if replicas is not None else workload.deployment.replicas
    if num < 1:
        raise KvsimError(f"must be >= 1, got {num}", field="--replicas")
    router = router if router is not None else workload.router
    result, ctx, requests, options = resolve_replay(workload, options)
    fleet = FleetResult(result=result, num_replicas=num, router=router, context=ctx, requests=requests)
    for config in result.workload.allocators:  # with vllm serve's defaults for the model
        fleet.fleets.append(replay_config(config, requests, ctx, options, num, router))
    result.runs = [f.deployment for f in fleet.fleets]
    return fleet


def replay_config(config, requests: list, ctx, options: ReplayOptions, num_replicas: int, router, *,
                  watch=None) -> FleetRun | None:
    """One allocator config on `num_replicas` engines: route every request at its arrival, then run them out.

    With `watch` (a `kvsim.deployment.slo_watch.SloWatch`), it sees every row and is asked before each row and
    before each arrival is routed, when every row scheduled before then has run; once it
    calls the SLO certainly missed, the replay stops there and returns None (the watch says when and why)."""
    queues = [Arrivals(closed=False) for _ in range(num_replicas)]
    on_schedule = watch.on_schedule if watch is not None else None
    engines = [engine_rows(config, requests, ctx, options, q, on_schedule=on_schedule) for q in queues]
    keys = [next(e) for e in engines]  # each yields the time its next row is scheduled at (inf: idle)
    prompt_tokens = np.array([r.num_prompt_tokens for r in requests], dtype=np.int64)
    views = [ReplicaView(q.scheduler, config.block_size, q.queue, prompt_tokens) for q in queues]
    policy = make_policy(router, views)
    hashes_needed = policy.needs_hashes
    heap = [(key, k) for k, key in enumerate(keys) if key != math.inf]
    heapq.heapify(heap)
    replica_of = np.empty(len(requests), dtype=np.int64)
    for i, request in enumerate(requests):
        t = request.arrival_time
        for q in queues:
            q.next_unrouted_s = t
        while heap and heap[0][0] < t:  # every row scheduled before t runs first; rows at t must see request i
            key, k = heapq.heappop(heap)
            if key != keys[k]:
                continue  # a stale entry
            if watch is not None and watch.certain_miss(key):
                return _stop(engines)
            keys[k] = next(engines[k])
            if watch is not None:
                watch.resumed(k, keys[k])
            if keys[k] != math.inf:
                heapq.heappush(heap, (keys[k], k))
        if watch is not None and watch.certain_miss(t):
            return _stop(engines)
        hashes = prompt_block_hashes(request, ctx.seed, config.block_size) if hashes_needed else None
        k = policy.pick(i, request.num_prompt_tokens, hashes)
        replica_of[i] = k
        queues[k].queue.append(i)
        if keys[k] == math.inf:  # idle: wakes at this arrival
            keys[k] = t
            heapq.heappush(heap, (t, k))
    if watch is not None:  # run the rows out in time order, asking the watch before each
        for q in queues:
            q.next_unrouted_s = math.inf
        while heap:
            key, k = heap[0]
            if key != keys[k]:
                heapq.heappop(heap)  # a stale entry
                continue
            if watch.certain_miss(key):
                return _stop(engines)
            heapq.heappop(heap)
            keys[k] = next(engines[k])
            watch.resumed(k, keys[k])
            if keys[k] != math.inf:
                heapq.heappush(heap, (keys[k], k))
    runs = []
    for q, engine in zip(queues, engines):
        q.closed, q.next_unrouted_s = True, math.inf
        try:
            while True:
                next(engine)  # closed: runs to its end
        except StopIteration as stop:
            runs.append(stop.value)
    for k, run in enumerate(runs):
        run.label = f"{config.label}/r{k}"
    return FleetRun(config.label, runs, replica_of, merge_runs(config.label, runs, replica_of))


def _stop(engines) -> None:
    """End every replica's generator where it stands (the replay was cut short)."""
    for engine in engines:
        engine.close()
    return None


def merge_runs(label: str, runs: list[AllocatorRun], replica_of: np.ndarray) -> AllocatorRun:
    """The deployment as one run: each request's arrays from its replica, the step rows of every replica."""
    columns = np.arange(len(replica_of))

    def pick(name: str) -> np.ndarray:
        return np.stack([getattr(r, name) for r in runs])[replica_of, columns]  # (replicas, requests) -> (requests,)

    rejected = [runs[k].rejected_reason[i] for i, k in enumerate(replica_of)]
    steps = {name: np.concatenate([r.steps[name] for r in runs]) for name, _ in STEP_COLUMNS}
    return replace(
        runs[0],
        label=label,
        steps=steps,
        admitted_s=pick("admitted_s"),
        first_token_s=pick("first_token_s"),
        finished_s=pick("finished_s"),
        num_preemptions=pick("num_preemptions"),
        num_cached_tokens=pick("num_cached_tokens"),
        rejected_reason=rejected,
        prefix_query_tokens=sum(r.prefix_query_tokens for r in runs),
        prefix_hit_tokens=sum(r.prefix_hit_tokens for r in runs),
        num_read_samples=0,
    )
