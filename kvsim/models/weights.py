"""Weight bytes per tensor group, from a config: as the checkpoint ships them, and as one tensor-parallel rank of
vLLM 0.33 holds them.

Groups: embedding, lm_head (absent when tied), attention (q/k/v/o, or MLA's projections), dense MLP, MoE experts
(with router and shared experts), and the rest (norms). Quantized groups take `Quantization.matrix_bytes`; the
embedding and lm_head stay in the activation dtype. Per rank, vLLM pads the vocabulary to a multiple of 64 and
splits it (`VocabParallelEmbedding`), splits q/o/MLP/experts, keeps whole KV heads (replicated when tp exceeds
them), and replicates MLA's down-projections, routers and norms. MXFP4 experts are padded to the MoE kernel's
tile (hidden to 256, intermediate to 128: vLLM's Marlin/TRT-LLM layouts), which is why gpt-oss loads bigger
than its checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvsim.models.quantization import Quantization, read_quantization
from kvsim.units import dtype_bytes

if TYPE_CHECKING:
    from kvsim.models.spec import ModelSpec

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
_UNGATED_MLP = {"opt", "gpt2", "gpt_neox", "falcon", "gpt_bigcode", "phi", "bloom"}
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3", "gemma3_text", "opt"}


@dataclass(frozen=True)
class WeightConfig:
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


def weight_config(data: dict[str, Any], num_layers: int, source: str | None) -> WeightConfig:
    """A flattened config dict's weight fields; raises KvsimError on an unmodelled quantization method."""
    family = str(data.get("model_type", "")).lower()
    quant = read_quantization(data.get("quantization_config"), source)
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
    )


@dataclass(frozen=True)
class WeightGroup:
    """One group of tensors: its elements and bytes (checkpoint or per rank), and whether they are quantized."""

    name: str
    params: int
    bytes: int
    quantized: bool


@dataclass(frozen=True)
class Weights:
    """A model's weights by group; `total_bytes` is the checkpoint's (tp=1) or one rank's."""

    groups: tuple[WeightGroup, ...]
    tp: int
    quantization: str  # the scheme's label, or the dtype
    computed: bool  # every group counted from the config (else the rest is num_params less the counted groups)

    @property
    def total_bytes(self) -> int:
        return sum(g.bytes for g in self.groups)

    @property
    def total_params(self) -> int:
        return sum(g.params for g in self.groups)


class _Counter:
    """Adds matrices to groups, per rank: quantized where the scheme covers the group, else in `plain` bytes."""

    def __init__(self, quant: Quantization | None, plain: float) -> None:
        self.quant, self.plain = quant, plain
        self.params: dict[str, int] = {}
        self.bytes: dict[str, float] = {}
        self.quantized: dict[str, bool] = {}

    def add(self, group: str, out_f: int, in_f: int, count: int = 1, *, quantize: bool = True) -> None:
        q = self.quant if quantize and self.quant is not None else None
        if q is not None and q.experts_only and group != "experts":
            q = None
        nbytes = q.matrix_bytes(out_f, in_f) if q is not None else out_f * in_f * self.plain
        self.params[group] = self.params.get(group, 0) + out_f * in_f * count
        self.bytes[group] = self.bytes.get(group, 0) + nbytes * count
        self.quantized[group] = self.quantized.get(group, False) or q is not None


