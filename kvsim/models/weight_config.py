"""The config.json fields weight bytes depend on beyond the layers: vocabulary, MLP and MoE widths, MLA ranks, and
the checkpoint's quantization (read once, kept on ModelSpec.weight_config; counted in kvsim.models.weights)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from kvsim.errors import KvsimError

if TYPE_CHECKING:
    from kvsim.models.quantization import Quantization

_UNGATED_MLP = {"opt", "gpt2", "gpt_neox", "falcon", "gpt_bigcode", "phi", "bloom"}
_QK_NORM = {"qwen3", "qwen3_moe", "gemma3", "gemma3_text"}
_QKV_BIAS = {"qwen2", "qwen2_moe", "qwen2_vl"}  # transformers' Qwen2 layers always have q/k/v biases
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3", "gemma3_text", "opt"}


class WeightConfig(NamedTuple):  # not a frozen dataclass: ~6x cheaper to define (kvsim size's start-up)
    """The config fields weight bytes depend on beyond the layers (read once from config.json)."""

    vocab_size: int | None
    tied: bool
    intermediate_size: int | None  # dense MLP width
    mlp_matrices: int = 3  # gated (gate, up, down) or 2
    num_experts: int = 0
    experts_per_token: int = 0  # top-k routing
    moe_intermediate_size: int | None = None
    moe_layers: tuple[int, ...] = ()  # indices of MoE layers
    shared_intermediate_size: int = 0  # shared experts' total width per MoE layer
    mla: tuple[int, int, int, int, int] | None = None  # q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head_dim
    quantization: Quantization | None = None
    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma 3)
    # the error of a quantization_config kvsim does not model: raised where weights are counted (kvsim size with a
    # GPU, the replay), never a silent bf16 guess; the KV cache of such a checkpoint is still sized
    unmodelled_quantization: str | None = None


def weight_config(data: dict[str, Any], num_layers: int, source: str | None) -> WeightConfig:
    """A flattened config dict's weight fields; an unmodelled quantization method is kept as its error, raised
    where weights are counted (kvsim.models.weights)."""
    family = str(data.get("model_type", "")).lower()
    quant, unmodelled = None, None
    if data.get("quantization_config") is not None:  # kvsim.models.quantization loads for a quantized checkpoint only
        from kvsim.models.quantization import read_quantization

        try:
            quant = read_quantization(data["quantization_config"], source)
        except KvsimError as exc:
            unmodelled = str(exc)
    experts = data.get("num_experts") or data.get("num_local_experts") or data.get("n_routed_experts") or 0
    experts = experts if isinstance(experts, int) and experts > 1 else 0
    moe_layers: tuple[int, ...] = ()
    if experts:
        first_dense = data.get("first_k_dense_replace") or 0
        step = data.get("decoder_sparse_step") or data.get("interleave_moe_layer_step") or data.get("moe_layer_freq") or 1
        dense_only = set(data.get("mlp_only_layers") or [])
        step = step if isinstance(step, int) and step > 0 else 1
        moe_layers = tuple(i for i in range(num_layers)
                           if i >= first_dense and (i + 1) % step == 0 and i not in dense_only)  # fmt: skip
    moe_inter = data.get("moe_intermediate_size") or (data.get("intermediate_size") if experts else None)
    shared = data.get("shared_expert_intermediate_size") or 0
    if not shared and data.get("n_shared_experts") and isinstance(moe_inter, int):
        shared = int(data["n_shared_experts"]) * moe_inter
    mla = None
    if data.get("kv_lora_rank"):
        mla = (int(data.get("q_lora_rank") or 0), int(data["kv_lora_rank"]), int(data.get("qk_nope_head_dim") or 0),
               int(data.get("qk_rope_head_dim") or 0), int(data.get("v_head_dim") or 0))  # fmt: skip
    vocab = data.get("vocab_size")
    inter = data.get("intermediate_size") or data.get("ffn_dim") or data.get("n_inner")
    return WeightConfig(
        vocab_size=vocab if isinstance(vocab, int) else None,
        tied=bool(data.get("tie_word_embeddings", family in _TIED_BY_DEFAULT)),
        intermediate_size=inter if isinstance(inter, int) else None,
        mlp_matrices=2 if family in _UNGATED_MLP else 3,
        num_experts=experts,
        experts_per_token=int(data.get("num_experts_per_tok") or data.get("moe_topk") or data.get("num_experts_per_token") or 0) if experts else 0,
        moe_intermediate_size=moe_inter if isinstance(moe_inter, int) else None,
        moe_layers=moe_layers,
        shared_intermediate_size=int(shared),
        mla=mla,
        quantization=quant,
        unmodelled_quantization=unmodelled,
        qk_norm=family in _QK_NORM,
        qkv_bias=bool(data.get("attention_bias", data.get("qkv_bias", family in _QKV_BIAS))),
    )
