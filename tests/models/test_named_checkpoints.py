"""The checkpoints issue 21 names, by their Hugging Face ids: each resolves offline from the catalogue (no cache, no
Hub: conftest sets HF_HUB_OFFLINE=1 and an empty HF_HUB_CACHE) and sizes its KV cache as vLLM 0.33 groups it.

KV sizes and groups only: weight bytes of quantized checkpoints are not tested here.
"""

from __future__ import annotations

import pytest

from kvsim.models.catalogue import resolve_model
from kvsim.size.sizing import kv_cache_spec
from kvsim.size.vllm import vllm_startup
from kvsim.size.vllm_layers import vllm_layers

GiB = 2**30
BUDGET = 40 * GiB

# (hf id, catalogue entry, max_model_len, KV bytes/token bf16 over every per-token layer, of which full attention,
#  state bytes a sequence, vLLM groups as (kind, layers, block_size, page bytes), num_gpu_blocks for 40 GiB), by hand:
NAMED = [
    # 40 layers x 8 KV heads x 128 x (K+V) x 2 B = 163,840; a page 16 x 8 x 128 x 2 x 2 = 65,536;
    # 40 GiB / (40 x 65,536) = 16,384 blocks
    ("Qwen/Qwen3-14B-AWQ", "qwen3-14b-awq", 40960, 163840, 163840, 0, [("full", 40, 16, 65536)], 16384),
    # 48 x 4 x 128 x 2 x 2 = 98,304; page 16 x 4 x 128 x 4 = 32,768; 40 GiB / (48 x 32,768) = 27,306
    ("Qwen/Qwen3-30B-A3B-Instruct-2507-FP8", "qwen3-30b-2507-fp8", 262144, 98304, 98304, 0, [("full", 48, 16, 32768)], 27306),
    # 42 layers, the last 18 share KV: 20 sliding(512) x 2 x 256 x 4 = 40,960 + 4 full x 2 x 512 x 4 = 16,384 = 57,344.
    # Sliding pages (16 x 2,048 = 32,768) divide the full page (16 x 4,096 = 65,536): block 32 for sliding. Buckets 20 and
    # 4 -> group_size 4: 5 sliding groups + 1 full; 40 GiB / (4 x 65,536) = 163,840 blocks
    (
        "google/gemma-4-E4B-it",
        "gemma-4-e4b",
        131072,
        57344,
        16384,
        0,
        [("sliding", 4, 32, 65536)] * 5 + [("full", 4, 16, 65536)],
        163840,
    ),
    # 40 x 8 x 64 x 4 = 81,920 (the config's mamba_* keys are inert: every layer_types entry is "attention");
    # page 16 x 8 x 64 x 4 = 32,768; 40 GiB / (40 x 32,768) = 32,768
    ("ibm-granite/granite-4.0-micro", "granite-4.0-micro", 131072, 81920, 81920, 0, [("full", 40, 16, 32768)], 32768),
    # 8 full x 4 x 256 x 4 = 32,768; 24 gated-delta-net layers x (conv 3 x 8,192 x 2 B + ssm 32 x 128 x 128 x 4 B =
    # 2,146,304) = 51,511,296. Block raised to 528 so an attention page (528 x 4,096 = 2,162,688) holds a state;
    # buckets 24 and 8 -> group_size 8: 3 state groups + 1 full; 40 GiB / (8 x 2,162,688) = 2,482
    (
        "Qwen/Qwen3.5-9B",
        "qwen3.5-9b",
        262144,
        32768,
        32768,
        51511296,
        [("state", 8, 262144, 2162688)] * 3 + [("full", 8, 528, 2162688)],
        2482,
    ),
    # 12 sliding(128) + 12 full x 8 x 64 x 4 = 49,152, half of it full; page 16 x 2,048 = 32,768;
    # 40 GiB / (12 x 32,768) = 109,226
    (
        "openai/gpt-oss-20b",
        "gpt-oss-20b",
        131072,
        49152,
        24576,
        0,
        [("sliding", 12, 16, 32768), ("full", 12, 16, 32768)],
        109226,
    ),
    # 92 x 8 x 128 x 4 = 376,832; page 65,536; 40 GiB / (92 x 65,536) = 7,123
    ("QuantTrio/GLM-4.6-AWQ", "glm-4.6-awq", 202752, 376832, 376832, 0, [("full", 92, 16, 65536)], 7123),
]


@pytest.mark.parametrize("hf_id, name, max_len, per_token, full, state, groups, blocks", NAMED, ids=[n[0] for n in NAMED])
def test_named_checkpoint_resolves_offline_and_sizes_its_kv_cache(hf_id, name, max_len, per_token, full, state, groups, blocks):
    model = resolve_model(hf_id)
    assert (model.name, model.hf_id, model.max_model_len) == (name, hf_id, max_len)
    spec = kv_cache_spec(model)
    assert (spec.bytes_per_token, spec.full_bytes_per_token, spec.state_bytes_per_sequence) == (per_token, full, state)
    startup = vllm_startup(vllm_layers(model, spec), BUDGET, model.max_model_len, spec.block_size)
    assert [(g.kind, g.num_layers, g.block_size, g.page_bytes) for g in startup.groups] == groups
    assert startup.num_blocks == blocks


def test_named_checkpoints_size_from_the_cli_offline(cli):
    """`kvsim size -m ORG/NAME` with HF_HUB_OFFLINE=1 and no cache, no --gpu: the catalogue answers."""
    import json

    for hf_id, name, max_len, per_token, full, state, *_ in NAMED:
        result = cli(["size", "--model", hf_id, "--json"])
        assert result.exit_code == 0, result.stderr
        out = json.loads(result.stdout)
        assert (out["model"], out["hf_id"], out["context_tokens"]) == (name, hf_id, max_len)
        assert (out["kv_bytes_per_token"], out["full_attention_bytes_per_token"]) == (per_token, full)
        assert out["state_bytes_per_sequence"] == state


def test_kimi_linear_is_refused_by_name():
    """Kimi Linear is not modelled: refused naming the family, so it does not count as a catalogue model."""
    from kvsim.errors import KvsimError
    from kvsim.models.hf_config import model_spec_from_config

    cfg = {"model_type": "kimi_linear", "num_hidden_layers": 27, "hidden_size": 2304, "num_attention_heads": 32}
    with pytest.raises(KvsimError, match="Kimi Linear"):
        model_spec_from_config(cfg, source="kimi.json", name="k", hf_id="moonshotai/Kimi-Linear-48B-A3B-Instruct", num_params=1, params_source="t")
