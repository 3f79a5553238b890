"""The default context (max_model_len) vLLM derives from a config, and the weight dtype a config implies."""

from __future__ import annotations

from kvsim.errors import KvsimError
from kvsim.models.hf.fields import Config

_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16", "half": "fp16",
                 "float": "fp32", "fp32": "fp32"}


# vLLM's keys for a model's length (ModelArchConfigConvertor.derive_max_model_len_and_key): the smallest
# present wins, model_max_length overrides; none present means 2048.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")  # fmt: skip
_DEFAULT_MAX_LEN = 2048
# RoPE types whose max_position_embeddings already states the scaled length (no factor applied).
_PRESCALED = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def _rope_parameters(cfg: Config) -> list[dict]:
    """rope_scaling (transformers v4) or rope_parameters (v5, possibly one dict per layer type)."""
    rope = cfg.get("rope_scaling", "rope_parameters", default=None)
    if not isinstance(rope, dict):
        return []
    if all(isinstance(v, dict) for v in rope.values()) and rope:
        return list(rope.values())
    return [rope]


def max_model_len(cfg: Config, *, assume_default: bool = False) -> int:
    """The context vLLM 0.33 serves by default (vllm/config/model.py _get_and_verify_max_len).

    The smallest of the length keys (model_max_length overriding); when none is present vLLM assumes 2048 with
    a warning, which kvsim does only where `assume_default` (attention-free models, whose configs state no
    length) and otherwise refuses, naming max_position_embeddings. Then times the RoPE
    `factor` unless the type states the scaled length already (llama3, yarn, longrope, su) or the model is
    gemma-3; longrope then serves original_max_position_embeddings (Phi-3.5-mini, Phi-4-mini: 4,096).
    """
    lengths = [cfg.get_int(key) for key in _MAX_LEN_KEYS if cfg.get(key, default=None) is not None]
    if not lengths and not assume_default:
        cfg.get_int(*_MAX_LEN_KEYS)  # raises: missing field max_position_embeddings / ...
    derived = min(lengths) if lengths else _DEFAULT_MAX_LEN
    if cfg.get("model_max_length", default=None) is not None:
        derived = cfg.get_int("model_max_length")
    ropes = [{**r, "rope_type": str(r.get("rope_type") or r.get("type") or "default").lower()} for r in _rope_parameters(cfg)]
    model_type = str(cfg.get("model_type", default="")).lower()
    if ropes and "gemma3" not in model_type:
        factor = 1.0
        for rope in ropes:
            if rope["rope_type"] not in _PRESCALED and rope["rope_type"] != "default":
                factor = rope.get("factor") or factor
                if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
                    raise KvsimError(f"expected a positive number, got {factor!r}", source=cfg.source, field="rope_scaling.factor")
        derived = int(derived * factor)
    if any(rope["rope_type"] == "longrope" for rope in ropes):
        return int(cfg.get("original_max_position_embeddings", default=derived))
    return int(derived)


# vLLM's names for a ModelOpt checkpoint's quant_algo where the config names only its producer
# (`ModelArchConfigConvertor._normalize_quantization_config`)
_MODELOPT_METHODS = {"FP8": "modelopt", "FP8_PER_CHANNEL_PER_TOKEN": "modelopt", "FP8_PB_WO": "modelopt",
                     "NVFP4": "modelopt_fp4", "MIXED_PRECISION": "modelopt_mixed"}


