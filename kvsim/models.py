"""A model as kvsim sees it: a list of layers, each of one kind, plus the facts weight memory needs.

Every size kvsim reports follows from the layers (`LayerSpec`), never from special cases per model name.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum


class LayerKind(str, Enum):
    """How a layer keeps its past.

    - FULL: full attention, K and V of every token (`2 x num_kv_heads x head_dim` elements per token);
    - SLIDING: attention over the last `window` tokens only; same per-token cost as FULL, but an engine
      that frees blocks outside the window keeps at most `window` tokens per sequence;
    - MLA: multi-head latent attention (DeepSeek): one compressed latent of `kv_lora_rank +
      qk_rope_head_dim` elements per token, no separate K and V, the same on every TP rank;
    - LINEAR_STATE: linear attention / gated delta net / mamba: a constant-size state per sequence.
    """

    FULL = "full"
    SLIDING = "sliding"
    MLA = "mla"
    LINEAR_STATE = "linear-state"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's cache footprint, in elements (dtype applied later by `kvsim.sizing`).

    `state_elements` is the whole per-sequence state of a LINEAR_STATE layer (conv + recurrent/ssm state);
    `state_sharded` says whether TP ranks split it (heads / channels are split in vLLM's gated delta net
    and mamba layers), in which case each rank holds `cdiv(state_elements, tp)`.
    """

    kind: LayerKind
    num_kv_heads: int = 0  # FULL / SLIDING
    head_dim: int = 0  # FULL / SLIDING
    window: int | None = None  # SLIDING
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim
    state_elements: int = 0  # LINEAR_STATE
    state_sharded: bool = True

    def __post_init__(self) -> None:
        if self.kind in (LayerKind.FULL, LayerKind.SLIDING):
            assert self.num_kv_heads > 0 and self.head_dim > 0, self
        assert (self.window is not None and self.window > 0) == (self.kind == LayerKind.SLIDING), self
        assert (self.latent_dim > 0) == (self.kind == LayerKind.MLA), self
        assert (self.state_elements > 0) == (self.kind == LayerKind.LINEAR_STATE), self

    @property
    def holds_tokens(self) -> bool:
        """Whether this layer's cache grows with every token (all kinds but LINEAR_STATE)."""
        return self.kind != LayerKind.LINEAR_STATE

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads on one TP rank: split across ranks, replicated when fewer heads than ranks (vLLM)."""
        if self.kind == LayerKind.MLA:
            return 1  # the latent is replicated on every rank
        return max(1, self.num_kv_heads // tp)

    def elements_per_token(self, tp: int = 1) -> int:
        """Cache elements one token adds to this layer on one TP rank (0 for state layers)."""
        if self.kind == LayerKind.MLA:
            return self.latent_dim
        if self.kind == LayerKind.LINEAR_STATE:
            return 0
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim  # K and V

    def state_elements_per_rank(self, tp: int = 1) -> int:
        """Constant per-sequence state elements on one TP rank (0 for attention layers)."""
        if not self.state_sharded:
            return self.state_elements
        return _cdiv(self.state_elements, tp)

    def describe(self) -> str:
        """A short label for tables: 'full 8x128', 'sliding(4096) 8x128', 'mla 576', 'linear-state 1097728'."""
        if self.kind == LayerKind.MLA:
            return f"mla latent {self.latent_dim}"
        if self.kind == LayerKind.LINEAR_STATE:
            return f"linear-state {self.state_elements} elems"
        prefix = f"sliding({self.window})" if self.kind == LayerKind.SLIDING else "full"
        return f"{prefix} {self.num_kv_heads}x{self.head_dim}"


@dataclass(frozen=True)
class ModelSpec:
    """A model's layers and the facts sizing needs (names follow Hugging Face config.json).

    `num_params` is the total parameter count (all experts of a MoE), for weight memory; None when
    unknown (a config.json alone does not say it reliably). `weight_dtype` is the checkpoint dtype.
    """

    name: str
    hf_id: str | None
    layers: tuple[LayerSpec, ...]
    max_model_len: int  # max_position_embeddings
    num_params: int | None
    hidden_size: int
    num_attention_heads: int
    weight_dtype: str = "bf16"
    vocab_size: int | None = None
    source: str | None = None  # where the config came from (catalogue entry or file path)
    params_source: str | None = None  # where num_params came from
    checkpoint_bytes: int | None = None  # shipped weight bytes when they mix dtypes (gpt-oss MXFP4 experts)

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
            label = f"sliding({layer.window})" if layer.kind == LayerKind.SLIDING else layer.kind.value
            counts[label] += 1
        return dict(counts)

    @property
    def attention_layers(self) -> tuple[LayerSpec, ...]:
        """Layers whose cache grows per token (full, sliding, MLA)."""
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
