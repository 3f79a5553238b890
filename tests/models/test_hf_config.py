"""Hugging Face config.json -> ModelSpec: every attention kind and hybrid, through files written here."""

from __future__ import annotations

import json

import pytest

from kvsim.errors import KvsimError
from kvsim.models.hf_config import load_hf_config
from kvsim.models.spec import LayerKind
from kvsim.size.sizing import kv_cache_spec

LLAMA_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def write_config(tmp_path):
    """write_config({...}) -> path of a config.json holding it."""

    def write(data, name="config.json"):
        path = tmp_path / name
        path.write_text(json.dumps(data) if not isinstance(data, str) else data)
        return path

    return write


def bytes_per_token(model, **kwargs) -> int:
    return kv_cache_spec(model, **kwargs).bytes_per_token


def test_derived_head_dim(write_config):
    model = load_hf_config(write_config(LLAMA_8B))
    assert model.head_dim == 4096 // 32 == 128
    assert bytes_per_token(model) == 2 * 32 * 8 * 128 * 2 == 131072
    assert model.max_model_len == 131072 and model.weight_dtype == "bf16"


def test_explicit_head_dim_wins_over_hidden_over_heads(write_config):
    # Qwen3-0.6B: hidden/heads = 64, but head_dim is 128
    cfg = {**LLAMA_8B, "num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16, "head_dim": 128}
    model = load_hf_config(write_config(cfg))
    assert model.head_dim == 128
    assert bytes_per_token(model) == 114688


def test_missing_num_key_value_heads_means_mha(write_config):
    cfg = {k: v for k, v in LLAMA_8B.items() if k != "num_key_value_heads"}
    model = load_hf_config(write_config(cfg))
    assert model.num_kv_heads == 32
    assert bytes_per_token(model) == 2 * 32 * 32 * 128 * 2


def test_null_num_key_value_heads_means_mha(write_config):
    model = load_hf_config(write_config({**LLAMA_8B, "num_key_value_heads": None}))
    assert model.num_kv_heads == 32


def test_falcon_multi_query_uses_one_kv_head_whatever_the_head_counts_say(write_config):
    # The trap: num_kv_heads says 71, but multi_query without new_decoder_architecture means ONE KV head.
    cfg = {
        "model_type": "falcon",
        "num_hidden_layers": 32,
        "hidden_size": 4544,
        "num_attention_heads": 71,
        "num_kv_heads": 71,
        "multi_query": True,
        "new_decoder_architecture": False,
        "max_position_embeddings": 2048,
    }
    model = load_hf_config(write_config(cfg))
    assert model.num_kv_heads == 1 and model.head_dim == 64
    assert bytes_per_token(model) == 2 * 32 * 1 * 64 * 2 == 8192


def test_falcon_new_decoder_architecture_uses_num_kv_heads(write_config):
    cfg = {
        "model_type": "falcon",
        "num_hidden_layers": 60,
        "hidden_size": 8192,
        "num_attention_heads": 128,
        "num_kv_heads": 8,
        "multi_query": True,
        "new_decoder_architecture": True,
        "max_position_embeddings": 2048,
    }
    model = load_hf_config(write_config(cfg))
    assert model.num_kv_heads == 8
    assert bytes_per_token(model) == 2 * 60 * 8 * 64 * 2


def test_mla_stores_one_latent_per_token_per_layer(write_config):
    cfg = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "max_position_embeddings": 163840,
    }
    model = load_hf_config(write_config(cfg))
    assert {layer.kind for layer in model.layers} == {LayerKind.MLA}
    assert bytes_per_token(model) == 61 * (512 + 64) * 2 == 70272
    assert bytes_per_token(model, tp=8) == 70272  # replicated on every rank


def test_mla_without_rope_dim_names_the_field(write_config):
    cfg = {**LLAMA_8B, "kv_lora_rank": 512}
    with pytest.raises(KvsimError, match="qk_rope_head_dim"):
        load_hf_config(write_config(cfg))


def test_model_wide_sliding_window_applies_to_every_layer(write_config):
    model = load_hf_config(write_config({**LLAMA_8B, "max_position_embeddings": 32768, "sliding_window": 4096}))
    assert model.layer_counts == {"sliding(4096)": 32}
    spec = kv_cache_spec(model)
    assert spec.full_bytes_per_token == 0 and spec.bytes_per_token == 131072


