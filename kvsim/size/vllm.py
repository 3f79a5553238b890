"""vLLM 0.33.0's start-up arithmetic: the hybrid attention+mamba block-size raise, KV cache groups, num_gpu_blocks
and the line "GPU KV cache size: N tokens, Maximum concurrency for L tokens per request: X.XXx".

Each step names the vLLM function it follows; pure integers, no torch. `kvsim.conformance.size_check` calls
those functions themselves and compares.

The settings are `vllm_settings`, the per-layer specs `vllm_layers`, the hybrid raise `vllm_hybrid`, the groups
and capacity line `vllm_capacity`; this module unifies pages and forms the groups (`vllm_startup`).
"""

from __future__ import annotations

from typing import Callable

from kvsim.errors import KvsimError
from kvsim.size.kv_cache_spec import PoolSpec, VllmGroup
from kvsim.size.sizing import cdiv, positive_int
from kvsim.size.vllm_capacity import VllmStartup
from kvsim.size.vllm_hybrid import MLA_HYBRID_ALIGNMENT, HybridPages, hybrid_pages
from kvsim.size.vllm_layers import VllmLayer, vllm_layers
from kvsim.size.vllm_settings import DEFAULT_KERNEL_BLOCK_SIZE, MAMBA_CACHE_MODES, VLLM_VERSION, VllmSettings

__all__ = [
    "DEFAULT_KERNEL_BLOCK_SIZE",
    "MAMBA_CACHE_MODES",
    "MLA_HYBRID_ALIGNMENT",
    "VLLM_VERSION",
    "HybridPages",
    "VllmGroup",
    "VllmLayer",
    "VllmSettings",
    "VllmStartup",
    "hybrid_pages",
    "largest_starting_max_model_len",
    "vllm_layers",
    "vllm_startup",
]

# vLLM pads layer groups to the largest type's layer count when it is within this factor of the smallest's.
_GROUP_SIZE_SLACK = 1.5


# Blocks one request of max_model_len tokens holds in a group of this kind: cdiv(the spec's
# `max_memory_usage_bytes`, its `page_size_bytes`) in vllm/v1/kv_cache_interface.py. New kinds slot in here.
BlocksPerRequest = Callable[[VllmLayer, int, int, VllmSettings], int]
_BLOCKS_PER_REQUEST: dict[str, BlocksPerRequest] = {
    # FullAttentionSpec / MLAAttentionSpec: every token
    "full": lambda layer, block_size, max_len, s: cdiv(max_len, block_size),
    "mla": lambda layer, block_size, max_len, s: cdiv(max_len, block_size),
    # SlidingWindowSpec.max_admission_blocks_per_request: the window, the in-flight tokens, +1 for a window
    # that does not start on a block boundary
    "sliding": lambda layer, block_size, max_len, s: cdiv(min(layer.window - 1 + s.max_in_flight_tokens, max_len), block_size) + 1,
    # ChunkedLocalAttentionSpec.max_admission_blocks_per_request: one chunk and the in-flight tokens
    "chunked": lambda layer, block_size, max_len, s: cdiv(min(layer.window + s.max_in_flight_tokens, max_len), block_size),
    # MambaSpec: one state (none); the running and the cached state, and a checkpoint block (align)
    "state": lambda layer, block_size, max_len, s: s.mamba_state_blocks,
}


def _kv_cache_bytes_per_block(group_pages: list[list[int]]) -> int:
    """One block id: a page of each layer of the largest group, the layers' pages summed
    (`_get_kv_cache_bytes_per_block`; pages are padded to one size, so it is the widest group's layers x page,
    except a single group of one uniform type, whose layers' pages differ)."""
    return max(sum(pages) for pages in group_pages)


def _unified_page(layer: VllmLayer, block_size: int, hybrid: HybridPages | None) -> int:
    """One block of this layer before unifying: an attention page, a state page padded to the hybrid page, or
    (attention-free models, where the platform aligns nothing) the state itself."""
    if layer.kind != "state":
        return layer.bytes_per_token * block_size
    return hybrid.page_bytes if hybrid is not None else layer.state_bytes


