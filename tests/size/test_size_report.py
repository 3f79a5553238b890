"""What `kvsim size` reports: capacity in a budget (kvsim's figures beside vLLM's lines) and the report's JSON."""

from __future__ import annotations

import pytest

from kvsim.models.catalogue import resolve_model
from kvsim.errors import KvsimError
from kvsim.size.report import capacity, size_report
from kvsim.size.sizing import kv_budget_bytes, kv_cache_spec, weight_bytes
from kvsim.size.vllm import VllmSettings, vllm_layers

GiB = 2**30


def test_capacity_matches_vllm_for_a_uniform_model():
    """qwen3-0.6b on an H100 80GB at 0.9: vLLM's num_blocks / cdiv(max_model_len, block_size)."""
    model = resolve_model("qwen3-0.6b")
    spec = kv_cache_spec(model)
    budget = kv_budget_bytes(80 * GiB, utilization=0.9, weight_bytes=weight_bytes(model))
    assert budget == 76117311488
    cap = capacity(spec, budget, 40960, vllm_layers(model, spec))
    assert cap.max_tokens == 663690  # budget // 114688
    assert cap.max_tokens_block_rounded == int(41480 / 2560 * 40960) == 663680
    assert cap.max_sequences_block_rounded == 41480 / 2560 == 16.203125  # 41,480 blocks of 1,835,008 B
    assert cap.max_sequences == pytest.approx(76117311488 / (114688 * 40960))
    assert cap.max_sequences_uncapped == cap.max_sequences
    # one kind of layer: kvsim's whole-block figures are vLLM's
    assert (cap.own_tokens_block_rounded, cap.own_sequences_block_rounded) == (663680, 16.203125)


def test_capacity_of_a_sliding_model_counts_capped_sequences():
    spec = kv_cache_spec(resolve_model("gemma-2-9b"))
    cap = capacity(spec, 10 * GiB, 8192)
    assert cap.max_sequences == pytest.approx(10 * GiB / (172032 * 8192 + 172032 * 4096))
    assert cap.max_sequences_uncapped == pytest.approx(10 * GiB / (344064 * 8192))
    assert cap.max_tokens == 10 * GiB // 344064


def test_capacity_of_a_hybrid_state_model_is_vllms_with_kvsims_own_beside_it():
    """qwen3-next-80b-a3b, tp 1, 20 GiB, 32,768 tokens (arithmetic in test_vllm_sizing.py's layout)."""
    model = resolve_model("qwen3-next-80b-a3b")
    spec = kv_cache_spec(model)
    cap = capacity(spec, 20 * GiB, 32768, vllm_layers(model, spec))
    assert cap.vllm_exact and cap.vllm.hybrid.block_size == 544
    # page 544 x 2,048 = 1,114,112 B; num_blocks = 21,474,836,480 // (12 x 1,114,112) = 1,606
    assert cap.vllm.num_blocks == 1606
    # per request cdiv(32,768, 544) = 61 + 3 state groups = 64 blocks; tokens = int(1,606 / 64 x 32,768)
    assert cap.max_sequences_block_rounded == 1606 / 64
    assert cap.max_tokens_block_rounded == 822272
    # without vLLM's per-layer view, kvsim's own whole-block figures stand in
    assert not capacity(spec, 20 * GiB, 32768).vllm_exact
    # kvsim's own: whole 16-token blocks of 393,216 B, a sequence 2,048 blocks + its 39,518,208 B of state
    assert cap.own_tokens_block_rounded == (20 * GiB // 393216) * 16
    assert cap.own_sequences_block_rounded == (20 * GiB // 393216) * 393216 / (2048 * 393216 + 39518208)


def test_size_report_defaults_to_max_model_len_and_json_keys():
    report = size_report(resolve_model("llama-3.1-8b"), memory_bytes=80 * GiB, gpu_name="x")
    out = report.as_json()
    assert out["context_tokens"] == 131072
    assert out["bytes_per_sequence"] == 131072 * 131072
    for key in ("model", "kv_dtype", "kv_bytes_per_token", "full_attention_bytes_per_token", "sliding_window_bytes_per_token",
                "sliding_window_cap_bytes_per_sequence", "state_bytes_per_sequence", "block_size", "block_bytes",
                "context_tokens", "bytes_per_sequence", "tp", "kv_budget_bytes", "max_tokens", "max_sequences",
                "vllm_version", "vllm_num_gpu_blocks", "vllm_kv_cache_size_tokens", "vllm_max_concurrency", "vllm_num_groups",
                "vllm_group_size", "vllm_blocks_per_request", "vllm_groups", "vllm_async_scheduling", "vllm_max_in_flight_tokens"):
        assert key in out, key
    assert "vllm_block_size" not in out  # only models with state layers have a raised block size
    assert (out["vllm_version"], out["vllm_max_in_flight_tokens"]) == ("0.33.0", 2 * 8192)
    assert out["vllm_groups"] == [{"kind": "full", "num_layers": 32, "block_size": 16, "page_bytes": 65536, "blocks_per_request": 8192}]
    assert "kv_budget_bytes" not in size_report(resolve_model("llama-3.1-8b")).as_json()


def test_hybrid_json_names_vllms_block_size_and_padded_state_page_even_without_a_device():
    out = size_report(resolve_model("qwen3-next-80b-a3b"), tp=4).as_json()
    assert out["block_size"] == 16  # kvsim's own figures stay at --block-size
    assert (out["vllm_block_size"], out["vllm_block_size_raised"], out["vllm_kernel_block_size"]) == (272, True, 16)
    assert (out["vllm_state_page_bytes"], out["vllm_state_page_padded_bytes"]) == (274432, 278528)
    assert out["vllm_mamba_cache_mode"] == "none"
    aligned = size_report(resolve_model("qwen3-next-80b-a3b"), tp=4, settings=VllmSettings(kernel_block_size=32, mamba_cache_mode="align"))
    assert (aligned.hybrid.block_size, aligned.as_json()["vllm_mamba_cache_mode"]) == (288, "align")


@pytest.mark.parametrize("field, kwargs", [("--context", {"context_tokens": 0}), ("--block-size", {"block_size": 0}), ("--tp", {"tp": 0})])
def test_non_positive_options(field, kwargs):
    with pytest.raises(KvsimError, match=field):
        size_report(resolve_model("llama-3.1-8b"), **kwargs)


def test_utilization_checked_even_without_a_device():
    with pytest.raises(KvsimError, match="--gpu-memory-utilization"):
        size_report(resolve_model("llama-3.1-8b"), utilization=1.5)


def test_weights_too_big_names_the_gpu_option_when_a_gpu_was_given():
    with pytest.raises(KvsimError, match="^--gpu: vLLM 0.33.0 would not start"):
        size_report(resolve_model("qwen3-32b"), memory_bytes=24 * GiB, gpu_name="NVIDIA L4")