def test_sliding_window_ignored_when_use_sliding_window_is_false(write_config):
    # Qwen2/Qwen3 configs carry a sliding_window value but switch it off
    model = load_hf_config(write_config({**LLAMA_8B, "sliding_window": 4096, "use_sliding_window": False}))
    assert model.layer_counts == {"full": 32}


def test_layer_types_list(write_config):
    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    cfg = {**LLAMA_8B, "num_hidden_layers": 4, "sliding_window": 512, "layer_types": types}
    model = load_hf_config(write_config(cfg))
    assert [layer.kind for layer in model.layers] == [LayerKind.SLIDING, LayerKind.FULL, LayerKind.FULL, LayerKind.SLIDING]
    assert model.layers[0].window == 512


def test_layer_types_of_wrong_length_is_an_error(write_config):
    cfg = {**LLAMA_8B, "num_hidden_layers": 4, "layer_types": ["full_attention"] * 3}
    with pytest.raises(KvsimError, match="layer_types") as err:
        load_hf_config(write_config(cfg))
    assert "config.json" in str(err.value)


def test_unknown_layer_type_is_an_error(write_config):
    cfg = {**LLAMA_8B, "num_hidden_layers": 2, "layer_types": ["full_attention", "banana"]}
    with pytest.raises(KvsimError, match="banana"):
        load_hf_config(write_config(cfg))


def test_sliding_window_pattern(write_config):
    # gemma-3-27b: (i+1) % 6 != 0 -> sliding: 52 sliding, 10 full
    cfg = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 62,
        "hidden_size": 5376,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    }
    model = load_hf_config(write_config(cfg))
    assert model.layer_counts == {"sliding(1024)": 52, "full": 10}
    assert model.layers[5].kind == LayerKind.FULL and model.layers[4].kind == LayerKind.SLIDING
    spec = kv_cache_spec(model)
    assert spec.full_bytes_per_token == 81920
    assert spec.bytes_per_token - spec.full_bytes_per_token == 425984


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_family_alternation_starts_with_a_sliding_layer(write_config, model_type):
    cfg = {**LLAMA_8B, "model_type": model_type, "num_hidden_layers": 6, "sliding_window": 128}
    model = load_hf_config(write_config(cfg))
    kinds = [layer.kind for layer in model.layers]
    assert kinds == [LayerKind.SLIDING, LayerKind.FULL] * 3


def test_gemma3_family_default_pattern_is_six(write_config):
    cfg = {**LLAMA_8B, "model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 1024}
    model = load_hf_config(write_config(cfg))
    assert model.layer_counts == {"sliding(1024)": 10, "full": 2}


QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}


def test_qwen3_next_gated_delta_net_state(write_config):
    model = load_hf_config(write_config(QWEN3_NEXT))
    assert model.layer_counts == {"linear-state": 36, "full": 12}
    assert [i for i, layer in enumerate(model.layers) if layer.kind == LayerKind.FULL] == list(range(3, 48, 4))
    # per layer: conv (4-1) x (128*16*2 + 128*32) = 24,576 + recurrent 32*128*128 = 524,288 elements
    assert model.layers[0].state_elements == 24576 + 524288
    spec = kv_cache_spec(model)
    assert spec.bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24576
    assert spec.state_bytes_per_sequence == 36 * 1097728 == 39518208


def test_qwen3_next_missing_linear_dim_names_field_and_file(write_config):
    cfg = {k: v for k, v in QWEN3_NEXT.items() if k != "linear_value_head_dim"}
    path = write_config(cfg)
    with pytest.raises(KvsimError) as err:
        load_hf_config(path)
    assert "linear_value_head_dim" in str(err.value) and str(path) in str(err.value)


def test_jamba_attention_period_and_mamba_state(write_config):
    cfg = {
        "model_type": "jamba",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 262144,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    }
    model = load_hf_config(write_config(cfg))
    assert [i for i, layer in enumerate(model.layers) if layer.kind == LayerKind.FULL] == [4, 12, 20, 28]
    intermediate = 2 * 4096
    assert model.layers[0].state_elements == intermediate * (4 - 1) + intermediate * 16 == 155648
    spec = kv_cache_spec(model)
    assert spec.bytes_per_token == 4 * 2 * 8 * 128 * 2
    assert spec.state_bytes_per_sequence == 28 * 155648 * 2
    assert kv_cache_spec(model, tp=2).state_bytes_per_sequence == 28 * 155648  # channels split across ranks


