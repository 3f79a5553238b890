"""The shipped model and GPU catalogues: every reference model's figures, name resolution, sources."""

from __future__ import annotations

import pytest
import yaml

from conftest import SHARED
from kvsim.catalogue import catalogue_entry, catalogue_models, model_names, resolve_model
from kvsim.errors import KvsimError
from kvsim.hardware import get_gpu, gpu_names
from kvsim.sizing import kv_cache_spec, sliding_cap_bytes_per_sequence

# Hand-checked against ../shared/reference/models.yaml: (hf id, KV bytes/token bf16 over every per-token layer,
# full-attention bytes/token, sliding-window cap per sequence, state bytes per sequence)
REFERENCE = [
    ("Qwen/Qwen3-0.6B", 114688, 114688, 0, 0),
    ("Qwen/Qwen3-1.7B", 114688, 114688, 0, 0),
    ("Qwen/Qwen3-8B", 147456, 147456, 0, 0),
    ("Qwen/Qwen3-32B", 262144, 262144, 0, 0),
    ("Qwen/Qwen3-30B-A3B", 98304, 98304, 0, 0),
    ("Qwen/Qwen3-235B-A22B", 192512, 192512, 0, 0),
    ("meta-llama/Llama-3.1-8B", 131072, 131072, 0, 0),
    ("meta-llama/Llama-3.1-70B", 327680, 327680, 0, 0),
    ("meta-llama/Llama-3.1-405B", 516096, 516096, 0, 0),
    ("meta-llama/Llama-3.2-1B", 32768, 32768, 0, 0),
    ("mistralai/Mistral-7B-v0.1", 131072, 0, 536870912, 0),  # every layer slides, 4096 x 131072
    ("mistralai/Mixtral-8x7B-v0.1", 131072, 131072, 0, 0),
    ("google/gemma-2-9b", 344064, 172032, 704643072, 0),  # 21 layers x 8192 B x 4096
    ("google/gemma-3-27b", 507904, 81920, 425984 * 1024, 0),
    ("deepseek-ai/DeepSeek-V3", 70272, 70272, 0, 0),  # 61 x (512 + 64) x 2, no K/V factor
    ("openai/gpt-oss-120b", 73728, 36864, 4718592, 0),  # 18 x 2048 x 128
    ("Qwen/Qwen3-Next-80B-A3B", 24576, 24576, 0, 39518208),  # 36 gated-delta-net layers x 1,097,728 B
    ("facebook/opt-13b", 819200, 819200, 0, 0),  # 2 x 40 x 40 x 128 x 2 (bf16 and fp16 are both 2 bytes)
]


@pytest.mark.parametrize("hf_id, per_token, full, cap, state", REFERENCE, ids=[r[0] for r in REFERENCE])
def test_every_reference_model_in_bf16(hf_id, per_token, full, cap, state):
    spec = kv_cache_spec(resolve_model(hf_id))
    assert spec.bytes_per_token == per_token
    assert spec.full_bytes_per_token == full
    assert sliding_cap_bytes_per_sequence(spec) == cap
    assert spec.state_bytes_per_sequence == state


def test_opt_13b_fp16_matches_the_pagedattention_paper():
    assert kv_cache_spec(resolve_model("opt-13b"), kv_dtype="fp16").bytes_per_token == 819200


def test_catalogue_covers_the_reference_models():
    ours = {resolve_model(hf_id).hf_id for hf_id, *_ in REFERENCE}
    assert len(ours) == len(REFERENCE) == len(model_names())
    reference_file = SHARED / "reference" / "models.yaml"
    if reference_file.exists():  # the lead's copy; the package never reads it
        reference = yaml.safe_load(reference_file.read_text())
        assert {k.lower() for k in reference} == {m.hf_id.lower() for m in catalogue_models()}


