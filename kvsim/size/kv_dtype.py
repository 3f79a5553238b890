"""vLLM's --kv-cache-dtype as kvsim names it: what `auto` and vLLM's aliases resolve to for a model."""

from __future__ import annotations


def kv_cache_dtype(name: str, model, weight_dtype: str | None = None) -> str:
    """vLLM's --kv-cache-dtype in kvsim's names: auto is the model's dtype (bf16 for quantized and fp32
    checkpoints, as vLLM serves them; --weight-dtype fp32/fp16 where given), fp8_e4m3/fp8_e5m2 are fp8."""
    key = name.lower()
    if key == "auto":
        if weight_dtype in ("fp32", "fp16", "bf16"):
            return weight_dtype
        return model.weight_dtype if model.weight_dtype in ("fp16", "bf16") else "bf16"
    return {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(key, key)