def test_text_config_nesting(write_config):
    cfg = {"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": {**LLAMA_8B, "num_hidden_layers": 4}}
    model = load_hf_config(write_config(cfg))
    assert model.num_layers == 4 and bytes_per_token(model) == 2 * 4 * 8 * 128 * 2


@pytest.mark.parametrize("field", ["num_hidden_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"])
def test_missing_needed_field_names_field_and_file(write_config, field):
    path = write_config({k: v for k, v in LLAMA_8B.items() if k != field})
    with pytest.raises(KvsimError) as err:
        load_hf_config(path)
    assert field in str(err.value) and str(path) in str(err.value)


def test_missing_sliding_window_for_sliding_layers(write_config):
    cfg = {**LLAMA_8B, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(KvsimError, match="sliding_window"):
        load_hf_config(write_config(cfg))


def test_underivable_head_dim(write_config):
    with pytest.raises(KvsimError, match="head_dim"):
        load_hf_config(write_config({**LLAMA_8B, "num_attention_heads": 30}))


def test_non_integer_field(write_config):
    with pytest.raises(KvsimError, match="num_hidden_layers"):
        load_hf_config(write_config({**LLAMA_8B, "num_hidden_layers": "32"}))


def test_invalid_json(write_config):
    path = write_config('{"num_hidden_layers": 32,')
    with pytest.raises(KvsimError, match="invalid JSON") as err:
        load_hf_config(path)
    assert str(path) in str(err.value)


def test_json_that_is_not_an_object(write_config):
    with pytest.raises(KvsimError, match="JSON object"):
        load_hf_config(write_config("[1, 2]"))


def test_unreadable_file(tmp_path):
    path = tmp_path / "missing" / "config.json"
    with pytest.raises(KvsimError, match="cannot read") as err:
        load_hf_config(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("dtype, expected", [("float16", "fp16"), ("float32", "fp32"), ("bfloat16", "bf16")])
def test_torch_dtype_becomes_weight_dtype(write_config, dtype, expected):
    assert load_hf_config(write_config({**LLAMA_8B, "torch_dtype": dtype})).weight_dtype == expected


@pytest.mark.parametrize(
    "name", ["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "llama-3.1-8b", "llama-3.1-405b", "llama-3.2-1b",
             "mistral-7b-v0.1", "mixtral-8x7b-v0.1", "gemma-2-9b", "gemma-3-27b"],
)
def test_parameter_estimate_from_a_config_file_matches_the_catalogue(write_config, name):
    from kvsim.models.catalogue import catalogue_entry

    entry = catalogue_entry(name)
    model = load_hf_config(write_config(entry["config"]))
    assert model.num_params == entry["num_params"]
    assert "estimated" in model.params_source


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-next-80b-a3b"])
def test_no_parameter_estimate_for_mla_or_hybrids(write_config, name):
    from kvsim.models.catalogue import catalogue_entry

    assert load_hf_config(write_config(catalogue_entry(name)["config"])).num_params is None


def test_parameter_estimate_needs_vocab_and_mlp_sizes(write_config):
    assert load_hf_config(write_config(LLAMA_8B)).num_params is None
    cfg = {**LLAMA_8B, "vocab_size": 128256, "intermediate_size": 14336}
    assert load_hf_config(write_config(cfg)).num_params == 8030261248


@pytest.mark.parametrize("offset", [None, 8, -1, "4"])
def test_jamba_bad_attention_offset(write_config, offset):
    cfg = {**LLAMA_8B, "attn_layer_period": 8, "attn_layer_offset": offset, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2}
    with pytest.raises(KvsimError, match="attn_layer_offset"):
        load_hf_config(write_config(cfg))


# --- shipped configs that lean on their transformers class defaults -----------------------------------------

FALCON_7B = {  # tiiuae/falcon-7b config.json: no max_position_embeddings, num_kv_heads 71 beside multi_query
    "model_type": "falcon",
    "hidden_size": 4544,
    "num_attention_heads": 71,
    "num_hidden_layers": 32,
    "num_kv_heads": 71,
    "multi_query": True,
    "new_decoder_architecture": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 65024,
}


def test_falcon_7b_config_without_max_position_embeddings_uses_the_class_default(write_config):
    model = load_hf_config(write_config(FALCON_7B))
    assert model.max_model_len == 2048  # FalconConfig default
    assert model.num_kv_heads == 1 and model.head_dim == 4544 // 71 == 64
    assert bytes_per_token(model) == 2 * 32 * 1 * 64 * 2 == 8192


@pytest.mark.parametrize(
    "cfg",
    [
        {"model_type": "falcon", "new_decoder_architecture": True, "num_kv_heads": 8, "num_attention_heads": 128,
         "num_hidden_layers": 60, "hidden_size": 8192},
        {"model_type": "RefinedWeb", "n_head_kv": 8, "n_head": 128, "n_layer": 60, "hidden_size": 8192},
    ],
    ids=["falcon-40b", "falcon-40b-refinedweb"],
)
def test_falcon_40b_configs(write_config, cfg):
    model = load_hf_config(write_config(cfg))
    assert model.max_model_len == 2048 and model.num_kv_heads == 8 and model.head_dim == 64
    assert bytes_per_token(model) == 2 * 60 * 8 * 64 * 2 == 122880


def test_gemma3_multimodal_config_as_shipped(write_config):
    # google/gemma-3-27b-it: text_config without max_position_embeddings, vocab_size or sliding_window_pattern
    cfg = {
        "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {"model_type": "gemma3_text", "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                        "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "num_hidden_layers": 27},
    }
    model = load_hf_config(write_config(cfg))
    assert model.max_model_len == 131072 and model.vocab_size == 262208
    assert model.layer_counts == {"sliding(1024)": 52, "full": 10}
    spec = kv_cache_spec(model)
    assert spec.full_bytes_per_token == 10 * 2 * 16 * 128 * 2 == 81920
    assert spec.bytes_per_token - spec.full_bytes_per_token == 52 * 2 * 16 * 128 * 2 == 425984


QWEN2_7B = {
    "model_type": "qwen2",
    "num_hidden_layers": 28,
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "sliding_window": 32768,
}


@pytest.mark.parametrize("model_type", ["qwen2", "qwen2_moe", "qwen3", "qwen3_moe"])
def test_qwen_sliding_window_is_off_unless_use_sliding_window_says_so(write_config, model_type):
    # Qwen2/Qwen3 configs often carry sliding_window with no use_sliding_window: the class default is False
    model = load_hf_config(write_config({**QWEN2_7B, "model_type": model_type}))
    assert model.layer_counts == {"full": 28}


def test_qwen_max_window_layers_first_layers_keep_full_attention(write_config):
    cfg = {**QWEN2_7B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 21}
    model = load_hf_config(write_config(cfg))
    assert [layer.kind for layer in model.layers] == [LayerKind.FULL] * 21 + [LayerKind.SLIDING] * 7
    spec = kv_cache_spec(model)
    assert spec.full_bytes_per_token == 21 * 2 * 4 * 128 * 2 == 43008
    # the class default max_window_layers is 28: with 28 layers, nothing slides
    cfg = {**QWEN2_7B, "use_sliding_window": True, "sliding_window": 4096}
    assert load_hf_config(write_config(cfg)).layer_counts == {"full": 28}


def test_bad_max_window_layers_names_the_field(write_config):
    cfg = {**QWEN2_7B, "use_sliding_window": True, "max_window_layers": -1}
    with pytest.raises(KvsimError, match="max_window_layers"):
        load_hf_config(write_config(cfg))


BAMBA = {  # Bamba-9B style: attention at attn_layer_indices, Mamba-2 elsewhere
    "model_type": "bamba",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 262144,
    "attn_layer_indices": [9, 18, 27],
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
}


def test_attn_layer_indices_and_mamba2_state(write_config):
    model = load_hf_config(write_config(BAMBA))
    assert [i for i, layer in enumerate(model.layers) if layer.kind == LayerKind.FULL] == [9, 18, 27]
    # conv (4 - 1) x (8192 + 2 x 1 x 128) + ssm 128 heads x 64 x 128
    assert model.layers[0].state_elements == 3 * (8192 + 256) + 128 * 64 * 128 == 1073920
    spec = kv_cache_spec(model)
    assert spec.bytes_per_token == 3 * 2 * 8 * 128 * 2
    assert spec.state_bytes_per_sequence == 29 * 1073920 * 2


@pytest.mark.parametrize(
    "field, value",
    [("hybrid_override_pattern", "M-M*-M-"), ("mamba_d_ssm", 1024), ("layers_block_type", ["mamba", "hybrid"])],
)
def test_unknown_hybrid_layout_is_an_error_not_all_attention(write_config, field, value):
    # Nemotron-H, Falcon-H1, Zamba2: sizing these as all-attention would be silently wrong
    cfg = {**LLAMA_8B, field: value}
    with pytest.raises(KvsimError, match=field):
        load_hf_config(write_config(cfg))


def test_bad_attn_layer_indices(write_config):
    with pytest.raises(KvsimError, match="attn_layer_indices"):
        load_hf_config(write_config({**BAMBA, "attn_layer_indices": [40]}))


@pytest.mark.parametrize(
    "quant, expected",
    [
        ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, "fp8"),  # DeepSeek-V3, Qwen3-8B-FP8
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "int4"),
        ({"quant_method": "gptq", "bits": 8}, "int8"),
        ({"quant_method": "mxfp4"}, "int4"),  # gpt-oss experts
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}}}, "fp8"),
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}}}, "int4"),
    ],
)
def test_quantization_config_sets_the_weight_dtype_over_torch_dtype(write_config, quant, expected):
    model = load_hf_config(write_config({**LLAMA_8B, "quantization_config": quant}))
    assert model.weight_dtype == expected


