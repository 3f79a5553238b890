"""vLLM 0.33's start-up memory accounting, term by term: how much KV cache memory a worker is left with.

`Worker.determine_available_memory` (vllm/v1/worker/gpu_worker.py) and `memory_profiling`
(vllm/utils/mem_utils.py), on one tensor-parallel rank:

    requested  = ceil(total_memory x gpu_memory_utilization)        total_memory: what the device reports to CUDA
    available  = requested - weights - activation peak - non-torch - CUDA graph estimate
                 (kv_cache_memory_bytes, when given, is the answer instead: no utilization)

weights are `Model loading took` (kvsim.models.weights, per rank); the activation peak is what the profile
run (`profile_run`: a forward pass of max_num_batched_tokens tokens, then the sampler over max_num_seqs rows
with top-k/top-p) allocates beyond what it keeps; non-torch memory is what NCCL, cuBLAS and the attention
backends take outside torch (more with tensor parallelism); the CUDA graph estimate is what capturing
the first two graphs of each mode measures, extrapolated to all (`profile_cudagraph_memory`), subtracted by
default since 0.21 (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1). vLLM measures the last three on the device;
kvsim estimates them, and says by how much each may be off (`ESTIMATE_ERROR`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from kvsim.errors import KvsimError
from kvsim.models.spec import ModelSpec
from kvsim.size.sizing import cdiv, positive_int

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92  # vLLM 0.33's CacheConfig.gpu_memory_utilization
# How far each estimated term may be from what vLLM measures (from the real start-up logs in
# tests/size/data/startup_logs.yaml; see docs/startup-memory.md).
ESTIMATE_ERROR = {"activation_peak": 0.3 * GiB, "non_torch": 0.25 * GiB, "cudagraph": 0.3 * GiB}  # 2 of 35 graph
# estimates are further off (DeepSeek-V2-Lite's MLA graphs, Llama-3.1-8B at tp 2: up to 0.85 GiB)
# The constants below are fitted to vLLM 0.19's logged terms on H100 (llm-d-planner's sweep, 40 runs):
_SAMPLER_BYTES_PER_LOGIT = 14.5  # the dummy sampler run over max_num_seqs x vocab logits (fp32, top-k/top-p)
_SAMPLER_BASE = 0.15 * GiB
_NON_TORCH = 0.25 * GiB  # cuBLAS workspaces and the attention backend's buffers, one rank alone
_NON_TORCH_TP = 2.05 * GiB  # NCCL's and the custom all-reduce's buffers with tp > 1 over NVLink (H100 SXM: logged
_NON_TORCH_TP_PER_RANK = 0.035 * GiB  # 2.06-2.21 GiB); over PCIe alone (GeForce cards) ~0.2-0.25 GiB, as one rank
_GRAPH_BASE = 0.2 * GiB  # the CUDA graph estimate: a base, plus per graph and layer
_GRAPH_PER_LAYER = 0.2 * MiB


@dataclass(frozen=True)
class StartupSettings:
    """The vllm serve settings start-up memory depends on; None: vllm serve's default for the device."""

    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    kv_cache_memory_bytes: int | None = None
    estimate_cudagraphs: bool = True  # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS (default on since 0.21)

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise KvsimError(f"must be in (0, 1], got {self.gpu_memory_utilization}", field="--gpu-memory-utilization")
        if self.max_num_seqs is not None:
            positive_int(self.max_num_seqs, "--max-num-seqs")
        if self.max_num_batched_tokens is not None:
            positive_int(self.max_num_batched_tokens, "--max-num-batched-tokens")
        if self.kv_cache_memory_bytes is not None:
            positive_int(self.kv_cache_memory_bytes, "--kv-cache-memory")


def serve_batch_defaults(total_memory_bytes: int, device_name: str = "") -> tuple[int, int]:
    """vllm serve's (max_num_batched_tokens, max_num_seqs) for a device (`EngineArgs.get_batch_defaults`):
    16384/1024 from 160 GiB, 8192/1024 from 70 GiB except A100 and GB10, else 2048/256."""
    name = device_name.lower()
    if total_memory_bytes >= 160 * GiB:
        return 16384, 1024
    if total_memory_bytes >= 70 * GiB and "a100" not in name and "gb10" not in name and "spark" not in name:
        return 8192, 1024
    return 2048, 256


def cudagraph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, blackwell: bool = False) -> list[int]:
    """`VllmConfig._set_cudagraph_sizes` without speculative decoding: 1, 2, 4, every 8 to 248, every 16 from
    256, up to min(2 x max_num_seqs, 512 (1024 on Blackwell), max_num_batched_tokens)."""
    top = min(max_num_seqs * 2, 1024 if blackwell else 512, max_num_batched_tokens)
    sizes = [i for i in (1, 2, 4) if i <= top]
    if top >= 8:
        sizes += list(range(8, min(top + 1, 256), 8))
    if top >= 256:
        sizes += list(range(256, top + 1, 16))
    if max_num_batched_tokens <= top and max_num_batched_tokens not in sizes:
        sizes.append(max_num_batched_tokens)
    return sorted(sizes)


