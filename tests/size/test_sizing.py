"""Size math: KV per token under TP and dtypes, per-sequence caps, block rounding, weights, budgets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.models.catalogue import resolve_model
from kvsim.errors import KvsimError
from kvsim.size.sizing import (
    block_rounded_bytes_per_sequence,
    bytes_per_sequence,
    cdiv,
    kv_budget_bytes,
    kv_cache_spec,
    weight_bytes,
)

GiB = 2**30


@pytest.mark.parametrize(
    "name, tp, per_rank",
    [
        ("llama-3.1-70b", 1, 327680),
        ("llama-3.1-70b", 2, 163840),  # 4 KV heads per rank
        ("llama-3.1-70b", 8, 40960),  # 1 KV head per rank
        ("llama-3.1-70b", 16, 40960),  # 8 KV heads < 16 ranks: replicated, still 1 per rank
        ("qwen3-30b-a3b", 8, 48 * 2 * 1 * 128 * 2),  # 4 KV heads over 8 ranks: replicated
        ("deepseek-v3", 8, 70272),  # MLA latent replicated on every rank
        ("opt-13b", 4, 819200 // 4),
    ],
)
def test_tp_splits_kv_heads_per_rank(name, tp, per_rank):
    assert kv_cache_spec(resolve_model(name), tp=tp).bytes_per_token == per_rank


def test_tp_must_divide_attention_heads():
    with pytest.raises(KvsimError, match="--tp"):
        kv_cache_spec(resolve_model("llama-3.1-8b"), tp=3)


@pytest.mark.parametrize("tp, per_rank_heads", [(2, 5), (5, 2), (10, 1), (20, 1), (40, 1)])
def test_tp_splits_or_replicates_kv_heads_evenly(tp, per_rank_heads):
    # Phi-3-medium's 40 query heads and 10 KV heads
    model = _model({"num_hidden_layers": 4, "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 10})
    assert kv_cache_spec(model, tp=tp).bytes_per_token == 4 * 2 * per_rank_heads * 128 * 2


@pytest.mark.parametrize("tp", [4, 8])
def test_tp_that_neither_splits_nor_replicates_kv_heads_evenly_is_an_error(tp):
    # 10 KV heads over 4 ranks: vLLM cannot shard them (10 % 4 and 4 % 10 are both non-zero)
    model = _model({"num_hidden_layers": 4, "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 10})
    with pytest.raises(KvsimError, match=f"--tp: --tp {tp} neither divides nor is a multiple of the 10 KV heads"):
        kv_cache_spec(model, tp=tp)


def _model(fields: dict):
    from kvsim.models.hf_config import model_spec_from_config

    return model_spec_from_config({"max_position_embeddings": 4096, **fields}, source="test", name="test")


@pytest.mark.parametrize("dtype, per_token", [("bf16", 131072), ("fp16", 131072), ("fp32", 262144), ("fp8", 65536), ("int8", 65536)])
def test_kv_dtypes(dtype, per_token):
    spec = kv_cache_spec(resolve_model("llama-3.1-8b"), kv_dtype=dtype)
    assert spec.bytes_per_token == per_token
    assert spec.block_bytes == 16 * per_token


@pytest.mark.parametrize("dtype", ["fp4", "int4", "bogus"])
def test_bad_kv_dtype_names_the_option(dtype):
    with pytest.raises(KvsimError, match="--kv-dtype"):
        kv_cache_spec(resolve_model("llama-3.1-8b"), kv_dtype=dtype)


def test_state_is_in_the_model_dtype_whatever_the_kv_dtype():
    spec = kv_cache_spec(resolve_model("qwen3-next-80b-a3b"), kv_dtype="fp8")
    assert spec.bytes_per_token == 12288 and spec.state_bytes_per_sequence == 39518208


def test_groups_of_a_hybrid_sliding_model():
    spec = kv_cache_spec(resolve_model("gemma-3-27b"), block_size=32)
    kinds = [(g.kind, g.num_layers, g.window) for g in spec.groups]
    assert kinds == [("full", 10, None), ("sliding", 52, 1024)]
    assert spec.block_size == 32 and spec.num_attention_layers == 62
    assert (spec.num_kv_heads, spec.head_dim) == (16, 128)


def test_mla_spec_reports_the_latent():
    spec = kv_cache_spec(resolve_model("deepseek-v3"))
    assert (spec.num_kv_heads, spec.head_dim, spec.num_attention_layers) == (1, 576, 61)


@pytest.mark.parametrize("n", [1, 100, 1024, 1025, 5000, 131072])
def test_gemma3_per_sequence_formula(n):
    spec = kv_cache_spec(resolve_model("gemma-3-27b"))
    assert bytes_per_sequence(spec, n) == 81920 * n + 425984 * min(n, 1024)
    assert bytes_per_sequence(spec, n, capped=False) == 507904 * n


def test_state_counted_once_per_sequence():
    spec = kv_cache_spec(resolve_model("qwen3-next-80b-a3b"))
    assert bytes_per_sequence(spec, 1000) == 24576 * 1000 + 39518208
    assert block_rounded_bytes_per_sequence(spec, 1000) == 24576 * 16 * 63 + 39518208


def test_block_rounding_full_and_sliding():
    llama = kv_cache_spec(resolve_model("llama-3.1-8b"))
    assert block_rounded_bytes_per_sequence(llama, 100) == 7 * 16 * 131072 == 14680064
    gemma2 = kv_cache_spec(resolve_model("gemma-2-9b"))
    # full: 512 blocks; sliding: cdiv(4096, 16) + 1 = 257 blocks (vLLM's bound with a one-token step)
    assert block_rounded_bytes_per_sequence(gemma2, 8192) == 172032 * 16 * 512 + 172032 * 16 * 257 == 2116681728
    # a short sequence never holds more sliding blocks than it has
    assert block_rounded_bytes_per_sequence(gemma2, 20) == 2 * 16 * 344064


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["llama-3.2-1b", "gemma-2-9b", "gemma-3-27b", "gpt-oss-120b", "qwen3-next-80b-a3b", "mistral-7b-v0.1"]),
    n=st.integers(1, 300_000),
    block_size=st.sampled_from([1, 8, 16, 32, 128]),
)
def test_per_sequence_invariants(name, n, block_size):
    spec = kv_cache_spec(resolve_model(name), block_size=block_size)
    capped = bytes_per_sequence(spec, n)
    assert capped <= bytes_per_sequence(spec, n, capped=False)
    assert capped <= block_rounded_bytes_per_sequence(spec, n)
    assert block_rounded_bytes_per_sequence(spec, n) <= capped + len(spec.groups) * 2 * spec.block_bytes
    assert bytes_per_sequence(spec, n + 1) >= capped


# --- weights and budgets ------------------------------------------------------------------------------


def test_weight_bytes_from_params_and_dtype():
    llama = resolve_model("llama-3.1-8b")
    assert weight_bytes(llama) == 2 * 8030261248 == 16060522496
    assert weight_bytes(llama, tp=2) == 8030261248
    assert weight_bytes(llama, weight_dtype="fp8") == 8030261248
    assert weight_bytes(llama, weight_dtype="int4") == 4015130624
    assert weight_bytes(llama, weight_dtype="fp32", tp=3) == cdiv(4 * 8030261248, 3)
    assert weight_bytes(resolve_model("opt-13b")) == 2 * 12853473280  # fp16 checkpoint
    assert weight_bytes(resolve_model("deepseek-v3")) == 671 * 10**9  # fp8 checkpoint


def test_mixed_dtype_checkpoint_uses_its_size_unless_a_dtype_is_given():
    gpt_oss = resolve_model("gpt-oss-120b")
    assert weight_bytes(gpt_oss) == 65283502899  # 60.8 GiB, MXFP4 experts
    assert weight_bytes(gpt_oss, weight_dtype="bf16") == 2 * 116830000000


def test_weight_bytes_needs_a_parameter_count(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128}')
    from kvsim.models.hf_config import load_hf_config

    with pytest.raises(KvsimError, match="num_params"):
        weight_bytes(load_hf_config(path))


def test_bad_weight_dtype():
    with pytest.raises(KvsimError, match="--weight-dtype"):
        weight_bytes(resolve_model("llama-3.1-8b"), weight_dtype="fp5")


def test_kv_budget():
    assert kv_budget_bytes(80 * GiB, utilization=0.9, weight_bytes=16060522496) == int(80 * GiB * 0.9) - 16060522496
    assert kv_budget_bytes(80 * GiB, utilization=1.0, weight_bytes=0) == 80 * GiB


def test_budget_smaller_than_weights_names_the_figures():
    with pytest.raises(KvsimError) as err:
        kv_budget_bytes(24 * GiB, utilization=0.9, weight_bytes=65524246528)
    message = str(err.value)
    assert "65,524,246,528" in message and "23,192,823,398" in message


@pytest.mark.parametrize("utilization", [0, -0.1, 1.5])
def test_utilization_range(utilization):
    with pytest.raises(KvsimError, match="--utilization"):
        kv_budget_bytes(80 * GiB, utilization=utilization, weight_bytes=0)
