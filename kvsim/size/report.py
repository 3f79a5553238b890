"""What `kvsim size` reports: capacity in a KV budget (kvsim's figures and vLLM's start-up lines) and the
report object behind the tables and --json.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.size.kv_dtype import served_dtype
from kvsim.errors import KvsimError
from kvsim.models.spec import ModelSpec
from kvsim.size.sizing import (
    block_rounded_bytes_per_sequence,
    bytes_per_sequence,
    kv_cache_spec,
    positive_int,
    sliding_cap_bytes_per_sequence,
)
from kvsim.size.startup import StartupMemory, StartupSettings, startup_memory
from kvsim.size.vllm import (
    VLLM_VERSION,
    HybridPages,
    VllmLayer,
    VllmSettings,
    VllmStartup,
    hybrid_pages,
    largest_starting_max_model_len,
    vllm_layers,
    vllm_startup,
)


class Capacity(NamedTuple):  # not a frozen dataclass: ~6x cheaper to define (kvsim size's start-up)
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

    The block-rounded pair is vLLM's own arithmetic (`kvsim.size.vllm.vllm_startup` over `layers`, vLLM's
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


class SizeReport(NamedTuple):  # not a frozen dataclass: ~6x cheaper to define (kvsim size's start-up)
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
    startup: StartupMemory | None = None  # vLLM's start-up accounting behind the KV budget
    largest_max_model_len: int | None = None  # where one request of context_tokens does not fit: the most that does
    served_dtype: str = "bf16"  # the dtype vLLM serves the model in (`kv_dtype.served_dtype`)

    @property
    def verdict(self) -> str | None:
        """vLLM's start-up refusal in one line with the numbers, or None where it starts."""
        cap = self.capacity
        if cap is None or cap.vllm is None or cap.vllm.starts:
            return None
        v = cap.vllm
        needed = v.bytes_per_block * (v.blocks_per_request + 1)
        fit = f"; the largest max_model_len that starts is {self.largest_max_model_len:,}" if self.largest_max_model_len else ""
        return (
            f"vLLM {VLLM_VERSION} would not start: one request of max_model_len {self.context_tokens:,} needs "
            f"{needed / 2**30:.2f} GiB of KV cache ({v.blocks_per_request:,} blocks and the null block), and start-up leaves "
            f"{cap.kv_budget_bytes / 2**30:.2f} GiB{fit} (lower --max-model-len, raise --gpu-memory-utilization, or add --tp)"
        )

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
                "vllm_unserved": self.model.vllm_unserved,
                "vllm_max_num_batched_tokens": self.settings.max_num_batched_tokens,
                "vllm_async_scheduling": self.settings.async_scheduling,
                "vllm_max_in_flight_tokens": self.settings.max_in_flight_tokens,
                "vllm_mamba_cache_mode": self.settings.mamba_cache_mode,
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
                    "starts": self.verdict is None,
                    "verdict": self.verdict,
                    "largest_max_model_len": self.largest_max_model_len,
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
            if self.startup is not None:
                out["startup"] = self.startup.as_json()
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
    utilization: float | None = None,
    weight_dtype: str | None = None,
    settings: VllmSettings = VllmSettings(),
    startup: StartupSettings | None = None,
    kv_budget_bytes: int | None = None,
) -> SizeReport:
    """Everything `kvsim size` reports; the capacity part when `memory_bytes` (the memory the device reports to
    CUDA) or a `kv_budget_bytes` is given.

    With `memory_bytes`, the KV budget is what vLLM 0.33's start-up leaves (`kvsim.size.startup`: requested
    memory less weights, the profile run's peak, non-torch memory and the CUDA graph estimate, or
    kv_cache_memory_bytes); `utilization` overrides `startup`'s gpu_memory_utilization. `settings` only enter
    vLLM's figures: max_num_batched_tokens and async scheduling its sliding-window bound; the kernel block size
    and mamba_cache_mode the hybrid block size and state blocks (see `kvsim.size.vllm`).
    """
    startup = startup or StartupSettings()
    if utilization is not None:
        startup = replace(startup, gpu_memory_utilization=utilization)  # checks (0, 1] even without a device
    spec = kv_cache_spec(model, kv_dtype=kv_dtype, block_size=block_size, tp=tp)
    layers = () if model.vllm_unserved else vllm_layers(model, spec, tp)  # no vLLM figures where vLLM serves none
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
        served_dtype=served_dtype(model, weight_dtype),
    )
    memory = None
    if kv_budget_bytes is not None:
        budget = kv_budget_bytes
    elif memory_bytes is not None:
        memory = startup_memory(model, total_memory_bytes=memory_bytes, tp=tp, settings=startup,
                                device_name=gpu_name or "", weight_dtype=weight_dtype)  # fmt: skip
        budget = memory.available
        if budget <= 0:
            raise KvsimError(
                f"vLLM {VLLM_VERSION} would not start: {memory.requested / 2**30:.2f} GiB requested "
                f"({memory_bytes / 2**30:.2f} GiB x {startup.gpu_memory_utilization}) less weights "
                f"{memory.weights / 2**30:.2f} GiB, the profile run's peak {memory.activation_peak / 2**30:.2f} GiB, "
                f"non-torch {memory.non_torch / 2**30:.2f} GiB and CUDA graphs {memory.cudagraph / 2**30:.2f} GiB leaves "
                f"{budget / 2**30:.2f} GiB for the KV cache (raise --gpu-memory-utilization, add --tp, or use less memory: "
                "--max-num-seqs, --enforce-eager)",
                field="--gpu" if gpu_name else "--memory",
            )
    else:
        return report
    cap = capacity(spec, budget, n, layers, settings)
    largest = None
    if cap.vllm is not None and not cap.vllm.starts:
        largest = largest_starting_max_model_len(layers, budget, n, spec.block_size, settings)
    return report._replace(
        memory_bytes=memory_bytes,
        gpu_name=gpu_name,
        utilization=startup.gpu_memory_utilization if memory is not None else None,
        weight_dtype=memory.weights_how if memory is not None else None,
        weight_bytes=memory.weights if memory is not None else None,
        capacity=cap,
        startup=memory,
        largest_max_model_len=largest,
    )

