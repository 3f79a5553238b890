"""vLLM's start-up arithmetic, numbers worked by hand: layer groups and padding, sliding-window bounds, and the
hybrid attention+mamba block-size raise with its padded state page (Qwen3-Next, Jamba, Bamba)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvsim.catalogue import resolve_model
from kvsim.engine.kv_cache_spec import KVCacheGroupSpec, KVCacheSpec
from kvsim.errors import KvsimError
from kvsim.hf_config import model_spec_from_config
from kvsim.sizing import cdiv, kv_budget_bytes, kv_cache_spec
from kvsim.vllm_sizing import hybrid_pages, vllm_kv_cache_size, vllm_startup

GiB = 2**30
H100 = int(80 * GiB * 0.9)  # 77,309,411,328 B: --gpu h100-80gb at utilization 0.9

# ai21labs/Jamba-v0.1 (transformers JambaConfig defaults are this model's): attention at i % 8 == 4, Mamba-1 elsewhere
JAMBA_V01 = {
    "model_type": "jamba", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
    "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
}
# ibm-ai-platform/Bamba-9B: attention at layers 9, 18, 27, Mamba-2 elsewhere (d_head 64, d_state 128, 1 group)
BAMBA_9B = {
    "model_type": "bamba", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
    "attn_layer_indices": [9, 18, 27], "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_n_groups": 1,
}


def _config_spec(config: dict, **kwargs) -> KVCacheSpec:
    return kv_cache_spec(model_spec_from_config(config, source="test", name="test"), **kwargs)


# --- layer groups and sliding windows ---------------------------------------------------------------------


def test_vllm_lines_pad_hybrid_groups_and_bound_sliding_blocks_by_the_batch():
    """gemma-3-27b: 10 full + 52 sliding layers -> group_size 10: 1 full group, 6 sliding (8 padding layers)."""
    spec = kv_cache_spec(resolve_model("gemma-3-27b"))
    # page per layer = 16 x 2 x 16 x 128 x 2 = 131,072 B; num_blocks = 10 GiB // (131,072 x 10) = 8,192
    tokens, concurrency = vllm_kv_cache_size(spec, 10 * GiB, 131072)
    assert tokens == 8192 // 7 * 16 == 18720
    # per request: cdiv(131072, 16) + 6 x (cdiv(min(1023 + 8192, 131072), 16) + 1) = 8,192 + 6 x 577
    assert concurrency == 8192 / (8192 + 6 * 577)


def test_vllm_lines_equal_groups_need_no_padding():
    """gpt-oss-120b: 18 full + 18 sliding(128): two groups of 18; a block of one layer is 32,768 B."""
    spec = kv_cache_spec(resolve_model("gpt-oss-120b"))
    tokens, concurrency = vllm_kv_cache_size(spec, 20 * GiB, 131072)
    num_blocks = 20 * GiB // (32768 * 18)
    assert num_blocks == 36408 and tokens == 36408 // 2 * 16 == 291264
    assert concurrency == 36408 / (8192 + cdiv(127 + 8192, 16) + 1)  # 8,192 + 521 blocks


def test_vllm_lines_all_sliding_model_and_a_smaller_batch_budget():
    """mistral-7b-v0.1: one sliding(4096) group of 32 layers; 2 MiB blocks."""
    spec = kv_cache_spec(resolve_model("mistral-7b-v0.1"))
    tokens, concurrency = vllm_kv_cache_size(spec, 20 * GiB, 32768, max_num_batched_tokens=2048)
    assert tokens == 10240 * 16
    assert concurrency == 10240 / (cdiv(4095 + 2048, 16) + 1)  # 385 blocks
    # a short max length bounds the window's blocks: cdiv(min(4095 + 2048, 1000), 16) + 1 = 64
    assert vllm_kv_cache_size(spec, 20 * GiB, 1000, max_num_batched_tokens=2048)[1] == 10240 / 64


def test_group_size_is_the_largest_count_within_one_and_a_half_times_the_smallest():
    """vLLM pads 12 full + 17 sliding layers to two groups of 17 (17 < 1.5 x 12), not 1 + 2 groups of 12."""
    page = 16 * 2 * 8 * 128 * 2  # one block of one layer: 65,536 B
    spec = KVCacheSpec(
        groups=(KVCacheGroupSpec("full", 12, bytes_per_token=12 * 4096), KVCacheGroupSpec("sliding", 17, bytes_per_token=17 * 4096, window=128)),
        block_size=16, dtype="bf16", dtype_bytes=2, num_kv_heads=8, head_dim=128, num_attention_layers=29,
    )
    startup = vllm_startup(spec, 17 * page * 1000, 4096)
    assert (startup.group_size, startup.num_groups, startup.num_blocks) == (17, 2, 1000)
    # 18 sliding layers are 1.5 x 12: groups of 12, the sliding type padded to 2 groups (6 padding layers)
    wider = replace(spec, groups=(spec.groups[0], KVCacheGroupSpec("sliding", 18, bytes_per_token=18 * 4096, window=128)))
    startup = vllm_startup(wider, 12 * page * 1000, 4096)
    assert (startup.group_size, startup.num_groups) == (12, 3)


# --- hybrid attention + mamba: the raised block size and the padded state page -----------------------------


def test_qwen3_next_tp4_on_an_h100_raises_the_block_to_272_and_pads_the_state_page():
    """kvsim size -m qwen3-next-80b-a3b --gpu h100-80gb --tp 4 (262,144 tokens, bf16).

    12 full-attention layers, 36 gated-delta-net layers. Per rank (tp 4):
      attention: 2 KV heads < 4 ranks -> 1 head per rank: 2 (K, V) x 1 x 256 x 2 B = 1,024 B per token per layer
      state: conv (4 - 1) x (128 x 16 x 2 + 128 x 32) / 4 = 6,144 + recurrent 32 / 4 x 128 x 128 = 131,072
             elements = 137,216 x 2 B = 274,432 B per layer
      block_size = 16 x cdiv(274,432, 16 x 1,024) = 16 x cdiv(274,432, 16,384) = 16 x 17 = 272 (16.75 rounds up)
      page = 272 x 1,024 = 278,528 B; the state page is padded by 4,096 B (1.49%)
    """
    spec = kv_cache_spec(resolve_model("qwen3-next-80b-a3b"), tp=4)
    h = hybrid_pages(spec)
    assert (h.attention_bytes_per_token, h.state_page_bytes) == (1024, 274432)
    assert (h.block_size, h.page_bytes, h.raised) == (272, 278528, True)
    assert h.padding_pct == pytest.approx(100 * 4096 / 274432)  # 1.49%
    # weights 80e9 x 2 B / 4 = 40,000,000,000 B: budget 77,309,411,328 - 40,000,000,000 = 37,309,411,328
    budget = kv_budget_bytes(80 * GiB, utilization=0.9, weight_bytes=40_000_000_000)
    assert budget == 37_309_411_328
    startup = vllm_startup(spec, budget, 262144)
    # groups: min(12, 36) = 12 layers (36 >= 1.5 x 12): 1 full group + 3 state groups
    assert (startup.group_size, startup.num_groups) == (12, 4)
    # num_blocks = 37,309,411,328 // 278,528 // 12 = 133,952 // 12 = 11,162
    assert startup.num_blocks == 11162
    # "GPU KV cache size": 11,162 // 4 groups x 272 = 2,790 x 272
    assert startup.tokens == 758880
    # per request: cdiv(262,144, 272) = 964 blocks + 3 state groups x 1 block = 967; 11,162 / 967 = 11.54
    assert startup.blocks_per_request == 967
    assert startup.concurrency == 11162 / 967
    assert f"{startup.concurrency:.2f}" == "11.54"


def test_qwen3_next_fp8_kv_state_page_fits_exactly_without_padding():
    """tp 1, --kv-dtype fp8, fp8 weights on an H200 (141 GiB x 0.9 - 80e9 B = 56,257,837,465 B).

      attention: 2 x 2 heads x 256 x 1 B = 1,024 B per token per layer; state stays bf16: 1,097,728 B
      block_size = 16 x cdiv(1,097,728, 16,384) = 16 x 67 = 1,072 (exactly 67.0): page 1,097,728 B, no padding
    """
    spec = kv_cache_spec(resolve_model("qwen3-next-80b-a3b"), kv_dtype="fp8")
    h = hybrid_pages(spec)
    assert (h.block_size, h.page_bytes, h.padding_pct) == (1072, 1097728, 0)
    budget = int(141 * GiB * 0.9) - 80_000_000_000
    startup = vllm_startup(spec, budget, 262144)
    # num_blocks = 56,257,837,465 // 1,097,728 // 12 = 4,270; tokens = 4,270 // 4 x 1,072 = 1,067 x 1,072
    assert (startup.num_blocks, startup.tokens) == (4270, 1143824)
    # cdiv(262,144, 1,072) = 245 (244 x 1,072 = 261,568) + 3 = 248 blocks per request
    assert startup.concurrency == 4270 / 248


def test_jamba_v01_tp2_raises_the_block_to_80():
    """Jamba-v0.1 at tp 2 (--params 51.6e9: weights 51.6e9 x 2 B / 2 = 51,600,000,000 B per rank).

    4 attention layers (4, 12, 20, 28), 28 Mamba-1 layers. Per rank:
      attention: 8 / 2 = 4 KV heads x 2 x 128 x 2 B = 2,048 B per token per layer
      state: intermediate 2 x 4,096 = 8,192 channels / 2 ranks = 4,096; conv 4,096 x 3 + ssm 4,096 x 16
             = 77,824 elements x 2 B = 155,648 B per layer
      block_size = 16 x cdiv(155,648, 32,768) = 16 x 5 = 80 (4.75 rounds up); page 163,840 B (+5.26%)
    """
    spec = _config_spec(JAMBA_V01, tp=2)
    h = hybrid_pages(spec)
    assert (h.attention_bytes_per_token, h.state_page_bytes, h.block_size, h.page_bytes) == (2048, 155648, 80, 163840)
    budget = H100 - 51_600_000_000  # 25,709,411,328 B
    startup = vllm_startup(spec, budget, 262144)
    # group_size 4 (28 >= 6): 1 attention group + 7 state groups; num_blocks = 25,709,411,328 // 163,840 // 4
    # = 156,917 // 4 = 39,229; tokens = 39,229 // 8 x 80 = 4,903 x 80
    assert (startup.group_size, startup.num_groups, startup.num_blocks) == (4, 8, 39229)
    assert startup.tokens == 392240
    # per request: cdiv(262,144, 80) = 3,277 + 7 = 3,284 blocks; 39,229 / 3,284 = 11.95
    assert startup.concurrency == 39229 / 3284


def test_bamba_9b_raises_the_block_to_528_and_pads_the_last_state_group():
    """Bamba-9B, tp 1, --context 4096 (--params 9.78e9: weights 19,560,000,000 B).

    3 attention layers, 29 Mamba-2 layers:
      attention: 8 x 2 x 128 x 2 B = 4,096 B per token per layer
      state: conv 3 x (8,192 + 2 x 1 x 128) = 25,344 + ssm 128 x 64 x 128 = 1,048,576 -> 1,073,920 x 2 B = 2,147,840 B
      block_size = 16 x cdiv(2,147,840, 65,536) = 16 x 33 = 528 (32.77 rounds up); page 2,162,688 B (+0.69%)
      (IBM's own Granite-4.0-H platform hook quotes the same 528 for this Mamba-2 shape without prefix caching)
    """
    spec = _config_spec(BAMBA_9B)
    h = hybrid_pages(spec)
    assert (h.state_page_bytes, h.block_size, h.page_bytes) == (2147840, 528, 2162688)
    budget = H100 - 19_560_000_000  # 57,749,411,328 B
    startup = vllm_startup(spec, budget, 4096)
    # group_size 3: 1 attention group + cdiv(29, 3) = 10 state groups (the last: 2 layers + 1 padding)
    # num_blocks = 57,749,411,328 // 2,162,688 // 3 = 26,702 // 3 = 8,900; tokens = 8,900 // 11 x 528 = 809 x 528
    assert (startup.group_size, startup.num_groups, startup.num_blocks, startup.tokens) == (3, 11, 8900, 427152)
    # per request: cdiv(4,096, 528) = 8 + 10 state groups = 18 blocks; 8,900 / 18 = 494.44
    assert startup.blocks_per_request == 18 and startup.concurrency == 8900 / 18


@pytest.mark.parametrize(
    "block_size, expected",
    [
        (8, 272),  # below the kernel block: aligned to 16, 16 x 17
        (16, 272),
        (32, 288),  # alignment max(16, 32) = 32: 32 x cdiv(274,432, 32,768) = 32 x 9 (8.375 rounds up)
        (48, 288),  # 48 x cdiv(274,432, 49,152) = 48 x 6 (5.58 rounds up)
        (512, 512),  # 512 x 1,024 = 524,288 B already holds 274,432 B: kept, the state page padded to it
    ],
)
def test_a_block_size_asked_for_is_the_unit_the_raise_counts_in(block_size, expected):
    spec = kv_cache_spec(resolve_model("qwen3-next-80b-a3b"), tp=4, block_size=block_size)
    h = hybrid_pages(spec)
    assert (h.requested_block_size, h.block_size, h.raised) == (block_size, expected, block_size != expected)
    assert h.page_bytes == expected * 1024 >= h.state_page_bytes


def test_a_backend_with_a_larger_kernel_block_raises_in_its_multiples():
    # kernel block 32 (FlashInfer with head size 256 on Blackwell): 32 x cdiv(274,432, 32,768) = 32 x 9 = 288
    spec = kv_cache_spec(resolve_model("qwen3-next-80b-a3b"), tp=4)
    assert hybrid_pages(spec, kernel_block_size=32).block_size == 288


def test_prefix_caching_align_mode_holds_two_state_blocks_per_request():
    """mamba_cache_mode 'align' (prefix caching on): a state group needs 2 blocks a request, not 1."""
    spec = kv_cache_spec(resolve_model("qwen3-next-80b-a3b"), tp=4)
    budget = 37_309_411_328
    none, align = vllm_startup(spec, budget, 262144), vllm_startup(spec, budget, 262144, mamba_cache_mode="align")
    assert none.blocks_per_request == 964 + 3 and align.blocks_per_request == 964 + 3 * 2
    assert align.num_blocks == none.num_blocks and align.tokens == none.tokens == 758880


def test_a_context_shorter_than_the_block_counts_tokens_in_context_sized_blocks():
    """A state group's block_size is max_model_len (mamba_cache_mode 'none'): the tokens line takes the smaller."""
    spec = kv_cache_spec(resolve_model("qwen3-next-80b-a3b"), tp=4)
    startup = vllm_startup(spec, 37_309_411_328, 200)
    assert startup.token_block_size == 200 and startup.tokens == 11162 // 4 * 200
    assert startup.blocks_per_request == 1 + 3  # cdiv(200, 272) = 1
    aligned = vllm_startup(spec, 37_309_411_328, 200, mamba_cache_mode="align")
    assert aligned.tokens == 11162 // 4 * 272  # 'align': the state block is the attention block


def test_models_without_state_layers_keep_their_block_size():
    spec = kv_cache_spec(resolve_model("gemma-3-27b"))
    assert hybrid_pages(spec) is None
    assert vllm_startup(spec, 10 * GiB, 131072).block_size == 16


def test_unequal_attention_pages_are_not_followed():
    spec = KVCacheSpec(
        groups=(KVCacheGroupSpec("full", 2, bytes_per_token=2 * 4096), KVCacheGroupSpec("sliding", 2, bytes_per_token=2 * 2048, window=64),
                KVCacheGroupSpec("state", 4, state_bytes=4 * 100_000)),
        block_size=16, dtype="bf16", dtype_bytes=2, num_kv_heads=8, head_dim=128, num_attention_layers=4,
    )
    assert hybrid_pages(spec) is None and vllm_startup(spec, GiB, 4096) is None


@pytest.mark.parametrize("kwargs, field", [({"mamba_cache_mode": "all"}, "--mamba-cache-mode"), ({"kernel_block_size": 0}, "--kernel-block-size")])
def test_unknown_vllm_settings_are_errors(kwargs, field):
    spec = kv_cache_spec(resolve_model("qwen3-next-80b-a3b"))
    with pytest.raises(KvsimError, match=field):
        vllm_startup(spec, GiB, 4096, **kwargs)
