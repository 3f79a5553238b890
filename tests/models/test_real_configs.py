"""Real config.json files of every family kvsim reads (tests/models/data/README.md names each source): each one's
layers and KV bytes a token (bf16, tp=1) checked by hand, and the ones kvsim cannot size refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsim.errors import KvsimError
from kvsim.models.hf_config import load_hf_config
from kvsim.size.sizing import kv_cache_spec

CONFIGS = Path(__file__).parent / "data" / "configs"

# file -> (layers by kind, KV bytes a token over every per-token layer, bf16). K+V: 2 x kv heads x head_dim x 2 B.
SIZED = {
    # max_window_layers beside use_sliding_window false: inert. 36 x 2 heads x 128 (2048/16) x 4 B
    "Qwen--Qwen2.5-3B-Instruct": ({"full": 36}, 36 * 2 * 128 * 4),
    "Qwen--Qwen2-0.5B-Instruct": ({"full": 24}, 24 * 2 * 64 * 4),  # 896 / 14 = 64
    "Qwen--Qwen1.5-MoE-A2.7B-Chat": ({"full": 24}, 24 * 16 * 128 * 4),
    "Qwen--Qwen3-8B": ({"full": 36}, 36 * 8 * 128 * 4),
    "Qwen--Qwen3-30B-A3B": ({"full": 48}, 48 * 4 * 128 * 4),
    "Qwen--Qwen3-32B-FP8": ({"full": 64}, 64 * 8 * 128 * 4),  # quantized weights, bf16 KV
    "Qwen--Qwen3.5-27B": ({"linear-state": 48, "full": 16}, 16 * 4 * 256 * 4),
    "Qwen--Qwen3.5-9B": ({"linear-state": 24, "full": 8}, 8 * 4 * 256 * 4),
    # sliding_window_size (equal to sliding_window) is never read by vLLM's gemma2.py
    "google--gemma-2-9b-it": ({"sliding(4096)": 21, "full": 21}, 42 * 8 * 256 * 4),
    "google--gemma-3-1b-it": ({"sliding(512)": 22, "full": 4}, 26 * 1 * 256 * 4),
    "google--gemma-4-26B-A4B": ({"sliding(1024)": 25, "full": 5}, 25 * 8 * 256 * 4 + 5 * 2 * 512 * 4),
    "meta-llama--Llama-3.1-8B": ({"full": 32}, 32 * 8 * 128 * 4),
    # no no_rope_layers: Llama4TextConfig's default makes every 4th layer NoPE (full), the rest chunked
    "meta-llama--Llama-4-Scout-17B-16E-Instruct": ({"chunked(8192)": 36, "full": 12}, 48 * 8 * 128 * 4),
    "mistralai--Mistral-7B-Instruct-v0.3": ({"full": 32}, 32 * 8 * 128 * 4),
    "mistralai--Mixtral-8x7B-v0.1": ({"full": 32}, 32 * 8 * 128 * 4),
    "deepseek-ai--DeepSeek-V2-Lite": ({"mla": 27}, 27 * (512 + 64) * 2),
    "deepseek-ai--DeepSeek-V3": ({"mla": 61}, 61 * (512 + 64) * 2),
    "deepseek-ai--DeepSeek-V3.2": ({"mla": 61}, 61 * ((512 + 64) * 2 + 128 + 128 // 128 * 4)),  # + fp8 index keys
    "zai-org--GLM-5": ({"mla": 78}, 78 * (512 + 64) * 2 + 78 * (128 + 4)),
    "moonshotai--Kimi-K2-Instruct": ({"mla": 61}, 61 * (512 + 64) * 2),
    "openai--gpt-oss-20b": ({"sliding(128)": 12, "full": 12}, 24 * 8 * 64 * 4),
    # attention_chunk_size is never read by vLLM's mimo_v2.py; full 4 x 192/128, sliding 8 x 192/128
    "XiaomiMiMo--MiMo-V2-Flash": ({"full": 9, "sliding(128)": 39}, 9 * 4 * (192 + 128) * 2 + 39 * 8 * (192 + 128) * 2),
    "MiniMaxAI--MiniMax-M2.5": ({"full": 62}, 62 * 8 * 128 * 4),  # attn_type_list: never read by vLLM
    "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": ({"linear-state": 23, "none": 23, "full": 6}, 6 * 2 * 128 * 4),
    "nvidia--Llama-3_3-Nemotron-Super-49B-v1": ({"full": 49, "none": 31}, 200704),
    "microsoft--Phi-3.5-mini-instruct": ({"sliding(262144)": 32}, 32 * 32 * 96 * 4),
    "THUDM--chatglm3-6b": ({"full": 28}, 28 * 2 * 128 * 4),  # multi_query_group_num 2, kv_channels 128
    "allenai--OLMo-2-1124-7B-Instruct": ({"full": 32}, 32 * 32 * 128 * 4),
    "bigcode--starcoder2-7b": ({"sliding(4096)": 32}, 32 * 4 * 128 * 4),
    "CohereForAI--aya-23-8B": ({"full": 32}, 32 * 8 * 128 * 4),
}

# file -> (field named, words the one-line error carries)
REFUSED = {
    "RWKV--rwkv-5-world-3b": ("model_type", "rwkv5"),  # routed to the RWKV reader, refused by name
    "moonshotai--Kimi-K3": ("model_type", "KDA"),
}


def test_every_data_file_is_checked():
    assert {p.stem for p in CONFIGS.glob("*.json")} == set(SIZED) | set(REFUSED)


@pytest.mark.parametrize("name", sorted(SIZED))
def test_real_config_layers_and_kv_bytes_per_token(name):
    counts, per_token = SIZED[name]
    model = load_hf_config(CONFIGS / f"{name}.json")
    assert model.layer_counts == counts
    assert kv_cache_spec(model).bytes_per_token == per_token


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_real_configs_kvsim_cannot_size_are_refused_by_name(name):
    field, words = REFUSED[name]
    with pytest.raises(KvsimError, match=words) as err:
        load_hf_config(CONFIGS / f"{name}.json")
    assert err.value.field == field and f"{name}.json" in str(err.value)
