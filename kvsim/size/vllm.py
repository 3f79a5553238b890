"""vLLM 0.33.0's start-up arithmetic: the hybrid attention+mamba block-size raise, KV cache groups, num_gpu_blocks
and the line "GPU KV cache size: N tokens, Maximum concurrency for L tokens per request: X.XXx".

Each step names the vLLM function it follows; pure integers, no torch. `kvsim.conformance.size_check` calls
those functions themselves and compares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from kvsim.size.kv_cache_spec import KVCacheSpec, PoolGroupSpec, PoolSpec
from kvsim.errors import KvsimError
from kvsim.models.spec import LayerKind, ModelSpec
from kvsim.size.sizing import cdiv, positive_int

VLLM_VERSION = "0.33.0"
# The smallest kernel block of vLLM's default attention backends on Hopper/Ampere: FlashAttention supports
# any multiple of 16, FlashInfer 16/32/64. vLLM aligns the raised hybrid block size to it.
DEFAULT_KERNEL_BLOCK_SIZE = 16
# MLA decode kernels need the hybrid block in multiples of 128 (`Platform._align_hybrid_block_size`).
MLA_HYBRID_ALIGNMENT = 128
# vLLM's `mamba_cache_mode`: "none" (prefix caching off), "align" (prefix caching on: `vllm serve`'s default
# for hybrid models in 0.33, see `MambaModelConfig.verify_and_update_config`).
MAMBA_CACHE_MODES = ("none", "align")
# vLLM pads layer groups to the largest type's layer count when it is within this factor of the smallest's.
_GROUP_SIZE_SLACK = 1.5


@dataclass(frozen=True)
class VllmSettings:
    """The vLLM engine settings its KV cache sizing depends on (`vllm serve`'s defaults)."""

    max_num_batched_tokens: int = 8192
    async_scheduling: bool = True  # on by default in 0.33; --no-async-scheduling turns it off
    kernel_block_size: int = DEFAULT_KERNEL_BLOCK_SIZE
    mamba_cache_mode: str = "none"
    # align mode only: the token alignment of the state checkpoints every state layer exports from inside a
    # prefill (`get_mamba_prefill_checkpoint_alignment`); 0 when some layer exports none. vLLM 0.33's gated
    # delta net layers export them with FlashInfer's GDN prefill (Hopper; Blackwell with CUDA 13): 64.
    mamba_checkpoint_alignment: int = 0

    def __post_init__(self) -> None:
        positive_int(self.max_num_batched_tokens, "--max-num-batched-tokens")
        positive_int(self.kernel_block_size, "--kernel-block-size")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise KvsimError(
                f"expected one of {', '.join(MAMBA_CACHE_MODES)}, got {self.mamba_cache_mode!r}", field="--mamba-cache-mode"
            )
        if self.mamba_checkpoint_alignment:
            positive_int(self.mamba_checkpoint_alignment, "--mamba-checkpoint-alignment")
            if self.mamba_cache_mode != "align":
                raise KvsimError("state checkpoints exist only with --mamba-cache-mode align", field="--mamba-checkpoint-alignment")

    @property
    def mamba_state_blocks(self) -> int:
        """`MambaSpec.max_memory_usage_bytes` in pages: the running state, in align mode the cached one too,
        and a prefill checkpoint block where the layers export checkpoints (no speculative blocks)."""
        if self.mamba_cache_mode != "align":
            return 1
        return 2 + (1 if self.mamba_checkpoint_alignment else 0)

    @property
    def max_concurrent_batches(self) -> int:
        """`VllmConfig.max_concurrent_batches` without pipeline parallelism: 2 batches overlap with async scheduling."""
        return 2 if self.async_scheduling else 1

    @property
    def max_in_flight_tokens(self) -> int:
        """`VllmConfig.max_in_flight_tokens`: tokens scheduled but not yet settled, which a window keeps alive."""
        return self.max_concurrent_batches * self.max_num_batched_tokens


@dataclass(frozen=True)
class VllmLayer:
    """One layer as vLLM's KV cache spec sees it, on one TP rank (equal layers share a group)."""

    kind: str  # "full", "mla", "sliding", "chunked" or "state": a key of _BLOCKS_PER_REQUEST
    bytes_per_token: int = 0  # per-token kinds: one token of this layer
    window: int | None = None  # sliding: the window; chunked: attention_chunk_size
    state_bytes: int = 0  # state: the whole state of one request, before padding


# kvsim's layer kinds (LayerKind values) as vLLM's KV cache spec kinds; None: the layer has no KV cache spec.
_VLLM_KIND: dict[str, str | None] = {
    "full": "full",  # FullAttentionSpec
    "mla": "mla",  # MLAAttentionSpec
    "sliding": "sliding",  # SlidingWindowSpec
    "chunked": "chunked",  # ChunkedLocalAttentionSpec (0.33 keeps the hybrid manager on for it by default)
    "linear-state": "state",  # MambaSpec
    "none": None,  # no cache (MLP-only layers, KV read from another layer)
}


def vllm_layers(model: ModelSpec, spec: KVCacheSpec, tp: int = 1) -> tuple[VllmLayer, ...]:
    """kvsim's layer list as vLLM's per-layer specs (the spec gives the dtypes kvsim sized with).

    A layer kind this table does not know, or one it cannot reproduce exactly (an MLA layer with a sparse
    indexer cache, state layers of different shapes in mixed dtypes), is a KvsimError: vLLM's arithmetic for
    it is not modelled, and no number is printed for it.
    """
    states = [layer for layer in model.layers if layer.kind == LayerKind.LINEAR_STATE]
    if states and any(layer.head_dim_v not in (0, layer.head_dim) for layer in model.layers):
        # `_align_hybrid_block_size` sizes the attention page from head_size alone (K and V equal)
        raise KvsimError(f"vLLM {VLLM_VERSION}'s hybrid block size with head_dim_v != head_dim is not modelled", field="layers")
    state_bytes = iter(_state_bytes_per_layer(states, spec.state_bytes_per_sequence, tp))
    out = []
    for layer in model.layers:
        kind = _VLLM_KIND.get(layer.kind.value, "?")
        if kind == "?":
            raise KvsimError(f"vLLM {VLLM_VERSION}'s KV cache arithmetic for {layer.kind.value!r} layers is not modelled", field="layers")
        if kind == "state":
            out.append(VllmLayer("state", state_bytes=next(state_bytes)))
        elif kind is not None:
            out.append(VllmLayer(kind, layer.elements_per_token(tp) * spec.dtype_bytes, window=layer.window))
        if layer.index_bytes:
            out.append(_indexer_layer(layer, spec))
    return tuple(out)


def _indexer_layer(layer, spec: KVCacheSpec) -> VllmLayer:
    """A sparse-attention indexer's key cache: its own layer in vLLM (`DeepseekV32IndexerCache`), an MLA spec of
    `index_bytes` uint8 a token. A quantized KV cache beside it is stored as vLLM's fp8_ds_mla (656 B a token,
    not the latent x 1 B kvsim sizes), so only a 2-byte KV dtype is followed."""
    if layer.kind != LayerKind.MLA or spec.dtype_bytes != 2:
        what = "an indexer beside a non-MLA layer" if layer.kind != LayerKind.MLA else f"sparse MLA with --kv-dtype {spec.dtype} (fp8_ds_mla)"
        raise KvsimError(f"vLLM {VLLM_VERSION}'s KV cache arithmetic for {what} is not modelled", field="layers")
    return VllmLayer("mla", layer.index_bytes)


def _state_bytes_per_layer(states: list, total: int, tp: int) -> list[int]:
    """Each state layer's bytes on one rank: equal layers share the spec's total; unequal ones need one dtype
    for every element (the total a whole multiple of the elements), else a KvsimError."""
    if not states:
        return []
    if len(set(states)) == 1 and total % len(states) == 0:
        return [total // len(states)] * len(states)
    elements = [layer.state_elements_per_rank(tp) for layer in states]
    if total % sum(elements):
        raise KvsimError(f"vLLM {VLLM_VERSION}'s arithmetic for unequal state layers in mixed dtypes is not modelled", field="layers")
    return [n * (total // sum(elements)) for n in elements]


@dataclass(frozen=True)
class HybridPages:
    """How vLLM puts constant state pages and per-token attention pages in one pool of equal pages.

    `Platform._align_hybrid_block_size`: vLLM raises the attention `block_size` to the smallest multiple of
    the alignment whose page (block_size x one attention layer's bytes per token) holds one layer's state,
    then pads the state page to exactly that page. The alignment is max(backend's smallest kernel block,
    the block size asked for), at least 128 for MLA models, and in align mode a multiple of the state layers'
    prefill checkpoint alignment.
    """

    requested_block_size: int  # --block-size (vLLM's default 16 when not given)
    kernel_block_size: int  # the backend's smallest kernel block
    alignment: int  # the unit the raise counts in
    block_size: int  # vLLM's block_size for this model, after the raise
    attention_bytes_per_token: int  # one token of one attention layer, this rank
    state_page_bytes: int  # one state layer's whole state (the largest), this rank, before padding
    mamba_cache_mode: str = "none"

    @property
    def raised(self) -> bool:
        return self.block_size != self.requested_block_size

    @property
    def page_bytes(self) -> int:
        """One block of one layer: the attention page, and the padded state page."""
        return self.block_size * self.attention_bytes_per_token

    @property
    def padding_pct(self) -> float:
        """vLLM's log line: 'Padding mamba page size by X.XX%'."""
        return 100 * (self.page_bytes - self.state_page_bytes) / self.state_page_bytes


def hybrid_pages(layers: tuple[VllmLayer, ...], block_size: int, settings: VllmSettings = VllmSettings()) -> HybridPages | None:
    """vLLM's raised block size and padded state page; None without both state and per-token layers.

    State layers of different sizes: the largest sets the raise (vLLM's `get_mamba_specs_from_config`
    models) and every state page is padded to the attention page.
    """
    positive_int(block_size, "--block-size")
    states = [layer.state_bytes for layer in layers if layer.kind == "state"]
    attention = [layer for layer in layers if layer.kind != "state"]
    if not states or not attention:
        return None
    state_page = max(states)
    per_token = attention[0].bytes_per_token  # vLLM: the model's head size and KV heads, i.e. the first layer's
    align = max(settings.kernel_block_size, block_size)
    if any(layer.kind == "mla" for layer in attention):
        align = max(align, MLA_HYBRID_ALIGNMENT)
    if settings.mamba_cache_mode == "align" and settings.mamba_checkpoint_alignment:
        align = math.lcm(align, settings.mamba_checkpoint_alignment)
    raised = align * cdiv(state_page, align * per_token)
    raised = settings.kernel_block_size * cdiv(raised, settings.kernel_block_size)  # every backend's kernel block
    return HybridPages(
        requested_block_size=block_size,
        kernel_block_size=settings.kernel_block_size,
        alignment=align,
        block_size=max(block_size, raised),  # vLLM only ever raises block_size
        attention_bytes_per_token=per_token,
        state_page_bytes=state_page,
        mamba_cache_mode=settings.mamba_cache_mode,
    )


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


@dataclass(frozen=True)
class VllmGroup:
    """One of vLLM's KV cache groups: layers of one kind sharing a block table."""

    kind: str
    num_layers: int  # real layers; a group with fewer than group_size holds padding
    block_size: int  # tokens per block (a state group's: mamba_block_size)
    page_bytes: int  # one block of one layer (padded)
    blocks_per_request: int  # a request of max_model_len tokens
    window: int | None = None  # sliding: the window; chunked: the chunk
    layer_page_bytes: int = 0  # one block of one layer before padding (a state layer: its state)


@dataclass(frozen=True)
class VllmStartup:
    """vLLM's KV cache config for a model and budget, and the line it logs at start-up."""

    groups: tuple[VllmGroup, ...]
    group_size: int  # layers per group (the pool: group_size tensors, one block id spans each group)
    bytes_per_block: int  # one block id across a group's layers: num_blocks = budget // bytes_per_block
    num_blocks: int  # num_gpu_blocks (the null block included)
    budget_bytes: int
    max_model_len: int
    settings: VllmSettings
    hybrid: HybridPages | None = None

    @property
    def block_size(self) -> int:
        """`cache_config.block_size` after start-up: the smallest group block size."""
        return min(g.block_size for g in self.groups)

    @property
    def page_bytes(self) -> int:
        return self.groups[0].page_bytes

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request of max_model_len tokens needs, summed over groups (they share one pool)."""
        return sum(g.blocks_per_request for g in self.groups)

    @property
    def concurrency(self) -> float:
        """`get_max_concurrency_for_kv_cache_config`: 'Maximum concurrency for L tokens per request: X.XXx'."""
        return self.num_blocks / self.blocks_per_request

    @property
    def tokens(self) -> int:
        """`get_kv_cache_capacity`: 'GPU KV cache size: N tokens' = int(concurrency x max_model_len)."""
        return int(self.concurrency * self.max_model_len)

    @property
    def starts(self) -> bool:
        """`_check_enough_kv_cache_memory`: one request of max_model_len fits beside the null block, else vLLM refuses to start."""
        return self.bytes_per_block * self.blocks_per_request <= self.budget_bytes - self.bytes_per_block


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
    bytes_per_block = sum(layer.bytes_per_token * block_size for layer in layers)
    # the group's spec as the scheduler sees it: the first layer's (`generate_scheduler_kv_cache_config`)
    group = VllmGroup(first.kind, len(layers), block_size, first.bytes_per_token * block_size, blocks)
    return VllmStartup(
        groups=(group,),
        group_size=len(layers),
        bytes_per_block=bytes_per_block,
        num_blocks=budget_bytes // bytes_per_block,
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

        num_blocks  = budget // (12 x page)                     (`get_kv_cache_configs`)
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
    groups, widest = [], 0
    for (layer, bs, page), members in buckets.items():
        if layer.kind not in _BLOCKS_PER_REQUEST:
            raise KvsimError(f"vLLM {VLLM_VERSION}'s KV cache arithmetic for {layer.kind!r} layers is not modelled", field="layers")
        n = cdiv(len(members), group_size)
        if layer.kind == "state":  # mamba_block_size: max_model_len without prefix caching, the attention block with
            bs = bs if settings.mamba_cache_mode == "align" else max_model_len
        blocks = _BLOCKS_PER_REQUEST[layer.kind](layer, bs, max_model_len, settings)
        for i in range(n):
            size = len(members[i::n])  # vLLM deals layers round-robin: layers[i::num_groups]
            widest = max(widest, size)
            layer_page = layer.state_bytes if layer.kind == "state" else layer.bytes_per_token * bs
            groups.append(VllmGroup(layer.kind, size, bs, page, blocks, layer.window, layer_page))
    bytes_per_block = widest * groups[0].page_bytes
    return VllmStartup(
        groups=tuple(groups),
        group_size=group_size,
        bytes_per_block=bytes_per_block,
        num_blocks=budget_bytes // bytes_per_block,
        budget_bytes=budget_bytes,
        max_model_len=max_model_len,
        settings=settings,
        hybrid=hybrid,
    )


def pool_spec(startup: VllmStartup) -> PoolSpec:
    """vLLM's groups as the replay's paged pool allocates them (`KVCacheSpec.pool`)."""
    groups = tuple(
        PoolGroupSpec(
            g.kind,
            g.num_layers,
            g.block_size,
            g.page_bytes,
            g.layer_page_bytes,
            window=g.window,
            max_admission_blocks=g.blocks_per_request if g.kind in ("sliding", "chunked") else None,
        )
        for g in startup.groups
    )
    return PoolSpec(groups, startup.group_size)


def with_pool(model: ModelSpec, spec: KVCacheSpec, budget_bytes: int, max_model_len: int, settings: VllmSettings) -> KVCacheSpec:
    """`spec` with vLLM's groups for a mixed model (uniform models and models whose arithmetic vLLM
    0.33.0 would not run, or kvsim does not model, keep the spec as it is: one pool of kvsim's lanes)."""
    if spec.is_uniform:
        return spec
    try:
        startup = vllm_startup(vllm_layers(model, spec), budget_bytes, max_model_len, spec.block_size, settings)
    except KvsimError:
        return spec
    if startup is None or startup.num_blocks < 2:
        return spec
    return replace(spec, pool=pool_spec(startup))
