"""LayerSpec / ModelSpec: per-token and per-sequence elements by layer kind, TP splitting, summaries."""

from __future__ import annotations

import pytest

from kvsim.models.spec import LayerKind, LayerSpec, ModelSpec


def make_model(layers, **kwargs) -> ModelSpec:
    defaults = dict(name="toy", hf_id=None, max_model_len=4096, num_params=10**9, hidden_size=1024, num_attention_heads=16)
    return ModelSpec(layers=tuple(layers), **{**defaults, **kwargs})


def test_full_layer_stores_k_and_v_per_kv_head():
    layer = LayerSpec(LayerKind.FULL, num_kv_heads=8, head_dim=128)
    assert layer.elements_per_token() == 2 * 8 * 128
    assert layer.state_elements_per_rank() == 0


@pytest.mark.parametrize("tp, heads_per_rank", [(1, 8), (2, 4), (8, 1), (16, 1), (32, 1)])
def test_kv_heads_split_across_ranks_and_replicated_when_fewer(tp, heads_per_rank):
    layer = LayerSpec(LayerKind.FULL, num_kv_heads=8, head_dim=128)
    assert layer.kv_heads_per_rank(tp) == heads_per_rank
    assert layer.elements_per_token(tp) == 2 * heads_per_rank * 128


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_mla_latent_has_no_kv_factor_and_is_replicated(tp):
    layer = LayerSpec(LayerKind.MLA, latent_dim=512 + 64)
    assert layer.elements_per_token(tp) == 576
    assert layer.kv_heads_per_rank(tp) == 1


def test_sliding_layer_costs_like_full_per_token():
    full = LayerSpec(LayerKind.FULL, num_kv_heads=4, head_dim=64)
    sliding = LayerSpec(LayerKind.SLIDING, num_kv_heads=4, head_dim=64, window=128)
    assert sliding.elements_per_token() == full.elements_per_token() == 512


def test_state_layer_is_constant_and_sharded_with_ceil():
    state = LayerSpec(LayerKind.LINEAR_STATE, state_elements=1001)
    assert state.elements_per_token() == 0
    assert not state.holds_tokens
    assert state.state_elements_per_rank(1) == 1001
    assert state.state_elements_per_rank(2) == 501
    unsharded = LayerSpec(LayerKind.LINEAR_STATE, state_elements=1001, state_sharded=False)
    assert unsharded.state_elements_per_rank(4) == 1001


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kind=LayerKind.FULL, num_kv_heads=0, head_dim=128),
        dict(kind=LayerKind.SLIDING, num_kv_heads=8, head_dim=128),  # no window
        dict(kind=LayerKind.FULL, num_kv_heads=8, head_dim=128, window=64),
        dict(kind=LayerKind.MLA),
        dict(kind=LayerKind.LINEAR_STATE),
    ],
)
def test_inconsistent_layers_are_internal_errors(kwargs):
    with pytest.raises(AssertionError):
        LayerSpec(**kwargs)


def test_model_counts_and_representative_attention_layer():
    full = LayerSpec(LayerKind.FULL, num_kv_heads=2, head_dim=256)
    state = LayerSpec(LayerKind.LINEAR_STATE, state_elements=10)
    model = make_model([state, state, state, full] * 2)
    assert model.num_layers == 8
    assert model.layer_counts == {"linear-state": 6, "full": 2}
    assert model.describe_layers() == "6 linear-state + 2 full"
    assert len(model.attention_layers) == 2
    assert (model.num_kv_heads, model.head_dim) == (2, 256)


def test_mla_model_reports_one_head_of_latent_width():
    model = make_model([LayerSpec(LayerKind.MLA, latent_dim=576)] * 3)
    assert (model.num_kv_heads, model.head_dim) == (1, 576)
    assert model.layer_counts == {"mla": 3}


def test_sliding_windows_are_counted_per_window():
    a = LayerSpec(LayerKind.SLIDING, num_kv_heads=1, head_dim=8, window=128)
    b = LayerSpec(LayerKind.SLIDING, num_kv_heads=1, head_dim=8, window=4096)
    model = make_model([a, b, a])
    assert model.layer_counts == {"sliding(128)": 2, "sliding(4096)": 1}


def test_model_spec_is_frozen():
    model = make_model([LayerSpec(LayerKind.FULL, num_kv_heads=1, head_dim=8)])
    with pytest.raises(Exception):
        model.name = "other"  # type: ignore[misc]


def test_v_heads_of_their_own_size():
    layer = LayerSpec(LayerKind.SLIDING, num_kv_heads=8, head_dim=192, head_dim_v=128, window=128)
    assert layer.elements_per_token() == 8 * (192 + 128)
    assert layer.elements_per_token(tp=2) == 4 * (192 + 128)
    assert layer.describe() == "sliding(128) 8x192/128"


def test_chunked_layer_costs_like_full_and_labels_its_chunk():
    layer = LayerSpec(LayerKind.CHUNKED, num_kv_heads=8, head_dim=128, window=8192)
    assert layer.elements_per_token() == 2 * 8 * 128 and layer.holds_tokens
    assert layer.label == "chunked(8192)"


def test_no_cache_layer_keeps_nothing():
    layer = LayerSpec(LayerKind.NO_CACHE)
    assert (layer.elements_per_token(), layer.state_bytes_per_rank(2), layer.holds_tokens) == (0, 0, False)
    model = make_model([LayerSpec(LayerKind.FULL, num_kv_heads=8, head_dim=128), layer])
    assert model.layer_counts == {"full": 1, "none": 1} and len(model.attention_layers) == 1


def test_ssm_part_of_a_state_in_its_own_dtype():
    # Nemotron-H's mamba layer: conv 30,720 elements in bf16, ssm 1,048,576 in fp32
    layer = LayerSpec(LayerKind.LINEAR_STATE, state_elements=30720 + 1048576, ssm_elements=1048576, ssm_dtype="fp32")
    assert layer.state_bytes_per_rank(2) == 30720 * 2 + 1048576 * 4
    assert layer.state_bytes_per_rank(2, tp=2) == (30720 + 1048576) // 2 * 2 + 1048576 // 2 * 2
    same = LayerSpec(LayerKind.LINEAR_STATE, state_elements=1079296)
    assert same.state_bytes_per_rank(2) == 1079296 * 2


def test_indexer_bytes_ride_on_mla_layers():
    layer = LayerSpec(LayerKind.MLA, latent_dim=576, index_bytes=132)
    assert layer.elements_per_token() == 576 and layer.describe() == "mla latent 576 + index 132 B"
