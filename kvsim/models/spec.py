"""A model as kvsim sees it: a list of layers, each of one kind, plus the facts weight memory needs.

Every size kvsim reports follows from the layers (`LayerSpec`), never from special cases per model name.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from kvsim.units import dtype_bytes

if TYPE_CHECKING:
    from kvsim.models.weight_config import WeightConfig


class LayerKind(str, Enum):
    """How a layer keeps its past.

    - FULL: full attention, K and V of every token (`2 x num_kv_heads x head_dim` elements per token);
    - SLIDING: attention over the last `window` tokens only; same per-token cost as FULL, but an engine
      that frees blocks outside the window keeps at most `window` tokens per sequence;
    - MLA: multi-head latent attention (DeepSeek): one compressed latent of `kv_lora_rank +
      qk_rope_head_dim` elements per token, no separate K and V, the same on every TP rank;
    - CHUNKED: chunked local attention (Llama 4): attends within its `window`-token chunk only; same
      per-token cost as FULL. vLLM 0.33 keeps it in its own ChunkedLocalAttentionSpec groups (the hybrid KV
      cache manager stays on for it by default); kvsim's paged replay still allocates it as FULL;
    - LINEAR_STATE: linear attention / gated delta net / mamba / RWKV: a constant-size state per sequence;
    - NO_CACHE: a layer that keeps nothing: an MLP-only layer (Nemotron-H `-`/`E`), attention replaced by a
      no-op or a linear map (DeciLM), or one that reads an earlier layer's KV (Gemma-3n/Gemma 4 KV sharing).
    """

    FULL = "full"
    SLIDING = "sliding"
    CHUNKED = "chunked"
    MLA = "mla"
    LINEAR_STATE = "linear-state"
    NO_CACHE = "none"


_WINDOWED = (LayerKind.SLIDING, LayerKind.CHUNKED)
_KV_HEADS = (LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's cache footprint, in elements (dtype applied later by `kvsim.size.sizing`).

    `head_dim_v` is V's head size where it differs from K's (MiMo-V2: 192 / 128); 0 means equal.
    `index_bytes` is a sparse-attention indexer's key cache per token (DeepSeek-V3.2, GLM-5): vLLM stores it
    as fp8 plus one fp32 scale per 128 elements whatever the KV dtype, so it is bytes, not elements.
    `state_elements` is the whole per-sequence state of a LINEAR_STATE layer (conv + recurrent/ssm state);
    `ssm_elements` of them (the recurrent/ssm part) are kept in `ssm_dtype` when one is given (vLLM's
    mamba_ssm_cache_dtype: float32 for Nemotron-H, the config's mamba_ssm_dtype for Qwen3.5), the rest in the
    model's dtype. `state_sharded` says whether TP ranks split it (heads / channels are split in vLLM's gated
    delta net and mamba layers), in which case each rank holds `cdiv(state_elements, tp)`.
    """

    kind: LayerKind
    num_kv_heads: int = 0  # FULL / SLIDING / CHUNKED
    head_dim: int = 0  # FULL / SLIDING / CHUNKED: K's head size
    window: int | None = None  # SLIDING: window; CHUNKED: attention_chunk_size
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim
    state_elements: int = 0  # LINEAR_STATE
    state_sharded: bool = True
    head_dim_v: int = 0  # V's head size when it differs from head_dim
    index_bytes: int = 0  # MLA with a sparse-attention indexer: its key cache, bytes per token
    ssm_elements: int = 0  # LINEAR_STATE: the part of state_elements kept in ssm_dtype
    ssm_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.kind in _KV_HEADS:
            assert self.num_kv_heads > 0 and self.head_dim > 0 and self.head_dim_v >= 0, self
        assert (self.window is not None and self.window > 0) == (self.kind in _WINDOWED), self
        assert (self.latent_dim > 0) == (self.kind == LayerKind.MLA), self
        assert (self.state_elements > 0) == (self.kind == LayerKind.LINEAR_STATE), self
        assert 0 <= self.ssm_elements <= self.state_elements and self.index_bytes >= 0, self

    @property
    def holds_tokens(self) -> bool:
        """Whether this layer's cache grows with every token (attention kinds, not state or no-cache)."""
        return self.kind not in (LayerKind.LINEAR_STATE, LayerKind.NO_CACHE)

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads on one TP rank: split across ranks, replicated when fewer heads than ranks (vLLM)."""
        if self.kind == LayerKind.MLA:
            return 1  # the latent is replicated on every rank
        return max(1, self.num_kv_heads // tp)

    def elements_per_token(self, tp: int = 1) -> int:
        """Cache elements one token adds to this layer on one TP rank (0 for state layers)."""
        if self.kind == LayerKind.MLA:
            return self.latent_dim
        if not self.holds_tokens:
            return 0
        return self.kv_heads_per_rank(tp) * (self.head_dim + (self.head_dim_v or self.head_dim))  # K and V

    def state_elements_per_rank(self, tp: int = 1) -> int:
        """Constant per-sequence state elements on one TP rank (0 for attention layers)."""
        if not self.state_sharded:
            return self.state_elements
        return _cdiv(self.state_elements, tp)

    def state_bytes_per_rank(self, model_dtype_bytes: float, tp: int = 1) -> int:
        """Constant per-sequence state bytes on one TP rank: the ssm part in ssm_dtype, the rest in the model's."""
        if self.kind != LayerKind.LINEAR_STATE:
            return 0
        ssm = _cdiv(self.ssm_elements, tp) if self.state_sharded else self.ssm_elements
        ssm_bytes = dtype_bytes(self.ssm_dtype) if self.ssm_dtype else model_dtype_bytes
        return int((self.state_elements_per_rank(tp) - ssm) * model_dtype_bytes + ssm * ssm_bytes)

    @property
    def label(self) -> str:
        """The kind as tables group it: 'full', 'sliding(4096)', 'chunked(8192)', 'mla', 'linear-state', 'none'."""
        return f"{self.kind.value}({self.window})" if self.kind in _WINDOWED else self.kind.value

    def describe(self) -> str:
        """A short label: 'full 8x128', 'sliding(4096) 8x192/128', 'mla latent 576 + index 132 B', ..."""
        if self.kind == LayerKind.MLA:
            return f"mla latent {self.latent_dim}" + (f" + index {self.index_bytes} B" if self.index_bytes else "")
        if self.kind == LayerKind.LINEAR_STATE:
            return f"linear-state {self.state_elements} elems" + (f" ({self.ssm_elements} in {self.ssm_dtype})" if self.ssm_dtype else "")
        if self.kind == LayerKind.NO_CACHE:
            return "none"
        v = f"/{self.head_dim_v}" if self.head_dim_v and self.head_dim_v != self.head_dim else ""
        return f"{self.label} {self.num_kv_heads}x{self.head_dim}{v}"


