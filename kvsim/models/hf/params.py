"""A parameter count estimated from a config's tensor shapes (for weight memory).
"""

from __future__ import annotations

from typing import Any

from kvsim.models.hf.families import family_of
from kvsim.models.hf.fields import Config, flatten
from kvsim.models.spec import LayerKind, ModelSpec

# Families whose MLP is two matrices (up, down) rather than gated (gate, up, down).
_UNGATED_MLP = {"opt", "gpt2", "gpt_neox", "falcon", "gpt_bigcode", "phi", "bloom"}
_QK_NORM = {"qwen3", "qwen3_moe", "gemma3", "gemma3_text"}  # per-head RMSNorm on q and k
_SANDWICH_NORM = {"gemma2", "gemma3", "gemma3_text"}  # four norms per layer
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3", "gemma3_text", "opt"}  # transformers class defaults


def estimate_num_params(data: dict[str, Any], model: ModelSpec) -> int | None:
    """Total parameters counted from tensor shapes, for weight memory; None where kvsim can't count them.

    Counts embeddings (and an untied LM head), each layer's q/k/v/o projections, MLP or all MoE experts
    (plus router and shared expert), and norms; ignores biases. Matches the published totals of Llama 3.x,
    Mistral, Mixtral and Qwen3 dense models to the parameter. MLA, linear/mamba, chunked and no-cache layers,
    layers of differing shapes and families with a reader of their own (kvsim.models.hf.families): None.
    """
    data = flatten(data)
    if family_of(Config(data, model.source or "")) != "generic":
        return None
    if any(layer.kind not in (LayerKind.FULL, LayerKind.SLIDING) or layer.head_dim_v for layer in model.layers):
        return None
    if len({(layer.num_kv_heads, layer.head_dim) for layer in model.layers}) > 1:
        return None
    h = model.hidden_size
    inter = data.get("moe_intermediate_size") or data.get("intermediate_size") or data.get("ffn_dim")
    vocab = data.get("vocab_size")
    if not isinstance(inter, int) or not isinstance(vocab, int):
        return None
    layer = model.layers[0]
    q_dim = model.num_attention_heads * layer.head_dim
    attention = h * q_dim + 2 * h * layer.num_kv_heads * layer.head_dim + q_dim * h
    family = str(data.get("model_type", "")).lower()
    if family in _QK_NORM:
        attention += 2 * layer.head_dim  # q_norm, k_norm
    norms = 4 if family in _SANDWICH_NORM else 2
    matrices = 2 if family in _UNGATED_MLP else 3
    experts = data.get("num_experts") or data.get("num_local_experts") or data.get("n_routed_experts") or 1
    mlp = matrices * h * inter * experts + (h * experts if experts > 1 else 0)
    shared = data.get("shared_expert_intermediate_size")
    if isinstance(shared, int):
        mlp += 3 * h * shared + h
    tied = data.get("tie_word_embeddings", family in _TIED_BY_DEFAULT)
    embeddings = vocab * h * (1 if tied else 2)
    return model.num_layers * (attention + mlp + norms * h) + h + embeddings
