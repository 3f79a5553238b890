"""Hugging Face config.json -> ModelSpec, offline: which kind each layer is and what it stores.

Handles explicit vs derived head_dim, MHA (no num_key_value_heads), Falcon multi_query, MLA, sliding windows
(model-wide, `layer_types`, `sliding_window_pattern`, family alternation), Qwen3-Next and Jamba hybrids, and
configs nested under `text_config`. A field it needs and cannot find raises KvsimError naming field and file.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvsim.errors import KvsimError
from kvsim.models import LayerKind, LayerSpec, ModelSpec

_MISSING = object()

# Families whose configs leave the sliding/full alternation implicit: layer i slides when (i+1) % n != 0.
# gemma2 and gpt-oss alternate starting with a sliding layer; gemma3's class default pattern is 6.
_FAMILY_PATTERN = {"gemma2": 2, "gpt_oss": 2, "gemma3": 6, "gemma3_text": 6}

_LAYER_TYPE_KINDS = {
    "full_attention": LayerKind.FULL,
    "attention": LayerKind.FULL,
    "global_attention": LayerKind.FULL,
    "sliding_attention": LayerKind.SLIDING,
    "local_attention": LayerKind.SLIDING,
    "linear_attention": LayerKind.LINEAR_STATE,
    "mamba": LayerKind.LINEAR_STATE,
}

_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16"}

# Fields a family's transformers config class fills in when config.json leaves them out (or sets them null).
# Shipped checkpoints rely on these: Falcon-7B/40B's config.json has no max_position_embeddings, gemma-3's
# text_config has neither max_position_embeddings nor vocab_size, and Qwen2/Qwen3 keep sliding windows off
# unless use_sliding_window says otherwise (then only layers >= max_window_layers slide).
_FALCON = {"max_position_embeddings": 2048}
_GEMMA3 = {"max_position_embeddings": 131072, "vocab_size": 262208}
_QWEN = {"use_sliding_window": False, "max_window_layers": 28}
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "falcon": _FALCON,
    "refinedweb": _FALCON,
    "refinedwebmodel": _FALCON,
    "gemma3": _GEMMA3,
    "gemma3_text": _GEMMA3,
    "qwen2": _QWEN,
    "qwen2_moe": _QWEN,
    "qwen3": _QWEN,
    "qwen3_moe": _QWEN,
}


def _flatten(data: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields: `text_config` (multimodal wrappers) over the top level, then class defaults."""
    text = data.get("text_config")
    if isinstance(text, dict):  # gemma3, llava...: the decoder lives here
        data = {**{k: v for k, v in data.items() if k != "text_config"}, **text}
    defaults = _CLASS_DEFAULTS.get(str(data.get("model_type", "")).lower(), {})
    return {**data, **{k: v for k, v in defaults.items() if data.get(k) is None}}


