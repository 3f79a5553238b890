"""`kvsim size`'s vLLM lines: the raised hybrid block size and padded state page, the start-up line
"GPU KV cache size: N tokens, Maximum concurrency ...", and vLLM's pool of groups behind it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvsim.size.console import SizeConsole


def print_hybrid_pages(console: SizeConsole, h, checkpoint: int = 0) -> None:
    """vLLM's raised block size and padded state page, and the vLLM settings they assume."""
    how = (
        f"raised from --block-size {h.requested_block_size}, in multiples of {h.alignment}, until one attention page holds one layer's state"
        if h.raised
        else f"--block-size {h.requested_block_size} already holds one layer's state"
    )
    pad = f"state page padded to {h.page_bytes:,} B (+{h.padding_pct:.2f}%)" if h.padding_pct else "state page needs no padding"
    console.print(
        f"vLLM block_size for this model: {h.block_size:,} tokens ({how}: {h.block_size:,} x "
        f"{h.attention_bytes_per_token:,} B = {h.page_bytes:,} B >= {h.state_page_bytes:,} B); {pad}",
        highlight=False,
        soft_wrap=True,
    )
    if h.mamba_cache_mode == "none":
        prefix = "off (mamba_cache_mode none; vllm serve's default for a hybrid model is align: --enable-prefix-caching)"
    elif checkpoint:
        prefix = f"on (mamba_cache_mode align, prefill state checkpoints at a {checkpoint}-token alignment: 3 state blocks per request)"
    else:
        prefix = (
            "on (mamba_cache_mode align, 2 state blocks per request; no prefill checkpoints: a gated delta net "
            "on Hopper checkpoints with FlashInfer's prefill, --mamba-checkpoint-alignment 64)"
        )
    console.print(
        f"vLLM settings assumed: attention kernel block {h.kernel_block_size} "
        f"({'FlashAttention / FlashInfer default' if h.kernel_block_size == 16 else '--kernel-block-size'}), "
        f"prefix caching {prefix}",
        style="dim",
        highlight=False,
        soft_wrap=True,
    )


def print_vllm_lines(console: SizeConsole, report) -> None:
    """vLLM's start-up line (or kvsim's whole-block estimate where vLLM's arithmetic is not followed)."""
    from kvsim.size.vllm import VLLM_VERSION

    cap, n, st = report.capacity, report.context_tokens, report.settings
    if report.spec.bytes_per_token == 0:  # attention-free (Mamba, RWKV): no per-token KV, a state per sequence
        console.print(
            f"no per-token KV cache (attention-free): the budget holds {cap.max_sequences_block_rounded:,.2f} sequences' "
            "states, whatever their length"
            + (f"; vLLM {VLLM_VERSION} does not serve it ({report.model.vllm_unserved})" if report.model.vllm_unserved else ""),
            highlight=False,
            soft_wrap=True,
        )
        if cap.vllm is None:
            return
    tokens = f"{cap.max_tokens_block_rounded:,}" if cap.max_tokens_block_rounded is not None else "0"
    v = cap.vllm
    if v is None:
        how = "in whole blocks, state once (vLLM's arithmetic not followed for this layout)"
    else:
        sched = "async" if st.async_scheduling else "sync"
        how = f"as vLLM {VLLM_VERSION} computes it (max_num_batched_tokens {st.max_num_batched_tokens:,}, {sched} scheduling"
        how += f", block_size {v.hybrid.block_size:,})" if v.hybrid else ")"
        if report.spec.dtype == "int8":  # vLLM's int8 caches (int8_per_token_head) store per-token scales too
            how = (f"a what-if in vLLM {VLLM_VERSION}'s arithmetic, which has no plain int8 KV cache dtype "
                   f"(max_num_batched_tokens {st.max_num_batched_tokens:,}, {sched} scheduling)")
        elif report.spec.dtype == "fp32" and report.served_dtype != "fp32":  # auto is fp32 only with --dtype float32
            how = (f"a what-if in vLLM {VLLM_VERSION}'s arithmetic, whose fp32 KV cache needs fp32 weights "
                   f"(--weight-dtype fp32; max_num_batched_tokens {st.max_num_batched_tokens:,}, {sched} scheduling)")
    console.print(
        f"{how}: GPU KV cache size: {tokens} tokens, "
        f"Maximum concurrency for {n:,} tokens per request: {cap.max_sequences_block_rounded:.2f}x",
        highlight=False,
        soft_wrap=True,
    )
    if v is None:
        return
    kinds: dict[str, list] = {}
    for g in v.groups:
        kinds.setdefault(g.kind, []).append(g)
    per_kind = "; ".join(
        f"{len(gs)} {kind} group{'s' if len(gs) > 1 else ''} x {gs[0].blocks_per_request:,} block{'s' if gs[0].blocks_per_request > 1 else ''}"
        for kind, gs in kinds.items()
    )
    pages = f"{v.group_size} layers x {v.page_bytes:,} B pages"
    if v.bytes_per_block != v.group_size * v.page_bytes:  # one group of one type, pages of unequal sizes
        pages = f"one page of each of {v.group_size} layers, unequal"
    console.print(
        f"  vLLM pool: num_gpu_blocks {v.num_blocks:,} = KV budget // {v.bytes_per_block:,} B ({pages}); "
        f"per request of {n:,} tokens: {per_kind} = {v.blocks_per_request:,} blocks",
        style="dim",
        highlight=False,
        soft_wrap=True,
    )
    if v.hybrid is not None:
        own = f"{cap.own_tokens_block_rounded:,}" if cap.own_tokens_block_rounded is not None else "0"
        console.print(
            f"kvsim's own estimate, whole {report.spec.block_size}-token blocks, each sequence's state once (not paged): {own} tokens, "
            f"{cap.own_sequences_block_rounded:.2f}x",
            highlight=False,
            soft_wrap=True,
        )
