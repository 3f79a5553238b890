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
from typing import TYPE_CHECKING, NamedTuple

from kvsim.errors import KvsimError
from kvsim.models.weight_config import WeightConfig
from kvsim.units import dtype_bytes

if TYPE_CHECKING:
    from kvsim.models.quantization import Quantization
    from kvsim.models.spec import ModelSpec

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


class WeightGroup(NamedTuple):  # not a frozen dataclass: ~6x cheaper to define (kvsim size's start-up)
    """One group of tensors: its elements and bytes (checkpoint or per rank), and whether they are quantized."""

    name: str
    params: int
    bytes: int
    quantized: bool


class Weights(NamedTuple):  # not a frozen dataclass: ~6x cheaper to define (kvsim size's start-up)
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
    if cfg is not None and cfg.unmodelled_quantization and not weight_dtype:
        raise KvsimError(cfg.unmodelled_quantization)
    if cfg is None or cfg.vocab_size is None:
        return None
    quant = None if weight_dtype else cfg.quantization
    # vLLM's dtype "auto": the config's torch_dtype, but float32 checkpoints are served in bf16
    activation = model.weight_dtype if model.weight_dtype in ("bf16", "fp16") else "bf16"
    if weight_dtype in ("bf16", "fp16", "fp32"):
        activation = weight_dtype  # vLLM's --dtype: every tensor in it
    elif weight_dtype:  # --quantization fp8 and the like: linear layers in it, embeddings in the activation dtype
        from kvsim.models.quantization import Quantization

        quant = Quantization(weight_dtype, 8 * dtype_bytes(weight_dtype, field="--weight-dtype"), group_size=0, scale_bytes=4)
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
    stated = model.num_params if not (model.params_source or "").startswith("estimated") else None
    if stated is not None:  # a config excerpt without some widths (catalogue entries): the rest
        counted = sum(counter.params.values()) * (split if loaded else 1)
        if loaded:  # the stated count is the checkpoint's: compare it without vLLM's padding (vocab, MXFP4 tiles)
            shipped = model_weights(model, loaded=False, weight_dtype=weight_dtype)
            computed = computed and shipped is not None and shipped.computed
        else:
            computed = computed and abs(counted - stated) <= 0.02 * stated
        if not computed:
            rest = max(stated - counted, 0)
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
            if cfg.qk_norm:
                counter.add("attention", 2 * d, 1, quantize=False)
            if cfg.qkv_bias:
                counter.add("attention", heads // tp * d + kv * (d + dv), 1, quantize=False)
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
    eh, per_rank = h, cfg.moe_intermediate_size // tp
    quant = counter.quant
    if loaded and quant is not None and quant.method == "mxfp4":  # the MoE kernel's tiles, per rank
        eh, per_rank = math.ceil(h / 256) * 256, math.ceil(per_rank / 128) * 128
    n = len(moe) * cfg.num_experts
    counter.add("experts", 2 * per_rank, eh, n)  # gate_up
    counter.add("experts", eh, per_rank, n)  # down
    counter.add("router", cfg.num_experts, h, len(moe), quantize=False)
    if cfg.shared_intermediate_size:
        s = cfg.shared_intermediate_size // tp
        counter.add("mlp", 2 * s, h, len(moe))
        counter.add("mlp", h, s, len(moe))
