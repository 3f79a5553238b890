"""Each replica's request stream: the requests a fleet's router sent it, in arrival order. Replayed alone, a
replica's stream gives the steps the replica took inside the fleet (its engine only ever sees its own
requests), which is how `kvsim conformance` checks every replica against vLLM's own scheduler."""

from __future__ import annotations

from kvsim.errors import KvsimError


def replica_streams(workload, *, allocator: int = 0) -> tuple[list, list[list]]:
    """(the request stream, each replica's requests) of `workload`'s fleet, routed as its allocator
    `allocator` routes them (the prefix policies read the replicas' caches, so routing depends on it)."""
    from dataclasses import replace

    from kvsim.deployment.fleet import replay_config
    from kvsim.replay.options import ReplayOptions
    from kvsim.replay.run import resolve_replay

    num = workload.deployment.replicas
    if num < 2:
        raise KvsimError(f"names no fleet (deployment.replicas is {num})", source=str(workload.path), field="deployment.replicas")
    result, ctx, requests, options = resolve_replay(workload, ReplayOptions(tensors=False))
    config = result.workload.allocators[allocator]
    run = replay_config(config, requests, ctx, replace(options, tensors=False), num, workload.router)
    return requests, [[requests[i] for i in range(len(requests)) if run.replica_of[i] == k] for k in range(num)]
