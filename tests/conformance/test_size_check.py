"""`kvsim size --json` equals vLLM 0.33.0's own sizing functions for every catalogue model, tp and GPU tried."""

from __future__ import annotations

import pytest

from kvsim import vllm_sizing
from kvsim.catalogue import model_names
from kvsim.conformance.size_check import Case, catalogue_cases, check, settings_cases

pytestmark = pytest.mark.conformance


def _differences(results) -> list[str]:
    return [f"{r.case.label}: {r.differing}" for r in results if r.differing]


def test_every_catalogue_model_at_tp_1_2_8_on_two_gpus_equals_vllm(vllm_loaded):
    results = [check(case) for case in catalogue_cases()]
    assert _differences(results) == []
    compared = [r for r in results if not r.skipped]
    # a case is skipped only where kvsim refuses it (weights beyond the device, which vLLM refuses too)
    assert all("weights" in r.skipped for r in results if r.skipped)
    assert {r.case.model for r in compared} == set(model_names())  # every model compared somewhere
    refused = [r.case.label for r in compared if r.compared == {"vllm_starts": (False, False)}]
    # llama-3.1-70b at tp 2 on an H100: 42 GB of KV budget, a 131,072-token request needs 43 GB; both refuse
    assert refused == ["llama-3.1-70b --tp 2 --gpu h100-80gb --kv-dtype bf16", "llama-3.1-70b --tp 2 --gpu h100-80gb --kv-dtype bf16 --no-async-scheduling"]
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
    result = check(Case("gemma-3-27b", 1, "h100-80gb"))
    assert {"vllm_kv_cache_size_tokens", "vllm_max_concurrency", "vllm_groups"} <= set(result.differing)
    assert check(Case("qwen3-8b", 1, "h100-80gb")).differing == {}  # no sliding layer: unaffected


def test_the_json_kvsim_size_prints_is_what_is_compared(vllm_loaded, cli):
    """The command line's --json, parsed, goes through the same comparison (a sliding model and a hybrid)."""
    import json

    from kvsim.vllm_sizing import VllmSettings

    for case, args in (
        (Case("gemma-3-27b", 2, "h200"), []),
        (Case("qwen3-next-80b-a3b", 4, "h100-80gb", VllmSettings(mamba_cache_mode="align", mamba_checkpoint_alignment=64, async_scheduling=False)),
         ["--mamba-cache-mode", "align", "--mamba-checkpoint-alignment", "64", "--no-async-scheduling"]),
    ):
        result = cli(["size", "-m", case.model, "--tp", str(case.tp), "--gpu", case.gpu, "--json", *args])
        assert result.exit_code == 0, result.output
        checked = check(case, json.loads(result.stdout))
        assert checked.differing == {} and len(checked.compared) >= 12