def test_chatglm_multi_query_groups_and_kv_channels(write_config):
    # THUDM/glm-4-9b style: 2 KV groups of kv_channels 128 (MHA over 32 heads would be 16x too big)
    cfg = {"model_type": "chatglm", "num_layers": 40, "hidden_size": 4096, "num_attention_heads": 32,
           "multi_query_attention": True, "multi_query_group_num": 2, "kv_channels": 128, "seq_length": 131072}
    model = load_hf_config(write_config(cfg))
    assert (model.num_kv_heads, model.head_dim, model.max_model_len) == (2, 128, 131072)
    assert bytes_per_token(model) == 2 * 40 * 2 * 128 * 2 == 40960


@pytest.mark.parametrize(
    "rope, max_len",
    [
        # vLLM 0.33 takes a YaRN config's max_position_embeddings as already scaled (no factor applied)
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 40960),
        ({"type": "linear", "factor": 2.0}, 2 * 40960),
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 40960),  # already scaled
        (None, 40960),
    ],
)
def test_rope_scaling_sets_the_default_context_as_vllm_derives_it(write_config, rope, max_len):
    cfg = {**LLAMA_8B, "max_position_embeddings": 40960, "rope_scaling": rope}
    assert load_hf_config(write_config(cfg)).max_model_len == max_len