@dataclass(frozen=True)
class ModelSpec:
    """A model's layers and the facts sizing needs (names follow Hugging Face config.json).

    `num_params` is the total parameter count (all experts of a MoE), for weight memory; None when
    unknown (a config.json alone does not say it reliably). `weight_dtype` is the checkpoint dtype;
    `checkpoint_kv_dtype` the KV cache dtype its quantization_config asks for ("fp8", "nvfp4"; None: the model's
    dtype), which vLLM's --kv-cache-dtype auto takes (kvsim.models.hf.context.checkpoint_kv_dtype).
    """

    name: str
    hf_id: str | None
    layers: tuple[LayerSpec, ...]
    max_model_len: int  # max_position_embeddings
    num_params: int | None
    hidden_size: int
    num_attention_heads: int
    weight_dtype: str = "bf16"
    checkpoint_kv_dtype: str | None = None
    vocab_size: int | None = None
    source: str | None = None  # where the config came from (catalogue entry or file path)
    params_source: str | None = None  # where num_params came from
    checkpoint_bytes: int | None = None  # shipped weight bytes when they mix dtypes (gpt-oss MXFP4 experts)
    vllm_unserved: str | None = None  # why vLLM serves no such model (RWKV); then kvsim's figures are its own
    weight_config: WeightConfig | None = None  # vocabulary, MLP/MoE widths, quantization (kvsim.models.weight_config)

    def __post_init__(self) -> None:
        assert len(self.layers) > 0 and self.max_model_len > 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_counts(self) -> dict[str, int]:
        """Layers by kind label, e.g. {'full': 21, 'sliding(4096)': 21}, in first-seen order."""
        counts: Counter[str] = Counter()
        for layer in self.layers:
            counts[layer.label] += 1
        return dict(counts)

    @property
    def attention_layers(self) -> tuple[LayerSpec, ...]:
        """Layers whose cache grows per token (full, sliding, chunked, MLA)."""
        return tuple(layer for layer in self.layers if layer.holds_tokens)

    @property
    def num_kv_heads(self) -> int:
        """KV heads of the first attention layer (MLA: 1; no attention layer: 0)."""
        first = next(iter(self.attention_layers), None)
        if first is None:
            return 0
        return 1 if first.kind == LayerKind.MLA else first.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Head size of the first attention layer (MLA: the latent width; no attention layer: 0)."""
        first = next(iter(self.attention_layers), None)
        if first is None:
            return 0
        return first.latent_dim if first.kind == LayerKind.MLA else first.head_dim

    def describe_layers(self) -> str:
        """'21 sliding(4096) + 21 full' style summary."""
        return " + ".join(f"{n} {label}" for label, n in self.layer_counts.items())
