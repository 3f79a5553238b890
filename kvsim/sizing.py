"""All of kvsim's size math: KV bytes per token / block / sequence, weight bytes, budgets, concurrency.

The figures follow vLLM (vllm/v1/kv_cache_interface.py): full attention stores K and V per KV head, MLA one
latent per token (no factor 2, replicated on every TP rank), sliding layers need at most their window,
linear/mamba layers hold a constant state per sequence. Everything is per tensor-parallel rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvsim.engine.kv_cache_spec import KVCacheGroupSpec, KVCacheSpec
from kvsim.errors import KvsimError
from kvsim.models import LayerKind, ModelSpec
from kvsim.units import dtype_bytes


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def _positive_int(value: int, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KvsimError(f"must be a positive integer, got {value!r}", field=field)
    return value


def _state_dtype(model: ModelSpec) -> str:
    """Linear/mamba state keeps the model's activation dtype (vLLM's mamba_cache_dtype 'auto')."""
    return model.weight_dtype if model.weight_dtype in ("bf16", "fp16", "fp32") else "bf16"


def kv_cache_spec(model: ModelSpec, *, kv_dtype: str = "bf16", block_size: int = 16, tp: int = 1) -> KVCacheSpec:
    """The allocator-facing description of `model`'s cache on one TP rank.

    Groups: one `full` group (full attention and MLA layers), one `sliding` group per distinct window,
    one `state` group (linear/mamba layers, constant bytes per request in the model's dtype).
    """
    _positive_int(block_size, "--block-size")
    _positive_int(tp, "--tp")
    if model.num_attention_heads % tp:
        raise KvsimError(
            f"--tp {tp} does not divide num_attention_heads {model.num_attention_heads} of {model.name}", field="--tp"
        )
    for layer in model.attention_layers:
        _check_kv_heads_split(layer.num_kv_heads, tp, model.name)
    kv_bytes = int(dtype_bytes(kv_dtype, field="--kv-dtype", kv=True))
    state_bytes = int(dtype_bytes(_state_dtype(model)))

    full = [layer for layer in model.layers if layer.kind in (LayerKind.FULL, LayerKind.MLA)]
    windows: dict[int, list] = {}
    for layer in model.layers:
        if layer.kind == LayerKind.SLIDING:
            windows.setdefault(layer.window, []).append(layer)
    states = [layer for layer in model.layers if layer.kind == LayerKind.LINEAR_STATE]

    groups = []
    if full:
        per_token = sum(layer.elements_per_token(tp) for layer in full) * kv_bytes
        groups.append(KVCacheGroupSpec("full", len(full), bytes_per_token=per_token))
    for window, layers in windows.items():
        per_token = sum(layer.elements_per_token(tp) for layer in layers) * kv_bytes
        groups.append(KVCacheGroupSpec("sliding", len(layers), bytes_per_token=per_token, window=window))
    if states:
        total = sum(layer.state_elements_per_rank(tp) for layer in states) * state_bytes
        groups.append(KVCacheGroupSpec("state", len(states), state_bytes=total))

    attention = model.attention_layers
    first = attention[0] if attention else None
    return KVCacheSpec(
        groups=tuple(groups),
        block_size=block_size,
        dtype=kv_dtype.lower(),
        dtype_bytes=kv_bytes,
        num_kv_heads=first.kv_heads_per_rank(tp) if first else 0,
        head_dim=(first.latent_dim if first.kind == LayerKind.MLA else first.head_dim) if first else 0,
        num_attention_layers=len(attention),
    )


def _check_kv_heads_split(num_kv_heads: int, tp: int, name: str) -> None:
    """vLLM splits KV heads evenly (kv % tp == 0) or replicates them evenly (tp % kv == 0); nothing else loads.

    MLA layers (num_kv_heads 0 here: one latent, replicated) always pass.
    """
    if num_kv_heads == 0 or num_kv_heads % tp == 0 or tp % num_kv_heads == 0:
        return
    raise KvsimError(
        f"--tp {tp} neither divides nor is a multiple of the {num_kv_heads} KV heads of {name} "
        "(vLLM splits KV heads evenly across ranks, or replicates them evenly)",
        field="--tp",
    )


def is_mla(model: ModelSpec) -> bool:
    """Whether the model's attention layers store one MLA latent (no separate K and V)."""
    return any(layer.kind == LayerKind.MLA for layer in model.layers)


def sliding_cap_bytes_per_sequence(spec: KVCacheSpec) -> int:
    """The most sliding-window KV one sequence ever needs: each sliding group's window of tokens."""
    return sum(g.bytes_per_token * g.window for g in spec.groups if g.kind == "sliding")


def bytes_per_sequence(spec: KVCacheSpec, num_tokens: int, *, capped: bool = True) -> int:
    """KV + state of one sequence of `num_tokens` tokens, before block rounding.

    capped: sliding layers keep at most their window (an engine that frees blocks outside the window);
    uncapped: every per-token layer keeps every token (what engines without window freeing allocate).
    State layers count once either way.
    """
    total = spec.state_bytes_per_sequence
    for g in spec.groups:
        if g.kind == "full" or (g.kind == "sliding" and not capped):
            total += g.bytes_per_token * num_tokens
        elif g.kind == "sliding":
            total += g.bytes_per_token * min(num_tokens, g.window)
    return total


def block_rounded_bytes_per_sequence(spec: KVCacheSpec, num_tokens: int) -> int:
    """Like `bytes_per_sequence` (capped) but in whole blocks, as a paged engine allocates.

    Full layers hold cdiv(n, block_size) blocks. A sliding layer holds the blocks its window can touch,
    vLLM's SlidingWindowSpec bound with a one-token step: cdiv(window, block_size) + 1, never more than the
    sequence's own cdiv(n, block_size).
    """
    bs = spec.block_size
    blocks = cdiv(num_tokens, bs)
    total = spec.state_bytes_per_sequence
    for g in spec.groups:
        if g.kind == "full":
            total += g.bytes_per_token * bs * blocks
        elif g.kind == "sliding":
            total += g.bytes_per_token * bs * min(blocks, cdiv(g.window, bs) + 1)
    return total


def _vllm_page_per_layer(spec: KVCacheSpec) -> int | None:
    """Bytes of one block of one layer when every per-token layer has the same page (vLLM's uniform page)."""
    pages = {g.bytes_per_token * spec.block_size // g.num_layers for g in spec.groups}
    ok = all(g.bytes_per_token % g.num_layers == 0 for g in spec.groups) and len(pages) == 1
    return pages.pop() if ok else None


def vllm_kv_cache_size(
    spec: KVCacheSpec, budget_bytes: int, max_model_len: int, max_num_batched_tokens: int = 8192
) -> tuple[int, float] | None:
    """vLLM's two start-up lines, ("GPU KV cache size: N tokens", "Maximum concurrency ...: X.XXx").

    Follows vllm/v1/core/kv_cache_utils.py. Layers of one type form groups of `group_size` layers (the
    smallest type's layer count, or the largest's when within 1.25x), a type with fewer layers than a
    multiple of it is padded; each block id spans one layer of every group:

        gemma-3-27b, 10 full + 52 sliding layers, group_size 10 -> 1 full group + 6 sliding groups
        (the last holds 2 layers + 8 padding); num_blocks = budget // (page x 10)
        tokens      = num_blocks // 7 groups x block_size
        concurrency = num_blocks / (cdiv(len, bs) + 6 x (cdiv(min(window - 1 + max_num_batched_tokens,
                      len), bs) + 1))

    A sliding group's bound allows for a chunked prefill of `max_num_batched_tokens` tokens beside the
    window. None when vLLM sizes the model otherwise: per-sequence state layers (mamba pages, padded to
    the attention page) or layers with different page sizes.
    """
    page = _vllm_page_per_layer(spec)
    if page is None or spec.state_bytes_per_sequence or not spec.groups:
        return None
    _positive_int(max_num_batched_tokens, "--max-num-batched-tokens")
    bs = spec.block_size
    counts = [g.num_layers for g in spec.groups]
    group_size = min(counts)
    if max(counts) < group_size * 1.25:
        group_size = max(counts)
    num_groups, blocks_per_request = 0, 0
    for g in spec.groups:
        if g.kind == "sliding":
            blocks = cdiv(min(g.window - 1 + max_num_batched_tokens, max_model_len), bs) + 1
        else:
            blocks = cdiv(max_model_len, bs)
        num_groups += cdiv(g.num_layers, group_size)
        blocks_per_request += cdiv(g.num_layers, group_size) * blocks
    num_blocks = budget_bytes // (page * group_size)
    return num_blocks // num_groups * bs, num_blocks / blocks_per_request


def weight_bytes(model: ModelSpec, *, weight_dtype: str | None = None, tp: int = 1) -> int:
    """Bytes of weights on one TP rank: parameters x dtype bytes / tp (ceil).

    Without `weight_dtype`, the shipped checkpoint's size when the catalogue knows it (mixed-dtype
    checkpoints such as gpt-oss's MXFP4 experts), else parameters x the model's dtype.
    """
    _positive_int(tp, "--tp")
    if weight_dtype is None and model.checkpoint_bytes:
        return cdiv(model.checkpoint_bytes, tp)
    if model.num_params is None:
        raise KvsimError(
            f"the parameter count of {model.name} is unknown (a config.json does not state it), so weight memory "
            "cannot be computed; use a catalogue model or give --params",
            source=model.source,
            field="num_params",
        )
    dtype = weight_dtype or model.weight_dtype
    per_param = dtype_bytes(dtype, field="--weight-dtype")
    return cdiv(math.ceil(model.num_params * per_param), tp)


def kv_budget_bytes(memory_bytes: int, *, utilization: float, weight_bytes: int, field: str = "--memory") -> int:
    """KV bytes left on a device: memory x utilization (vLLM's gpu_memory_utilization) minus weights.

    Activations and CUDA graphs also take memory in a real engine; kvsim does not guess them.
    """
    if not 0 < utilization <= 1:
        raise KvsimError(f"must be in (0, 1], got {utilization}", field="--utilization")
    usable = int(memory_bytes * utilization)
    budget = usable - weight_bytes
    if budget <= 0:
        raise KvsimError(
            f"weights ({weight_bytes:,} B) do not fit in {memory_bytes:,} B x utilization {utilization} "
            f"= {usable:,} B; no room for KV cache (try --tp, a smaller --weight-dtype, or more memory)",
            field=field,
        )
    return budget


@dataclass(frozen=True)
class Capacity:
    """How much fits in a KV budget: tokens, and sequences of `context_tokens` (vLLM's concurrency line)."""

    kv_budget_bytes: int
    max_tokens: int | None  # budget / bytes per token, every layer keeping every token; None without per-token KV
    max_tokens_block_rounded: int | None  # whole blocks x block_size (vLLM's "GPU KV cache size: N tokens")
    max_sequences: float  # budget / capped bytes per sequence
    max_sequences_block_rounded: float  # whole blocks of the budget / whole-block bytes per sequence
    max_sequences_uncapped: float  # budget / uncapped bytes per sequence
    vllm_exact: bool = True  # the block-rounded pair is vLLM's arithmetic (False: state layers, kvsim's estimate)


def capacity(spec: KVCacheSpec, budget_bytes: int, context_tokens: int, max_num_batched_tokens: int = 8192) -> Capacity:
    """Tokens and concurrent sequences of `context_tokens` that `budget_bytes` of KV memory holds.

    The block-rounded pair is vLLM's own arithmetic (`vllm_kv_cache_size`) where kvsim can reproduce it;
    for models with state layers, whole blocks of every layer plus each sequence's state.
    """
    per_token = spec.bytes_per_token
    usable = budget_bytes
    if spec.block_bytes:
        usable = (budget_bytes // spec.block_bytes) * spec.block_bytes  # whole blocks
    tokens_rounded = (budget_bytes // spec.block_bytes) * spec.block_size if per_token else None
    sequences_rounded = usable / block_rounded_bytes_per_sequence(spec, context_tokens)
    vllm = vllm_kv_cache_size(spec, budget_bytes, context_tokens, max_num_batched_tokens)
    if vllm is not None:
        tokens_rounded, sequences_rounded = vllm
    return Capacity(
        kv_budget_bytes=budget_bytes,
        max_tokens=budget_bytes // per_token if per_token else None,
        max_tokens_block_rounded=tokens_rounded,
        max_sequences=budget_bytes / bytes_per_sequence(spec, context_tokens),
        max_sequences_block_rounded=sequences_rounded,
        max_sequences_uncapped=budget_bytes / bytes_per_sequence(spec, context_tokens, capped=False),
        vllm_exact=vllm is not None,
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
    max_num_batched_tokens: int = 8192

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
    max_num_batched_tokens: int = 8192,
) -> SizeReport:
    """Everything `kvsim size` reports; the capacity part only when `memory_bytes` is given.

    `max_num_batched_tokens` only enters vLLM's sliding-window bound (see `vllm_kv_cache_size`).
    """
    if not 0 < utilization <= 1:  # checked even without a device, so a typo never passes silently
        raise KvsimError(f"must be in (0, 1], got {utilization}", field="--utilization")
    _positive_int(max_num_batched_tokens, "--max-num-batched-tokens")
    spec = kv_cache_spec(model, kv_dtype=kv_dtype, block_size=block_size, tp=tp)
    n = _positive_int(context_tokens, "--context") if context_tokens is not None else model.max_model_len
    report = SizeReport(
        model=model,
        spec=spec,
        tp=tp,
        context_tokens=n,
        bytes_per_sequence=bytes_per_sequence(spec, n),
        bytes_per_sequence_uncapped=bytes_per_sequence(spec, n, capped=False),
        bytes_per_sequence_block_rounded=block_rounded_bytes_per_sequence(spec, n),
        max_num_batched_tokens=max_num_batched_tokens,
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
        capacity=capacity(spec, budget, n, max_num_batched_tokens),
    )
