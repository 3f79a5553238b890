"""vLLM's --kv-cache-dtype as kvsim names it: what `auto` and vLLM's aliases resolve to for a model."""

from __future__ import annotations

from kvsim.errors import KvsimError


def kv_cache_dtype(name: str, model, weight_dtype: str | None = None, *, field: str = "--kv-dtype",
                   source: str | None = None) -> str:
    """vLLM's --kv-cache-dtype in kvsim's names: auto is the KV dtype the checkpoint's quantization_config asks
    for (fp8; `ModelSpec.checkpoint_kv_dtype`), else the model's dtype (bf16 for quantized and fp32 checkpoints, as
    vLLM serves them; --weight-dtype fp32/fp16 where given); fp8_e4m3/fp8_e5m2 are fp8. A checkpoint that asks
    for nvfp4, a packed format kvsim does not model, is an error naming `field`."""
    key = name.lower()
    if key == "auto":
        asked = getattr(model, "checkpoint_kv_dtype", None)
        if asked == "fp8":
            return "fp8"
        if asked is not None:
            raise KvsimError(f"{model.name}: its quantization_config asks for an {asked} KV cache, which vLLM takes "
                             "for auto and kvsim does not model (a packed format); give fp8 or bf16", source=source,
                             field=field)
        return served_dtype(model, weight_dtype)
    return {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(key, key)


def served_dtype(model, weight_dtype: str | None = None) -> str:
    """The dtype vLLM serves `model` in (its --dtype): `weight_dtype` where given (fp32, fp16, bf16), else auto's, the
    checkpoint's fp16 or bf16 and bf16 for quantized and fp32 checkpoints. A KV cache in fp32 is vLLM's only when
    this is fp32 (its --kv-cache-dtype has no float32: auto takes the model's dtype)."""
    if weight_dtype in ("fp32", "fp16", "bf16"):
        return weight_dtype
    return model.weight_dtype if model.weight_dtype in ("fp16", "bf16") else "bf16"
