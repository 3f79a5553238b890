"""What `kvsim size` reports: capacity in a KV budget (kvsim's figures and vLLM's start-up lines) and the
report object behind the tables and --json.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvsim.engine.kv_cache_spec import KVCacheSpec
from kvsim.errors import KvsimError
from kvsim.models import ModelSpec
from kvsim.sizing import (
    block_rounded_bytes_per_sequence,
    bytes_per_sequence,
    kv_budget_bytes,
    kv_cache_spec,
    positive_int,
    sliding_cap_bytes_per_sequence,
    weight_bytes,
)
from kvsim.vllm_sizing import (
    VLLM_VERSION,
    HybridPages,
    VllmLayer,
    VllmSettings,
    VllmStartup,
    hybrid_pages,
    vllm_layers,
    vllm_startup,
)


@dataclass(frozen=True)
class Capacity:
    """How much fits in a KV budget: tokens, and sequences of `context_tokens` (vLLM's concurrency line)."""

    kv_budget_bytes: int
    max_tokens: int | None  # budget / bytes per token, every layer keeping every token; None without per-token KV
    max_tokens_block_rounded: int | None  # vLLM's "GPU KV cache size: N tokens" (else kvsim's whole blocks)
    max_sequences: float  # budget / capped bytes per sequence
    max_sequences_block_rounded: float  # vLLM's "Maximum concurrency" (else kvsim's whole blocks)
    max_sequences_uncapped: float  # budget / uncapped bytes per sequence
    own_tokens_block_rounded: int | None  # kvsim: whole blocks of --block-size tokens, every layer
    own_sequences_block_rounded: float  # kvsim: whole blocks / whole-block bytes per sequence, state once unpadded
    vllm: VllmStartup | None = None  # vLLM's pool behind the block-rounded pair; None where kvsim cannot follow it

    @property
    def vllm_exact(self) -> bool:
        """Whether the block-rounded pair is vLLM's arithmetic (else kvsim's own estimate)."""
        return self.vllm is not None


def capacity(
    spec: KVCacheSpec,
    budget_bytes: int,
    context_tokens: int,
    layers: tuple[VllmLayer, ...] = (),
    settings: VllmSettings = VllmSettings(),
) -> Capacity:
    """Tokens and concurrent sequences of `context_tokens` that `budget_bytes` of KV memory holds.

    The block-rounded pair is vLLM's own arithmetic (`kvsim.vllm_sizing.vllm_startup` over `layers`, vLLM's
    per-layer view of the model) where kvsim can reproduce it, else kvsim's whole-block estimate.
    """
    per_token = spec.bytes_per_token
    usable = budget_bytes
    if spec.block_bytes:
        usable = (budget_bytes // spec.block_bytes) * spec.block_bytes  # whole blocks
    own_tokens = (budget_bytes // spec.block_bytes) * spec.block_size if per_token else None
    own_sequences = usable / block_rounded_bytes_per_sequence(spec, context_tokens)
    vllm = vllm_startup(layers, budget_bytes, context_tokens, spec.block_size, settings) if layers else None
    return Capacity(
        kv_budget_bytes=budget_bytes,
        max_tokens=budget_bytes // per_token if per_token else None,
        max_tokens_block_rounded=vllm.tokens if vllm else own_tokens,
        max_sequences=budget_bytes / bytes_per_sequence(spec, context_tokens),
        max_sequences_block_rounded=vllm.concurrency if vllm else own_sequences,
        max_sequences_uncapped=budget_bytes / bytes_per_sequence(spec, context_tokens, capped=False),
        own_tokens_block_rounded=own_tokens,
        own_sequences_block_rounded=own_sequences,
        vllm=vllm,
    )


@dataclass(frozen=True)
class SizeReport:
    """Every figure `kvsim size` prints, per TP rank; `as_json()` is the --json object."""

    model: ModelSpec
    spec: KVCacheSpec
    tp: int
    context_tokens: int
    bytes_per_sequence: int  # capped sliding, state once, before block rounding
    bytes_per_sequence_uncapped: int
    bytes_per_sequence_block_rounded: int
    memory_bytes: int | None = None
    gpu_name: str | None = None
    utilization: float | None = None
    weight_dtype: str | None = None
    weight_bytes: int | None = None
    capacity: Capacity | None = None
    settings: VllmSettings = VllmSettings()
    hybrid: HybridPages | None = None  # vLLM's raised block size and padded state page (state layers only)

    def as_json(self) -> dict:
        spec = self.spec
        out = {
            "model": self.model.name,
            "hf_id": self.model.hf_id,
            "kv_dtype": spec.dtype,
            "tp": self.tp,
            "layers": self.model.layer_counts,
            "kv_bytes_per_token": spec.bytes_per_token,
            "full_attention_bytes_per_token": spec.full_bytes_per_token,
            "sliding_window_bytes_per_token": spec.bytes_per_token - spec.full_bytes_per_token,
            "sliding_window_cap_bytes_per_sequence": sliding_cap_bytes_per_sequence(spec),
            "state_bytes_per_sequence": spec.state_bytes_per_sequence,
            "block_size": spec.block_size,
            "block_bytes": spec.block_bytes,
            "context_tokens": self.context_tokens,
            "bytes_per_sequence": self.bytes_per_sequence,
            "bytes_per_sequence_uncapped": self.bytes_per_sequence_uncapped,
            "bytes_per_sequence_block_rounded": self.bytes_per_sequence_block_rounded,
        }
        out.update(
            {
                "vllm_version": VLLM_VERSION,
                "vllm_max_num_batched_tokens": self.settings.max_num_batched_tokens,
                "vllm_async_scheduling": self.settings.async_scheduling,
                "vllm_max_in_flight_tokens": self.settings.max_in_flight_tokens,
            }
        )
        if self.hybrid is not None:
            h = self.hybrid
            out.update(
                {
                    "vllm_block_size": h.block_size,
                    "vllm_block_size_raised": h.raised,
                    "vllm_kernel_block_size": h.kernel_block_size,
                    "vllm_block_alignment": h.alignment,
                    "vllm_mamba_checkpoint_alignment": self.settings.mamba_checkpoint_alignment,
                    "vllm_mamba_cache_mode": h.mamba_cache_mode,
                    "vllm_page_bytes": h.page_bytes,
                    "vllm_state_page_bytes": h.state_page_bytes,
                    "vllm_state_page_padded_bytes": h.page_bytes,
                }
            )
        if self.capacity is not None:
            cap = self.capacity
            out.update(
                {
                    "gpu": self.gpu_name,
                    "memory_bytes": self.memory_bytes,
                    "utilization": self.utilization,
                    "weight_dtype": self.weight_dtype,
                    "weight_bytes": self.weight_bytes,
                    "kv_budget_bytes": cap.kv_budget_bytes,
                    "max_tokens": cap.max_tokens,
                    "max_tokens_block_rounded": cap.max_tokens_block_rounded,
                    "max_sequences": round(cap.max_sequences, 4),
                    "max_sequences_block_rounded": round(cap.max_sequences_block_rounded, 4),
                    "max_sequences_uncapped": round(cap.max_sequences_uncapped, 4),
                    "block_rounded_is_vllm_exact": cap.vllm_exact,
                    "kvsim_tokens_block_rounded": cap.own_tokens_block_rounded,
                    "kvsim_sequences_block_rounded": round(cap.own_sequences_block_rounded, 4),
                }
            )
            if cap.vllm is not None:
                v = cap.vllm
                out.update(
                    {
                        "vllm_num_gpu_blocks": v.num_blocks,
                        "vllm_kv_cache_size_tokens": v.tokens,
                        "vllm_max_concurrency": v.concurrency,
                        "vllm_cache_block_size": v.block_size,
                        "vllm_bytes_per_block": v.bytes_per_block,
                        "vllm_num_groups": v.num_groups,
                        "vllm_group_size": v.group_size,
                        "vllm_blocks_per_request": v.blocks_per_request,
                        "vllm_starts": v.starts,
                        "vllm_groups": [
                            {
                                "kind": g.kind,
                                "num_layers": g.num_layers,
                                "block_size": g.block_size,
                                "page_bytes": g.page_bytes,
                                "blocks_per_request": g.blocks_per_request,
                            }
                            for g in v.groups
                        ],
                    }
                )
        return out


def size_report(
    model: ModelSpec,
    *,
    kv_dtype: str = "bf16",
    block_size: int = 16,
    context_tokens: int | None = None,
    tp: int = 1,
    memory_bytes: int | None = None,
    gpu_name: str | None = None,
    utilization: float = 0.9,
    weight_dtype: str | None = None,
    settings: VllmSettings = VllmSettings(),
) -> SizeReport:
    """Everything `kvsim size` reports; the capacity part only when `memory_bytes` is given.

    `settings` only enter vLLM's figures: max_num_batched_tokens and async scheduling its sliding-window
    bound; the kernel block size and mamba_cache_mode the hybrid block size and state blocks (see
    `kvsim.vllm_sizing`).
    """
    if not 0 < utilization <= 1:  # checked even without a device, so a typo never passes silently
        raise KvsimError(f"must be in (0, 1], got {utilization}", field="--utilization")
    spec = kv_cache_spec(model, kv_dtype=kv_dtype, block_size=block_size, tp=tp)
    layers = vllm_layers(model, spec, tp)
    n = positive_int(context_tokens, "--context") if context_tokens is not None else model.max_model_len
    report = SizeReport(
        model=model,
        spec=spec,
        tp=tp,
        context_tokens=n,
        bytes_per_sequence=bytes_per_sequence(spec, n),
        bytes_per_sequence_uncapped=bytes_per_sequence(spec, n, capped=False),
        bytes_per_sequence_block_rounded=block_rounded_bytes_per_sequence(spec, n),
        settings=settings,
        hybrid=hybrid_pages(layers, block_size, settings),
    )
    if memory_bytes is None:
        return report
    weights = weight_bytes(model, weight_dtype=weight_dtype, tp=tp)
    budget = kv_budget_bytes(
        memory_bytes, utilization=utilization, weight_bytes=weights, field="--gpu" if gpu_name else "--memory"
    )
    return replace(
        report,
        memory_bytes=memory_bytes,
        gpu_name=gpu_name,
        utilization=utilization,
        weight_dtype=weight_dtype or ("checkpoint" if model.checkpoint_bytes else model.weight_dtype),
        weight_bytes=weights,
        capacity=capacity(spec, budget, n, layers, settings),
    )
