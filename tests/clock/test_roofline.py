"""The roofline step time: hand-computed decode (bandwidth-bound) and prefill (FLOP-bound) steps, decode runs."""

from __future__ import annotations

import math

import pytest

from kvsim.clock.roofline import Roofline

# 1 GB of weights, 0.5 B parameters, 1000 KV bytes per token, 1 TB/s, 1 PFLOP/s, no attention FLOPs.
R = Roofline(
    weight_bytes=1e9, num_params=5e8, kv_bytes_per_token=1000, attn_flops_per_ctx=0.0,
    hbm_bandwidth_bytes_per_s=1e12, peak_flops=1e15,
)


def test_decode_step_reads_weights_and_live_kv_at_hbm_bandwidth():
    # 10 requests with 99 tokens each: read 10 x 100 positions, write 10 tokens.
    memory = (1e9 + 1000 * (1000 + 10)) / 1e12
    compute = 2 * 5e8 * 10 / 1e15
    assert memory > compute
    assert R.step_time(10, 1000, 1000) == pytest.approx(memory, rel=1e-12)
    assert R.step_time(10, 1000, 1000) == pytest.approx(1.00101e-3, rel=1e-12)


def test_prefill_step_is_flop_bound():
    # 8192 prompt tokens: 2 x 0.5e9 x 8192 = 8.192e12 FLOPs = 8.192 ms at 1 PFLOP/s; memory is ~1.01 ms.
    assert R.step_time(8192, 0, 8192) == pytest.approx(8.192e-3, rel=1e-12)


def test_attention_flops_count_when_given():
    r = Roofline(weight_bytes=0, num_params=0, kv_bytes_per_token=0, attn_flops_per_ctx=4.0 * 2 * 4 * 8,
                 hbm_bandwidth_bytes_per_s=1e12, peak_flops=1e12)
    # 2 layers x 4 heads x head_dim 8: 256 FLOPs per attended position; 100 positions -> 25.6 ns.
    assert r.step_time(1, 100, 0) == pytest.approx(256 * 100 / 1e12)


def test_swap_bytes_cross_the_host_link():
    base = R.step_time(1, 1, 1)
    assert R.step_time(1, 1, 1, swap_bytes=64e9) == pytest.approx(base + 1.0)  # 64 GB at 64 GB/s


@pytest.mark.parametrize("num_seqs,ctx_sum,steps", [(10, 990, 50), (256, 10**6, 300), (1, 5, 1), (64, 0, 200)])
def test_decode_run_is_the_sum_of_its_steps(num_seqs, ctx_sum, steps):
    for roofline in (R, Roofline(weight_bytes=1e6, num_params=8e9, kv_bytes_per_token=1, attn_flops_per_ctx=5e5,
                                 hbm_bandwidth_bytes_per_s=3.35e12, peak_flops=989e12)):
        by_step = sum(
            roofline.step_time(num_seqs, ctx_sum + num_seqs * (j + 1), ctx_sum + num_seqs * (j + 1)) for j in range(steps)
        )
        assert roofline.decode_run(num_seqs, ctx_sum, steps) == pytest.approx(by_step, rel=1e-9)


def test_decode_steps_before_counts_steps_that_start_in_time():
    one = R.decode_run(10, 990, 1)
    assert R.decode_steps_before(10, 990, 100, one * 0.5) == (1, pytest.approx(one))  # step 0 always runs
    k, total = R.decode_steps_before(10, 990, 100, one * 4.5)
    assert k == 5 and total == pytest.approx(R.decode_run(10, 990, 5))  # steps 0..4 start before 4.5 steps
    assert R.decode_steps_before(10, 990, 7, math.inf)[0] == 7


def test_for_model_takes_the_catalogue_figures():
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu

    model, gpu = resolve_model("qwen3-0.6b"), get_gpu("h100-80gb")
    r = Roofline.for_model(model, gpu, weight_bytes=1_192_099_840, kv_bytes_per_token=114_688)
    assert r.attn_flops_per_ctx == 4 * 28 * 16 * 128  # 28 attention layers, 16 query heads of 128
    assert r.num_params == model.num_params
    # One request decoding at 1000 tokens of context: weights + 1001 positions read + 1 written, at 3.35 TB/s.
    assert r.step_time(1, 1001, 1001) == pytest.approx((1_192_099_840 + 114_688 * 1002) / 3.35e12)


def test_at_tp_a_rank_does_its_share_and_all_reduces_over_the_link():
    """Llama-3.1-70B at tp 4 on H100: a quarter of the parameters and heads per rank, and 2 x 80 + 1 all-reduces
    of each token's 8192 16-bit hidden states, 2 x 3/4 of them through each GPU's 450 GB/s NVLink direction."""
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu

    model, gpu = resolve_model("llama-3.1-70b"), get_gpu("h100-80gb")
    r = Roofline.for_model(model, gpu, weight_bytes=35e9, kv_bytes_per_token=80 * 2 * 2 * 128 * 2, tp=4)
    assert r.num_params == pytest.approx(model.num_params / 4)
    assert r.attn_flops_per_ctx == 4 * 80 * 16 * 128  # 64 query heads / 4 ranks
    comm = 161 * 1.5 * 8192 * 2 / 450e9
    assert r.comm_s_per_token == pytest.approx(comm)
    one = Roofline.for_model(model, gpu, weight_bytes=35e9, kv_bytes_per_token=80 * 2 * 2 * 128 * 2)
    assert one.comm_s_per_token == 0.0
    # A step is the tp-1 formula on the rank's figures plus the all-reduce of its tokens.
    assert r.step_time(512, 512 * 513 // 2, 0) == pytest.approx(
        (2 * model.num_params / 4 * 512 + r.attn_flops_per_ctx * 512 * 513 // 2) / gpu.bf16_flops_per_s + comm * 512)


@pytest.mark.parametrize("num_seqs,ctx_sum,steps", [(1, 10, 1), (8, 8000, 37), (200, 10**6, 300)])
def test_at_tp_a_decode_run_is_still_the_sum_of_its_steps(num_seqs, ctx_sum, steps):
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu

    r = Roofline.for_model(resolve_model("qwen3-32b"), get_gpu("l40s"), weight_bytes=8.2e9, kv_bytes_per_token=32_768, tp=8)
    by_step = sum(
        r.step_time(num_seqs, ctx_sum + num_seqs * (j + 1), ctx_sum + num_seqs * (j + 1)) for j in range(steps)
    )
    assert r.decode_run(num_seqs, ctx_sum, steps) == pytest.approx(by_step, rel=1e-9)
