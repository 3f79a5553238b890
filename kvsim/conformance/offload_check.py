"""kvsim's `CPUOffloadingManager` (kvsim.offload) beside vLLM 0.33.0's own, unmodified from the wheel, step by step.

Both are fed the same random sequence of calls, as the offloading connector's scheduler side makes them:
requests sharing prefixes of chunk keys in several KV cache groups; lookups; loads of ready runs and their
completions; stores of new chunks (all or nothing), completed or failed; touches; request finishes; cache
resets. After every call the answers (lookup result, chunk slots loaded, keys stored, their slots, keys
evicted, None for a refused store) and the tier's state (each resident chunk's slot and ref count; ARC's four
lists and target) must be equal. Run: `python3 -m kvsim.conformance.offload_check` (exit code 1 on a difference).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

from kvsim.offload.manager import CPUOffloadingManager
from kvsim.offload.request_context import ReqContext, make_offload_key

CHUNK_TOKENS = 16


@dataclass(frozen=True)
class OffloadScenario:
    """A random call sequence: the tier's size and policy, and the shape of the traffic."""

    policy: str = "lru"
    num_chunks: int = 24
    num_groups: int = 2
    num_prefixes: int = 3  # requests start with one of these shared runs of chunks
    max_live: int = 4
    num_ops: int = 400
    store_threshold: int = 0
    seed: int = 0

    @property
    def label(self) -> str:
        return (f"{self.policy} chunks={self.num_chunks} groups={self.num_groups} threshold={self.store_threshold} "
                f"ops={self.num_ops} seed={self.seed}")


@dataclass
class OffloadCheckResult:
    scenario: OffloadScenario
    steps: int = 0  # calls compared
    calls: dict[str, int] = field(default_factory=dict)  # calls by name
    refused_stores: int = 0
    evictions: int = 0
    difference: str | None = None  # the first call whose answer or state differs
    most_reused: int = 0  # ARC: the most chunks t2 held at once (reuse was exercised)
    highest_target: float = 0.0  # ARC: the highest t1 target (ghost hits were exercised)


def vllm_manager_modules():
    from kvsim.conformance.vllm_import import import_vllm

    return import_vllm("vllm.v1.kv_offload.cpu.manager"), import_vllm("vllm.v1.kv_offload.base")


def _state(manager, vllm: bool) -> dict:
    """The tier's observable state: resident chunks' (slot, ref count), counters, and ARC's lists."""
    policy = manager._policy if vllm else manager.policy
    if hasattr(policy, "t1"):
        resident = {**policy.t1, **policy.t2}
        extra = {"t1": list(policy.t1), "t2": list(policy.t2), "b1": list(policy.b1), "b2": list(policy.b2),
                 "target_t1_size": policy.target_t1_size}
    else:
        resident, extra = policy.chunks, {}
    if vllm:
        counters = (manager._num_evictable_cache_chunks, manager._num_write_pending_chunks, manager._get_num_free_chunks())
    else:
        counters = (manager.num_evictable, manager.num_write_pending, manager.num_free_chunks)
    return {"resident": {k: (c.chunk_id, c.ref_cnt) for k, c in resident.items()}, "counters": counters, **extra}


class _Pair:
    """One request on both sides: its keys in chunk order per group, and its two contexts."""

    def __init__(self, req_id: str, hashes: list[bytes], num_groups: int, base) -> None:
        self.keys = [[make_offload_key(h, g) for h in hashes] for g in range(num_groups)]
        self.ours, self.theirs = ReqContext(req_id), base.ReqContext(req_id=req_id)
        for group in self.keys:
            for i, key in enumerate(group):
                self.ours.set_offload_key_position(key, (i + 1) * CHUNK_TOKENS)
                self.theirs.set_offload_key_position(key, (i + 1) * CHUNK_TOKENS)
        self.finished = False
        self.busy = False  # a load in flight (the connector issues no other job for it until it completes)


