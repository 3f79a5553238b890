"""The default context (max_model_len) and the weight dtype a config implies.
"""

from __future__ import annotations

from kvsim.hf.fields import Config

_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def rope_scaled_max_len(cfg: Config, max_len: int) -> int:
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
    dtype = str(cfg.get("torch_dtype", "dtype", default="bfloat16")).lower()
    return _TORCH_DTYPES.get(dtype, "bf16")
