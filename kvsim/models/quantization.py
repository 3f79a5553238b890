"""A checkpoint's `quantization_config`, read into the bytes each quantized weight matrix takes.

Methods modelled (the tensors each ships, as vLLM 0.33 loads them):

    fp8                 e4m3 weights; one fp32 scale per tensor, or per 128x128 block (`weight_block_size`)
    awq                 4-bit packed (int32 qweight), fp16 scales and 4-bit zeros per group of `group_size` inputs
    gptq                4/8-bit packed, fp16 scales and packed zeros per group, int32 g_idx per input row
    compressed-tensors  `config_groups[*].weights`: num_bits, int/float, tensor/channel/group strategy
    bitsandbytes        nf4/fp4 with an absmax per 64 weights (8-bit absmax with double quantization), or int8
    mxfp4               gpt-oss: MoE experts in fp4 with an e8m0 scale per 32 weights; every other tensor bf16
    modelopt            FP8 (per tensor) or NVFP4 (fp4, an fp8 scale per 16 weights)

Any other method is a KvsimError naming it: never a silent bf16 guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsim.errors import KvsimError


@dataclass(frozen=True)
class Quantization:
    """How one quantized linear weight is stored: `weight_bits` per element and its scales and zeros.

    group_size > 0: one scale (and zero) per `group_size` input elements of each output row; 0: one per output
    row (channel); -1: one per tensor. `block` (out, in): block-wise scales instead (fp8 128x128).
    """

    method: str
    weight_bits: float
    group_size: int = -1
    scale_bytes: float = 4.0
    zero_bits: int = 0  # bits of a zero point per scale (0: symmetric)
    block: tuple[int, int] | None = None
    g_idx: bool = False  # gptq: an int32 group index per input row
    experts_only: bool = False  # mxfp4: only MoE experts are quantized
    ignored: tuple[str, ...] = ()  # module names the config leaves unquantized (lm_head is never quantized here)

    def matrix_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of one (out_features, in_features) weight with its scales, zeros and indices."""
        total = math.ceil(out_features * in_features * self.weight_bits / 8)
        if self.block is not None:
            scales = math.ceil(out_features / self.block[0]) * math.ceil(in_features / self.block[1])
        elif self.group_size > 0:
            scales = out_features * math.ceil(in_features / self.group_size)
        elif self.group_size == 0:
            scales = out_features
        else:
            scales = 1
        total += math.ceil(scales * self.scale_bytes) + math.ceil(scales * self.zero_bits / 8)
        if self.g_idx:
            total += 4 * in_features
        return total

    def bytes_per_param(self, out_features: int, in_features: int) -> float:
        """`matrix_bytes` per element, for matrices kvsim counts only in total."""
        return self.matrix_bytes(out_features, in_features) / (out_features * in_features)

    @property
    def label(self) -> str:
        """'awq int4 g128', 'fp8 block 128x128', 'mxfp4 experts', ..."""
        if self.block:
            return f"{self.method} block {self.block[0]}x{self.block[1]}"
        group = {0: " per channel", -1: ""}.get(self.group_size, f" g{self.group_size}")
        scope = " experts" if self.experts_only else ""
        bits = f"{self.weight_bits:g}-bit"
        return f"{self.method} {bits}{group}{scope}"


_SUPPORTED = ("fp8, awq, gptq, compressed-tensors, bitsandbytes, mxfp4, modelopt (FP8, NVFP4)")


