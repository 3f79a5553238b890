"""vLLM 0.33's start-up arithmetic, numbers worked by hand from its code: layer groups and padding, sliding-window bounds, and the
hybrid attention+mamba block-size raise with its padded state page (Qwen3-Next, Jamba, Bamba)."""

from __future__ import annotations

import pytest

from kvsim.catalogue import resolve_model
from kvsim.errors import KvsimError
from kvsim.hf_config import model_spec_from_config
from kvsim.models import LayerKind, LayerSpec, ModelSpec
from kvsim.sizing import cdiv, kv_budget_bytes, kv_cache_spec
from kvsim.vllm_sizing import VllmLayer, VllmSettings, hybrid_pages, vllm_layers, vllm_startup

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


def _layers(model, **kwargs):
    spec = kv_cache_spec(model, **kwargs)
    return vllm_layers(model, spec, kwargs.get("tp", 1))


def _config_layers(config: dict, **kwargs):
    return _layers(model_spec_from_config(config, source="test", name="test"), **kwargs)


def _catalogue_layers(name: str, **kwargs):
    return _layers(resolve_model(name), **kwargs)


def _toy(layers) -> ModelSpec:
    return ModelSpec(name="toy", hf_id=None, layers=tuple(layers), max_model_len=4096, num_params=10**9, hidden_size=1024, num_attention_heads=16)


SYNC = VllmSettings(async_scheduling=False)


# --- layer groups and sliding windows ---------------------------------------------------------------------


def test_gemma3_pads_sliding_groups_and_bounds_their_blocks_by_two_batches_in_flight():
    """gemma-3-27b: 10 full + 52 sliding(1024) layers -> group_size 10: 6 sliding groups (8 padding layers) + 1 full.

    page per layer = 16 x 2 x 16 x 128 x 2 = 131,072 B; bytes_per_block = 10 x 131,072; num_blocks = 10 GiB // that = 8,192
    sliding (SlidingWindowSpec.max_admission_blocks_per_request): cdiv(min(1023 + 2 x 8,192, 131,072), 16) + 1 = 1,089
    """
    startup = vllm_startup(_catalogue_layers("gemma-3-27b"), 10 * GiB, 131072)
    assert [(g.kind, g.num_layers) for g in startup.groups] == [("sliding", 9), ("sliding", 9), ("sliding", 9), ("sliding", 9),
                                                                ("sliding", 8), ("sliding", 8), ("full", 10)]
    assert (startup.group_size, startup.bytes_per_block, startup.num_blocks) == (10, 1310720, 8192)
    assert [g.blocks_per_request for g in startup.groups] == [1089] * 6 + [8192]
    assert startup.concurrency == 8192 / (8192 + 6 * 1089)
    assert startup.tokens == int(8192 / 14726 * 131072) == 72914
    # sync scheduling: one batch in flight, cdiv(1023 + 8,192, 16) + 1 = 577
    sync = vllm_startup(_catalogue_layers("gemma-3-27b"), 10 * GiB, 131072, settings=SYNC)
    assert sync.blocks_per_request == 8192 + 6 * 577 and sync.tokens == int(8192 / 11654 * 131072) == 92135


def test_gpt_oss_equal_groups_need_no_padding():
    """gpt-oss-120b: 18 sliding(128) + 18 full: two groups of 18; a block of one layer is 32,768 B."""
    startup = vllm_startup(_catalogue_layers("gpt-oss-120b"), 20 * GiB, 131072)
    assert startup.num_blocks == 20 * GiB // (32768 * 18) == 36408
    # cdiv(127 + 16,384, 16) + 1 = 1,033 sliding blocks + 8,192 full blocks
    assert [g.blocks_per_request for g in startup.groups] == [1033, 8192]
    assert startup.tokens == int(36408 / 9225 * 131072) == 517297


def test_all_sliding_model_and_a_smaller_batch_budget():
    """mistral-7b-v0.1: one sliding(4096) group of 32 layers; 2 MiB blocks."""
    layers = _catalogue_layers("mistral-7b-v0.1")
    small = VllmSettings(max_num_batched_tokens=2048)
    startup = vllm_startup(layers, 20 * GiB, 32768, settings=small)
    assert startup.num_blocks == 10240
    assert startup.blocks_per_request == cdiv(4095 + 2 * 2048, 16) + 1 == 513
    assert startup.tokens == int(10240 / 513 * 32768)
    sync = vllm_startup(layers, 20 * GiB, 32768, settings=VllmSettings(max_num_batched_tokens=2048, async_scheduling=False))
    assert sync.blocks_per_request == cdiv(4095 + 2048, 16) + 1 == 385
    # a short max length bounds the window's blocks: cdiv(min(4095 + 4096, 1000), 16) + 1 = 64
    assert vllm_startup(layers, 20 * GiB, 1000, settings=small).concurrency == 10240 / 64


