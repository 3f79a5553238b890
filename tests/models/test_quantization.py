"""A checkpoint's quantization_config read into bytes per weight matrix, by hand for each method."""

from __future__ import annotations

import pytest

from kvsim.errors import KvsimError
from kvsim.models.quantization import read_quantization


def bytes_of(config: dict, out_f: int = 4096, in_f: int = 4096) -> int:
    return read_quantization(config, "config.json").matrix_bytes(out_f, in_f)


def test_fp8_per_tensor_and_block_wise():
    # per tensor: 1 B a weight, one fp32 scale
    assert bytes_of({"quant_method": "fp8"}) == 4096 * 4096 + 4
    # DeepSeek-V3's 128x128 blocks: an fp32 scale per block, 32 x 32 of them
    assert bytes_of({"quant_method": "fp8", "weight_block_size": [128, 128]}) == 4096 * 4096 + 32 * 32 * 4


def test_awq_and_gptq_pack_4_bits_with_group_scales_and_zeros():
    # AWQ g128: 0.5 B a weight; per group of 128 inputs and output row an fp16 scale and a 4-bit zero
    groups = 4096 * (4096 // 128)
    assert bytes_of({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}) == 4096 * 4096 // 2 + groups * 2 + groups // 2
    # GPTQ also ships an int32 g_idx per input row; 8 bits: 1 B a weight and an 8-bit zero
    assert bytes_of({"quant_method": "gptq", "bits": 4, "group_size": 128}) == 4096 * 4096 // 2 + groups * 2 + groups // 2 + 4 * 4096
    assert bytes_of({"quant_method": "gptq", "bits": 8, "group_size": 128}) == 4096 * 4096 + groups * 3 + 4 * 4096
    # group_size -1: one group per output row
    assert bytes_of({"quant_method": "gptq", "bits": 4, "group_size": -1}) == 4096 * 4096 // 2 + 4096 * 2 + 4096 // 2 + 4 * 4096


def test_compressed_tensors_schemes():
    def ct(weights: dict) -> dict:
        return {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}

    # w4a16 (pack-quantized, group 128, symmetric): 0.5 B a weight and a bf16 scale per group
    assert bytes_of(ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True})) == 4096 * 4096 // 2 + 4096 * 32 * 2
    # w8a8 int8 per channel: a bf16 scale per output row; fp8 per tensor: one fp32 scale
    assert bytes_of(ct({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True})) == 4096 * 4096 + 4096 * 2
    assert bytes_of(ct({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True})) == 4096 * 4096 + 4


def test_bitsandbytes_and_mxfp4_and_nvfp4():
    # nf4 with an fp32 absmax per 64 weights; double quantization: a uint8 absmax plus an fp32 per 256 of them
    assert bytes_of({"quant_method": "bitsandbytes", "load_in_4bit": True}) == 4096 * 4096 // 2 + 4096 * 64 * 4
    double = bytes_of({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_use_double_quant": True})
    assert double == 4096 * 4096 // 2 + 4096 * 64 + 4096 * 64 * 4 // 256
    assert bytes_of({"quant_method": "bitsandbytes", "load_in_8bit": True}) == 4096 * 4096 + 4096 * 4
    # MXFP4: fp4 and an e8m0 scale per 32 weights, experts only
    q = read_quantization({"quant_method": "mxfp4"}, "config.json")
    assert q.experts_only and q.matrix_bytes(4096, 4096) == 4096 * 4096 // 2 + 4096 * 128
    assert bytes_of({"quant_method": "modelopt", "quant_algo": "NVFP4"}) == 4096 * 4096 // 2 + 4096 * 256


@pytest.mark.parametrize(
    "config, needle",
    [
        ({"quant_method": "gguf"}, "quantization method 'gguf' is not modelled"),
        ({"quant_method": "hqq"}, "quantization_config.quant_method"),
        ({"bits": 4}, "no quant_method"),
        ({"quant_method": "awq", "bits": 5}, "quantization_config.bits: expected 2, 3, 4 or 8 bits"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        ({"quant_method": "bitsandbytes"}, "load_in_4bit"),
        ("fp8", "expected an object"),
    ],
)
def test_an_unmodelled_method_is_an_error_naming_it(config, needle):
    with pytest.raises(KvsimError, match="config.json") as err:
        read_quantization(config, "config.json")
    assert needle in str(err.value)


def test_an_unmodelled_method_refuses_the_weights_but_not_the_kv_cache(tmp_path):
    from kvsim.models.hf_config import load_hf_config
    from kvsim.models.weights import model_weights
    from kvsim.size.sizing import kv_cache_spec

    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64,'
                    ' "vocab_size": 128, "intermediate_size": 256, "quantization_config": {"quant_method": "exl2"}}')
    model = load_hf_config(path)
    assert kv_cache_spec(model, kv_dtype="bf16").bytes_per_token == 2 * 2 * 64 * 2  # K and V, 2 layers, 64 wide
    with pytest.raises(KvsimError, match="'exl2' is not modelled"):
        model_weights(model)  # never a silent bf16 guess
