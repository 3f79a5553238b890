"""The shipped model and GPU catalogues: every reference model's figures, name resolution, sources."""

from __future__ import annotations

import pytest
import yaml

from conftest import SHARED
from kvsim.models.catalogue import catalogue_entry, catalogue_models, model_names, resolve_model
from kvsim.errors import KvsimError
from kvsim.models.hardware import get_gpu, gpu_names
from kvsim.size.sizing import kv_cache_spec, sliding_cap_bytes_per_sequence

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
    ("google/gemma-3-27b-pt", 507904, 81920, 425984 * 1024, 0),
    ("deepseek-ai/DeepSeek-V3", 70272, 70272, 0, 0),  # 61 x (512 + 64) x 2, no K/V factor
    ("openai/gpt-oss-120b", 73728, 36864, 4718592, 0),  # 18 x 2048 x 128
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 24576, 24576, 0, 39518208),  # 36 gated-delta-net layers x 1,097,728 B
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


# The reference file names two models by ids that are not repository ids; the catalogue uses real ones.
_REPOSITORY_ID = {"google/gemma-3-27b": "google/gemma-3-27b-pt", "qwen/qwen3-next-80b-a3b": "qwen/qwen3-next-80b-a3b-instruct"}


def test_catalogue_covers_the_reference_models():
    ours = {resolve_model(hf_id).hf_id for hf_id, *_ in REFERENCE}
    assert len(ours) == len(REFERENCE)
    reference_file = SHARED / "reference" / "models.yaml"
    if reference_file.exists():  # the lead's copy; the package never reads it
        reference = yaml.safe_load(reference_file.read_text())
        catalogue = {m.hf_id.lower() for m in catalogue_models()}
        assert {_REPOSITORY_ID.get(k.lower(), k.lower()) for k in reference} <= catalogue


def test_reference_file_per_token_figures_agree():
    reference_file = SHARED / "reference" / "models.yaml"
    if not reference_file.exists():
        pytest.skip("no ../shared/reference/models.yaml on this machine")
    reference = yaml.safe_load(reference_file.read_text())
    for hf_id, entry in reference.items():
        spec = kv_cache_spec(resolve_model(_REPOSITORY_ID.get(hf_id.lower(), hf_id)), kv_dtype="fp16")
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


# --- Every family the config reader knows, by real repository id ---------------------------------------------------

# (name, layers by kind, KV bytes/token bf16 over every per-token layer, state bytes per sequence bf16)
FAMILIES = [
    # 49 of 80 layers keep 8 KV heads x 128: 49 x 2 x 8 x 128 x 2
    ("nemotron-super-49b", {"full": 49, "none": 31}, 200704, 0),
    # 48 layers x 2 x 8 x 128 x 2; 36 of them chunked over 8192 tokens
    ("llama-4-scout", {"chunked(8192)": 36, "full": 12}, 196608, 0),
    # sliding: 25 x 2 x 8 x 256 x 2; full: 5 x 2 x 2 x 512 x 2 (global head size and KV heads)
    ("gemma-4-26b-a4b", {"sliding(1024)": 25, "full": 5}, 204800 + 20480, 0),
    # 20 of 35 layers keep KV (2 heads x 256): 20 x 2 x 2 x 256 x 2; the last 15 reuse it
    ("gemma-3n-e4b", {"sliding(512)": 16, "full": 4, "none": 15}, 40960, 0),
    # full: 9 x 4 x (192 + 128) x 2; sliding: 39 x 8 x (192 + 128) x 2
    ("mimo-v2-flash", {"full": 9, "sliding(128)": 39}, 9 * 2560 + 39 * 5120, 0),
    # 61 x ((512 + 64) x 2 + 132 index bytes)
    ("deepseek-v3.2", {"mla": 61}, 78324, 0),
    # 4 x 2 x 8 x 128 x 2; 24 mamba layers x (30,720 bf16 conv + 1,048,576 fp32 ssm elements)
    ("nemotron-h-8b", {"linear-state": 24, "none": 24, "full": 4}, 16384, 24 * (30720 * 2 + 1048576 * 4)),
    # every one of 44 layers: KV 2 x 2 x 128 x 2, and a mamba-2 state (3 x (3072 + 2 x 256) + 24 x 128 x 256) x 2
    ("falcon-h1-7b", {"full": 44, "linear-state": 44}, 44 * 1024, 44 * (3 * 3584 + 786432) * 2),
    # 4 attention layers x 2 x 8 x 128 x 2; 28 mamba layers x (8192 x 3 + 8192 x 16) x 2
    ("jamba-v0.1", {"linear-state": 28, "full": 4}, 16384, 28 * 8192 * 19 * 2),
    # attention-free: 64 x (5120 x 3 + 5120 x 16) x 2
    ("mamba-2.8b", {"linear-state": 64}, 0, 12451840),
    # 64 x (3 x (8192 + 2 x 8 x 128) + 128 x 64 x 128) x 2
    ("mamba-codestral-7b", {"linear-state": 64}, 0, 64 * 1079296 * 2),
    # 12 x (2 x 768 x 2 + 3 x 768 x 4)
    ("rwkv-4-169m", {"linear-state": 12}, 0, 12 * 12288),
]


