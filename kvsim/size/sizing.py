"""kvsim's size math: KV bytes per token / block / sequence, weight bytes, KV budgets.

The figures follow vLLM (vllm/v1/kv_cache_interface.py): full attention stores K and V per KV head, MLA one
latent per token (no factor 2, replicated on every TP rank), sliding layers need at most their window,
linear/mamba layers hold a constant state per sequence. Everything is per tensor-parallel rank. What fits in
a budget is `kvsim.size.report`; vLLM's own start-up arithmetic is `kvsim.size.vllm`.
"""

from __future__ import annotations

import math

from kvsim.size.kv_cache_spec import KVCacheGroupSpec, KVCacheSpec
from kvsim.errors import KvsimError
from kvsim.models.spec import LayerKind, ModelSpec
from kvsim.units import dtype_bytes


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def positive_int(value: int, field: str) -> int:
    """`value` if it is a positive int (not a bool), else a KvsimError naming the option `field`."""
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
    positive_int(block_size, "--block-size")
    positive_int(tp, "--tp")
    if model.num_attention_heads % tp:
        raise KvsimError(
            f"--tp {tp} does not divide num_attention_heads {model.num_attention_heads} of {model.name}", field="--tp"
        )
    for layer in model.attention_layers:
        _check_kv_heads_split(layer.num_kv_heads, tp, model.name)
    kv_bytes = int(dtype_bytes(kv_dtype, field="--kv-dtype", kv=True))
    state_bytes = dtype_bytes(_state_dtype(model))

    full = [layer for layer in model.layers if layer.kind in (LayerKind.FULL, LayerKind.MLA)]
    windowed: dict[tuple[str, int], list] = {}  # (group kind, window) -> layers
    for layer in model.layers:
        if layer.kind in (LayerKind.SLIDING, LayerKind.CHUNKED):
            windowed.setdefault((layer.kind.value, layer.window), []).append(layer)
    states = [layer for layer in model.layers if layer.kind == LayerKind.LINEAR_STATE]

    def per_token(layers: list) -> int:  # K+V (or latent) in the KV dtype, plus any indexer keys in fp8
        return sum(layer.elements_per_token(tp) for layer in layers) * kv_bytes + sum(layer.index_bytes for layer in layers)

    groups = []
    if full:
        groups.append(KVCacheGroupSpec("full", len(full), bytes_per_token=per_token(full)))
    for (kind, window), layers in windowed.items():
        groups.append(KVCacheGroupSpec(kind, len(layers), bytes_per_token=per_token(layers), window=window))
    if states:
        total = sum(layer.state_bytes_per_rank(state_bytes, tp) for layer in states)
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
    """The most windowed KV one sequence ever needs: each sliding group's window, each chunked group's chunk."""
    return sum(g.bytes_per_token * g.window for g in spec.groups if g.window is not None)


def bytes_per_sequence(spec: KVCacheSpec, num_tokens: int, *, capped: bool = True) -> int:
    """KV + state of one sequence of `num_tokens` tokens, before block rounding.

    capped: sliding layers keep at most their window, chunked layers at most one chunk (an engine that frees
    blocks they no longer attend to, as vLLM 0.33 does for both); uncapped: every per-token layer keeps every
    token (what engines without window freeing allocate). State layers count once either way.
    """
    total = spec.state_bytes_per_sequence
    for g in spec.groups:
        if g.kind == "full" or (g.window is not None and not capped):
            total += g.bytes_per_token * num_tokens
        elif g.window is not None:
            total += g.bytes_per_token * min(num_tokens, g.window)
    return total


def block_rounded_bytes_per_sequence(spec: KVCacheSpec, num_tokens: int) -> int:
    """Like `bytes_per_sequence` (capped) but in whole blocks, as a paged engine allocates.

    Full layers hold cdiv(n, block_size) blocks. A sliding layer holds the blocks its window can touch,
    vLLM's SlidingWindowSpec bound with a one-token step: cdiv(window, block_size) + 1, never more than the
    sequence's own cdiv(n, block_size). A chunked layer holds its current chunk's blocks: cdiv(chunk, block_size),
    one more when chunks do not start on a block boundary.
    """
    bs = spec.block_size
    blocks = cdiv(num_tokens, bs)
    total = spec.state_bytes_per_sequence
    for g in spec.groups:
        if g.kind == "full":
            total += g.bytes_per_token * bs * blocks
        elif g.kind == "sliding":
            total += g.bytes_per_token * bs * min(blocks, cdiv(g.window, bs) + 1)
        elif g.kind == "chunked":
            total += g.bytes_per_token * bs * min(blocks, cdiv(g.window, bs) + (1 if g.window % bs else 0))
    return total


def weight_bytes(model: ModelSpec, *, weight_dtype: str | None = None, tp: int = 1) -> int:
    """Bytes of weights on one TP rank: parameters x dtype bytes / tp (ceil).

    Without `weight_dtype`, the shipped checkpoint's size when the catalogue knows it (mixed-dtype
    checkpoints such as gpt-oss's MXFP4 experts), else parameters x the model's dtype.
    """
    positive_int(tp, "--tp")
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
    """Memory x utilization minus weights: the plain arithmetic, for a budget given as such.

    vLLM's start-up leaves less (the profile run's peak, non-torch memory, CUDA graphs): every budget derived from
    a GPU and a gpu_memory_utilization comes from `kvsim.size.startup.vllm_kv_cache_memory`.
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
