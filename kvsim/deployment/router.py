"""The router's policies: which replica an arriving request goes to, read from the replicas as they are at its
arrival (each engine advanced through every row scheduled before it).

`random` and `round-robin` read nothing; `least-loaded` reads waiting + running requests or KV usage (what
llm-d's queue and kv-cache-utilization scorers read from the engines' metrics); the prefix policies weigh a
replica's cached prefix of the request against its load, with the overlap read from the router's own LRU of
block hashes (`prefix-approx`, as llm-d's approximate prefix scorer and Dynamo's router without KV events keep
it) or from the replica's true cache (`prefix-precise`, what KV events tell llm-d's precise scorer and
Dynamo's KvIndexer). The cost: Dynamo's KvRouter (`overlap_score_weight` x new prefill blocks + active
blocks, the lowest wins) or llm-d's weighted scorers (the highest sum wins); see docs/deployment.md.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvsim.deployment.prefix_hashes import leading_hits
from kvsim.replay.sched.scheduler import Scheduler
from kvsim.size.vllm_capacity import num_gpu_blocks
from kvsim.workload.spec import Router


class ReplicaView:
    """What a router reads of one replica: its scheduler's queues and its allocator's blocks, and the requests
    routed to it that its engine takes in at its next step (`pending`: their prompt lengths, which vLLM's
    engine core would already hold in its waiting queue)."""

    def __init__(self, scheduler: Scheduler, block_size: int, pending=(), prompt_tokens=None):
        self.scheduler = scheduler
        self.pending = pending  # request indices routed here, not yet in the scheduler
        self.prompt_tokens = prompt_tokens  # (num_requests,) prompt lengths, for the pending ones
        self.allocator = scheduler.allocator
        self.block_size = block_size
        # block 0 is the null block; a flat allocator's "blocks" are its budget in the paged pool's blocks
        self.num_usable_blocks = max(num_gpu_blocks(self.allocator.spec, self.allocator.budget_bytes) - 1, 1)

    @property
    def num_requests(self) -> int:
        """Waiting + running (+ swapped) requests: llm-d's queue scorer's and least-loaded's load."""
        s = self.scheduler
        return len(s.waiting) + len(s.running) + len(s.swapped) + len(self.pending)

    @property
    def num_waiting(self) -> int:
        """Waiting (+ swapped, + routed but not yet taken in) requests: llm-d's queue scorer's WaitingQueueSize."""
        s = self.scheduler
        return len(s.waiting) + len(s.swapped) + len(self.pending)

    @property
    def num_used_blocks(self) -> int:
        return round(self.allocator.kv_cache_usage() * self.num_usable_blocks)

    @property
    def kv_usage(self) -> float:
        """Fraction of the pool's blocks held by requests (vLLM's kv_cache_usage metric)."""
        return self.num_used_blocks / self.num_usable_blocks

    @property
    def active_blocks(self) -> int:
        """Dynamo's decode blocks: blocks held now plus those the waiting requests' prompts will take."""
        bs = self.block_size
        waiting = sum(-(-seq.num_prompt_tokens // bs) for seq in self.scheduler.waiting)
        pending = sum(-(-int(self.prompt_tokens[i]) // bs) for i in self.pending) if len(self.pending) else 0
        return self.num_used_blocks + waiting + pending

    def cached(self):
        """The replica's cached prefix hashes (empty without prefix caching)."""
        return self.allocator.cached_block_hashes()


class Policy:
    """Picks a replica for request `index` (its prompt block hashes, when the policy reads them)."""

    needs_hashes = False

    def __init__(self, settings: Router, replicas: list[ReplicaView]):
        self.settings = settings
        self.replicas = replicas
        self.rng = np.random.default_rng(settings.seed)

    def pick(self, index: int, num_prompt_tokens: int, hashes: list[int] | None) -> int:
        raise NotImplementedError

    def _best(self, scores: list[float], lowest: bool) -> int:
        """The best score's replica; ties broken at random (seeded), as llm-d's max-score picker does."""
        best = min(scores) if lowest else max(scores)
        tied = [k for k, s in enumerate(scores) if s == best]
        return tied[0] if len(tied) == 1 else int(tied[self.rng.integers(len(tied))])


class RandomPolicy(Policy):
    """A uniformly random replica (seeded): a plain Kubernetes service in front of the pods."""

    def pick(self, index, num_prompt_tokens, hashes):
        return int(self.rng.integers(len(self.replicas)))


class RoundRobinPolicy(Policy):
    """Replicas in turn."""

    def pick(self, index, num_prompt_tokens, hashes):
        return index % len(self.replicas)


class LeastLoadedPolicy(Policy):
    """The replica with the fewest waiting + running requests (`load: requests`) or the lowest KV usage."""

    def pick(self, index, num_prompt_tokens, hashes):
        if self.settings.load == "kv_usage":
            return self._best([r.kv_usage for r in self.replicas], lowest=True)
        return self._best([r.num_requests for r in self.replicas], lowest=True)


class PrefixPolicy(Policy):
    """Overlap against load: Dynamo's KvRouter cost or llm-d's weighted scorers (`settings.scorer`)."""

    needs_hashes = True

    def overlaps(self, hashes: list[int], max_blocks: int) -> list[int]:
        raise NotImplementedError

    def pick(self, index, num_prompt_tokens, hashes):
        bs = self.replicas[0].block_size
        max_blocks = (num_prompt_tokens - 1) // bs  # vLLM computes the prompt's last token whatever is cached
        overlap = self.overlaps(hashes, max_blocks)
        s = self.settings
        if s.scorer == "dynamo":  # logit = overlap_score_weight * prefill blocks + decode blocks; the lowest wins
            prompt_blocks = -(-num_prompt_tokens // bs)
            costs = [s.overlap_score_weight * (prompt_blocks - o) + r.active_blocks for o, r in zip(overlap, self.replicas)]
            k = self._best(costs, lowest=True)
        else:  # llm-d: prefix-cache scorer (matched blocks / blocks), kv-cache-utilization (1 - usage), queue (min-max)
            queues = [r.num_waiting for r in self.replicas]
            lo, hi = min(queues), max(queues)
            total = max(len(hashes), 1)
            scores = [s.prefix_weight * o / total + s.kv_usage_weight * (1 - r.kv_usage)
                      + s.queue_weight * ((hi - q) / (hi - lo) if hi > lo else 1.0)
                      for o, r, q in zip(overlap, self.replicas, queues)]  # fmt: skip
            k = self._best(scores, lowest=False)
        self.routed(k, hashes)
        return k

    def routed(self, replica: int, hashes: list[int]) -> None:
        """What the router remembers of a request it sent to `replica` (the approximate index only)."""


class PrefixPrecisePolicy(PrefixPolicy):
    """Overlap from each replica's true cache: its prefix-hash table as the request arrives."""

    def overlaps(self, hashes, max_blocks):
        return [leading_hits(hashes, r.cached(), max_blocks) for r in self.replicas]


class PrefixApproxPolicy(PrefixPolicy):
    """Overlap from the router's own LRU of the block hashes it sent each replica (`approx_blocks` per replica,
    default the replica's pool): it never sees evictions, so it can claim blocks the replica has dropped."""

    def __init__(self, settings: Router, replicas: list[ReplicaView]):
        super().__init__(settings, replicas)
        self.lrus: list[OrderedDict] = [OrderedDict() for _ in replicas]
        self.capacity = [settings.approx_blocks or r.num_usable_blocks for r in replicas]

    def overlaps(self, hashes, max_blocks):
        return [leading_hits(hashes, lru, max_blocks) for lru in self.lrus]

    def routed(self, replica, hashes):
        lru = self.lrus[replica]
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity[replica]:
            lru.popitem(last=False)


POLICIES = {
    "random": RandomPolicy,
    "round-robin": RoundRobinPolicy,
    "least-loaded": LeastLoadedPolicy,
    "prefix-approx": PrefixApproxPolicy,
    "prefix-precise": PrefixPrecisePolicy,
}


def make_policy(settings: Router, replicas: list[ReplicaView]) -> Policy:
    """The policy `settings.policy` names (validated where the workload was read)."""
    return POLICIES[settings.policy](settings, replicas)