@pytest.mark.parametrize("name, layers, per_token, state", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_every_family_in_the_catalogue(name, layers, per_token, state):
    model = resolve_model(name)
    spec = kv_cache_spec(model)
    assert (model.layer_counts, spec.bytes_per_token, spec.state_bytes_per_sequence) == (layers, per_token, state)


@pytest.mark.parametrize(
    "variant, name",
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("google/gemma-3-27b-it", "gemma-3-27b"),
        ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.1-70b"),
        ("meta-llama/llama-4-scout-17b-16e-instruct", "llama-4-scout"),
        ("Qwen/Qwen3-Next-80B-A3B-Thinking", "qwen3-next-80b-a3b"),
        ("deepseek-ai/DeepSeek-V3.2-Exp", "deepseek-v3.2"),
    ],
)
def test_instruct_and_chat_variants_resolve_to_their_base(variant, name):
    assert resolve_model(variant).name == name


def test_catalogue_size_and_unique_repository_ids():
    entries = [catalogue_entry(name) for name in model_names()]
    ids = [repo.lower() for e in entries for repo in [e["hf_id"], *e.get("aliases", [])]]
    assert len(model_names()) >= 40 and len(ids) == len(set(ids))


def test_default_context_as_vllm_derives_it():
    assert resolve_model("phi-3.5-mini").max_model_len == 4096  # longrope: original_max_position_embeddings
    assert resolve_model("mamba-2.8b").max_model_len == 2048  # no length key
    assert resolve_model("llama-4-scout").max_model_len == 10485760


def test_a_gpu_name_that_fits_two_cards_is_an_error_listing_them(cli):
    # `--gpu a100` silently meant the 80 GB card.
    with pytest.raises(KvsimError, match=r"^--gpu: ambiguous GPU 'a100': say which of a100-40gb, a100-80gb$"):
        get_gpu("a100")
    assert get_gpu("A100_40GB").key == "a100-40gb" and get_gpu("h100").key == "h100-80gb"  # one card: fine
    result = cli(["size", "--model", "qwen3-0.6b", "--gpu", "a100"])
    assert result.exit_code == 2 and result.stderr.strip() == "kvsim: error: --gpu: ambiguous GPU 'a100': say which of a100-40gb, a100-80gb"


@pytest.mark.parametrize("name", model_names())
def test_no_catalogue_model_loses_its_vllm_groups(name):
    """Every catalogue model vLLM serves reaches vLLM's arithmetic: groups form, and a mixed model gets the replay's
    pool from them (`python3 -m kvsim.conformance.size_check` then compares each field with vLLM's own)."""
    from kvsim.size.vllm import vllm_startup
    from kvsim.size.vllm_layers import vllm_layers
    from kvsim.size.vllm_pool import with_pool
    from kvsim.size.vllm_settings import VllmSettings

    model = resolve_model(name)
    if model.vllm_unserved:
        pytest.skip(model.vllm_unserved)
    spec = kv_cache_spec(model)
    budget = 2**44  # 16 TiB: room for every model at its full context
    startup = vllm_startup(vllm_layers(model, spec), budget, model.max_model_len, spec.block_size)
    assert startup is not None and startup.groups and startup.num_blocks > 0
    assert sum(g.num_layers for g in startup.groups) >= len([layer for layer in model.layers if layer.kind.value != "none"])
    if not spec.is_uniform:
        assert with_pool(model, spec, budget, model.max_model_len, VllmSettings()).pool is not None


def test_the_grown_catalogue_names_a_source_for_every_entry():
    entries = [catalogue_entry(name) for name in model_names()]
    assert len(entries) >= 141
    assert all(e["config_source"].strip() and e["params_source"].strip() for e in entries)


def test_kvsim_models_fits_80_columns_without_cutting_a_cell():
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "kvsim", "models"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) >= len(model_names()) + 3
    assert "…" not in proc.stdout and max(len(line) for line in lines) <= 80
