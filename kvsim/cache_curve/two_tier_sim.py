"""The two tiers chunk by chunk: a GPU LRU of blocks and the CPU tier's manager called as vLLM's
OffloadingConnector calls it, one request at a time. The reference `two_tier` is tested against (and the
pass for policies other than LRU)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import numpy as np

from kvsim.offload.manager import CPUOffloadingManager
from kvsim.offload.request_context import ReqContext, make_offload_key


def unit_block_keys(keys: np.ndarray, counts: np.ndarray, offsets: np.ndarray, i: int) -> list[bytes]:
    """Request i's full blocks as keys: block j of unit k is (k, j) (kvsim.cache_curve.blocks' units)."""
    lo, hi = int(offsets[i]), int(offsets[i + 1])
    return [f"{k}:{j}".encode() for k, n in zip(keys[lo:hi].tolist(), counts[lo:hi].tolist()) for j in range(n)]


def simulate_two_tiers(gpu_units, cpu_units, prompt: np.ndarray, *, block_size: int, cpu_block_size: int,
                       capacity_blocks: int, cpu_chunks: int, policy: str = "lru",
                       manager_factory: Callable | None = None, context_factory: Callable = ReqContext,
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(GPU hit blocks, CPU hit tokens) of each request, (r,) int64 each.

    GPU: an LRU of `capacity_blocks` blocks; a request hits its longest cached prefix of (prompt - 1) // block_size
    blocks, then uses every full prompt block, last first. CPU: `manager_factory(cpu_chunks)` (kvsim's
    CPUOffloadingManager with `policy` by default; vLLM's own fits too) called as the connector calls it
    (`get_num_new_matched_tokens` -> `_lookup_complete_chunks`, `update_state_after_alloc` -> prepare_load,
    the load done, `_build_store_jobs` -> prepare_store of the prompt chunks from `next_stored_chunk_idx`, the
    store done, `on_request_finished`).
    """
    manager = manager_factory(cpu_chunks) if manager_factory else CPUOffloadingManager(cpu_chunks, policy)
    gpu: OrderedDict[bytes, None] = OrderedDict()
    b, t = block_size, cpu_block_size
    n_req = len(prompt)
    gpu_hits = np.zeros(n_req, dtype=np.int64)
    cpu_hits = np.zeros(n_req, dtype=np.int64)
    for i in range(n_req):
        p = int(prompt[i])
        blocks = unit_block_keys(*gpu_units, i)
        g = 0
        while g < (p - 1) // b and blocks[g] in gpu:
            g += 1
        chunks = [make_offload_key(k, 0) for k in unit_block_keys(*cpu_units, i)]
        ctx = context_factory(req_id=f"r{i}")
        for j, key in enumerate(chunks):
            ctx.set_offload_key_position(key, (j + 1) * t)
        manager.on_new_request(ctx)
        computed = g * b
        start = computed // t
        hits = 0
        if len(chunks) * t - computed >= t:
            while start + hits < len(chunks) and manager.lookup(chunks[start + hits], ctx).name == "HIT":
                hits += 1
            if t * (start + hits) - computed < t:
                hits = 0
        next_stored = 0
        if hits:
            loaded = chunks[start:start + hits]
            manager.prepare_load(loaded, ctx)
            manager.complete_load(loaded, ctx)
            next_stored = start + hits
            cpu_hits[i] = min(t * (start + hits) - computed, p - 1 - computed)
        out = manager.prepare_store(chunks[next_stored:], ctx)
        if out is not None and out.keys_to_store:
            manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        gpu_hits[i] = g
        for key in reversed(blocks):
            gpu[key] = None
            gpu.move_to_end(key)
        while len(gpu) > capacity_blocks:
            gpu.popitem(last=False)
    return gpu_hits, cpu_hits
