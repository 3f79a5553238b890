"""vLLM 0.33's start-up memory accounting (kvsim.size.startup): its defaults, each term, and the sum."""

from __future__ import annotations

import math

import pytest

from kvsim.errors import KvsimError
from kvsim.models.catalogue import resolve_model
from kvsim.models.hardware import get_gpu, gpu_names
from kvsim.models.hf_config import load_hf_config
from kvsim.size.startup import (
    StartupSettings,
    cudagraph_capture_sizes,
    serve_batch_defaults,
    startup_memory,
    vllm_kv_cache_memory,
)

GiB = 2**30
CONFIGS = "kvsim/conformance/startup_logs/configs/"


@pytest.mark.parametrize(
    "gpu, defaults",
    [("h100-80gb", (8192, 1024)), ("h200", (8192, 1024)), ("b200", (16384, 1024)), ("a100-80gb", (2048, 256)),
     ("l40s", (2048, 256)), ("dgx-spark", (2048, 256)), ("mi325x", (16384, 1024))],
)  # fmt: skip
def test_vllm_serve_batch_defaults_follow_the_memory_cuda_reports(gpu, defaults):
    device = get_gpu(gpu)
    assert serve_batch_defaults(device.reported_memory_bytes, device.name) == defaults


def test_cuda_graph_capture_sizes():
    # 1, 2, 4, 8..248 by 8 (31), 256..512 by 16 (17): 51 sizes up to min(2 x 1,024, 512, 8,192)
    sizes = cudagraph_capture_sizes(1024, 8192)
    assert len(sizes) == 51 and sizes[-1] == 512
    assert cudagraph_capture_sizes(8, 8192) == [1, 2, 4, 8, 16]
    assert cudagraph_capture_sizes(1024, 16384, blackwell=True)[-1] == 1024
    assert cudagraph_capture_sizes(1024, 100)[-1] == 100  # max_num_batched_tokens itself is captured


def test_the_terms_sum_as_vllms_worker_subtracts_them():
    model = resolve_model("llama-3.1-8b")
    h100 = get_gpu("h100-80gb")
    m = startup_memory(model, total_memory_bytes=h100.reported_memory_bytes, device_name=h100.name)
    assert m.requested == math.ceil(85029158912 * 0.92)
    assert m.weights == 16060522496 + 131072 * 128 * 2  # the checkpoint and the rotary cache
    assert m.available == m.requested - m.weights - m.activation_peak - m.non_torch - m.cudagraph
    assert (m.max_num_batched_tokens, m.max_num_seqs, m.num_cudagraphs) == (8192, 1024, 102)
    eager = startup_memory(model, total_memory_bytes=h100.reported_memory_bytes, settings=StartupSettings(enforce_eager=True))
    assert eager.cudagraph == 0 and eager.available == m.available + m.cudagraph
    before_021 = startup_memory(model, total_memory_bytes=h100.reported_memory_bytes, settings=StartupSettings(estimate_cudagraphs=False))
    assert before_021.cudagraph == m.cudagraph and before_021.available == m.available + m.cudagraph
    fixed = startup_memory(model, total_memory_bytes=h100.reported_memory_bytes, settings=StartupSettings(kv_cache_memory_bytes=20 * GiB))
    assert fixed.available == 20 * GiB and fixed.estimate_error == 0  # kv_cache_memory_bytes overrides utilization


def test_fewer_sequences_shrink_the_sampler_peak_and_tp_adds_nccl_memory():
    model = resolve_model("qwen3-8b")
    total = get_gpu("h100-80gb").reported_memory_bytes
    full = startup_memory(model, total_memory_bytes=total)
    few = startup_memory(model, total_memory_bytes=total, settings=StartupSettings(max_num_seqs=512))
    # the dummy sampler run: 1,024 -> 512 rows of a 151,936-token vocabulary, about 14.5 B a logit
    assert full.activation_peak - few.activation_peak == pytest.approx((1024 - 512) * 151936 * 14.5, rel=0.01)
    assert startup_memory(model, total_memory_bytes=total, tp=2).non_torch > 2 * GiB > full.non_torch


def test_the_issues_cases():
    # meta-llama/Llama-3.1-8B-Instruct on an A100 80GB at 0.92: vLLM logged 56.2 GiB of KV cache memory
    a100 = get_gpu("a100-80gb")
    m = startup_memory(resolve_model("llama-3.1-8b"), total_memory_bytes=a100.reported_memory_bytes, device_name=a100.name)
    assert abs(m.available / GiB - 56.2) < 0.3
    # gpt-oss-120b on one H100: about 66 GiB of weights loaded (vllm-project/vllm#23278: 65.97)
    h100 = get_gpu("h100")
    oss = load_hf_config(CONFIGS + "gpt-oss-120b.json")
    m = startup_memory(oss, total_memory_bytes=h100.reported_memory_bytes, settings=StartupSettings(gpu_memory_utilization=0.9))
    assert abs(m.weights / GiB - 65.97) < 0.3 and m.available < 2 * GiB  # one 131,072-token request needs 5.07 GiB
    # the catalogue's entry (`-m gpt-oss-120b`) carries the checkpoint's quantization_config and counts the same
    by_name = startup_memory(resolve_model("openai/gpt-oss-120b"), total_memory_bytes=h100.reported_memory_bytes,
                             settings=StartupSettings(gpu_memory_utilization=0.9))
    assert by_name.weights == m.weights and by_name.available == m.available


def test_the_one_budget_function_refuses_a_start_with_nothing_left():
    h100 = get_gpu("h100-80gb")
    assert vllm_kv_cache_memory(resolve_model("qwen3-0.6b"), h100.reported_memory_bytes, device_name=h100.name) > 60 * GiB
    with pytest.raises(KvsimError, match="^gpu_memory_utilization: .* leaves no KV cache memory"):
        vllm_kv_cache_memory(resolve_model("qwen3-32b"), h100.reported_memory_bytes, utilization=0.5)


def test_settings_are_checked_at_the_edge():
    with pytest.raises(KvsimError, match="--max-num-seqs"):
        StartupSettings(max_num_seqs=0)
    with pytest.raises(KvsimError, match="--gpu-memory-utilization"):
        StartupSettings(gpu_memory_utilization=0)


def test_every_gpu_reports_less_than_its_nominal_memory_with_a_source():
    assert len(gpu_names()) == 26
    for name in gpu_names():
        gpu = get_gpu(name)
        assert 0.9 * gpu.memory_bytes < gpu.reported_memory_bytes <= gpu.memory_bytes, name
        assert gpu.cuda_memory_source and gpu.source, name
    assert get_gpu("h100-80gb").reported_memory_bytes == 85029158912  # 79.19 GiB, as vLLM logs it
    assert not get_gpu("h100-80gb").cuda_memory_estimated and get_gpu("dgx-spark").unified_memory
    assert get_gpu("rtx-pro-6000").key == get_gpu("RTX-PRO-6000-Blackwell").key == "rtx-pro-6000"