def test_group_size_is_the_largest_count_within_one_and_a_half_times_the_smallest():
    """vLLM pads 12 full + 17 sliding layers to two groups of 17 (17 < 1.5 x 12), not 1 + 2 groups of 12."""
    full, sliding = LayerSpec(LayerKind.FULL, num_kv_heads=8, head_dim=128), LayerSpec(LayerKind.SLIDING, num_kv_heads=8, head_dim=128, window=128)
    page = 16 * 2 * 8 * 128 * 2  # one block of one layer: 65,536 B
    startup = vllm_startup(_layers(_toy([full] * 12 + [sliding] * 17)), 17 * page * 1000, 4096)
    assert (startup.group_size, startup.num_groups, startup.num_blocks) == (17, 2, 1000)
    assert [g.num_layers for g in startup.groups] == [12, 17]
    # 18 sliding layers are 1.5 x 12: groups of 12, the sliding type split in 2 groups of 9 (6 padding layers)
    startup = vllm_startup(_layers(_toy([full] * 12 + [sliding] * 18)), 12 * page * 1000, 4096)
    assert (startup.group_size, startup.num_groups, startup.num_blocks) == (12, 3, 1000)
    assert [g.num_layers for g in startup.groups] == [12, 9, 9]


def test_a_smaller_attention_page_that_divides_the_largest_gets_a_larger_block():
    """unify_kv_cache_spec_page_size: sliding layers of head dim 64 beside full layers of 128 take 32-token blocks."""
    full, sliding = LayerSpec(LayerKind.FULL, num_kv_heads=8, head_dim=128), LayerSpec(LayerKind.SLIDING, num_kv_heads=8, head_dim=64, window=100)
    startup = vllm_startup(_layers(_toy([sliding, full] * 4)), 4 * 65536 * 500, 4096)
    assert [(g.kind, g.block_size, g.page_bytes) for g in startup.groups] == [("sliding", 32, 65536), ("full", 16, 65536)]
    # sliding: cdiv(min(99 + 16,384, 4,096), 32) + 1 = 129; full: 256
    assert [g.blocks_per_request for g in startup.groups] == [129, 256] and startup.num_blocks == 500


def test_a_request_that_does_not_fit_beside_the_null_block_means_vllm_refuses_to_start():
    layers = _catalogue_layers("qwen3-0.6b")  # 28 layers x 65,536 B pages = 1,835,008 B a block
    exact = vllm_startup(layers, 1835008 * 257, 4096)  # 256 blocks a request + the null block
    assert exact.starts and not vllm_startup(layers, 1835008 * 257 - 1, 4096).starts


def test_an_unknown_layer_kind_is_an_error_not_a_number():
    with pytest.raises(KvsimError, match="not modelled"):
        vllm_startup((VllmLayer("chunked-local", bytes_per_token=4096),), GiB, 4096)


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
    layers = _catalogue_layers("qwen3-next-80b-a3b", tp=4)
    h = hybrid_pages(layers, 16)
    assert (h.attention_bytes_per_token, h.state_page_bytes) == (1024, 274432)
    assert (h.block_size, h.page_bytes, h.raised) == (272, 278528, True)
    assert h.padding_pct == pytest.approx(100 * 4096 / 274432)  # 1.49%
    # weights 80e9 x 2 B / 4 = 40,000,000,000 B: budget 77,309,411,328 - 40,000,000,000 = 37,309,411,328
    budget = kv_budget_bytes(80 * GiB, utilization=0.9, weight_bytes=40_000_000_000)
    assert budget == 37_309_411_328
    startup = vllm_startup(layers, budget, 262144)
    # groups: min(12, 36) = 12 layers (36 >= 1.5 x 12): 3 state groups + 1 full group (first-seen order)
    assert [g.kind for g in startup.groups] == ["state", "state", "state", "full"] and startup.group_size == 12
    # num_blocks = 37,309,411,328 // (12 x 278,528) = 11,162
    assert startup.num_blocks == 11162
    # per request: cdiv(262,144, 272) = 964 blocks + 3 state groups x 1 block = 967; 11,162 / 967 = 11.54
    assert startup.blocks_per_request == 967
    assert startup.concurrency == 11162 / 967
    assert f"{startup.concurrency:.2f}" == "11.54"
    # "GPU KV cache size": int(11.54... x 262,144)
    assert startup.tokens == 3025906
    # a state group's block is max_model_len (mamba_block_size without prefix caching): cache block_size stays 272
    assert [g.block_size for g in startup.groups] == [262144] * 3 + [272] and startup.block_size == 272