class _Config:
    """A config dict plus the file it came from, so every missing field names both."""

    def __init__(self, data: dict[str, Any], source: str):
        self.data = data
        self.source = source

    def get(self, *names: str, default: Any = _MISSING) -> Any:
        """The first of `names` present with a non-null value; `default` if given, else a KvsimError."""
        for name in names:
            value = self.data.get(name)
            if value is not None:
                return value
        if default is not _MISSING:
            return default
        raise KvsimError(f"missing field {' / '.join(names)!s}", source=self.source, field=names[0])

    def get_int(self, *names: str, default: Any = _MISSING) -> Any:
        """Like `get`, but a present value must be a positive integer (a default is returned as is)."""
        value = self.get(*names, default=default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise KvsimError(f"expected a positive integer, got {value!r}", source=self.source, field=names[0])
        return value


def config_name(path: Path, data: dict) -> str:
    """A model's name from its config file: the file's own name (`qwen25-7b.json` -> qwen25-7b), or for a
    Hugging Face `config.json` the config's `_name_or_path` (its last part) or else the folder holding it.

    Never the folder of a file with a name of its own: workloads resolve paths to absolute ones, and every
    report would be named after wherever the file happens to live.
    """
    if path.stem.lower() != "config":
        return path.stem
    hub = data.get("_name_or_path")
    if isinstance(hub, str) and hub.strip().strip("/"):
        return hub.strip().strip("/").split("/")[-1]
    return path.resolve().parent.name or path.stem


def load_hf_config(path: str | Path, *, name: str | None = None) -> ModelSpec:
    """Read a Hugging Face config.json at `path` into a ModelSpec (parameter count estimated from it)."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise KvsimError(f"cannot read config: {exc.strerror or exc}", source=source) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvsimError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", source=source) from None
    if not isinstance(data, dict):
        raise KvsimError("expected a JSON object at the top level", source=source)
    spec = model_spec_from_config(data, source=source, name=name or config_name(Path(path), data))
    estimate = estimate_num_params(data, spec)
    if estimate is None:
        return spec
    return replace(spec, num_params=estimate, params_source="estimated from config.json tensor shapes")


def model_spec_from_config(
    data: dict[str, Any],
    *,
    source: str,
    name: str,
    hf_id: str | None = None,
    num_params: int | None = None,
    params_source: str | None = None,
) -> ModelSpec:
    """Build a ModelSpec from a config dict (as in config.json). `source` names the file in errors."""
    data = _flatten(data)
    cfg = _Config(data, source)
    num_layers = cfg.get_int("num_hidden_layers", "n_layer", "num_layers")
    hidden_size = cfg.get_int("hidden_size", "d_model", "n_embd")
    num_heads = cfg.get_int("num_attention_heads", "n_head", "num_heads")
    max_len = _rope_scaled_max_len(cfg, cfg.get_int("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"))
    kinds = _layer_kinds(cfg, num_layers)
    attention = _attention_layer(cfg, hidden_size, num_heads)
    state = _state_layer(cfg, hidden_size) if LayerKind.LINEAR_STATE in kinds else None
    window = cfg.get_int("sliding_window") if LayerKind.SLIDING in kinds else None

    layers = []
    for kind in kinds:
        if kind == LayerKind.LINEAR_STATE:
            layers.append(state)
        elif kind == LayerKind.SLIDING and attention.kind == LayerKind.FULL:
            layers.append(LayerSpec(LayerKind.SLIDING, attention.num_kv_heads, attention.head_dim, window=window))
        else:  # FULL, or MLA (MLA models have no sliding layers kvsim knows of)
            layers.append(attention)
    return ModelSpec(
        name=name,
        hf_id=hf_id,
        layers=tuple(layers),
        max_model_len=max_len,
        num_params=num_params,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        weight_dtype=_weight_dtype(cfg),
        vocab_size=cfg.get("vocab_size", default=None),
        source=source,
        params_source=params_source,
    )


def _rope_scaled_max_len(cfg: _Config, max_len: int) -> int:
    """The context a RoPE-scaled config serves by default, as vLLM derives max_model_len.

    yarn: original_max_position_embeddings x factor (Qwen3 with YaRN 4.0: 32,768 -> 131,072); linear and
    dynamic: max_position_embeddings x factor; llama3 / longrope / su already state the scaled length,
    and gemma-3's max_position_embeddings is already scaled.
    """
    rope = cfg.get("rope_scaling", default=None)
    model_type = str(cfg.get("model_type", default="")).lower()
    if not isinstance(rope, dict) or "gemma3" in model_type:
        return max_len
    kind = str(rope.get("rope_type") or rope.get("type") or "default").lower()
    factor = rope.get("factor")
    if kind in ("default", "su", "longrope", "llama3", "mrope") or not isinstance(factor, (int, float)) or factor <= 0:
        return max_len
    if kind == "yarn":
        max_len = rope.get("original_max_position_embeddings") or max_len
    return int(max_len * factor)


def _weight_dtype(cfg: _Config) -> str:
    """The checkpoint's weight dtype: its quantization_config when quantized, else torch_dtype.

    fp8 checkpoints (DeepSeek-V3, "-FP8" repos) keep torch_dtype bfloat16 beside quant_method fp8; AWQ/GPTQ
    state `bits`; compressed-tensors its weights' num_bits. MXFP4 (gpt-oss experts) counts as 4-bit.
    """
    quant = cfg.get("quantization_config", default=None)
    if isinstance(quant, dict):
        method = str(quant.get("quant_method", "")).lower()
        bits = quant.get("bits") or quant.get("w_bit") or quant.get("weight_bits")
        floats = False
        for group in (quant.get("config_groups") or {}).values():  # compressed-tensors
            if isinstance(group, dict) and isinstance(group.get("weights"), dict):
                bits = bits or group["weights"].get("num_bits")
                floats = group["weights"].get("type") == "float"
        if method in ("fp8", "fbgemm_fp8"):
            return "fp8"
        if method == "mxfp4" or bits == 4:
            return "int4"
        if bits == 8:
            return "fp8" if floats else "int8"
    dtype = str(cfg.get("torch_dtype", "dtype", default="bfloat16")).lower()
    return _TORCH_DTYPES.get(dtype, "bf16")


def _attention_layer(cfg: _Config, hidden_size: int, num_heads: int) -> LayerSpec:
    """The attention layer every attention position of the model uses (full kind; sliding copies it)."""
    if cfg.get("kv_lora_rank", default=None) is not None:
        latent = cfg.get_int("kv_lora_rank") + cfg.get_int("qk_rope_head_dim")
        return LayerSpec(LayerKind.MLA, latent_dim=latent)
    return LayerSpec(LayerKind.FULL, num_kv_heads=_num_kv_heads(cfg, num_heads), head_dim=_head_dim(cfg, hidden_size, num_heads))


def _num_kv_heads(cfg: _Config, num_heads: int) -> int:
    """KV heads: Falcon's multi_query means ONE head unless new_decoder_architecture; missing means MHA."""
    if cfg.get("new_decoder_architecture", default=False):
        return cfg.get_int("num_kv_heads", "n_head_kv", "num_key_value_heads")
    if cfg.get("multi_query", default=False):
        return 1
    return cfg.get_int("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", default=num_heads)


def _head_dim(cfg: _Config, hidden_size: int, num_heads: int) -> int:
    """An explicit head_dim wins (Qwen3, Gemma set it); otherwise hidden_size / num_attention_heads."""
    explicit = cfg.get_int("head_dim", "kv_channels", default=None)  # kv_channels: ChatGLM / GLM-4
    if explicit is not None:
        return explicit
    if hidden_size % num_heads:
        raise KvsimError(
            f"no head_dim, and hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads}",
            source=cfg.source,
            field="head_dim",
        )
    return hidden_size // num_heads


def _layer_kinds(cfg: _Config, num_layers: int) -> list[LayerKind]:
    """Each layer's kind, from the most explicit description the config gives."""
    layer_types = cfg.get("layer_types", default=None)
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise KvsimError(f"expected a list of {num_layers} layer types", source=cfg.source, field="layer_types")
        unknown = sorted({str(t) for t in layer_types} - set(_LAYER_TYPE_KINDS))
        if unknown:
            raise KvsimError(
                f"unknown layer type(s) {', '.join(unknown)} (known: {', '.join(_LAYER_TYPE_KINDS)})",
                source=cfg.source,
                field="layer_types",
            )
        return [_LAYER_TYPE_KINDS[t] for t in layer_types]
    interval = cfg.get_int("full_attention_interval", default=None)
    if interval is not None:  # Qwen3-Next: every interval-th layer is full attention, the rest gated delta net
        return [LayerKind.FULL if (i + 1) % interval == 0 else LayerKind.LINEAR_STATE for i in range(num_layers)]
    indices = cfg.get("attn_layer_indices", default=None)
    if indices is not None:  # Bamba / Granite-4 style: attention at these layers, mamba elsewhere
        if not isinstance(indices, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in indices):
            raise KvsimError(f"expected a list of layer indices in [0, {num_layers})", source=cfg.source, field="attn_layer_indices")
        return [LayerKind.FULL if i in indices else LayerKind.LINEAR_STATE for i in range(num_layers)]
    period = cfg.get_int("attn_layer_period", default=None)
    if period is not None:  # Jamba: attention where i % period == offset, mamba elsewhere
        offset = cfg.get("attn_layer_offset")
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
            raise KvsimError(f"expected an integer in [0, {period}), got {offset!r}", source=cfg.source, field="attn_layer_offset")
        return [LayerKind.FULL if i % period == offset else LayerKind.LINEAR_STATE for i in range(num_layers)]
    for field in ("hybrid_override_pattern", "layers_block_type", "mamba_d_ssm", "mamba_num_heads", "mamba_n_heads", "mamba_d_state"):
        if cfg.get(field, default=None) is not None:  # Nemotron-H, Zamba, Falcon-H1...: never size them as all-attention
            raise KvsimError(
                "a hybrid attention/mamba layout kvsim does not know (it reads layer_types, full_attention_interval, "
                "attn_layer_period/offset and attn_layer_indices)",
                source=cfg.source,
                field=field,
            )
    window = cfg.get("sliding_window", default=None)
    if window is None or cfg.get("use_sliding_window", default=True) is False:  # Qwen: False unless set
        return [LayerKind.FULL] * num_layers
    model_type = str(cfg.get("model_type", default="")).lower()
    pattern = cfg.get_int("sliding_window_pattern", default=None) or _FAMILY_PATTERN.get(model_type)
    first_sliding = cfg.get("max_window_layers", default=None)
    if pattern is None and first_sliding is not None:  # Qwen2/Qwen3: layers >= max_window_layers slide
        if isinstance(first_sliding, bool) or not isinstance(first_sliding, int) or first_sliding < 0:
            raise KvsimError(
                f"expected a non-negative integer, got {first_sliding!r}", source=cfg.source, field="max_window_layers"
            )
        return [LayerKind.SLIDING if i >= first_sliding else LayerKind.FULL for i in range(num_layers)]
    if pattern is None:  # `sliding_window` alone: every layer slides (Mistral 7B v0.1)
        return [LayerKind.SLIDING] * num_layers
    return [LayerKind.SLIDING if (i + 1) % pattern != 0 else LayerKind.FULL for i in range(num_layers)]


def _state_layer(cfg: _Config, hidden_size: int) -> LayerSpec:
    """The constant per-sequence state of a linear layer: gated delta net (Qwen3-Next) or mamba (Jamba).

    Gated delta net (vLLM gated_delta_net_state_shape): conv state (conv_kernel - 1) x conv_dim with
    conv_dim = key_dim*num_key_heads*2 + value_dim*num_value_heads, plus recurrent num_value_heads x
    value_dim x key_dim. Mamba-2: conv (d_conv - 1) x (intermediate + 2 x n_groups x d_state), ssm
    n_heads x d_head x d_state. Mamba-1: conv state intermediate x (d_conv - 1), ssm state intermediate x d_state,
    intermediate = mamba_expand x hidden_size.
    """
    if cfg.get("linear_num_value_heads", default=None) is not None or cfg.get("full_attention_interval", default=None):
        nk = cfg.get_int("linear_num_key_heads")
        nv = cfg.get_int("linear_num_value_heads")
        dk = cfg.get_int("linear_key_head_dim")
        dv = cfg.get_int("linear_value_head_dim")
        kernel = cfg.get_int("linear_conv_kernel_dim")
        conv_dim = dk * nk * 2 + dv * nv
        elements = (kernel - 1) * conv_dim + nv * dv * dk
    elif cfg.get("mamba_n_heads", default=None) is not None:  # Mamba-2 (Bamba, Granite-4): vLLM mamba2_state_shape
        d_state = cfg.get_int("mamba_d_state")
        d_conv = cfg.get_int("mamba_d_conv")
        heads, head_dim = cfg.get_int("mamba_n_heads"), cfg.get_int("mamba_d_head")
        intermediate = cfg.get_int("mamba_expand") * hidden_size
        conv_dim = intermediate + 2 * cfg.get_int("mamba_n_groups", default=1) * d_state
        elements = (d_conv - 1) * conv_dim + heads * head_dim * d_state
    else:
        d_state = cfg.get_int("mamba_d_state")
        d_conv = cfg.get_int("mamba_d_conv")
        intermediate = cfg.get_int("mamba_expand") * hidden_size
        elements = intermediate * (d_conv - 1) + intermediate * d_state
    return LayerSpec(LayerKind.LINEAR_STATE, state_elements=elements)


# Families whose MLP is two matrices (up, down) rather than gated (gate, up, down).
_UNGATED_MLP = {"opt", "gpt2", "gpt_neox", "falcon", "gpt_bigcode", "phi", "bloom"}
_QK_NORM = {"qwen3", "qwen3_moe", "gemma3", "gemma3_text"}  # per-head RMSNorm on q and k
_SANDWICH_NORM = {"gemma2", "gemma3", "gemma3_text"}  # four norms per layer
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3", "gemma3_text", "opt"}  # transformers class defaults


def estimate_num_params(data: dict[str, Any], model: ModelSpec) -> int | None:
    """Total parameters counted from tensor shapes, for weight memory; None where kvsim can't count them.

    Counts embeddings (and an untied LM head), each layer's q/k/v/o projections, MLP or all MoE experts
    (plus router and shared expert), and norms; ignores biases. Matches the published totals of Llama 3.x,
    Mistral, Mixtral and Qwen3 dense models to the parameter. MLA and linear/mamba layers: None.
    """
    data = _flatten(data)
    if any(layer.kind not in (LayerKind.FULL, LayerKind.SLIDING) for layer in model.layers):
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