def run_scenario(s: OffloadScenario) -> OffloadCheckResult:
    """Drive both managers with the scenario's calls; stop at the first difference."""
    vm, base = vllm_manager_modules()
    theirs = vm.CPUOffloadingManager(num_chunks=s.num_chunks, cache_policy=s.policy, enable_events=False,
                                     store_threshold=s.store_threshold)
    ours = CPUOffloadingManager(s.num_chunks, s.policy, store_threshold=s.store_threshold)
    rng = random.Random(s.seed)
    result = OffloadCheckResult(s)
    prefixes = [[rng.randbytes(8) for _ in range(rng.randint(2, 8))] for _ in range(s.num_prefixes)]
    live: list[_Pair] = []
    loads: list[tuple[_Pair, list[bytes]]] = []
    stores: list[tuple[_Pair, list[bytes]]] = []
    next_id = 0

    def same(name: str, a, b, detail: str) -> bool:
        result.steps += 1
        result.calls[name] = result.calls.get(name, 0) + 1
        if a != b:
            result.difference = f"call {result.steps} {name}({detail}): kvsim {a!r}, vLLM {b!r}"
            return False
        sa, sb = _state(ours, False), _state(theirs, True)
        if sa != sb:
            diff = {k: (sa[k], sb[k]) for k in sa if sa[k] != sb[k]}
            result.difference = f"after call {result.steps} {name}({detail}): state differs {diff}"
            return False
        if "t2" in sa:
            result.most_reused = max(result.most_reused, len(sa["t2"]))
            result.highest_target = max(result.highest_target, sa["target_t1_size"])
        return True

    for _ in range(s.num_ops):
        op = rng.choices(["new", "lookup", "load", "complete_load", "store", "complete_store", "touch", "finish", "reset"],
                         weights=[3, 3, 3, 3, 5, 4, 1, 2, 0.05])[0]
        active = [p for p in live if not p.finished]
        if op == "new" or not live:
            if len(active) >= s.max_live:
                continue
            hashes = list(rng.choice(prefixes)) + [rng.randbytes(8) for _ in range(rng.randint(0, 6))]
            pair = _Pair(f"r{next_id}", hashes, s.num_groups, base)
            next_id += 1
            live.append(pair)
            ours.on_new_request(pair.ours)
            theirs.on_new_request(pair.theirs)
            if not same("on_new_request", None, None, pair.ours.req_id):
                return result
        elif op == "lookup":
            pair = rng.choice(live)
            key = rng.choice(rng.choice(pair.keys))
            if not same("lookup", ours.lookup(key, pair.ours).name, theirs.lookup(key, pair.theirs).name, pair.ours.req_id):
                return result
        elif op == "load" and active:
            pair = rng.choice(active)
            if pair.busy:
                continue
            # the longest ready run from a random chunk, in every group (the connector loads a prefix run)
            start = rng.randrange(len(pair.keys[0]))
            end = start
            while end < len(pair.keys[0]) and all(ours.lookup(g[end], pair.ours).name == "HIT" for g in pair.keys):
                end += 1
            keys = [g[i] for g in pair.keys for i in range(start, end)]
            if not keys:
                continue
            a = ours.prepare_load(keys, pair.ours)
            b = list(theirs.prepare_load(keys, pair.theirs).block_ids)
            if not same("prepare_load", a, [int(x) for x in b], f"{pair.ours.req_id}, {len(keys)} keys"):
                return result
            loads.append((pair, keys))
            pair.busy = True
        elif op == "complete_load" and loads:
            pair, keys = loads.pop(rng.randrange(len(loads)))
            ours.complete_load(keys, pair.ours)
            theirs.complete_load(keys, pair.theirs)
            pair.busy = False
            if not same("complete_load", None, None, f"{pair.ours.req_id}, {len(keys)} keys"):
                return result
        elif op == "store" and active:
            pair = rng.choice(active)
            n = len(pair.keys[0])
            lo = rng.randrange(n)
            hi = rng.randint(lo + 1, n)
            keys = [g[i] for g in pair.keys for i in range(lo, hi)]  # group by group, chunk order, as the connector offers
            a = ours.prepare_store(keys, pair.ours)
            b = theirs.prepare_store(keys, pair.theirs)
            ta = None if a is None else (a.keys_to_store, a.chunk_ids, a.evicted_keys)
            tb = None if b is None else (list(b.keys_to_store), [int(x) for x in b.store_spec.block_ids], list(b.evicted_keys))
            if not same("prepare_store", ta, tb, f"{pair.ours.req_id}, {len(keys)} keys"):
                return result
            result.refused_stores += a is None
            if a is not None:
                result.evictions += len(a.evicted_keys)
                if a.keys_to_store:
                    stores.append((pair, list(a.keys_to_store)))
        elif op == "complete_store" and stores:
            pair, keys = stores.pop(rng.randrange(len(stores)))
            ok = rng.random() < 0.9
            ours.complete_store(keys, pair.ours, success=ok)
            theirs.complete_store(keys, pair.theirs, success=ok)
            if not same("complete_store", None, None, f"{pair.ours.req_id}, {len(keys)} keys, success={ok}"):
                return result
        elif op == "touch":
            pair = rng.choice(live)
            keys = rng.sample(pair.keys[0], rng.randint(1, len(pair.keys[0])))
            ours.touch(keys, pair.ours)
            theirs.touch(keys, pair.theirs)
            if not same("touch", None, None, f"{pair.ours.req_id}, {len(keys)} keys"):
                return result
        elif op == "finish" and active:
            pair = rng.choice(active)
            pair.finished = True
            ours.on_request_finished(pair.ours)
            theirs.on_request_finished(pair.theirs)
            if not same("on_request_finished", None, None, pair.ours.req_id):
                return result
            if len(live) > 3 * s.max_live:
                live = [p for p in live if not p.finished or p.busy or any(p is q for q, _ in stores)]
        elif op == "reset":
            ours.reset_cache()
            theirs.reset_cache()
            loads.clear()  # vLLM's connector drops every pre-reset job's completion (_stale_job_threshold)
            stores.clear()
            for p in live:
                p.busy = False
            if not same("reset_cache", None, None, ""):
                return result
    return result


def default_scenarios() -> list[OffloadScenario]:
    """Both policies, tight and roomy tiers, one and three groups, the store threshold on and off, many seeds."""
    out = []
    for policy in ("lru", "arc"):
        for seed in range(8):
            out.append(OffloadScenario(policy=policy, num_chunks=[8, 24, 64][seed % 3], num_groups=1 + 2 * (seed % 2),
                                       store_threshold=2 if seed % 4 == 3 else 0, seed=seed))
    return out


def main(argv: list[str] | None = None) -> int:
    failed = 0
    for scenario in default_scenarios():
        r = run_scenario(scenario)
        failed += r.difference is not None
        print(f"{'DIFF' if r.difference else 'ok  '}  {scenario.label}: {r.steps} calls equal, "
              f"{r.refused_stores} stores refused, {r.evictions} evictions"
              + (f", t2 up to {r.most_reused}, t1 target up to {r.highest_target:g}" if scenario.policy == "arc" else "") + (f"\n      {r.difference}" if r.difference else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
