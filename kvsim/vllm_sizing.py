"""vLLM's start-up arithmetic: the hybrid attention+mamba block-size raise, layer groups, and the two lines
"GPU KV cache size: N tokens" / "Maximum concurrency for L tokens per request: X.XXx".

Follows vLLM v0.22-v0.24 (vllm/platforms/interface.py `Platform._align_hybrid_block_size`) and main at
001cabc1 (vllm/v1/core/kv_cache_utils.py, vllm/v1/kv_cache_interface.py). Pure integers, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvsim.engine.kv_cache_spec import KVCacheGroupSpec, KVCacheSpec
from kvsim.errors import KvsimError
from kvsim.sizing import cdiv, positive_int

# The smallest kernel block of vLLM's default attention backends on Hopper/Ampere: FlashAttention supports
# any multiple of 16, FlashInfer 16/32/64. vLLM aligns the raised hybrid block size to it.
DEFAULT_KERNEL_BLOCK_SIZE = 16
# vLLM's `mamba_cache_mode`: "none" without prefix caching (its default for hybrid models, whose
# `is_prefix_caching_supported` is False), "align" with prefix caching on a model without mamba prefix caching.
MAMBA_CACHE_MODES = ("none", "align")
# vLLM pads layer groups to the largest type's layer count when it is within this factor of the smallest's.
_GROUP_SIZE_SLACK = 1.5


@dataclass(frozen=True)
class HybridPages:
    """How vLLM puts constant state pages and per-token attention pages in one pool of equal pages.

    vLLM raises the attention `block_size` to the smallest multiple of the kernel alignment whose page
    (block_size x bytes per token of one attention layer) holds one layer's state, then pads the state page
    to exactly that page. The alignment is max(backend's smallest kernel block, the block size asked for),
    so a larger --block-size becomes the unit the raise counts in.
    """

    requested_block_size: int  # --block-size (vLLM's default 16 when not given)
    kernel_block_size: int  # the backend's smallest kernel block
    block_size: int  # vLLM's block_size for this model, after the raise
    attention_bytes_per_token: int  # one token of one attention layer, this rank
    state_page_bytes: int  # one state layer's whole state, this rank, before padding
    mamba_cache_mode: str = "none"

    @property
    def alignment(self) -> int:
        return max(self.kernel_block_size, self.requested_block_size)

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


def _check_options(kernel_block_size: int, mamba_cache_mode: str) -> None:
    positive_int(kernel_block_size, "--kernel-block-size")
    if mamba_cache_mode not in MAMBA_CACHE_MODES:
        raise KvsimError(f"expected one of {', '.join(MAMBA_CACHE_MODES)}, got {mamba_cache_mode!r}", field="--mamba-cache-mode")


def _bytes_per_layer(total: int, group: KVCacheGroupSpec) -> int | None:
    return total // group.num_layers if total % group.num_layers == 0 else None


def _attention_bytes_per_token(spec: KVCacheSpec) -> int | None:
    """Bytes one token adds to one per-token layer, when every per-token layer agrees (vLLM's uniform page)."""
    sizes = {_bytes_per_layer(g.bytes_per_token, g) for g in spec.groups if g.kind != "state"}
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def hybrid_pages(
    spec: KVCacheSpec,
    *,
    kernel_block_size: int = DEFAULT_KERNEL_BLOCK_SIZE,
    mamba_cache_mode: str = "none",
) -> HybridPages | None:
    """vLLM's block size and page sizes for a model with state layers; None without state or per-token layers.

    Also None where vLLM's arithmetic does not apply as modelled: per-token layers of different page sizes,
    or state layers of different sizes.
    """
    _check_options(kernel_block_size, mamba_cache_mode)
    states = [g for g in spec.groups if g.kind == "state"]
    per_token = _attention_bytes_per_token(spec)
    if not states or per_token is None:
        return None
    state_pages = {_bytes_per_layer(g.state_bytes, g) for g in states}
    if len(state_pages) != 1 or None in state_pages:
        return None
    state_page = state_pages.pop()
    align = max(kernel_block_size, spec.block_size)
    # the smallest multiple of `align` tokens whose page holds one state page; vLLM only ever raises
    # block_size (with align >= block_size this never keeps a smaller one, but says what vLLM does)
    block_size = max(spec.block_size, align * cdiv(state_page, align * per_token))
    return HybridPages(
        requested_block_size=spec.block_size,
        kernel_block_size=kernel_block_size,
        block_size=block_size,
        attention_bytes_per_token=per_token,
        state_page_bytes=state_page,
        mamba_cache_mode=mamba_cache_mode,
    )


@dataclass(frozen=True)
class VllmStartup:
    """vLLM's block pool for a model and budget, and the two lines it logs at start-up."""

    page_bytes: int  # one block of one layer (every layer's page is equal)
    block_size: int  # tokens per attention block
    group_size: int  # layers per group: the pool is `group_size` tensors of num_blocks pages
    num_groups: int  # groups, padding included; one block id spans one layer of every group
    num_blocks: int
    token_block_size: int  # the smallest block_size of any group (a state group's is max_model_len)
    blocks_per_request: int  # blocks one request of max_model_len tokens needs, all groups
    hybrid: HybridPages | None = None

    @property
    def tokens(self) -> int:
        """'GPU KV cache size: N tokens'."""
        return self.num_blocks // self.num_groups * self.token_block_size

    @property
    def concurrency(self) -> float:
        """'Maximum concurrency for L tokens per request: X.XXx'."""
        return self.num_blocks / self.blocks_per_request


def _promote_chunked(spec: KVCacheSpec) -> KVCacheSpec:
    """vLLM 0.33 turns its hybrid KV cache manager off for chunked local attention (unless
    VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1) and allocates those layers as full attention."""
    chunked = [g for g in spec.groups if g.kind == "chunked"]
    if not chunked:
        return spec
    full = [g for g in spec.groups if g.kind == "full"] + chunked
    merged = KVCacheGroupSpec("full", sum(g.num_layers for g in full), bytes_per_token=sum(g.bytes_per_token for g in full))
    rest = tuple(g for g in spec.groups if g.kind not in ("full", "chunked"))
    return replace(spec, groups=(merged, *rest))


def vllm_startup(
    spec: KVCacheSpec,
    budget_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int = 8192,
    *,
    kernel_block_size: int = DEFAULT_KERNEL_BLOCK_SIZE,
    mamba_cache_mode: str = "none",
) -> VllmStartup | None:
    """vLLM's pool and start-up lines (vllm/v1/core/kv_cache_utils.py), or None where kvsim cannot follow it.

    Layers of one type form groups of `group_size` layers (the smallest type's layer count, or the largest's
    when within 1.5x); a type whose count is not a multiple is padded. Every layer's page is equal (state
    pages padded up to the raised attention page), so the pool is `group_size` tensors and one block id
    spans one layer of every group:

        qwen3-next-80b-a3b, 12 full + 36 state layers, group_size 12 -> 1 full group + 3 state groups

        tensor 0  [ full.0  | state.0  | state.1  | state.2  ]   each tensor: num_blocks pages of
        tensor 1  [ full.1  | state.3  | state.4  | state.5  ]   page_bytes; a block id is one page in
          ...                                                     every tensor, owned by one group
        tensor 11 [ full.11 | state.33 | state.34 | state.35 ]

        num_blocks  = budget // page // 12
        tokens      = num_blocks // 4 groups x min(block_size, max_model_len)
        concurrency = num_blocks / (cdiv(len, block_size) + 3 x 1)   (a state group: 1 block a request)

    A sliding group needs cdiv(min(window - 1 + max_num_batched_tokens, len), block_size) + 1 blocks; a
    state group 1 block with mamba_cache_mode "none", 2 with "align" (prefix caching).
    """
    positive_int(max_num_batched_tokens, "--max-num-batched-tokens")
    positive_int(max_model_len, "--context")
    _check_options(kernel_block_size, mamba_cache_mode)
    spec = _promote_chunked(spec)
    per_token = _attention_bytes_per_token(spec)
    if per_token is None:
        return None
    hybrid = None
    if any(g.kind == "state" for g in spec.groups):
        hybrid = hybrid_pages(spec, kernel_block_size=kernel_block_size, mamba_cache_mode=mamba_cache_mode)
        if hybrid is None:
            return None
    bs = hybrid.block_size if hybrid else spec.block_size
    page = per_token * bs
    counts = [g.num_layers for g in spec.groups]
    group_size = min(counts)
    if max(counts) < group_size * _GROUP_SIZE_SLACK:
        group_size = max(counts)
    num_groups = blocks_per_request = 0
    for g in spec.groups:
        if g.kind == "sliding":
            blocks = cdiv(min(g.window - 1 + max_num_batched_tokens, max_model_len), bs) + 1
        elif g.kind == "state":
            blocks = 2 if mamba_cache_mode == "align" else 1
        else:
            blocks = cdiv(max_model_len, bs)
        num_groups += cdiv(g.num_layers, group_size)
        blocks_per_request += cdiv(g.num_layers, group_size) * blocks
    # a state group's block_size is mamba_block_size: max_model_len ("none") or the attention block ("align")
    token_block = min(bs, max_model_len) if hybrid and mamba_cache_mode == "none" else bs
    return VllmStartup(
        page_bytes=page,
        block_size=bs,
        group_size=group_size,
        num_groups=num_groups,
        num_blocks=budget_bytes // page // group_size,
        token_block_size=token_block,
        blocks_per_request=blocks_per_request,
        hybrid=hybrid,
    )


def vllm_kv_cache_size(
    spec: KVCacheSpec, budget_bytes: int, max_model_len: int, max_num_batched_tokens: int = 8192, **options
) -> tuple[int, float] | None:
    """vLLM's two start-up numbers, (GPU KV cache size in tokens, maximum concurrency), or None.

    `options` are `vllm_startup`'s: kernel_block_size, mamba_cache_mode.
    """
    startup = vllm_startup(spec, budget_bytes, max_model_len, max_num_batched_tokens, **options)
    return None if startup is None else (startup.tokens, startup.concurrency)