class StartupMemory(NamedTuple):  # not a frozen dataclass: ~6x cheaper to define (kvsim size's start-up)
    """Each term of vLLM's start-up accounting on one rank (bytes), and what is left for the KV cache."""

    total_memory: int  # what the device reports to CUDA
    gpu_memory_utilization: float
    requested: int
    weights: int
    weights_how: str
    activation_peak: int  # estimated
    non_torch: int  # estimated
    cudagraph: int  # estimated; 0 with enforce_eager
    cudagraph_applied: bool  # subtracted (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1, the default)
    num_cudagraphs: int
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_cache_memory_bytes: int | None  # the override, when given
    available: int  # vLLM's "Available KV cache memory" (may be negative: it does not start)

    @property
    def estimate_error(self) -> int:
        """How far `available` may be from vLLM's figure: the estimated terms' errors added."""
        if self.kv_cache_memory_bytes is not None:
            return 0
        graphs = ESTIMATE_ERROR["cudagraph"] if self.cudagraph and self.cudagraph_applied else 0
        return int(ESTIMATE_ERROR["activation_peak"] + ESTIMATE_ERROR["non_torch"] + graphs)

    def as_json(self) -> dict:
        return {
            "total_gpu_memory_bytes": self.total_memory,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "requested_memory_bytes": self.requested,
            "weights_bytes": self.weights,
            "weights_how": self.weights_how,
            "activation_peak_bytes": self.activation_peak,
            "activation_peak_estimated": True,
            "non_torch_bytes": self.non_torch,
            "non_torch_estimated": True,
            "cudagraph_estimate_bytes": self.cudagraph,
            "cudagraph_estimated": True,
            "cudagraph_estimate_subtracted": self.cudagraph_applied,
            "num_cudagraphs": self.num_cudagraphs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "available_kv_cache_memory_bytes": self.available,
            "available_estimate_error_bytes": self.estimate_error,
        }


def loaded_weight_bytes(model: ModelSpec, *, tp: int = 1, weight_dtype: str | None = None) -> tuple[int, str]:
    """Weight bytes one rank holds after loading (`Model loading took`), and how kvsim knows them.

    Counted per tensor group from the config (quantization, vocab padding, replicated tensors) where the
    config's shapes account for the parameter count; else the checkpoint's size / tp; else parameters x dtype / tp.
    """
    from kvsim.models.weights import model_weights
    from kvsim.size.sizing import weight_bytes

    weights = model_weights(model, tp=tp, weight_dtype=weight_dtype)
    if weights is not None and (weights.computed or not model.checkpoint_bytes or weight_dtype):
        how = "per tensor group from the config" if weights.computed else "config groups + the rest of num_params"
        return weights.total_bytes, f"{weights.quantization}, {how}"
    if model.checkpoint_bytes and weight_dtype is None:
        return cdiv(model.checkpoint_bytes, tp), "the checkpoint's size / tp"
    return weight_bytes(model, weight_dtype=weight_dtype, tp=tp), f"{weight_dtype or model.weight_dtype}, parameters x dtype / tp"