def test_gemma3_rope_scaling_is_already_in_its_max_length(write_config):
    cfg = {**LLAMA_8B, "model_type": "gemma3_text", "sliding_window": 1024, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert load_hf_config(write_config(cfg)).max_model_len == 131072


def test_a_config_file_names_the_model_by_its_own_name_not_its_folder(tmp_path):
    # `~/configs/mywl/qwen25-7b.json` was named `mywl`; workloads make every path absolute, so every report was.
    folder = tmp_path / "mywl"
    folder.mkdir()
    (folder / "qwen25-7b.json").write_text(json.dumps(LLAMA_8B))
    assert load_hf_config(folder / "qwen25-7b.json").name == "qwen25-7b"
    # A Hugging Face checkout's config.json: the config's own name, else the checkout's folder.
    (folder / "config.json").write_text(json.dumps({**LLAMA_8B, "_name_or_path": "meta-llama/Llama-3.1-8B"}))
    assert load_hf_config(folder / "config.json").name == "Llama-3.1-8B"
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    assert load_hf_config(folder / "config.json").name == "mywl"
    assert load_hf_config(folder / "config.json", name="mine").name == "mine"


def test_a_workload_names_its_config_model_after_the_file(tmp_path):
    from kvsim.replay.run import run_replay
    from kvsim.replay.options import ReplayOptions
    from kvsim.workload.spec import load_workload
    from tests.replay.test_replay import write_tiny

    result = run_replay(load_workload(write_tiny(tmp_path, count=2)), ReplayOptions(tensors=False), workers=1)
    assert result.model_name == "tiny-model"  # tiny.yaml's `model: tiny-model.json`, made absolute on load


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        # more KV heads than query heads: vLLM's Attention asserts num_heads % num_kv_heads == 0; kvsim sized it
        ({"num_key_value_heads": 64}, "num_key_value_heads: 64 KV heads do not divide num_attention_heads 32"),
        ({"num_key_value_heads": 5}, "num_key_value_heads: 5 KV heads do not divide num_attention_heads 32"),
        # a negative RoPE factor made a negative max_model_len and an AssertionError traceback
        ({"rope_scaling": {"type": "linear", "factor": -2}}, "rope_scaling.factor: expected a positive number, got -2"),
        ({"rope_scaling": {"type": "dynamic", "factor": "x"}}, "rope_scaling.factor: expected a positive number, got 'x'"),
    ],
)
def test_impossible_heads_and_rope_factors_are_one_error_naming_the_field(write_config, fields, message):
    path = write_config({**LLAMA_8B, **fields})
    with pytest.raises(KvsimError) as err:
        load_hf_config(path)
    assert str(err.value) == f"{path}: {message}"