def model_weights(model: ModelSpec, *, tp: int = 1, loaded: bool = True, weight_dtype: str | None = None) -> Weights | None:
    """Weight bytes by group: `loaded` as one of `tp` ranks of vLLM holds them, else as the checkpoint ships
    them (tp must be 1). None where neither the config's shapes nor `num_params` say enough.

    `weight_dtype` overrides the checkpoint (every group in that dtype, no quantization).
    """
    cfg = model.weight_config
    if cfg is None or cfg.vocab_size is None:
        return None
    quant = None if weight_dtype else cfg.quantization
    activation = model.weight_dtype if model.weight_dtype in ("bf16", "fp16", "fp32") else "bf16"
    if weight_dtype in ("bf16", "fp16", "fp32"):
        activation = weight_dtype  # vLLM's --dtype: every tensor in it
    elif weight_dtype:  # --quantization fp8 and the like: linear layers in it, embeddings in the activation dtype
        quant = Quantization(weight_dtype, 8 * dtype_bytes(weight_dtype), group_size=0, scale_bytes=4)
    plain = dtype_bytes(activation)
    if quant is None and not weight_dtype and model.weight_dtype not in ("bf16", "fp16", "fp32"):
        return None  # a dtype without its quantization_config (a catalogue's weight_dtype): no per-group bytes
    counter = _Counter(quant, plain)
    h = model.hidden_size
    vocab = cfg.vocab_size
    if loaded:
        vocab = math.ceil(vocab / VOCAB_PADDING) * VOCAB_PADDING // tp
    counter.add("embedding", vocab, h, quantize=False)
    if not cfg.tied:
        counter.add("lm_head", vocab, h, quantize=False)
    split = tp if loaded else 1
    computed = _attention(counter, model, cfg, split)
    _mlp(counter, model, cfg, split, loaded)
    counter.add("other", h, 1, 2 * model.num_layers + 1, quantize=False)  # norms, replicated
    if model.num_params is not None:  # a config excerpt without some widths (catalogue entries): the rest
        counted = sum(counter.params.values()) * (split if loaded else 1)
        computed = computed and abs(counted - model.num_params) <= 0.02 * model.num_params
        if not computed:
            rest = max(model.num_params - counted, 0)
            scheme = quant if quant is not None and not quant.experts_only else None
            per_param = scheme.bytes_per_param(h, h) if scheme is not None else plain
            counter.params["rest"] = rest // split
            counter.bytes["rest"] = rest * per_param / split
            counter.quantized["rest"] = scheme is not None
    elif not computed:
        return None
    if loaded:  # the rotary cos/sin cache vLLM builds once per model: max positions x rotary dim, in bf16
        rotary = max((layer.head_dim for layer in model.attention_layers), default=0)
        counter.add("buffers", model.max_model_len, rotary, quantize=False)
    groups = tuple(
        WeightGroup(name, counter.params[name], math.ceil(counter.bytes[name]), counter.quantized[name])
        for name in counter.params
    )
    label = quant.label if quant is not None else activation
    return Weights(groups, tp if loaded else 1, label, computed)


def _attention(counter: _Counter, model: ModelSpec, cfg: WeightConfig, tp: int) -> bool:
    """q/k/v/o (or MLA's projections) of every layer, per rank; False where some layer's shapes are unknown."""
    from kvsim.models.spec import LayerKind

    h, heads = model.hidden_size, model.num_attention_heads
    known = True
    for layer in model.layers:
        if layer.kind == LayerKind.MLA and cfg.mla is not None:
            q_lora, kv_lora, nope, rope, v_dim = cfg.mla
            if q_lora:
                counter.add("attention", q_lora + kv_lora + rope, h)  # fused q_a/kv_a: replicated
                counter.add("attention", heads // tp * (nope + rope), q_lora)
            else:
                counter.add("attention", heads // tp * (nope + rope), h)
                counter.add("attention", kv_lora + rope, h)
            counter.add("attention", heads // tp * (nope + v_dim), kv_lora)
            counter.add("attention", h, heads // tp * v_dim)
        elif layer.kind in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED):
            d, dv = layer.head_dim, layer.head_dim_v or layer.head_dim
            kv = layer.kv_heads_per_rank(tp)
            counter.add("attention", heads // tp * d + kv * (d + dv), h)
            counter.add("attention", h, heads // tp * dv)
        else:
            known = False  # linear / mamba / no-cache layers: counted in the rest
    return known


def _mlp(counter: _Counter, model: ModelSpec, cfg: WeightConfig, tp: int, loaded: bool) -> None:
    """Dense MLPs, and MoE layers' experts, router and shared experts, per rank."""
    h = model.hidden_size
    moe = set(cfg.moe_layers)
    dense_layers = model.num_layers - len(moe)
    if cfg.intermediate_size and dense_layers:
        m = cfg.mlp_matrices
        counter.add("mlp", (m - 1) * cfg.intermediate_size // tp, h, dense_layers)
        counter.add("mlp", h, cfg.intermediate_size // tp, dense_layers)
    if not moe or not cfg.moe_intermediate_size:
        return
    eh, ei = h, cfg.moe_intermediate_size
    quant = counter.quant
    if loaded and quant is not None and quant.method == "mxfp4":
        eh, ei = math.ceil(h / 256) * 256, math.ceil(ei / 128) * 128  # the MoE kernel's tiles
    per_rank = ei // tp
    n = len(moe) * cfg.num_experts
    counter.add("experts", 2 * per_rank, eh, n)  # gate_up
    counter.add("experts", eh, per_rank, n)  # down
    counter.add("router", cfg.num_experts, h, len(moe), quantize=False)
    if cfg.shared_intermediate_size:
        s = cfg.shared_intermediate_size // tp
        counter.add("mlp", 2 * s, h, len(moe))
        counter.add("mlp", h, s, len(moe))
