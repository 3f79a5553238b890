"""`kvsim size --json` equals vLLM 0.33.0's own sizing functions for every catalogue model, tp and GPU tried."""

from __future__ import annotations

import pytest

from kvsim.size import vllm as vllm_sizing
from kvsim.models.catalogue import model_names
from kvsim.conformance.size_check import Case, catalogue_cases, check, settings_cases
from kvsim.errors import KvsimError

pytestmark = pytest.mark.conformance


def _differences(results) -> list[str]:
    return [f"{r.case.label}: {r.differing}" for r in results if r.differing]


def test_every_catalogue_model_at_tp_1_2_8_on_two_gpus_equals_vllm(vllm_loaded):
    results = [check(case) for case in catalogue_cases()]
    assert _differences(results) == []
    compared = [r for r in results if not r.skipped]
    # a case is skipped only where kvsim refuses it (weights beyond the device, which vLLM refuses too, or a --tp
    # that does not divide the heads) or where vLLM serves no such model (RWKV)
    unserved = {r.case.model for r in results if r.skipped and "does not serve" in r.skipped}
    assert unserved == {"rwkv-4-169m"}
    assert all(any(why in r.skipped for why in ("weights", "--tp", "does not serve", "is not modelled")) for r in results if r.skipped)
    # a quantization kvsim does not count weights for is refused by name (never a bf16 guess): modelopt's
    # per-layer MIXED_PRECISION checkpoints only
    unmodelled = {r.case.model for r in results if r.skipped and "is not modelled" in r.skipped}
    assert unmodelled == {"qwen3.6-27b-nvfp4", "qwen3.6-35b-nvfp4"}
    # every other model is compared somewhere, but for the few whose weights (as kvsim counts them) fill eight H200s
    never = set(model_names()) - unserved - unmodelled - {r.case.model for r in compared}
    assert all("weights" in r.skipped for r in results if r.case.model in never), never
    # (kimi-k2's fp8 weights, 120.8 GiB a rank at tp 8, leave an H200 at vllm serve's 0.92 short by 0.1 GiB)
    assert len(never) <= 12 and not never & {"deepseek-v3", "deepseek-r1", "gpt-oss-20b", "qwen3.5-9b"}
    assert {"mamba-2.8b", "mamba-codestral-7b", "deepseek-v3.2", "llama-4-scout"} <= {r.case.model for r in compared}
    refused = [r.case.label for r in compared if r.compared == {"vllm_starts": (False, False)}]
    # llama-3.1-70b at tp 2 on an H100: ~35 GB of KV left by vLLM's start-up, a 131,072-token request needs 43 GB;
    # qwen3-32b (40,960 tokens, 10 GiB) and gemma-3-27b (131,072) alone on an H100 have 8 and 14 GiB left; mistral-nemo-12b's
    # 1,024,000 tokens and llama-4-scout's 10,485,760 do not fit one request either (scout's fit at tp 8 on an H200)
    # (the grown catalogue adds more such cases: kvsim and vLLM agree on each, as every field above)
    assert {label.split(" --")[0] + " --tp " + label.split("--tp ")[1][0] for label in refused} >= {
        "llama-3.1-70b --tp 2", "mistral-nemo-12b --tp 1", "mistral-nemo-12b --tp 2", "llama-4-scout --tp 2", "llama-4-scout --tp 8",
        "qwen3-32b --tp 1", "gemma-3-27b --tp 1",
    }  # fmt: skip
    assert len(compared) >= 170 and all(len(r.compared) >= 12 for r in compared if r.case.label not in refused)


def test_settings_beside_the_defaults_equal_vllm(vllm_loaded):
    results = [check(case) for case in settings_cases()]
    assert _differences(results) == []
    refused = results[-1]
    assert refused.compared == {"vllm_starts": (False, False)}  # kvsim says vLLM refuses; vLLM raises


def test_the_check_sees_a_wrong_formula(vllm_loaded, monkeypatch):
    """kvsim's old reading (a window plus one batch, not two in flight) differs from vLLM's function."""
    table = dict(vllm_sizing._BLOCKS_PER_REQUEST)
    table["sliding"] = lambda layer, bs, max_len, s: vllm_sizing.cdiv(min(layer.window - 1 + s.max_num_batched_tokens, max_len), bs) + 1
    monkeypatch.setattr(vllm_sizing, "_BLOCKS_PER_REQUEST", table)
    result = check(Case("gemma-3-27b", 1, "h200"))
    assert {"vllm_kv_cache_size_tokens", "vllm_max_concurrency", "vllm_groups"} <= set(result.differing)
    assert check(Case("qwen3-8b", 1, "h100-80gb")).differing == {}  # no sliding layer: unaffected