def activation_peak_bytes(model: ModelSpec, *, tp: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The profile run's torch peak (estimated): the larger of the forward pass over max_num_batched_tokens
    tokens (the widest layer output and the residual stream) and the dummy sampler run over max_num_seqs rows of
    the vocabulary, plus fused MoE's workspace (kept across the run). Fitted to vLLM 0.19's logs: within 0.3 GiB
    of 38 of 40 logged runs (the misses: Gemma 3's vision tower, CodeLlama's small vocabulary)."""
    cfg = model.weight_config
    h, t = model.hidden_size, max_num_batched_tokens
    widths = [h]
    first = next(iter(model.attention_layers), None)
    if first is not None:
        widths.append((model.num_attention_heads + 2 * first.num_kv_heads) * max(first.head_dim, 1) // tp)
    vocab = model.vocab_size or (cfg.vocab_size if cfg else None) or 32000
    if cfg is not None and cfg.intermediate_size and len(cfg.moe_layers) < model.num_layers:
        widths.append(cfg.mlp_matrices * cfg.intermediate_size // tp)  # gate_up output and the activation's
    forward = t * (max(widths) + 2 * h) * 2
    sampler = int(_SAMPLER_BASE + max_num_seqs * vocab * _SAMPLER_BYTES_PER_LOGIT)
    workspace = 0  # fused_moe's triton caches; MXFP4 experts run kernels of their own (Marlin, triton_kernels)
    mxfp4 = cfg is not None and cfg.quantization is not None and cfg.quantization.method == "mxfp4"
    if cfg is not None and cfg.moe_layers and cfg.moe_intermediate_size and not mxfp4:
        k = max(cfg.experts_per_token, 1)
        workspace = 2 * t * k * max(2 * cfg.moe_intermediate_size // tp, h) * 2
    return max(forward, sampler) + workspace


def non_torch_bytes(tp: int, peer_nvlink: bool = True) -> int:
    """Memory outside torch that start-up takes (estimated): 0.25 GiB alone, about 2.1 GiB with tp > 1 where the
    ranks talk over NVLink (H100 SXM logs: the growth with tp is what NCCL and the custom all-reduce set up for
    peer-to-peer links, after vLLM's start-up snapshot), 0.25 GiB with tp > 1 over PCIe alone (RTX 4090 and 3090
    logs at tp 2 and more: 0.25 and 0.20 GiB)."""
    return int(_NON_TORCH if tp == 1 or not peer_nvlink else _NON_TORCH_TP + _NON_TORCH_TP_PER_RANK * tp)


def cudagraph_estimate_bytes(num_graphs: int, num_layers: int) -> int:
    """`profile_cudagraph_memory`'s estimate (estimated here): 0.2 GiB plus 0.2 MiB per graph and layer."""
    return int(_GRAPH_BASE + num_graphs * num_layers * _GRAPH_PER_LAYER) if num_graphs else 0


def startup_memory(
    model: ModelSpec,
    *,
    total_memory_bytes: int,
    tp: int = 1,
    settings: StartupSettings = StartupSettings(),
    device_name: str = "",
    weight_dtype: str | None = None,
) -> StartupMemory:
    """vLLM 0.33's start-up accounting for `model` on one of `tp` ranks of a device reporting `total_memory_bytes`."""
    positive_int(tp, "--tp")
    mnbt, seqs = serve_batch_defaults(total_memory_bytes, device_name)
    mnbt = settings.max_num_batched_tokens or mnbt
    seqs = settings.max_num_seqs or seqs
    requested = math.ceil(total_memory_bytes * settings.gpu_memory_utilization)
    weights, how = loaded_weight_bytes(model, tp=tp, weight_dtype=weight_dtype)
    peak = activation_peak_bytes(model, tp=tp, max_num_batched_tokens=mnbt, max_num_seqs=seqs)
    if tp > 1:
        from kvsim.models.interconnect import peer_nvlink

        non_torch = non_torch_bytes(tp, peer_nvlink(device_name))
    else:
        non_torch = non_torch_bytes(tp)
    graphs, num_graphs = 0, 0
    if not settings.enforce_eager:
        blackwell = any(name in device_name.lower() for name in ("b200", "b300", "gb200"))
        sizes = cudagraph_capture_sizes(seqs, mnbt, blackwell=blackwell)
        full = [s for s in sizes if s <= seqs]  # FULL_AND_PIECEWISE: FULL graphs for uniform decode batches
        num_graphs = len(sizes) + len(full)
        graphs = cudagraph_estimate_bytes(num_graphs, model.num_layers)
    applied = graphs if settings.estimate_cudagraphs else 0
    if settings.kv_cache_memory_bytes is not None:
        available = settings.kv_cache_memory_bytes
    else:
        available = requested - weights - peak - non_torch - applied
    return StartupMemory(
        total_memory=total_memory_bytes,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        requested=requested,
        weights=weights,
        weights_how=how,
        activation_peak=peak,
        non_torch=non_torch,
        cudagraph=graphs,
        cudagraph_applied=settings.estimate_cudagraphs,
        num_cudagraphs=num_graphs,
        max_num_batched_tokens=mnbt,
        max_num_seqs=seqs,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        available=available,
    )


def vllm_kv_cache_memory(
    model: ModelSpec,
    total_memory_bytes: int,
    *,
    utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    tp: int = 1,
    device_name: str = "",
    source: str | None = None,
    field: str = "gpu_memory_utilization",
) -> int:
    """The KV cache memory vLLM 0.33's start-up leaves one rank (its "Available KV cache memory"), with vllm
    serve's defaults; a KvsimError naming `field` when nothing is left. Every budget derived from a
    utilization (the replay, cache-curve, profile) comes from here."""
    memory = startup_memory(
        model, total_memory_bytes=total_memory_bytes, tp=tp,
        settings=StartupSettings(gpu_memory_utilization=utilization), device_name=device_name,
    )  # fmt: skip
    if memory.available <= 0:
        raise KvsimError(
            f"{total_memory_bytes:,} B x {utilization:g} = {memory.requested:,} B leaves no KV cache memory after "
            f"{model.name}'s weights ({memory.weights:,} B) and vLLM's start-up profile "
            f"({memory.activation_peak + memory.non_torch + memory.cudagraph:,} B); raise it, or give kv_budget instead",
            source=source,
            field=field,
        )
    return memory.available
