"""kvsim's layer list as vLLM 0.33.0's per-layer KV cache specs, one TP rank; kinds it does not follow are a KvsimError."""

from __future__ import annotations

from typing import NamedTuple

from kvsim.errors import KvsimError
from kvsim.models.spec import LayerKind, ModelSpec
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.size.vllm_settings import VLLM_VERSION


class VllmLayer(NamedTuple):  # not a frozen dataclass: ~6x cheaper to define (kvsim size's start-up)
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