def test_a_linear_rope_factor_scales_the_length(write_config):
    config = {**LLAMA_8B, "max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert load_hf_config(write_config(config)).max_model_len == 8192


# llm-compressor's fp8 KV cache scheme as it serializes it (laguna-xs.2-fp8's config.json in the catalogue)
CT_FP8_KV = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
             "observer": "minmax", "observer_kwargs": {}, "scale_dtype": None, "strategy": "tensor", "symmetric": True,
             "type": "float", "zp_dtype": None}


@pytest.mark.parametrize(("quantization_config", "expected"), [
    # ModelOpt: a scheme dict (NVFP4 checkpoints ship this one), in the config or its `quantization` section
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}, "fp8"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}, "fp8"),
    ({"quant_method": "modelopt_fp4", "kv_cache_quant_algo": "nvfp4"}, "nvfp4"),
    ({"quant_method": "modelopt", "kv_cache_scheme": {"num_bits": 4, "type": "float"}}, "nvfp4"),
    # what vLLM does not recognise falls back to the model's dtype: a dynamic fp8 scheme, an unknown name
    ({"quant_method": "modelopt", "kv_cache_scheme": {"dynamic": True, "num_bits": 8, "type": "float"}}, None),
    ({"quant_method": "modelopt", "kv_cache_quant_algo": "int8"}, None),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, None),
    # llm-compressor: an 8-bit float kv_cache_scheme is fp8 (per tensor or per head, static or dynamic); a scheme
    # under another method is not read by vLLM
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": CT_FP8_KV}, "fp8"),
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": dict(CT_FP8_KV, strategy="attn_head", dynamic=True)}, "fp8"),
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": None}, None),
    ({"quant_method": "fp8", "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}, None),
    (None, None),
    # as vLLM normalizes the config first: a ModelOpt producer names the method, "compressed_tensors" is the same
    ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}, "fp8"),
    ({"quant_method": "compressed_tensors", "kv_cache_scheme": CT_FP8_KV}, "fp8"),
])
def test_the_kv_dtype_a_checkpoint_asks_for_is_what_vllm_auto_takes(write_config, quantization_config, expected):
    # vLLM 0.33's --kv-cache-dtype auto: get_kv_cache_quant_algo_string (ModelOpt), the Attention layer
    # (compressed-tensors); the conformance size check runs vLLM's function on every catalogue config
    config = dict(LLAMA_8B, **({"quantization_config": quantization_config} if quantization_config is not None else {}))
    model = load_hf_config(write_config(config))
    assert model.checkpoint_kv_dtype == expected