def checkpoint_kv_dtype(cfg: Config, layers=(), *, quant_source: str | None = None) -> str | None:
    """The KV cache dtype the checkpoint asks for, which vLLM 0.33 takes for --kv-cache-dtype auto: "fp8",
    "nvfp4", or None (the model's dtype).

    The quantization_config (else compression_config) as vLLM normalizes it first: a ModelOpt producer (or a
    legacy `modelopt_quant_config`) with a `quantization.quant_algo` names its quant_method, and
    "compressed_tensors" is "compressed-tensors". Then:
    - ModelOpt (quant_method modelopt*): `kv_cache_scheme`, else `kv_cache_quant_algo`, in the `quantization`
      section or the config itself; a scheme {dynamic: false, num_bits: 8, type: float} is fp8, {num_bits: 4,
      type: float} nvfp4, the strings "fp8" and "nvfp4" the same; anything else falls back to the model's dtype,
      with a warning in vLLM (`get_kv_cache_quant_algo_string`).
    - compressed-tensors (llm-compressor): a `kv_cache_scheme` is fp8, set by vLLM's Attention layer, whose
      `CompressedTensorsKVCacheMethod` loads only num_bits 8, type float, strategy tensor or attn_head, symmetric:
      any other scheme is refused (vLLM cannot load the checkpoint, whatever --kv-cache-dtype says). MLA layers
      (`MLAAttention`) neither apply nor check it, so a model of `layers` without a non-MLA attention layer keeps
      its dtype.

    `quant_source` names the file the quantization_config came from where it is not the config's own (a legacy
    ModelOpt `hf_quant_config.json`); errors then name that file and its fields.
    """
    quant = cfg.get("quantization_config", "compression_config", default=None)
    key = "quantization_config" if cfg.data.get("quantization_config") is not None else "compression_config"
    if not isinstance(quant, dict):
        return None
    method = str(quant.get("quant_method", "")).lower()
    producer = quant.get("producer")
    inner = quant.get("quantization")
    inner = inner if isinstance(inner, dict) else {}
    if (isinstance(producer, dict) and producer.get("name") == "modelopt") or "modelopt_quant_config" in inner:
        if inner.get("quant_algo") is not None:
            method = _MODELOPT_METHODS.get(str(inner["quant_algo"]).upper(), "")
            if not method:  # vLLM raises "Unknown ModelOpt quant algo" while it builds the model's config
                raise KvsimError(f"vLLM 0.33 cannot load this checkpoint: unknown ModelOpt quant_algo "
                                 f"{inner['quant_algo']!r} (it knows {', '.join(_MODELOPT_METHODS)})",
                                 source=quant_source or cfg.source,
                                 field="quantization.quant_algo" if quant_source else f"{key}.quantization.quant_algo")
    method = method.replace("compressed_tensors", "compressed-tensors")
    if method.startswith("modelopt"):
        inner = inner or quant
        algo = (inner.get("kv_cache_scheme") or quant.get("kv_cache_scheme") or inner.get("kv_cache_quant_algo")
                or quant.get("kv_cache_quant_algo"))
        if isinstance(algo, dict):
            if algo.get("dynamic") is False and algo.get("num_bits") == 8 and algo.get("type") == "float":
                return "fp8"
            return "nvfp4" if algo.get("num_bits") == 4 and algo.get("type") == "float" else None
        return {"fp8": "fp8", "nvfp4": "nvfp4"}.get(algo.lower()) if isinstance(algo, str) else None
    if method == "compressed-tensors" and quant.get("kv_cache_scheme") is not None:
        from kvsim.models.spec import LayerKind

        attention = (LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED)
        if not any(layer.kind in attention for layer in layers):
            return None
        field = "kv_cache_scheme" if quant_source else f"{key}.kv_cache_scheme"
        _check_compressed_tensors_kv_scheme(quant["kv_cache_scheme"], quant_source or cfg.source, field)
        return "fp8"
    return None


# QuantizationStrategy values vLLM's CompressedTensorsKVCacheMethod accepts for a KV cache scheme
_CT_KV_STRATEGIES = ("tensor", "attn_head")


def _check_compressed_tensors_kv_scheme(scheme: object, source: str, field: str) -> None:
    """vLLM 0.33's `CompressedTensorsKVCacheMethod.validate_kv_cache_scheme`, in its order: type float and
    num_bits 8, then strategy tensor or attn_head, then symmetric; anything else is a KvsimError naming the field
    (vLLM raises while building the model's Attention layers)."""
    why = "vLLM 0.33 cannot load this checkpoint: its compressed-tensors KV cache scheme must be "
    if not isinstance(scheme, dict):
        raise KvsimError(f"{why}an object (num_bits 8, type float, ...), got {scheme!r}", source=source, field=field)
    kind, bits = scheme.get("type"), scheme.get("num_bits")
    if kind != "float" or bits != 8:
        raise KvsimError(f"{why}num_bits 8, type float (an fp8 KV cache), got num_bits {bits!r}, type {kind!r}",
                         source=source, field=f"{field}.{'type' if kind != 'float' else 'num_bits'}")
    if scheme.get("strategy") not in _CT_KV_STRATEGIES:
        raise KvsimError(f"{why}per tensor or per attention head (strategy tensor or attn_head), got "
                         f"{scheme.get('strategy')!r}", source=source, field=f"{field}.strategy")
    if not scheme.get("symmetric"):
        raise KvsimError(f"{why}symmetric (symmetric: true), got {scheme.get('symmetric')!r}", source=source,
                         field=f"{field}.symmetric")


def weight_dtype(cfg: Config) -> str:
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
    raw = cfg.get("torch_dtype", "dtype", default="bfloat16")
    dtype = str(raw).lower().removeprefix("torch.")
    if not isinstance(raw, str) or dtype not in _TORCH_DTYPES:
        field = "torch_dtype" if cfg.data.get("torch_dtype") is not None else "dtype"
        raise KvsimError(f"unknown dtype {raw!r} (a config gives bfloat16, float16 or float32)", source=cfg.source, field=field)
    return _TORCH_DTYPES[dtype]
