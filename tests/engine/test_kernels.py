"""Cache kernels: scatters agree with a hand-made mapping, gathers follow block tables and slabs, attention
matches a float64 reference, integrity values are deterministic, token-unique and finite."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvsim.engine.tensors import kernels

HAS_TRITON = importlib.util.find_spec("triton") is not None

L, S, H, D, BS = 2, 24, 2, 4, 4  # layers, slots, kv heads, head dim, block size


def make_flat(dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(2, L, S, H, D, dtype=dtype)  # [2, L, S, H, D]


def source(n: int) -> torch.Tensor:
    return torch.arange(2 * L * n * H * D, dtype=torch.float32).view(2, L, n, H, D) + 1.0  # [2, L, n, H, D]


@pytest.mark.parametrize("scatter", [kernels.scatter_index_copy, kernels.scatter_index_put])
def test_scatter_puts_token_n_at_its_slot(scatter):
    flat = make_flat()
    slots = torch.tensor([7, 0, 13, 22])
    src = source(4)
    scatter(flat, slots, src)
    for n, slot in enumerate(slots.tolist()):
        assert torch.equal(flat[:, :, slot], src[:, :, n])
    untouched = [s for s in range(S) if s not in slots.tolist()]
    assert flat[:, :, untouched].abs().sum() == 0


def test_scatter_index_copy_and_index_put_agree_on_strided_source():
    wide = source(8)[:, :, :5]  # a slice of a larger buffer, as KVCache passes it
    a, b = make_flat(), make_flat()
    slots = torch.tensor([3, 4, 5, 20, 1])
    kernels.scatter_index_copy(a, slots, wide)
    kernels.scatter_index_put(b, slots, wide)
    assert torch.equal(a, b)


def test_gather_paged_follows_block_tables():
    cache = torch.randn(2, L, S // BS, BS, H, D)  # [2, L, num_blocks, BS, H, D]
    tables = torch.tensor([[2, 0, 5], [1, 3, 0]])  # (B=2, M=3)
    out = kernels.gather_paged(cache, tables)
    assert out.shape == (2, L, 2, 3 * BS, H, D)
    for b in range(2):
        for t in range(3 * BS):
            assert torch.equal(out[:, :, b, t], cache[:, :, tables[b, t // BS], t % BS])


def test_gather_runs_reads_each_slab_and_pads_with_its_last_slot():
    flat = torch.randn(2, L, S, H, D)
    starts, lens = torch.tensor([3, 10]), torch.tensor([5, 2])
    out = kernels.gather_runs(flat, starts, lens, 5)
    assert out.shape == (2, L, 2, 5, H, D)
    assert torch.equal(out[:, :, 0], flat[:, :, 3:8])
    assert torch.equal(out[:, :, 1, :2], flat[:, :, 10:12])
    assert torch.equal(out[:, :, 1, 4], flat[:, :, 11])  # padding repeats the last valid slot


def test_slice_run_is_a_view():
    flat = make_flat()
    run = kernels.slice_run(flat, 6, 3)
    run.fill_(5.0)
    assert flat[:, :, 6:9].eq(5.0).all() and flat.sum() == 5.0 * run.numel()


def reference_attention(q, k, v, n_valid):
    """float64 softmax(q k^T / sqrt(d)) v over the first n_valid keys, kv heads repeated for GQA."""
    hq, h = q.shape[0], k.shape[1]
    k = k[:n_valid].double().repeat_interleave(hq // h, dim=1)  # (T, Hq, D)
    v = v[:n_valid].double().repeat_interleave(hq // h, dim=1)
    scores = torch.einsum("hd,thd->ht", q.double(), k) / math.sqrt(q.shape[-1])
    return torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v)  # (Hq, D)


def _sdpa_backends_enabled() -> dict[str, bool]:
    b = torch.backends.cuda
    return {"cudnn": b.cudnn_sdp_enabled(), "flash": b.flash_sdp_enabled(),
            "efficient": b.mem_efficient_sdp_enabled(), "math": b.math_sdp_enabled()}


def test_decode_reads_on_cuda_keep_cudnn_attention_out_and_leave_the_cpu_alone():
    if kernels._SDPBackend is None or not hasattr(torch.backends.cuda, "cudnn_sdp_enabled"):
        pytest.skip("this torch has no cuDNN attention to keep out")
    # cuDNN builds a host-side plan for every new (batch, keys) shape, and a replay's reads change shape almost
    # every step: on CUDA the reads run memory-efficient attention or math, and torch's flags come back after.
    before = _sdpa_backends_enabled()
    assert before["cudnn"] and before["efficient"] and before["math"]  # torch's defaults, as a user has them
    with kernels.decode_backends(torch.device("cuda", 0)):
        assert _sdpa_backends_enabled() == {"cudnn": False, "flash": False, "efficient": True, "math": True}
    assert _sdpa_backends_enabled() == before
    with kernels.decode_backends(torch.device("cpu")):
        assert _sdpa_backends_enabled() == before


def test_decode_attention_runs_sdpa_inside_the_device_backends(monkeypatch):
    if kernels._SDPBackend is None or not hasattr(torch.backends.cuda, "cudnn_sdp_enabled"):
        pytest.skip("this torch has no cuDNN attention to keep out")
    seen = []
    real = kernels.F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(_sdpa_backends_enabled()["cudnn"])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", recording)
    monkeypatch.setattr(kernels, "decode_backends", lambda device: kernels._sdpa_kernel([kernels._SDPBackend.MATH]))
    q, k, v = torch.randn(2, 4, D), torch.randn(2, 5, H, D), torch.randn(2, 5, H, D)
    for fold_gqa in (True, False):
        kernels.decode_attention(q, k, v, torch.tensor([5, 2]), fold_gqa=fold_gqa)
    assert seen == [False, False]  # both SDPA calls ran under the backends decode_backends gave


@pytest.mark.gpu
def test_cuda_decode_attention_matches_reference_on_changing_shapes():
    # The replay's read shapes: bf16, 8 kv heads x 128, two query heads each, keys padded to odd lengths.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(0)
    for n, t in ((3, 7), (9, 2001), (17, 4096), (2, 33)):
        lens = torch.randint(1, t + 1, (n,), generator=gen)
        lens[0] = t
        q = torch.randn(n, 16, 128, generator=gen)
        k, v = torch.randn(n, t, 8, 128, generator=gen), torch.randn(n, t, 8, 128, generator=gen)
        out = kernels.decode_attention(*(x.cuda().bfloat16() for x in (q, k, v)), lens.cuda()).cpu()
        for i in range(n):
            ref = reference_attention(q[i].bfloat16().float(), k[i].bfloat16().float(), v[i].bfloat16().float(), int(lens[i]))
            torch.testing.assert_close(out[i].double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fold_gqa", [True, False])
@pytest.mark.parametrize("hq", [2, 4, 6])  # equal heads, then grouped-query
def test_decode_attention_masks_padding_and_matches_reference(hq, fold_gqa):
    torch.manual_seed(0)
    lens = torch.tensor([3, 7, 1])
    q = torch.randn(3, hq, D)
    k, v = torch.randn(3, 7, H, D), torch.randn(3, 7, H, D)
    k[0, 3:] = 1e4  # garbage in the padding must not leak through the mask
    out = kernels.decode_attention(q, k, v, lens, fold_gqa=fold_gqa)
    assert out.shape == (3, hq, D)
    for n in range(3):
        ref = reference_attention(q[n], k[n], v[n], int(lens[n]))
        torch.testing.assert_close(out[n].double(), ref, rtol=1e-5, atol=1e-5)


def test_integrity_values_are_deterministic_unique_and_in_range():
    fps = torch.tensor([11, 12, -5, 2**62, 11 + 2**40], dtype=torch.int64)  # the last differs only in high bits
    for bits, dtype in ((8, torch.int8), (16, torch.int16), (32, torch.int32)):
        lanes = kernels.integrity_lanes(L, H * D, bits)
        assert lanes.shape == (2, L, H * D) and lanes.dtype == dtype
        vals = kernels.integrity_values(fps, lanes)
        assert vals.shape == (2, L, 5, H * D) and vals.dtype == dtype
        assert torch.equal(vals, kernels.integrity_values(fps, kernels.integrity_lanes(L, H * D, bits)))
        rows = vals.permute(2, 0, 1, 3).reshape(5, -1)  # one row per token
        assert len({tuple(r.tolist()) for r in rows}) == 5
        assert not torch.equal(vals[0], vals[1])  # K and V differ
        assert not torch.equal(vals[:, 0], vals[:, 1])  # layers differ
        assert torch.equal(kernels.integrity_values(fps[2:3], lanes)[:, :, 0], vals[:, :, 2])  # per token


@pytest.mark.parametrize(
    ("bits", "dtype"),
    [(16, torch.bfloat16), (16, torch.float16), (32, torch.float32), (8, torch.float8_e4m3fn)],
)
def test_integrity_values_are_finite_floats(bits, dtype):
    fps = torch.arange(-500, 500, dtype=torch.int64) * 0x9E3779B97F4A7
    vals = kernels.integrity_values(fps, kernels.integrity_lanes(3, 64, bits))
    assert torch.isfinite(vals.view(dtype).float()).all()


@pytest.mark.gpu
def test_triton_scatter_matches_index_copy_and_skips_negative_slots():
    if not kernels.HAS_TRITON:
        pytest.skip("triton not installed")
    for h in (1, 3, 8):  # any head count, including rows that are not a power of two
        flat_a = torch.zeros(2, L, S, h, 32, device="cuda", dtype=torch.bfloat16)
        flat_b = flat_a.clone()
        src = torch.randn(2, L, 12, h, 32, device="cuda").to(torch.bfloat16)[:, :, :6]
        slots = torch.tensor([5, -1, 0, 23, -1, 9], device="cuda")
        kernels.scatter_triton(flat_a, slots, src)
        keep = slots >= 0
        kernels.scatter_index_copy(flat_b, slots[keep], src[:, :, keep])
        torch.cuda.synchronize()
        assert torch.equal(flat_a, flat_b)


# Run in a child process: Triton picks its interpreter when a kernel is defined (at import), from this variable.
_TRITON_ON_CPU = textwrap.dedent("""
    import torch
    from kvsim.engine.tensors import kernels

    assert kernels.HAS_TRITON
    gen = torch.Generator().manual_seed(0)
    cases = [  # (layers, slots, heads, head_dim, dtype, tokens): rows of 32, 96, 256 and 4096 elements
        (2, 24, 1, 32, torch.bfloat16, 6), (2, 24, 3, 32, torch.float16, 6), (3, 40, 8, 32, torch.float32, 9),
        (1, 16, 32, 128, torch.bfloat16, 5),  # a row longer than the kernel's 2048-element tile: two tiles
    ]
    for num_layers, num_slots, h, d, dtype, n in cases:
        flat_a = torch.randn(2, num_layers, num_slots, h, d, generator=gen).to(dtype)  # the pool's old contents
        flat_b = flat_a.clone()
        src = torch.randn(2, num_layers, 2 * n, h, d, generator=gen).to(dtype)[:, :, :n]  # strided tokens
        slots = torch.randperm(num_slots, generator=gen)[:n]
        slots[1::3] = -1  # padding: skipped
        kernels.scatter_triton(flat_a, slots, src)
        keep = slots >= 0
        kernels.scatter_index_copy(flat_b, slots[keep], src[:, :, keep])
        assert torch.equal(flat_a, flat_b), (num_layers, h, d, dtype)
    empty = torch.zeros(2, 1, 4, 2, 8)
    kernels.scatter_triton(empty, torch.full((3,), -1), torch.ones(2, 1, 3, 2, 8))  # all padding: nothing written
    assert not empty.any()
    print("ok", len(cases))
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_scatter_under_the_interpreter_matches_index_copy():
    # The fused K+V Triton kernel, run on CPU tensors by Triton's interpreter: same bytes as index_copy_, slots
    # < 0 skipped, any head count, rows longer than one tile. (The GPU test below runs the compiled kernel.)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _TRITON_ON_CPU], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "4"]
