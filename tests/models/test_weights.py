"""Weight bytes per tensor group from a config: the checkpoint's, tested against real model.safetensors.index.json
totals (metadata.total_size, to the byte), and one rank's, tested against vLLM's logged "Model loading took"."""

from __future__ import annotations

import pytest

from kvsim.models.catalogue import resolve_model
from kvsim.models.hf_config import load_hf_config
from kvsim.models.weights import model_weights

GiB = 2**30
CONFIGS = "kvsim/conformance/startup_logs/configs/"

# The index's metadata.total_size of each checkpoint (huggingface.co/<repo>/blob/main/model.safetensors.index.json),
# as quoted in public code that reads those indexes.
INDEX_TOTALS = [
    ("llama-3.1-8b", 16060522496),  # meta-llama/Llama-3.1-8B(-Instruct)
    (CONFIGS + "llama-3.1-8b-instruct.json", 16060522496),
    ("llama-3.1-70b", 141107412992),  # meta-llama/Llama-3.1-70B
    ("mistral-7b-v0.1", 14483464192),  # mistralai/Mistral-7B-v0.1
    ("qwen2.5-7b", 15231233024),  # Qwen/Qwen2.5-7B-Instruct (q/k/v biases counted)
    (CONFIGS + "qwen2.5-72b-instruct.json", 145412407296),  # Qwen/Qwen2.5-72B-Instruct
    ("qwen3-4b", 8044936192),  # Qwen/Qwen3-4B (tied embeddings; q/k norms counted)
    ("qwen3-8b", 16381470720),  # Qwen/Qwen3-8B
    ("qwen3-14b", 29536614400),  # Qwen/Qwen3-14B
    ("qwen3-32b", 65524246528),  # Qwen/Qwen3-32B
    ("qwen3-30b-a3b", 61064245248),  # Qwen/Qwen3-30B-A3B(-Instruct-2507): 128 experts x 48 layers
    (CONFIGS + "mixtral-8x7b-instruct.json", 93405585408),  # mistralai/Mixtral-8x7B-Instruct-v0.1
    ("phi-4", 29319014400),  # microsoft/phi-4
]


def _model(name: str):
    return load_hf_config(name) if name.endswith(".json") else resolve_model(name)


@pytest.mark.parametrize("name, total", INDEX_TOTALS, ids=[n.rsplit("/", 1)[-1] for n, _ in INDEX_TOTALS])
def test_checkpoint_bytes_equal_the_index_total(name, total):
    weights = model_weights(_model(name), loaded=False)
    assert weights.computed and weights.total_bytes == total


# vLLM 0.19's "Model loading took" (GiB, 2 decimals) on an H100, per rank: kvsim/conformance/startup_logs/logs.yaml
LOADED = [
    ("llama-3.1-8b-instruct-w4a16", 1, None, 5.38),  # GPTQ 4-bit g128 (RedHatAI ...-quantized.w4a16)
    ("llama-3.1-8b-instruct-w8a8", 1, None, 8.49),  # compressed-tensors int8 per channel
    ("llama-3.1-8b-instruct", 1, "fp8", 8.49),  # runtime --quantization fp8: embeddings stay bf16
    ("llama-3.1-8b-instruct", 1, "fp32", 29.98),  # --dtype float32
    ("llama-3.1-8b-instruct", 4, None, 3.77),
    ("qwen2.5-7b-instruct-fp8-dynamic", 1, None, 8.14),  # compressed-tensors fp8 per channel
    ("llama-3.3-70b-instruct-fp8-dynamic", 2, None, 33.88),
    ("llama-3.3-70b-instruct-fp8-dynamic", 4, None, 16.96),
    ("mixtral-8x7b-instruct", 2, None, 43.51),
    ("qwen1.5-moe-a2.7b", 1, None, 26.67),  # 60 experts + a shared expert
    ("gemma-2-2b-it", 1, None, 4.90),  # a float32 config served in bf16 (dtype auto), tied embeddings
    ("gpt-oss-20b", 2, None, 7.01),  # MXFP4 experts padded to the MoE kernel's tiles, the rest bf16
    ("gpt-oss-120b", 1, None, 65.97),  # vllm-project/vllm#23278 (0.10.1, Marlin MXFP4 on an H100)
]


@pytest.mark.parametrize("name, tp, dtype, logged", LOADED, ids=[f"{n}-tp{tp}-{d}" for n, tp, d, _ in LOADED])
def test_loaded_bytes_per_rank_equal_vllms_log(name, tp, dtype, logged):
    weights = model_weights(load_hf_config(CONFIGS + name + ".json"), tp=tp, weight_dtype=dtype)
    assert weights.total_bytes / GiB == pytest.approx(logged, abs=0.03 * logged)
    if "gpt-oss" not in name:  # exact to vLLM's rounding elsewhere
        assert weights.total_bytes / GiB == pytest.approx(logged, abs=0.09)


def test_tp_splits_the_vocabulary_padded_to_64_and_replicates_kv_heads():
    model = load_hf_config(CONFIGS + "llama-3.1-8b-instruct.json")
    groups = {g.name: g for g in model_weights(model, tp=16).groups}
    assert groups["embedding"].params == 128256 // 16 * 4096  # 128,256 is a multiple of 64 already
    # 8 KV heads on 16 ranks: each rank keeps a whole head (replicated), q 32 / 16 = 2 heads
    assert groups["attention"].params == 32 * ((2 * 128 + 2 * 128) * 4096 + 4096 * 2 * 128)
    phi = model_weights(load_hf_config(CONFIGS + "phi-2.json"), tp=2)
    assert {g.name: g.params for g in phi.groups}["embedding"] == 51200 // 2 * 2560


def test_mxfp4_quantizes_only_the_experts():
    weights = model_weights(load_hf_config(CONFIGS + "gpt-oss-120b.json"), loaded=False)
    quantized = {g.name for g in weights.groups if g.quantized}
    assert quantized == {"experts"}
    # the model card's 60.8 GiB checkpoint (experts' biases and attention sinks aside)
    assert weights.total_bytes / GiB == pytest.approx(60.8, abs=0.3)


def test_weight_dtype_without_a_quantization_config_falls_back_to_the_checkpoint_size():
    model = resolve_model("deepseek-v3")  # the catalogue states fp8 weights but no quantization_config
    assert model_weights(model) is None