def test_qwen3_next_fp8_kv_state_page_fits_exactly_without_padding():
    """tp 1, --kv-dtype fp8, fp8 weights on an H200 (141 GiB x 0.9 - 80e9 B = 56,257,837,465 B).

      attention: 2 x 2 heads x 256 x 1 B = 1,024 B per token per layer; state stays bf16: 1,097,728 B
      block_size = 16 x cdiv(1,097,728, 16,384) = 16 x 67 = 1,072 (exactly 67.0): page 1,097,728 B, no padding
    """
    layers = _catalogue_layers("qwen3-next-80b-a3b", kv_dtype="fp8")
    h = hybrid_pages(layers, 16)
    assert (h.block_size, h.page_bytes, h.padding_pct) == (1072, 1097728, 0)
    budget = int(141 * GiB * 0.9) - 80_000_000_000
    startup = vllm_startup(layers, budget, 262144)
    # num_blocks = 56,257,837,465 // (12 x 1,097,728) = 4,270; tokens = int(4,270 / 248 x 262,144)
    assert (startup.num_blocks, startup.tokens) == (4270, 4513527)
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
    layers = _config_layers(JAMBA_V01, tp=2)
    h = hybrid_pages(layers, 16)
    assert (h.attention_bytes_per_token, h.state_page_bytes, h.block_size, h.page_bytes) == (2048, 155648, 80, 163840)
    budget = H100 - 51_600_000_000  # 25,709,411,328 B
    startup = vllm_startup(layers, budget, 262144)
    # group_size 4 (28 >= 6): 1 attention group + 7 state groups; num_blocks = 25,709,411,328 // (4 x 163,840) = 39,229
    assert (startup.group_size, startup.num_groups, startup.num_blocks) == (4, 8, 39229)
    assert startup.tokens == int(39229 / 3284 * 262144) == 3131439
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
    layers = _config_layers(BAMBA_9B)
    h = hybrid_pages(layers, 16)
    assert (h.state_page_bytes, h.block_size, h.page_bytes) == (2147840, 528, 2162688)
    budget = H100 - 19_560_000_000  # 57,749,411,328 B
    startup = vllm_startup(layers, budget, 4096)
    # group_size 3: cdiv(29, 3) = 10 state groups (round-robin: nine of 3 layers, one of 2 + 1 padding) + 1 attention
    # num_blocks = 57,749,411,328 // (3 x 2,162,688) = 8,900; tokens = int(8,900 / 18 x 4,096)
    assert (startup.group_size, startup.num_groups, startup.num_blocks, startup.tokens) == (3, 11, 8900, 2025244)
    assert sorted(g.num_layers for g in startup.groups if g.kind == "state") == [2] + [3] * 9
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
    h = hybrid_pages(_catalogue_layers("qwen3-next-80b-a3b", tp=4, block_size=block_size), block_size)
    assert (h.requested_block_size, h.block_size, h.raised) == (block_size, expected, block_size != expected)
    assert h.page_bytes == expected * 1024 >= h.state_page_bytes


def test_a_backend_with_a_larger_kernel_block_raises_in_its_multiples():
    # kernel block 32 (FlashInfer with head size 256 on Blackwell): 32 x cdiv(274,432, 32,768) = 32 x 9 = 288
    layers = _catalogue_layers("qwen3-next-80b-a3b", tp=4)
    assert hybrid_pages(layers, 16, VllmSettings(kernel_block_size=32)).block_size == 288


def test_an_mla_hybrid_raises_in_multiples_of_128():
    """MLA decode kernels: max(16, 128) x cdiv(state, 128 x 1,152) for a 576-wide latent in bf16."""
    mla, state = LayerSpec(LayerKind.MLA, latent_dim=576), LayerSpec(LayerKind.LINEAR_STATE, state_elements=200_000)
    h = hybrid_pages(_layers(_toy([mla, state, state])), 16)
    assert (h.alignment, h.block_size) == (128, 128 * cdiv(400_000, 128 * 1152)) == (128, 384)