def test_the_json_kvsim_size_prints_is_what_is_compared(vllm_loaded, cli):
    """The command line's --json, parsed, goes through the same comparison (a sliding model and a hybrid)."""
    import json

    from kvsim.size.vllm import VllmSettings

    for case, args in (
        (Case("gemma-3-27b", 2, "h200"), []),
        (Case("qwen3-next-80b-a3b", 4, "h100-80gb", VllmSettings(mamba_cache_mode="align", mamba_checkpoint_alignment=64, async_scheduling=False)),
         ["--mamba-cache-mode", "align", "--mamba-checkpoint-alignment", "64", "--no-async-scheduling"]),
    ):
        result = cli(["size", "-m", case.model, "--tp", str(case.tp), "--gpu", case.gpu, "--json", *args])
        assert result.exit_code == 0, result.output
        checked = check(case, json.loads(result.stdout))
        assert checked.differing == {} and len(checked.compared) >= 12


def _family_configs() -> dict:
    """The config.json of each family test in tests/models/test_hf_families.py (public field names, published sizes)."""
    import importlib.util

    from conftest import REPO

    path = REPO / "tests" / "models" / "test_hf_families.py"
    spec = importlib.util.spec_from_file_location("hf_family_configs", path)
    families = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(families)

    configs = {name: value for name, value in vars(families).items() if name.isupper() and isinstance(value, dict)}
    # GLM-5's IndexCache: 17 of 61 MLA layers build an indexer, one group of 61 + 17 layers
    configs["GLM5_INDEX_CACHE"] = {**families.DEEPSEEK_V32, "model_type": "glm_moe_dsa", "index_topk_freq": 4, "index_skip_topk_offset": 3}
    return configs


@pytest.mark.parametrize("name", sorted(_family_configs()))
def test_every_family_test_config_equals_vllm(vllm_loaded, tmp_path, name):
    """Each family reader's layers (none layers, head_dim_v, indexer keys, per-state dtypes, chunked, ...)
    through vLLM's own grouping and capacity, at two TP sizes and two lengths."""
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(_family_configs()[name]))
    for tp in (1, 2):
        for context in (None, 4096):
            result = check(Case(str(path), tp, "h100-80gb", context=context, num_params=10**9))
            assert result.skipped is None and result.compared, result.skipped
            assert result.differing == {}, f"{name} --tp {tp} --context {context}: {result.differing}"


def test_kv_cache_dtype_auto_equals_vllms_for_every_catalogue_checkpoint(vllm_loaded, monkeypatch):
    from kvsim.conformance import size_check

    rows = size_check.checkpoint_kv_dtypes()
    assert len(rows) == len(model_names())
    assert [(name, ours) for name, ours, theirs in rows if ours != theirs] == []
    asking = {name for name, ours, _ in rows if ours}
    assert {"qwen3.5-122b-nvfp4", "kimi-k2.5-nvfp4", "laguna-xs.2-fp8", "gemma-4-31b-nvfp4"} <= asking and len(asking) >= 13
    # the check sees a reading that ignores the checkpoint (a bf16 guess for every model)
    from dataclasses import replace

    from kvsim.models import catalogue

    models = catalogue.catalogue_models()
    monkeypatch.setattr(catalogue, "catalogue_models", lambda: [replace(m, checkpoint_kv_dtype=None) for m in models])
    wrong = size_check.checkpoint_kv_dtypes()
    assert {name for name, ours, theirs in wrong if ours != theirs} == asking