def test_reference_file_per_token_figures_agree():
    reference_file = SHARED / "reference" / "models.yaml"
    if not reference_file.exists():
        pytest.skip("no ../shared/reference/models.yaml on this machine")
    reference = yaml.safe_load(reference_file.read_text())
    for hf_id, entry in reference.items():
        spec = kv_cache_spec(resolve_model(hf_id), kv_dtype="fp16")
        figure = entry.get("kv_bytes_per_token_bf16", entry.get("kv_bytes_per_token_fp16"))
        expected = figure["all_layers_uncapped"] if isinstance(figure, dict) else figure
        assert spec.bytes_per_token == expected, hf_id


@pytest.mark.parametrize("name", ["qwen3-0.6b", "Qwen/Qwen3-0.6B", "QWEN3-0.6B", "qwen/qwen3-0.6b", "  qwen3-0.6b "])
def test_short_names_and_hf_ids_case_insensitive(name):
    model = resolve_model(name)
    assert model.name == "qwen3-0.6b" and model.hf_id == "Qwen/Qwen3-0.6B"


def test_unknown_model_lists_close_matches():
    with pytest.raises(KvsimError) as err:
        resolve_model("qwen3-0.5b")
    assert "unknown model 'qwen3-0.5b'" in str(err.value) and "qwen3-0.6b" in str(err.value)


def test_path_to_config_json_resolves(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128}')
    assert resolve_model(str(path)).num_layers == 2
    assert resolve_model(str(tmp_path)).num_layers == 2  # a model directory


def test_every_entry_has_sourced_parameter_count():
    for model in catalogue_models():
        entry = catalogue_entry(model.name)
        assert model.num_params and model.num_params > 10**8, model.name
        assert entry["params_source"].strip() and entry["config_source"].strip(), model.name


@pytest.mark.parametrize(
    "name, params",
    [("llama-3.1-8b", 8030261248), ("llama-3.1-70b", 70553706496), ("mistral-7b-v0.1", 7241732096), ("gemma-2-9b", 9241705984)],
)
def test_parameter_counts_match_published_exact_figures(name, params):
    assert resolve_model(name).num_params == params


def test_max_model_len_and_dtypes():
    assert resolve_model("qwen3-0.6b").max_model_len == 40960
    assert resolve_model("gemma-2-9b").max_model_len == 8192
    assert resolve_model("opt-13b").weight_dtype == "fp16"
    assert resolve_model("deepseek-v3").weight_dtype == "fp8"


# --- GPUs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, memory_gib, bandwidth, flops",
    [
        ("h100-80gb", 80, 3.35e12, 989.4e12),
        ("H200", 141, 4.8e12, 989.4e12),
        ("a100-40gb", 40, 1.555e12, 312e12),
        ("A100-80GB", 80, 2.039e12, 312e12),
        ("l4", 24, 300e9, 121e12),
        ("l40s", 48, 864e9, 362.05e12),
        ("rtx-4090", 24, 1008e9, 165.2e12),
        ("b200", 180, 8e12, 2.25e15),
        ("mi300x", 192, 5.3e12, 1307.4e12),
    ],
)
def test_gpu_catalogue(name, memory_gib, bandwidth, flops):
    gpu = get_gpu(name)
    assert gpu.memory_bytes == memory_gib * 2**30
    assert gpu.hbm_bandwidth_bytes_per_s == bandwidth and gpu.bf16_flops_per_s == flops
    assert gpu.source


def test_gpu_aliases_and_unknown():
    assert get_gpu("H100").key == get_gpu("h100_80gb").key == "h100-80gb"
    assert len(gpu_names()) == 9
    with pytest.raises(KvsimError, match="h100-80gb"):
        get_gpu("h1000")


def test_a_gpu_name_that_fits_two_cards_is_an_error_listing_them(cli):
    # `--gpu a100` silently meant the 80 GB card.
    with pytest.raises(KvsimError, match=r"^--gpu: ambiguous GPU 'a100': say which of a100-40gb, a100-80gb$"):
        get_gpu("a100")
    assert get_gpu("A100_40GB").key == "a100-40gb" and get_gpu("h100").key == "h100-80gb"  # one card: fine
    result = cli(["size", "--model", "qwen3-0.6b", "--gpu", "a100"])
    assert result.exit_code == 2 and result.stderr.strip() == "kvsim: error: --gpu: ambiguous GPU 'a100': say which of a100-40gb, a100-80gb"