def test_prefix_caching_align_mode_holds_two_state_blocks_per_request():
    """mamba_cache_mode 'align' (prefix caching on): a state group needs 2 blocks a request, not 1."""
    layers = _catalogue_layers("qwen3-next-80b-a3b", tp=4)
    budget = 37_309_411_328
    none = vllm_startup(layers, budget, 262144)
    align = vllm_startup(layers, budget, 262144, settings=VllmSettings(mamba_cache_mode="align"))
    assert none.blocks_per_request == 964 + 3 and align.blocks_per_request == 964 + 3 * 2
    assert align.num_blocks == none.num_blocks and align.tokens == int(11162 / 970 * 262144) == 3016547
    assert [g.block_size for g in align.groups] == [272] * 4  # 'align': mamba_block_size is the attention block


def test_a_context_shorter_than_the_block_sets_the_cache_block_size():
    """A state group's block_size is max_model_len without prefix caching: vLLM's block_size is the smaller."""
    startup = vllm_startup(_catalogue_layers("qwen3-next-80b-a3b", tp=4), 37_309_411_328, 200)
    assert startup.block_size == 200 and startup.blocks_per_request == 1 + 3  # cdiv(200, 272) = 1
    assert startup.tokens == int(11162 / 4 * 200) == 558100


def test_models_without_state_layers_keep_their_block_size():
    layers = _catalogue_layers("gemma-3-27b")
    assert hybrid_pages(layers, 16) is None
    assert vllm_startup(layers, 10 * GiB, 131072).block_size == 16


def test_state_layers_of_different_sizes_form_groups_padded_to_the_largest():
    """unify_kv_cache_spec_page_size pads every MambaSpec page to the attention page the largest state raised."""
    full = LayerSpec(LayerKind.FULL, num_kv_heads=8, head_dim=128)  # 4,096 B per token
    small, large = LayerSpec(LayerKind.LINEAR_STATE, state_elements=50_000), LayerSpec(LayerKind.LINEAR_STATE, state_elements=60_000)
    layers = _layers(_toy([full, small, large]))
    assert [layer.state_bytes for layer in layers[1:]] == [100_000, 120_000]
    h = hybrid_pages(layers, 16)
    assert (h.state_page_bytes, h.block_size) == (120_000, 16 * cdiv(120_000, 16 * 4096)) == (120_000, 32)
    startup = vllm_startup(layers, 131072 * 100, 4096)  # group_size 1: a block id is one 131,072 B page
    assert [(g.kind, g.page_bytes) for g in startup.groups] == [("full", 131072), ("state", 131072), ("state", 131072)]
    assert startup.num_blocks == 100 and startup.blocks_per_request == cdiv(4096, 32) + 2


def test_kinds_vllm_sizing_does_not_know_are_errors_naming_the_kind():
    with pytest.raises(KvsimError, match="'chunked-local' layers is not modelled"):
        vllm_startup((VllmLayer("chunked-local", bytes_per_token=4096),), GiB, 4096)


@pytest.mark.parametrize("kwargs, field", [({"mamba_cache_mode": "all"}, "--mamba-cache-mode"), ({"kernel_block_size": 0}, "--kernel-block-size"),
                                           ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens")])
def test_unknown_vllm_settings_are_errors(kwargs, field):
    with pytest.raises(KvsimError, match=field):
        VllmSettings(**kwargs)


def test_align_mode_with_prefill_checkpoints_raises_in_their_multiples_and_holds_a_third_state_block():
    """Gated delta net layers with FlashInfer's prefill export a state every 64 tokens (vLLM on Hopper):
    the raise counts in lcm(16, 64) = 64: 64 x cdiv(274,432, 64 x 1,024) = 320; a state group holds 3 blocks."""
    layers = _catalogue_layers("qwen3-next-80b-a3b", tp=4)
    settings = VllmSettings(mamba_cache_mode="align", mamba_checkpoint_alignment=64)
    h = hybrid_pages(layers, 16, settings)
    assert (h.alignment, h.block_size, h.page_bytes) == (64, 320, 327680)
    startup = vllm_startup(layers, 37_309_411_328, 262144, settings=settings)
    # num_blocks = 37,309,411,328 // (12 x 327,680) = 9,488; per request cdiv(262,144, 320) = 820 + 3 x 3
    assert (startup.num_blocks, startup.blocks_per_request) == (9488, 829)
    assert startup.tokens == int(9488 / 829 * 262144) == 3000268
    with pytest.raises(KvsimError, match="--mamba-checkpoint-alignment"):
        VllmSettings(mamba_checkpoint_alignment=64)  # checkpoints exist only in align mode