def test_kv_cache_dtype_auto_equals_vllms_on_configs_vllm_normalizes(vllm_loaded, tmp_path):
    # vLLM's own _normalize_quantization_config runs first: a ModelOpt producer without quant_method, a
    # "compressed_tensors" spelling, a compression_config key; an MLA model under llm-compressor keeps its dtype
    import json

    from kvsim.conformance import size_check
    from kvsim.models.hf_config import load_hf_config

    llama = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 4096}
    mla = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
           "num_key_value_heads": 4, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
           "v_head_dim": 32, "max_position_embeddings": 4096}
    scheme = {"num_bits": 8, "type": "float", "dynamic": False, "strategy": "tensor", "symmetric": True}
    configs = {
        "producer-only": dict(llama, quantization_config={"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}),
        "underscore": dict(llama, quantization_config={"quant_method": "compressed_tensors", "kv_cache_scheme": scheme}),
        "compression-config": dict(llama, compression_config={"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}),
        "mla-compressed": dict(mla, quantization_config={"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}),
        "modelopt-nvfp4-kv": dict(llama, quantization_config={"quant_method": "modelopt", "kv_cache_scheme": {"num_bits": 4, "type": "float"}}),
        "plain": llama,
    }
    models = []
    for name, config in configs.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        models.append((name, config, load_hf_config(path)))
    rows = size_check.checkpoint_kv_dtypes(models)
    assert [(name, ours) for name, ours, theirs in rows if ours != theirs] == []
    assert {name: ours for name, ours, _ in rows} == {"producer-only": "fp8", "underscore": "fp8", "compression-config": "fp8",
                                                    "mla-compressed": None, "modelopt-nvfp4-kv": "nvfp4", "plain": None}


@pytest.mark.parametrize(("change", "refused"), [
    ({}, False),
    ({"strategy": "attn_head", "dynamic": True}, False),
    ({"num_bits": 8.0}, False),
    ({"num_bits": 4, "type": "int"}, True),
    ({"num_bits": 8, "type": "int"}, True),
    ({"num_bits": 4, "type": "float"}, True),
    ({"strategy": "channel"}, True),
    ({"strategy": "TENSOR"}, True),
    ({"strategy": None}, True),
    ({"symmetric": False}, True),
    ({"symmetric": None}, True),
])
def test_kvsim_refuses_the_compressed_tensors_kv_schemes_vllms_own_check_refuses(vllm_loaded, tmp_path, change, refused):
    # vLLM's CompressedTensorsKVCacheMethod.validate_kv_cache_scheme, compiled from its source, against kvsim's
    # reading of the same config: a refusal on both sides, or fp8 on both
    import json

    from kvsim.conformance import size_check
    from kvsim.models.hf_config import load_hf_config

    scheme = {"num_bits": 8, "type": "float", "dynamic": False, "strategy": "tensor", "symmetric": True, **change}
    assert size_check.vllm_refuses_kv_cache_scheme(scheme) is refused
    llama = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 4096,
             "quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama))
    if refused:
        with pytest.raises(KvsimError, match="kv_cache_scheme"):
            load_hf_config(path)
    else:
        rows = size_check.checkpoint_kv_dtypes([("llama", llama, load_hf_config(path))])
        assert rows == [("llama", "fp8", "fp8")]


def test_kvsim_refuses_the_modelopt_quant_algos_vllms_normalization_refuses(vllm_loaded, tmp_path):
    # vLLM's _normalize_quantization_config raises for a ModelOpt quant_algo it does not know (in config.json or a
    # legacy hf_quant_config.json, which vLLM reads into quantization_config); kvsim sized the KV cache regardless
    import json
    from types import SimpleNamespace

    from kvsim.conformance.vllm_import import import_vllm
    from kvsim.models.hf_config import load_hf_config

    normalize = import_vllm("vllm.transformers_utils.model_arch_config_convertor").ModelArchConfigConvertorBase._normalize_quantization_config
    llama = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 4096}
    for algo, refused in (("INT4_AWQ", True), ("W4A8_AWQ", True), ("fp8", False), ("NVFP4", False), ("FP8_PB_WO", False)):
        quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": algo, "kv_cache_quant_algo": "FP8"}}
        try:
            normalize(None, SimpleNamespace(quantization_config=json.loads(json.dumps(quant))))
            vllm_refused = False
        except ValueError:
            vllm_refused = True
        assert vllm_refused is refused, algo
        path = tmp_path / "config.json"
        path.write_text(json.dumps(dict(llama, quantization_config=quant)))
        if refused:
            with pytest.raises(KvsimError, match=f"quantization_config.quantization.quant_algo: .*'{algo}'"):
                load_hf_config(path)
        else:
            assert load_hf_config(path).checkpoint_kv_dtype == "fp8", algo
