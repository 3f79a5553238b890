"""vLLM 0.33.0's hybrid attention+mamba block-size raise and padded state page (`Platform._align_hybrid_block_size`)."""

from __future__ import annotations

import math
from typing import NamedTuple

from kvsim.size.sizing import cdiv, positive_int
from kvsim.size.vllm_layers import VllmLayer
from kvsim.size.vllm_settings import VllmSettings

# MLA decode kernels need the hybrid block in multiples of 128 (`Platform._align_hybrid_block_size`).
MLA_HYBRID_ALIGNMENT = 128


class HybridPages(NamedTuple):  # not a frozen dataclass: ~6x cheaper to define (kvsim size's start-up)
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