@pytest.mark.parametrize(("field", "value", "says"), [
    ("num_hidden_layers", 10**30, "at most 10,000 layers"),  # a typo of this size hung or overflowed
    ("vocab_size", -1, "positive integer"),  # a negative vocabulary shrank the weights and grew the KV budget
    ("intermediate_size", -1, "positive integer"),
    ("intermediate_size", 14336.5, "positive integer"),
    ("n_routed_experts", -1, "whole number >= 0"),
    ("moe_intermediate_size", "wide", "whole number >= 0"),
    ("torch_dtype", "float99", "unknown dtype 'float99'"),  # was read as bf16
    ("torch_dtype", 5, "unknown dtype 5"),
])
def test_a_config_field_out_of_range_names_the_field_instead_of_a_wrong_figure(write_config, field, value, says):
    config = {**LLAMA_8B, "intermediate_size": 14336, "vocab_size": 128256, field: value}
    with pytest.raises(KvsimError) as info:
        load_hf_config(write_config(config))
    assert info.value.field == field and says in str(info.value) and str(info.value.source).endswith("config.json")


def test_torch_dtype_spellings_a_config_uses(write_config):
    for spelling, dtype in (("float16", "fp16"), ("torch.bfloat16", "bf16"), ("float32", "fp32"), ("half", "fp16")):
        assert load_hf_config(write_config(dict(LLAMA_8B, torch_dtype=spelling))).weight_dtype == dtype
    assert load_hf_config(write_config({k: v for k, v in LLAMA_8B.items() if k != "torch_dtype"})).weight_dtype == "bf16"


def test_an_mla_model_keeps_its_dtype_under_a_compressed_tensors_kv_scheme(write_config):
    # vLLM's MLAAttention does not apply llm-compressor's kv_cache_scheme (its Attention layer does): auto stays bf16
    mla = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
           "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
           "v_head_dim": 128, "max_position_embeddings": 163840,
           "quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": CT_FP8_KV}}
    assert load_hf_config(write_config(mla)).checkpoint_kv_dtype is None
    # nor does it check the scheme: an int4 one, which vLLM's Attention refuses, leaves an MLA model in its dtype
    int4 = dict(mla, quantization_config={"quant_method": "compressed-tensors", "kv_cache_scheme": dict(CT_FP8_KV, num_bits=4, type="int")})
    assert load_hf_config(write_config(int4)).checkpoint_kv_dtype is None
    modelopt = dict(mla, quantization_config={"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"})
    assert load_hf_config(write_config(modelopt)).checkpoint_kv_dtype == "fp8"  # ModelOpt's sets the cache's dtype
    assert load_hf_config(write_config(dict(LLAMA_8B, compression_config=mla["quantization_config"]))).checkpoint_kv_dtype == "fp8"


@pytest.mark.parametrize(("scheme", "field", "says"), [
    # vLLM 0.33's CompressedTensorsKVCacheMethod.validate_kv_cache_scheme refuses each while building the Attention
    # layers (whatever --kv-cache-dtype says); kvsim read every one of them as an fp8 KV cache
    (dict(CT_FP8_KV, num_bits=4, type="int"), "type", "got num_bits 4, type 'int'"),
    (dict(CT_FP8_KV, num_bits=8, type="int"), "type", "num_bits 8, type float"),
    (dict(CT_FP8_KV, num_bits=4, type="float"), "num_bits", "got num_bits 4, type 'float'"),
    (dict(CT_FP8_KV, strategy="channel"), "strategy", "got 'channel'"),
    ({k: v for k, v in CT_FP8_KV.items() if k != "strategy"}, "strategy", "got None"),
    (dict(CT_FP8_KV, symmetric=False), "symmetric", "symmetric: true"),
])
def test_a_compressed_tensors_kv_scheme_vllm_cannot_load_is_refused_naming_the_field(write_config, scheme, field, says):
    path = write_config(dict(LLAMA_8B, quantization_config={"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}))
    with pytest.raises(KvsimError) as info:
        load_hf_config(path)
    assert info.value.field == f"quantization_config.kv_cache_scheme.{field}" and info.value.source == str(path)
    assert says in str(info.value) and "vLLM 0.33 cannot load this checkpoint" in str(info.value)
    # the same under compression_config, and a scheme that is not an object
    path = write_config(dict(LLAMA_8B, compression_config={"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}))
    with pytest.raises(KvsimError, match=f"compression_config.kv_cache_scheme.{field}: "):
        load_hf_config(path)
    path = write_config(dict(LLAMA_8B, quantization_config={"quant_method": "compressed-tensors", "kv_cache_scheme": "fp8"}))
    with pytest.raises(KvsimError, match="quantization_config.kv_cache_scheme: .* got 'fp8'"):
        load_hf_config(path)