def _layer_pages(layers, block_size: int, hybrid: HybridPages | None) -> list[tuple[int, int]] | None:
    """(block_size, page bytes) per layer after `unify_kv_cache_spec_page_size`; None where vLLM cannot unify.

    A smaller attention page whose size divides the largest gets a proportionally larger block; a state page
    or a non-MLA attention page that does not divide it is padded; an MLA page that does not divide it fails.
    """
    raw = [(block_size, _unified_page(layer, block_size, hybrid)) for layer in layers]
    largest = max(page for _, page in raw)
    out = []
    for layer, (bs, page) in zip(layers, raw):
        if page == largest or layer.kind == "state":
            out.append((bs, largest))
        elif largest % page == 0:
            out.append((bs * (largest // page), largest))
        elif layer.kind != "mla":
            out.append((bs, largest))  # padded page
        else:
            return None
    return out


def _uniform_type(layer: VllmLayer) -> tuple:
    """Layers of one uniform type need the same token slots a request (`UniformTypeKVCacheSpecs.is_uniform_type`):
    MLA is a full attention spec; windows and chunks must be equal."""
    return ("full",) if layer.kind in ("full", "mla") else (layer.kind, layer.window)


def _uniform_type_startup(
    layers: tuple[VllmLayer, ...], budget_bytes: int, max_model_len: int, block_size: int, settings: VllmSettings
) -> VllmStartup | None:
    """One group of every layer when all are one uniform type with unequal pages, or None.

    `get_kv_cache_groups` checks this before unifying page sizes: full layers of different KV heads (DeciLM),
    a sparse MLA layer beside its indexer's key cache (DeepSeek-V3.2), ... share one block table, and one
    block id spans a page of every layer: bytes_per_block is the sum of their pages.
    """
    kinds = {_uniform_type(layer) for layer in layers}
    if len(kinds) != 1 or layers[0].kind == "state" or len(set(layers)) == 1:
        return None  # mixed types, states, or all layers equal (the bucket path gives the same one group)
    first = layers[0]
    blocks = _BLOCKS_PER_REQUEST[first.kind](first, block_size, max_model_len, settings)
    # the group's spec as the scheduler sees it: the first layer's (`generate_scheduler_kv_cache_config`)
    page = first.bytes_per_token * block_size
    group = VllmGroup(first.kind, len(layers), block_size, page, page, blocks)
    return VllmStartup(
        pool=PoolSpec((group,), len(layers), _kv_cache_bytes_per_block([[layer.bytes_per_token * block_size for layer in layers]])),
        budget_bytes=budget_bytes,
        max_model_len=max_model_len,
        settings=settings,
    )


def vllm_startup(
    layers: tuple[VllmLayer, ...],
    budget_bytes: int,
    max_model_len: int,
    block_size: int = 16,
    settings: VllmSettings = VllmSettings(),
) -> VllmStartup | None:
    """vLLM's groups, num_gpu_blocks and start-up line (vllm/v1/core/kv_cache_planning.py), or None where not followed.

    Equal layers form a bucket; each bucket splits into groups of `group_size` layers (the smallest bucket's
    count, or the largest's when within 1.5x), the last one padded (`_get_kv_cache_groups_uniform_page_size`).
    Every page is equal, so the pool is group_size tensors and one block id spans one layer of every group:

        qwen3-next-80b-a3b, 12 full + 36 state layers, group_size 12 -> 1 full group + 3 state groups

        tensor 0  [ full.0  | state.0  | state.3  | state.6  ]   each tensor: num_blocks pages of
        tensor 1  [ full.1  | state.1  | state.4  | state.7  ]   page_bytes; a block id is one page in
          ...                                                     every tensor, owned by one group
        tensor 11 [ full.11 | state.32 | state.33 | state.35 ]

        num_blocks  = budget // (12 x page)                     (`get_kv_cache_configs`, `num_gpu_blocks`)
        concurrency = num_blocks / (cdiv(len, block_size) + 3 x 1)   (a state group: 1 block a request)
        tokens      = int(concurrency x len)                    (`get_kv_cache_capacity`)

    An attention-free model (Mamba, Mamba-2) has no attention backend, so the platform raises nothing
    (`Platform.check_and_update_config` returns before `_align_hybrid_block_size`): each state page is the
    state itself, unpadded, and its block size is `mamba_block_size` (max_model_len; align mode: block_size).
    """
    positive_int(max_model_len, "--context")
    positive_int(block_size, "--block-size")
    if not layers:
        return None
    uniform = _uniform_type_startup(layers, budget_bytes, max_model_len, block_size, settings)
    if uniform is not None:
        return uniform
    hybrid = hybrid_pages(layers, block_size, settings)  # None for attention-only and attention-free models
    if hybrid is not None:
        block_size = hybrid.block_size
    pages = _layer_pages(layers, block_size, hybrid)
    if pages is None:
        return None
    buckets: dict[tuple, list[int]] = {}  # equal specs, first-seen order
    for i, (layer, (bs, page)) in enumerate(zip(layers, pages)):
        buckets.setdefault((layer, bs, page), []).append(i)
    counts = [len(members) for members in buckets.values()]
    group_size = min(counts)
    if max(counts) < group_size * _GROUP_SIZE_SLACK:
        group_size = max(counts)
    groups, group_pages = [], []
    for (layer, bs, page), members in buckets.items():
        if layer.kind not in _BLOCKS_PER_REQUEST:
            raise KvsimError(f"vLLM {VLLM_VERSION}'s KV cache arithmetic for {layer.kind!r} layers is not modelled", field="layers")
        n = cdiv(len(members), group_size)
        if layer.kind == "state":  # mamba_block_size: max_model_len without prefix caching, the attention block with
            bs = bs if settings.mamba_cache_mode == "align" else max_model_len
        blocks = _BLOCKS_PER_REQUEST[layer.kind](layer, bs, max_model_len, settings)
        for i in range(n):
            size = len(members[i::n])  # vLLM deals layers round-robin: layers[i::num_groups]
            group_pages.append([page] * size)
            layer_page = layer.state_bytes if layer.kind == "state" else layer.bytes_per_token * bs
            groups.append(VllmGroup(layer.kind, size, bs, page, layer_page, blocks, layer.window))
    return VllmStartup(
        pool=PoolSpec(tuple(groups), group_size, _kv_cache_bytes_per_block(group_pages)),
        budget_bytes=budget_bytes,
        max_model_len=max_model_len,
        settings=settings,
        hybrid=hybrid,
    )


def largest_starting_max_model_len(
    layers: tuple[VllmLayer, ...], budget_bytes: int, max_model_len: int, block_size: int, settings: VllmSettings
) -> int | None:
    """The largest max_model_len below `max_model_len` with which vLLM starts on `budget_bytes` (the estimate its
    start-up error gives); None where not even one token fits."""
    lo, hi = 0, max_model_len  # vLLM starts at lo (0: not even one token), not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        v = vllm_startup(layers, budget_bytes, mid, block_size, settings)
        if v is not None and v.starts:
            lo = mid
        else:
            hi = mid
    return lo or None
