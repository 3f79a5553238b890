"""Pool tensor layout: shape, strides, total bytes and element byte offsets, checked by hand and by torch."""

from __future__ import annotations

import pytest

from kvsim.models.catalogue import resolve_model
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.errors import KvsimError
from kvsim.size.layout import parse_address, pool_layout
from kvsim.size.sizing import kv_cache_spec


def test_llama_8b_pool_by_hand():
    pool = pool_layout(kv_cache_spec(resolve_model("llama-3.1-8b")), 1000)
    assert pool.shape == (2, 32, 1000, 16, 8, 128)
    assert pool.strides == (32 * 1000 * 16 * 8 * 128, 1000 * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1)
    assert pool.byte_strides[-1] == 2
    assert pool.total_bytes == 1000 * 16 * 131072 == 2097152000
    assert pool.byte_offset(0, 0, 0, 0, 0, 0) == 0
    assert pool.byte_offset(0, 0, 0, 0, 0, 1) == 2
    assert pool.byte_offset(0, 0, 0, 1, 0, 0) == 8 * 128 * 2  # next token: one token's heads later
    assert pool.byte_offset(0, 0, 1, 0, 0, 0) == 16 * 8 * 128 * 2  # next block of the same layer
    assert pool.byte_offset(1, 0, 0, 0, 0, 0) == pool.total_bytes // 2  # V starts half way
    assert pool.byte_offset(1, 31, 999, 15, 7, 127) == pool.total_bytes - 2  # the last element


def test_uniform_pool_bytes_equal_blocks_times_block_bytes():
    spec = KVCacheSpec.uniform(num_layers=4, num_kv_heads=2, head_dim=64, block_size=8, dtype="fp32", dtype_bytes=4)
    pool = pool_layout(spec, 10)
    assert pool.total_bytes == 10 * spec.block_bytes


def test_mla_pool_has_one_latent_tensor():
    spec = kv_cache_spec(resolve_model("deepseek-v3"))
    pool = pool_layout(spec, 100, mla=True)
    assert pool.shape == (1, 61, 100, 16, 1, 576)
    assert pool.total_bytes == 100 * spec.block_bytes


def test_tp_pool_is_per_rank():
    pool = pool_layout(kv_cache_spec(resolve_model("llama-3.1-70b"), tp=8), 10)
    assert pool.shape == (2, 80, 10, 16, 1, 128)


def test_offsets_agree_with_torch_contiguous_tensor():
    torch = pytest.importorskip("torch")
    spec = KVCacheSpec.uniform(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4)
    pool = pool_layout(spec, 5)
    tensor = torch.arange(pool.num_elements).reshape(pool.shape)
    assert tuple(tensor.stride()) == pool.strides
    for index in [(0, 0, 0, 0, 0, 0), (1, 2, 4, 3, 1, 3), (0, 1, 3, 2, 0, 1), (1, 0, 2, 1, 1, 2)]:
        assert pool.byte_offset(*index) == int(tensor[index]) * 2


@pytest.mark.parametrize("index", [(2, 0, 0, 0, 0, 0), (0, 32, 0, 0, 0, 0), (0, 0, 10, 0, 0, 0), (0, 0, 0, 16, 0, 0), (0, 0, 0, 0, 8, 0), (0, 0, 0, 0, 0, -1)])
def test_out_of_range_index_names_the_dimension(index):
    pool = pool_layout(kv_cache_spec(resolve_model("llama-3.1-8b")), 10)
    with pytest.raises(KvsimError, match="--address.*out of range"):
        pool.byte_offset(*index)


def test_parse_address():
    assert parse_address("1, 2,3,4,5,6") == (1, 2, 3, 4, 5, 6)
    for bad in ("1,2,3", "a,b,c,d,e,f", "1,2,3,4,5,6,7", ""):
        with pytest.raises(KvsimError, match="--address"):
            parse_address(bad)


def test_num_blocks_must_be_positive():
    with pytest.raises(KvsimError, match="--num-blocks"):
        pool_layout(kv_cache_spec(resolve_model("llama-3.1-8b")), 0)