def read_quantization(config: object, source: str | None) -> Quantization | None:
    """The `quantization_config` dict of a config.json as a Quantization; None when absent."""
    if config is None:
        return None
    field = "quantization_config"
    if not isinstance(config, dict):
        raise KvsimError(f"expected an object, got {config!r}", source=source, field=field)
    method = str(config.get("quant_method", "")).lower().replace("_", "-")
    producer, inner = config.get("producer"), config.get("quantization")
    if not method and isinstance(producer, dict) and producer.get("name") == "modelopt":
        # a legacy hf_quant_config.json names its producer only: vLLM's _normalize_quantization_config makes its
        # quant_algo the method, and without one (a checkpoint that quantizes only its KV cache) loads no method
        if not isinstance(inner, dict) or inner.get("quant_algo") is None:
            return None
        method = "modelopt"
    ignored = tuple(str(m) for m in (config.get("modules_to_not_convert") or config.get("ignored_layers")
                                     or config.get("ignore") or config.get("llm_int8_skip_modules") or []))
    if method in ("fp8", "fbgemm-fp8"):
        block = config.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise KvsimError(f"expected [rows, cols], got {block!r}", source=source, field=f"{field}.weight_block_size")
            return Quantization("fp8", 8, block=(block[0], block[1]), scale_bytes=4, ignored=ignored)
        return Quantization("fp8", 8, group_size=-1 if method == "fp8" else 0, scale_bytes=4, ignored=ignored)
    if method in ("awq", "gptq", "awq-marlin", "gptq-marlin"):
        base = method.split("-")[0]
        bits = _bits(config.get("bits", config.get("w_bit")), source, f"{field}.bits")
        group = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group, int) or isinstance(group, bool) or group == 0 or group < -1:
            raise KvsimError(f"expected a positive int or -1, got {group!r}", source=source, field=f"{field}.group_size")
        group = 0 if group == -1 else group
        # both ship packed qzeros per group, GPTQ even when symmetric
        return Quantization(base, bits, group_size=group, scale_bytes=2, zero_bits=bits,
                            g_idx=base == "gptq", ignored=ignored)
    if method == "compressed-tensors":
        return _compressed_tensors(config, source, ignored)
    if method == "bitsandbytes":
        if config.get("load_in_4bit") or config.get("_load_in_4bit"):
            double = bool(config.get("bnb_4bit_use_double_quant"))
            # absmax per 64 weights: fp32, or uint8 plus an fp32 per 256 absmax with double quantization
            return Quantization("bitsandbytes", 4, group_size=64, scale_bytes=1 + 4 / 256 if double else 4, ignored=ignored)
        if config.get("load_in_8bit") or config.get("_load_in_8bit"):
            return Quantization("bitsandbytes", 8, group_size=0, scale_bytes=4, ignored=ignored)
        raise KvsimError("bitsandbytes without load_in_4bit or load_in_8bit", source=source, field=field)
    if method == "mxfp4":
        return Quantization("mxfp4", 4, group_size=32, scale_bytes=1, experts_only=True, ignored=ignored)
    if method == "modelopt":
        algo = str(config.get("quant_algo", (config.get("quantization") or {}).get("quant_algo", ""))).upper()
        if algo == "FP8":
            return Quantization("modelopt-fp8", 8, group_size=-1, scale_bytes=8, ignored=ignored)  # weight + input scale
        if algo == "NVFP4":
            return Quantization("modelopt-nvfp4", 4, group_size=16, scale_bytes=1, ignored=ignored)
        raise KvsimError(f"modelopt quant_algo {algo or '(none)'} is not modelled (FP8, NVFP4 are)", source=source, field=field)
    raise KvsimError(
        f"quantization method {method or '(no quant_method)'!r} is not modelled, so its weight bytes are unknown "
        f"(modelled: {_SUPPORTED}); give --weight-dtype to size it as a plain dtype",
        source=source,
        field=f"{field}.quant_method",
    )


def _bits(value: object, source: str | None, field: str) -> int:
    if value not in (2, 3, 4, 8):
        raise KvsimError(f"expected 2, 3, 4 or 8 bits, got {value!r}", source=source, field=field)
    return int(value)  # type: ignore[arg-type]


def _compressed_tensors(config: dict, source: str | None, ignored: tuple[str, ...]) -> Quantization:
    """compressed-tensors: the first config group's weight scheme (every group of a real checkpoint agrees)."""
    field = "quantization_config.config_groups"
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise KvsimError("compressed-tensors without config_groups", source=source, field=field)
    weights = next(iter(groups.values())).get("weights") if isinstance(next(iter(groups.values())), dict) else None
    if not isinstance(weights, dict):
        raise KvsimError("expected a `weights` scheme in the first config group", source=source, field=field)
    bits = _bits(weights.get("num_bits"), source, f"{field}.weights.num_bits")
    strategy = str(weights.get("strategy", "tensor")).lower()
    floats = weights.get("type") == "float"
    zero_bits = 0 if weights.get("symmetric", True) else (8 if bits == 8 else bits)
    scale_bytes = 4 if floats and strategy == "tensor" else 2  # fp8 per-tensor scales are fp32, others bf16
    if strategy == "group":
        group = weights.get("group_size")
        if not isinstance(group, int) or group <= 0:
            raise KvsimError(f"expected a positive group_size, got {group!r}", source=source, field=f"{field}.weights.group_size")
        return Quantization("compressed-tensors", bits, group_size=group, scale_bytes=scale_bytes, zero_bits=zero_bits, ignored=ignored)
    if strategy == "block":
        block = weights.get("block_structure") or [128, 128]
        return Quantization("compressed-tensors", bits, block=(int(block[0]), int(block[1])), scale_bytes=4, ignored=ignored)
    if strategy in ("channel", "tensor"):
        return Quantization("compressed-tensors", bits, group_size=0 if strategy == "channel" else -1,
                            scale_bytes=scale_bytes, zero_bits=zero_bits, ignored=ignored)
    raise KvsimError(f"compressed-tensors strategy {strategy!r} is not modelled (tensor, channel, group, block are)",
                     source=source, field=f"{field}.weights.strategy")
