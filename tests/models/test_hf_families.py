"""Each family's layout read from its public config keys, with figures checked by hand against vLLM 0.33's rule.

Configs carry the public config.json's own field names and the published sizes of the model named in each test;
the arithmetic in the comments is the figure vLLM would allocate (bf16 KV, tp=1 unless said).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvsim.errors import KvsimError
from kvsim.models.hf_config import load_hf_config
from kvsim.models.spec import LayerKind
from kvsim.size.sizing import block_rounded_bytes_per_sequence, bytes_per_sequence, kv_cache_spec
from kvsim.size.vllm import VllmSettings, vllm_layers, vllm_startup


@pytest.fixture
def load(tmp_path):
    """load({...}) -> the ModelSpec kvsim reads from a config.json holding it."""

    def read(data):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(data))
        return load_hf_config(path)

    return read


def kinds(model) -> dict[str, int]:
    return model.layer_counts


# --- DeciLM / Llama-Nemotron: block_configs ---------------------------------------------------------------------

NEMOTRON_SUPER_BLOCKS = {  # nvidia/Llama-3_3-Nemotron-Super-49B-v1's fields, four of its 80 block configs
    "model_type": "nemotron-nas",
    "architectures": ["DeciLMForCausalLM"],
    "num_hidden_layers": 4,
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
    "block_configs": [
        {"attention": {"n_heads_in_group": 8, "no_op": False, "replace_with_linear": False}, "ffn": {"ffn_mult": 5.25}},
        {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False}, "ffn": {"ffn_mult": 2.625}},
        {"attention": {"n_heads_in_group": None, "no_op": False, "replace_with_linear": True}, "ffn": {"ffn_mult": 2.625}},
        {"attention": {"n_heads_in_group": 16, "no_op": False, "replace_with_linear": False}, "ffn": {"ffn_mult": 5.25}},
    ],
}


def test_decilm_block_configs_give_each_layer_its_own_kv_heads(load):
    model = load(NEMOTRON_SUPER_BLOCKS)
    assert [layer.kind for layer in model.layers] == [LayerKind.FULL, LayerKind.NO_CACHE, LayerKind.NO_CACHE, LayerKind.FULL]
    assert [layer.num_kv_heads for layer in model.attention_layers] == [64 // 8, 64 // 16]
    # K+V of 8 and 4 heads of 8192/64 = 128, bf16: 2 x (8 + 4) x 128 x 2 (taken as 4 x 8-head MHA layers: 13x)
    assert kv_cache_spec(model).bytes_per_token == 2 * (8 + 4) * 128 * 2 == 6144
    assert model.max_model_len == 131072  # llama3 rope: already the scaled length


def test_decilm_attention_without_group_size_is_refused(load):
    blocks = [{"attention": {"n_heads_in_group": None, "no_op": False}}] * 4
    with pytest.raises(KvsimError, match="block_configs"):
        load({**NEMOTRON_SUPER_BLOCKS, "block_configs": blocks})


# --- Llama 4: chunked local attention ---------------------------------------------------------------------------

LLAMA4_SCOUT = {  # meta-llama/Llama-4-Scout-17B-16E-Instruct: text_config fields
    "model_type": "llama4",
    "text_config": {
        "model_type": "llama4_text",
        "num_hidden_layers": 48,
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_chunk_size": 8192,
        "no_rope_layers": [1, 1, 1, 0] * 12,
        "max_position_embeddings": 10485760,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "original_max_position_embeddings": 8192},
        "torch_dtype": "bfloat16",
    },
}


def test_llama4_rope_layers_use_chunked_local_attention(load):
    model = load(LLAMA4_SCOUT)
    assert kinds(model) == {"chunked(8192)": 36, "full": 12}
    spec = kv_cache_spec(model)
    per_layer = 2 * 8 * 128 * 2  # 4096 B a token a layer
    assert spec.bytes_per_token == 48 * per_layer == 196608
    # what the model needs at 131,072 tokens: 12 full layers keep all, 36 chunked layers one 8192-token chunk
    assert bytes_per_sequence(spec, 131072) == 12 * per_layer * 131072 + 36 * per_layer * 8192
    # in whole 16-token blocks: a chunk starts on a block boundary, 512 blocks
    assert block_rounded_bytes_per_sequence(spec, 131072) == 12 * per_layer * 131072 + 36 * per_layer * 16 * 512
    assert model.max_model_len == 10485760  # vLLM: llama3 rope is not rescaled


def test_llama4_vllm_keeps_chunked_layers_in_their_own_groups(load):
    # vLLM 0.33 keeps its hybrid KV cache manager on for chunked local attention: 36 chunked + 12 full layers,
    # groups of 12 (36 > 1.5 x 12): 3 ChunkedLocalAttentionSpec groups + 1 full group, 16-token pages of 4,096 B
    model = load(LLAMA4_SCOUT)
    spec = kv_cache_spec(model)
    bytes_per_block = 12 * 16 * 4096  # a block id spans one layer of each group: 786,432 B
    startup = vllm_startup(vllm_layers(model, spec), bytes_per_block * 25600, 131072, spec.block_size, VllmSettings())
    assert [(g.kind, g.num_layers) for g in startup.groups] == [("chunked", 12)] * 3 + [("full", 12)]
    assert (startup.group_size, startup.bytes_per_block, startup.num_blocks) == (12, bytes_per_block, 25600)
    # a request of 131,072 tokens: a chunk plus 2 x 8,192 tokens in flight, cdiv(8192 + 16384, 16) = 1,536 blocks
    # in each chunked group, cdiv(131072, 16) = 8,192 in the full one: 3 x 1,536 + 8,192 = 12,800 blocks
    assert [g.blocks_per_request for g in startup.groups] == [1536] * 3 + [8192]
    assert (startup.concurrency, startup.tokens) == (2.0, 262144)  # 25,600 / 12,800; 2 x 131,072


def test_llama4_layer_types_chunked_attention(load):
    text = {k: v for k, v in LLAMA4_SCOUT["text_config"].items() if k != "no_rope_layers"}
    text["layer_types"] = ["chunked_attention", "chunked_attention", "chunked_attention", "full_attention"] * 12
    assert kinds(load({**LLAMA4_SCOUT, "text_config": text})) == {"chunked(8192)": 36, "full": 12}


# --- Gemma 4: the full layers' own head size and KV heads -------------------------------------------------------

GEMMA4 = {  # google/gemma-4 text_config field names; 6 layers of its 5 sliding : 1 full pattern
    "model_type": "gemma4_text",
    "num_hidden_layers": 6,
    "hidden_size": 5376,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 256,
    "num_global_key_value_heads": 4,
    "global_head_dim": 512,
    "attention_k_eq_v": True,
    "sliding_window": 1024,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "max_position_embeddings": 262144,
}


def test_gemma4_full_layers_use_global_head_dim_and_kv_heads(load):
    model = load(GEMMA4)
    spec = kv_cache_spec(model)
    full, sliding = spec.groups
    assert (full.kind, sliding.kind, sliding.window) == ("full", "sliding", 1024)
    assert full.bytes_per_token == 1 * 2 * 4 * 512 * 2 == 8192  # not 2 x 16 x 256 x 2 = 16384 (sliding shapes)
    assert sliding.bytes_per_token == 5 * 2 * 16 * 256 * 2 == 81920


def test_gemma4_kv_shared_layers_cache_nothing(load):
    model = load({**GEMMA4, "num_kv_shared_layers": 2})
    assert [layer.kind for layer in model.layers][-2:] == [LayerKind.NO_CACHE, LayerKind.NO_CACHE]
    assert kinds(model) == {"sliding(1024)": 4, "none": 2}


# --- Gemma-3n: num_kv_shared_layers -----------------------------------------------------------------------------

GEMMA3N_E4B = {  # google/gemma-3n-E4B-it text_config
    "model_type": "gemma3n",
    "text_config": {
        "model_type": "gemma3n_text",
        "num_hidden_layers": 35,
        "hidden_size": 2048,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
        "num_kv_shared_layers": 15,
        "activation_sparsity_pattern": [0.95] * 10 + [0.0] * 25,
        "max_position_embeddings": 32768,
    },
}


def test_gemma3n_last_layers_reuse_earlier_kv(load):
    model = load(GEMMA3N_E4B)
    # layers 0-19 keep KV (16 sliding, 4 full), layers 20-34 read it
    assert kinds(model) == {"sliding(512)": 16, "full": 4, "none": 15}
    assert kv_cache_spec(model).bytes_per_token == 20 * 2 * 2 * 256 * 2 == 40960


# --- MiMo-V2: hybrid_layer_pattern with per-kind heads and V of another size ------------------------------------

MIMO_V2_FLASH = {  # XiaomiMiMo/MiMo-V2-Flash field names; 6 layers of its pattern
    "model_type": "mimo_v2_flash",
    "num_hidden_layers": 6,
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 192,
    "v_head_dim": 128,
    "swa_num_attention_heads": 64,
    "swa_num_key_value_heads": 8,
    "swa_head_dim": 192,
    "swa_v_head_dim": 128,
    "sliding_window_size": 128,
    "hybrid_layer_pattern": [0, 1, 1, 1, 1, 1],
    "max_position_embeddings": 262144,
}


def test_hybrid_layer_pattern_with_swa_heads_and_v_head_dim(load):
    model = load(MIMO_V2_FLASH)
    assert kinds(model) == {"full": 1, "sliding(128)": 5}
    full, sliding = kv_cache_spec(model).groups
    assert full.bytes_per_token == 4 * (192 + 128) * 2 == 2560  # K 192 + V 128 per head
    assert sliding.bytes_per_token == 5 * 8 * (192 + 128) * 2 == 25600
    # at 262,144 tokens the full layer keeps all, the sliding ones 128 (every layer sliding would be 321x under)
    assert bytes_per_sequence(kv_cache_spec(model), 262144) == 2560 * 262144 + 25600 * 128


def test_hybrid_layer_pattern_as_a_string(load):
    assert kinds(load({**MIMO_V2_FLASH, "hybrid_layer_pattern": "011111"})) == {"full": 1, "sliding(128)": 5}


# --- Sparse-attention indexers: DeepSeek-V3.2, GLM-5 ------------------------------------------------------------

DEEPSEEK_V32 = {  # deepseek-ai/DeepSeek-V3.2-Exp
    "model_type": "deepseek_v32",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "q_lora_rank": 1536,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "max_position_embeddings": 163840,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
}


@pytest.mark.parametrize("kv_dtype, latent_bytes", [("bf16", 2), ("fp8", 1)])
def test_indexer_keys_are_fp8_plus_scale_whatever_the_kv_dtype(load, kv_dtype, latent_bytes):
    spec = kv_cache_spec(load(DEEPSEEK_V32), kv_dtype=kv_dtype)
    # per layer: latent 512 + 64 in the KV dtype, index keys 128 fp8 + 128/128 x 4-byte scale = 132 B
    assert spec.bytes_per_token == 61 * (576 * latent_bytes + 132)


def test_deepseek_v32_context_is_not_rescaled_by_yarn(load):
    assert load(DEEPSEEK_V32).max_model_len == 163840


def test_glm5_indexer(load):
    cfg = {**DEEPSEEK_V32, "model_type": "glm_moe_dsa", "num_hidden_layers": 78}
    assert kv_cache_spec(load(cfg)).bytes_per_token == 78 * (576 * 2 + 132)


# --- State dtypes -----------------------------------------------------------------------------------------------

QWEN35_TEXT = {  # Qwen/Qwen3.5 text_config fields (gated delta net + full attention, mamba_ssm_dtype)
    "model_type": "qwen3_5_text",
    "num_hidden_layers": 8,
    "hidden_size": 4096,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}


def test_qwen35_recurrent_state_in_float32(load):
    spec = kv_cache_spec(load(QWEN35_TEXT))
    conv = 3 * (128 * 16 * 2 + 128 * 32)  # (kernel - 1) x conv_dim = 24,576, bf16
    ssm = 32 * 128 * 128  # value heads x value dim x key dim = 524,288, fp32
    assert spec.state_bytes_per_sequence == 6 * (conv * 2 + ssm * 4) == 6 * 2146304


def test_mamba_ssm_dtype_outside_qwen35_is_refused(load):
    cfg = {**QWEN35_TEXT, "model_type": "qwen3_next"}
    with pytest.raises(KvsimError, match="mamba_ssm_dtype"):
        load(cfg)


# --- Nemotron-H / Nemotron-3: hybrid_override_pattern, fp32 ssm state --------------------------------------------

NEMOTRON_H_8B = {  # nvidia/Nemotron-H-8B-Base-8K
    "model_type": "nemotron_h",
    "num_hidden_layers": 52,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_head_dim": 128,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "chunk_size": 128,
    "expand": 2,
    "mamba_hidden_act": "silu",
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def test_nemotron_h_pattern_and_fp32_ssm_state(load):
    model = load(NEMOTRON_H_8B)
    assert kinds(model) == {"linear-state": 24, "none": 24, "full": 4}
    spec = kv_cache_spec(model)
    assert spec.bytes_per_token == 4 * 2 * 8 * 128 * 2 == 16384
    conv = 3 * (128 * 64 + 2 * 8 * 128)  # (conv_kernel - 1) x (intermediate + 2 n_groups d_state) = 30,720, bf16
    ssm = 128 * 64 * 128  # heads x head_dim x d_state = 1,048,576, fp32 (vLLM's NemotronH default)
    assert spec.state_bytes_per_sequence == 24 * (conv * 2 + ssm * 4) == 24 * 4255744


def test_nemotron_h_ssm_cache_dtype_from_config(load):
    spec = kv_cache_spec(load({**NEMOTRON_H_8B, "mamba_ssm_cache_dtype": "bfloat16"}))
    assert spec.state_bytes_per_sequence == 24 * (30720 + 1048576) * 2


def test_nemotron_h_unknown_layer_character(load):
    with pytest.raises(KvsimError, match="hybrid_override_pattern"):
        load({**NEMOTRON_H_8B, "hybrid_override_pattern": "MX" * 26})


# --- Falcon-H1: attention and mamba in every layer ---------------------------------------------------------------

FALCON_H1 = {  # tiiuae/Falcon-H1 field names
    "model_type": "falcon_h1",
    "num_hidden_layers": 36,
    "hidden_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "mamba_d_ssm": 1536,
    "mamba_n_heads": 24,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 128,
    "max_position_embeddings": 16384,
}


def test_falcon_h1_auto_mamba_head_dim(load):
    spec = kv_cache_spec(load({**FALCON_H1, "mamba_d_head": "auto"}))  # 1536 / 24 heads = 64, as given explicitly
    assert spec.state_bytes_per_sequence == kv_cache_spec(load(FALCON_H1)).state_bytes_per_sequence


def test_falcon_h1_every_layer_keeps_kv_and_state(load):
    spec = kv_cache_spec(load(FALCON_H1))
    assert spec.bytes_per_token == 36 * 2 * 2 * 64 * 2 == 18432
    conv = 3 * (1536 + 2 * 1 * 128)  # mamba_d_ssm, not mamba_expand x hidden
    assert spec.state_bytes_per_sequence == 36 * (conv + 24 * 64 * 128) * 2


# --- Zamba2: shared attention on hybrid layers ------------------------------------------------------------------

ZAMBA2_1B = {  # Zyphra/Zamba2-1.2B
    "model_type": "zamba2",
    "num_hidden_layers": 6,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "attention_head_dim": 128,
    "layers_block_type": ["mamba", "mamba", "hybrid", "mamba", "mamba", "hybrid"],
    "hybrid_layer_ids": [2, 5],
    "mamba_expand": 2,
    "n_mamba_heads": 64,
    "mamba_headdim": 64,
    "mamba_ngroups": 1,
    "mamba_d_state": 64,
    "mamba_d_conv": 4,
    "max_position_embeddings": 4096,
}


def test_zamba2_hybrid_layers_add_attention(load):
    spec = kv_cache_spec(load(ZAMBA2_1B))
    assert spec.bytes_per_token == 2 * 2 * 32 * 128 * 2  # two hybrid layers, MHA of attention_head_dim
    assert spec.state_bytes_per_sequence == 6 * (3 * (4096 + 2 * 64) + 64 * 64 * 64) * 2


# --- Granite-4.0-H: layer_types mamba / attention ----------------------------------------------------------------


def test_granite_4_h_layer_types(load):
    cfg = {  # ibm-granite/granite-4.0-h field names, 4 layers
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 4,
        "hidden_size": 1536,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "layer_types": ["mamba", "mamba", "mamba", "attention"],
        "mamba_n_heads": 48,
        "mamba_d_head": 64,
        "mamba_n_groups": 1,
        "mamba_d_state": 128,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "max_position_embeddings": 131072,
    }
    spec = kv_cache_spec(load(cfg))
    assert spec.bytes_per_token == 2 * 4 * 128 * 2
    assert spec.state_bytes_per_sequence == 3 * (3 * (3072 + 256) + 48 * 64 * 128) * 2


# --- Attention-free models --------------------------------------------------------------------------------------


def test_mamba1_zero_kv_per_token_and_a_state(load):
    cfg = {"model_type": "mamba", "num_hidden_layers": 64, "hidden_size": 2560, "intermediate_size": 5120,
           "state_size": 16, "conv_kernel": 4, "expand": 2}  # state-spaces/mamba-2.8b-hf  # fmt: skip
    model = load(cfg)
    spec = kv_cache_spec(model)
    assert spec.bytes_per_token == 0 and model.attention_layers == ()
    assert spec.state_bytes_per_sequence == 64 * (5120 * 3 + 5120 * 16) * 2 == 12451840
    assert model.max_model_len == 2048  # no length key: vLLM assumes 2048


def test_mamba2_codestral(load):
    cfg = {"model_type": "mamba2", "num_hidden_layers": 64, "hidden_size": 4096, "num_heads": 128, "head_dim": 64,
           "n_groups": 8, "state_size": 128, "conv_kernel": 4, "expand": 2}  # mistralai/Mamba-Codestral-7B-v0.1  # fmt: skip
    spec = kv_cache_spec(load(cfg))
    assert spec.state_bytes_per_sequence == 64 * (3 * (8192 + 2 * 8 * 128) + 128 * 64 * 128) * 2


def test_rwkv_state(load):
    cfg = {"model_type": "rwkv", "num_hidden_layers": 12, "hidden_size": 768, "attention_hidden_size": 768,
           "context_length": 1024}  # RWKV/rwkv-4-169m-pile  # fmt: skip
    spec = kv_cache_spec(load(cfg))
    assert spec.bytes_per_token == 0
    assert spec.state_bytes_per_sequence == 12 * (2 * 768 * 2 + 3 * 768 * 4)  # two shifts bf16, num/den/max fp32


def test_minimax_text_01_is_refused_as_vllm_no_longer_serves_it(load):
    with pytest.raises(KvsimError, match="0.23.0"):
        load({"model_type": "minimax", "num_hidden_layers": 80, "hidden_size": 6144, "num_attention_heads": 64,
              "attn_type_list": [0] * 7 + [1], "max_position_embeddings": 10240000})  # fmt: skip


# --- Default context --------------------------------------------------------------------------------------------


def test_longrope_serves_original_max_position_embeddings(load):
    cfg = {  # microsoft/Phi-3.5-mini-instruct
        "model_type": "phi3",
        "num_hidden_layers": 32,
        "hidden_size": 3072,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48},
    }
    assert load(cfg).max_model_len == 4096


# --- The mechanism: a layout key kvsim does not read is an error, never a number ---------------------------------


@pytest.mark.parametrize(
    "key, value",
    [
        ("swa_num_key_value_heads", 8),  # a MiMo key on a Llama config
        ("hybrid_layer_pattern", [0, 1] * 16),
        ("global_head_dim", 512),
        ("attention_chunk_size", 8192),
        ("index_head_dim", 128),
        ("foo_layer_pattern", "ABAB"),  # a key no family has: still looks like layout
        ("num_kv_shared_layers", 4),
    ],
)
def test_unknown_layout_key_is_an_error_naming_key_and_file(tmp_path, key, value):
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "max_position_embeddings": 131072, key: value}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(KvsimError) as err:
        load_hf_config(path)
    assert err.value.field == key and str(path) in str(err.value)


def test_layout_key_a_family_reads_but_this_config_never_uses(load):
    # Gemma 4 reads global_head_dim for its full layers; a config with no full layer never consults it
    cfg = {**GEMMA4, "layer_types": ["sliding_attention"] * 6}
    assert kinds(load(cfg)) == {"sliding(1024)": 6}  # num_global_key_value_heads / global_head_dim are read
    nemotron = {**NEMOTRON_H_8B, "hybrid_override_pattern": "M-" * 26}
    assert kinds(load(nemotron)) == {"linear-state": 26, "none": 26}


def test_false_or_null_layout_keys_are_not_set(load):
    assert kinds(load({**MIMO_V2_FLASH, "model_type": "llama", "hybrid_layer_pattern": None, "swa_num_key_value_heads": None,
                       "swa_head_dim": None, "swa_v_head_dim": None, "sliding_window_size": None, "v_head_dim": None,
                       "swa_num_attention_heads": None})) == {"full": 6}  # fmt: skip


def test_context_smallest_length_key_and_model_max_length(load):
    base = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    assert load({**base, "max_position_embeddings": 8192, "seq_length": 4096}).max_model_len == 4096
    assert load({**base, "max_position_embeddings": 8192, "model_max_length": 16384}).max_model_len == 16384
    # transformers v5 rope_parameters, one dict per layer type: a linear factor still scales
    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0}, "sliding_attention": {"rope_type": "default"}}
    assert load({**base, "max_position_embeddings": 8192, "rope_parameters": rope}).max_model_len == 16384
    with pytest.raises(KvsimError, match="max_position_embeddings"):
        load(base)  # vLLM would assume 2048 with a warning; kvsim asks (attention models state their length)


def test_nemotron_h_through_vllms_hybrid_arithmetic(load):
    model = load(NEMOTRON_H_8B)
    spec = kv_cache_spec(model)
    layers = vllm_layers(model, spec)
    assert len(layers) == 4 + 24  # the 24 MLP-only layers have no KV cache spec
    startup = vllm_startup(layers, 4 * 4259840 * 700, 8192, spec.block_size, VllmSettings())
    # one attention layer's token: 2 x 8 x 128 x 2 = 4,096 B; one mamba layer's state: 30,720 x 2 + 1,048,576 x 4
    # = 4,255,744 B; block_size raised to 16 x cdiv(4,255,744, 16 x 4,096) = 1,040 tokens, page 4,259,840 B
    assert (startup.block_size, startup.page_bytes) == (1040, 4259840)
    # 4 attention + 24 mamba layers: groups of 4, 1 full + 6 state groups; a block id spans 4 pages
    assert (startup.group_size, startup.num_groups, startup.num_blocks) == (4, 7, 700)
    # a request of 8,192 tokens: cdiv(8192, 1040) = 8 attention blocks + 1 state block in each of 6 groups
    assert startup.blocks_per_request == 8 + 6
    assert (startup.concurrency, startup.tokens) == (50.0, 50 * 8192)


def test_decilm_full_layers_of_different_kv_heads_share_one_group(load):
    # vLLM's uniform-type rule: full layers of 8 and 4 KV heads need the same token slots: one group, and a
    # block id spans one page of each: 16 x (8 + 4) x 256 x 2 = 98,304 B (not two groups of unified pages)
    model = load(NEMOTRON_SUPER_BLOCKS)
    startup = vllm_startup(vllm_layers(model, kv_cache_spec(model)), 98304 * 1000, 4096)
    assert (startup.num_groups, startup.group_size, startup.bytes_per_block, startup.num_blocks) == (1, 2, 98304, 1000)
    assert startup.groups[0].page_bytes == 16 * 8 * 256 * 2  # the group's spec is its first layer's
    assert (startup.blocks_per_request, startup.concurrency) == (256, 1000 / 256)


def test_dsa_indexer_keys_are_their_own_layers_in_mla_s_group(load):
    # DeepseekV32IndexerCache: an MLA spec of 132 uint8 a token beside each of the 61 MLA layers (576 x 2 B):
    # one uniform-type group of 122 layers; a block id spans 16 x (61 x 1,152 + 61 x 132) B
    model = load(DEEPSEEK_V32)
    layers = vllm_layers(model, kv_cache_spec(model))
    assert [layer.bytes_per_token for layer in layers[:4]] == [1152, 132, 1152, 132] and len(layers) == 122
    startup = vllm_startup(layers, 16 * 61 * 1284 * 500, 4096)
    assert (startup.num_groups, startup.group_size, startup.bytes_per_block, startup.num_blocks) == (1, 122, 16 * 61 * 1284, 500)
    with pytest.raises(KvsimError, match="fp8_ds_mla"):  # vLLM stores a quantized sparse MLA cache as 656 B a token
        vllm_layers(model, kv_cache_spec(model, kv_dtype="fp8"))


def test_mamba_without_attention_keeps_its_state_pages_unpadded(load):
    # no attention backend, so no block-size raise: each page is one layer's state, mamba_block_size max_model_len
    cfg = {"model_type": "mamba", "num_hidden_layers": 64, "hidden_size": 2560, "intermediate_size": 5120,
           "state_size": 16, "conv_kernel": 4, "expand": 2, "torch_dtype": "bfloat16"}  # fmt: skip
    model = load(cfg)
    spec = kv_cache_spec(model)
    state = (5120 * 3 + 5120 * 16) * 2  # conv (intermediate x (conv_kernel - 1)) + ssm (intermediate x state_size), bf16
    assert spec.state_bytes_per_sequence == 64 * state == 64 * 194560
    startup = vllm_startup(vllm_layers(model, spec), 64 * state * 300, model.max_model_len, spec.block_size, VllmSettings())
    assert (startup.num_groups, startup.page_bytes, startup.num_blocks, startup.blocks_per_request) == (1, state, 300, 1)
    assert startup.block_size == model.max_model_len == 2048  # vLLM assumes 2048 without a length key
    assert (startup.concurrency, startup.tokens) == (300.0, 300 * 2048)  # "GPU KV cache size: 614,400 tokens"
    aligned = vllm_startup(vllm_layers(model, spec), 64 * state * 300, 2048, 16, VllmSettings(mamba_cache_mode="align"))
    assert (aligned.block_size, aligned.blocks_per_request) == (16, 2)  # running + cached state


def test_a_hybrid_with_a_different_v_head_size_is_refused(load):
    # vLLM raises a hybrid's block size from head_size alone (its FullAttentionSpec with head_size_v = head_size)
    model = load({**NEMOTRON_H_8B, "hybrid_override_pattern": "M*" * 26})
    other_v = replace(model, layers=tuple(replace(layer, head_dim_v=64) if layer.kind == LayerKind.FULL else layer for layer in model.layers))
    assert len(vllm_layers(model, kv_cache_spec(model))) == 52
    with pytest.raises(KvsimError, match="head_dim_v"):
        vllm_layers(other_v, kv_cache_spec(other_v))


def test_rwkv_gets_no_vllm_figures(load):
    from kvsim.size.report import size_report

    model = load({"model_type": "rwkv", "num_hidden_layers": 12, "hidden_size": 768, "attention_hidden_size": 768,
                  "intermediate_size": 3072, "context_length": 1024, "vocab_size": 50277})  # fmt: skip
    assert model.vllm_unserved  # vLLM 0.33 has no RWKV architecture
    report = size_report(replace(model, num_params=169_000_000), memory_bytes=10**10).as_json()
    assert report["block_rounded_is_vllm_exact"] is False and "vllm_num_gpu_blocks" not in report
    assert "RWKV" in report["vllm_unserved"]


def test_no_parameter_estimate_for_families_with_their_own_reader(load):
    shapes = {"vocab_size": 152576, "intermediate_size": 16384}  # what the generic count needs
    assert load({**MIMO_V2_FLASH, **shapes}).num_params is None  # per-kind heads: the generic count would be wrong
    assert load({**NEMOTRON_SUPER_BLOCKS, **shapes}).num_params is None  # per-layer heads and MLPs
    assert load({**MIMO_V2_FLASH, **shapes, "model_type": "llama", "hybrid_layer_pattern": None, "swa_num_key_value_heads": None,
                 "swa_head_dim": None, "swa_v_head_dim": None, "sliding_window_size": None, "v_head_dim": None,
                 "swa_num_attention_heads": None}).num_params is not None  # fmt: skip


@pytest.mark.parametrize(
    "key, value",
    [("use_cla", True), ("cla_share_factor", 2), ("cross_attention_layers", [3, 8]), ("linear_attn_config", {"kda_layers": [1]})],
)
def test_layout_keys_of_families_kvsim_does_not_read_are_refused(load, key, value):
    # Hunyuan's cross-layer KV sharing, Mllama's cross-attention layers, Kimi-Linear's KDA layers
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "max_position_embeddings": 8192, key: value}  # fmt: skip
    with pytest.raises(KvsimError, match=key):
        load(cfg)


def test_gemma4_global_kv_heads_without_k_eq_v_is_not_guessed(load):
    with pytest.raises(KvsimError, match="num_global_key_value_heads"):
        load({**GEMMA4, "attention_k_eq_v": False})
    with pytest.raises(KvsimError, match="global_head_dim"):
        load({k: v for k, v in GEMMA4.items() if k != "global_head_dim"})  # no class default assumed


def test_every_family_reader_has_its_row_in_the_layout_key_table():
    from kvsim.models.hf.families import _READERS
    from kvsim.models.hf.layout_keys import FAMILY_KEYS

    assert set(_READERS) == set(FAMILY_KEYS)


def test_indexer_sharing_across_layers(load):
    # IndexCache (GLM-5.x): index_topk_freq 4 from offset 3: layer i builds an indexer when
    # max(i - 2, 0) % 4 == 0: layers 0, 1, 2, then 6, 10, ..., 58 (14 more): 17 of 61 layers cache index keys
    cfg = {**DEEPSEEK_V32, "model_type": "glm_moe_dsa", "index_topk_freq": 4, "index_skip_topk_offset": 3}
    model = load(cfg)
    with_index = [i for i, layer in enumerate(model.layers) if layer.index_bytes]
    assert with_index == [0, 1, 2] + list(range(6, 61, 4)) and len(with_index) == 17
    assert kv_cache_spec(model).bytes_per_token == 61 * 576 * 2 + 17 * 132
    types = ["full" if i in with_index else "shared" for i in range(61)]
    assert load({**cfg, "indexer_types": types}).layers == model.layers  # agrees: accepted
    with pytest.raises(KvsimError, match="indexer_types"):
        load({**cfg, "indexer_types": ["full"] * 61})
    pattern = ["F", "S"] * 30 + ["F"]  # an explicit pattern wins over the frequency
    assert sum(1 for layer in load({**cfg, "index_topk_pattern": pattern}).layers if layer.index_bytes) == 31


def test_dsa_mlp_and_indexer_rope_keys_are_not_layout(load):
    # these describe the MLP and the indexer's rope, not the cache
    cfg = {**DEEPSEEK_V32, "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 58, "indexer_rope_interleave": True, "qk_head_dim": 192}
    assert kv_cache_spec(load(cfg)).bytes_per_token == 61 * (576 * 2 + 132)


# --- Issue 21: keys that change nothing are not errors; class defaults are read -------------------------------------


def test_falcon_h1_without_mamba_d_ssm_reads_the_config_class_default(load):
    # FalconH1Config's default mamba_d_ssm is 1024 when config.json leaves the key out: 16 heads x 64 = 1024 agree
    cfg = {k: v for k, v in FALCON_H1.items() if k != "mamba_d_ssm"}
    spec = kv_cache_spec(load({**cfg, "mamba_n_heads": 16}))
    assert spec.state_bytes_per_sequence == 36 * (3 * (1024 + 2 * 128) + 16 * 64 * 128) * 2


def test_falcon_h1_null_mamba_d_ssm_is_expand_times_hidden(load):
    # vLLM's falcon_h1.py: d_ssm = mamba_expand x hidden_size when mamba_d_ssm is None: 2 x 1024 = 32 heads x 64
    spec = kv_cache_spec(load({**FALCON_H1, "mamba_d_ssm": None, "mamba_n_heads": 32}))
    assert spec.state_bytes_per_sequence == 36 * (3 * (2048 + 2 * 128) + 32 * 64 * 128) * 2


def test_falcon_h1_heads_that_contradict_the_ssm_width_are_refused(load):
    cfg = {k: v for k, v in FALCON_H1.items() if k != "mamba_d_ssm"}  # default 1024, but 24 heads x 64 = 1536
    with pytest.raises(KvsimError, match=r"24 x 64 = 1536 contradicts the SSM width 1024") as err:
        load(cfg)
    assert err.value.field == "mamba_d_ssm"


def test_llama4_without_no_rope_layers_uses_the_transformers_default(load):
    cfg = {"model_type": "llama4_text", "num_hidden_layers": 8, "hidden_size": 5120, "num_attention_heads": 40,
           "num_key_value_heads": 8, "head_dim": 128, "attention_chunk_size": 8192, "max_position_embeddings": 10485760}
    model = load(cfg)  # Llama4TextConfig: (i + 1) % 4 != 0 has RoPE (chunked); layers 3 and 7 are NoPE (full)
    assert [layer.label for layer in model.layers] == ["chunked(8192)"] * 3 + ["full"] + ["chunked(8192)"] * 3 + ["full"]
    model = load({**cfg, "no_rope_layer_interval": 2})
    assert [layer.label for layer in model.layers] == ["chunked(8192)", "full"] * 4


def test_gemma2_sliding_window_size_is_never_read(load):
    cfg = {"model_type": "gemma2", "num_hidden_layers": 2, "hidden_size": 2304, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192, "sliding_window": 4096}
    assert load({**cfg, "sliding_window_size": 4096}).layers == load(cfg).layers
    # vLLM's gemma2.py sizes the window from sliding_window alone, whatever sliding_window_size says
    assert load({**cfg, "sliding_window_size": 2048}).layers[0].window == 4096


def test_qwen_max_window_layers_with_sliding_windows_off_changes_nothing(load):
    cfg = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
           "num_key_value_heads": 2, "max_position_embeddings": 32768, "sliding_window": 32768,
           "use_sliding_window": False}
    assert load({**cfg, "max_window_layers": 2}).layer_counts == {"full": 4}
    assert load({**cfg, "max_window_layers": 2, "use_sliding_window": True}).layer_counts == {"full": 2, "sliding(32768)": 2}


def test_a_key_vllm_reads_and_kvsim_does_not_is_still_refused(load):
    # MiMo-V2's attention_chunk_size is inert, but on a Llama config it would be a chunked layout kvsim never read
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 8,
           "max_position_embeddings": 4096, "attention_chunk_size": 1024}
    with pytest.raises(KvsimError, match="attention_chunk_size"):
        load(cfg)


def test_mamba_keys_beside_a_layer_list_of_attention_only_change_nothing(load):
    # The dense Granite 4.0 models ship as granitemoehybrid with every layer_types entry "attention" and the mamba
    # keys of the family still set: vLLM's granitemoehybrid.py builds a mamba mixer only on "mamba" layers.
    cfg = {"model_type": "granitemoehybrid", "num_hidden_layers": 40, "hidden_size": 2560, "num_attention_heads": 40,
           "num_key_value_heads": 8, "layer_types": ["attention"] * 40, "mamba_n_heads": 128, "mamba_d_head": 64,
           "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2,
           "max_position_embeddings": 131072}  # fmt: skip
    spec = kv_cache_spec(load(cfg))
    assert (spec.bytes_per_token, spec.state_bytes_per_sequence) == (40 * 8 * 64 * 4, 0)  # 2560 / 40 = 64
    # without a layer list the same keys still mean an unknown hybrid layout: refused (test_hf_config.py)
    with pytest.raises(KvsimError, match="mamba"):
        load({k: v for k, v in cfg.items() if k != "layer_types"})
