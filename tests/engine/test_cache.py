"""KVCache: pool layout, write/read round trips (paged and flat), swap and copies, attention over pages,
the accounting-only mode, the device-memory refusal, and the step timer."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvsim.engine.tensors import cache as cache_mod
from kvsim.engine.tensors import kernels
from kvsim.engine.tensors.cache import KVCache
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.engine.tensors.timing import StepTimer
from kvsim.errors import KvsimError

BS = 4


def make_spec(dtype: str = "fp32", dtype_bytes: int = 4, *, heads: int = 2, head_dim: int = 8) -> KVCacheSpec:
    return KVCacheSpec.uniform(
        num_layers=6, num_kv_heads=heads, head_dim=head_dim, block_size=BS, dtype=dtype, dtype_bytes=dtype_bytes
    )


def make_cache(num_slots: int = 64, **kwargs) -> KVCache:
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("num_layers", 2)
    return KVCache(kwargs.pop("spec", make_spec()), num_slots, **kwargs)


def paged_slots(table: list[int], n: int) -> np.ndarray:
    """Slots of tokens 0..n-1 through a block table: slot = block_id * block_size + offset."""
    pos = np.arange(n)
    return np.asarray(table)[pos // BS] * BS + pos % BS


def test_pool_layout_and_bytes():
    c = make_cache(64, num_layers=3)
    assert c.kv_cache.shape == (2, 3, 16, BS, 2, 8)  # [2, L, num_blocks, block_size, H, D]
    assert c.kv_flat.shape == (2, 3, 64, 2, 8)
    assert c.kv_flat.data_ptr() == c.kv_cache.data_ptr()
    assert c.nbytes == 2 * 3 * 64 * 2 * 8 * 4 == c.kv_cache.numel() * 4
    assert c.kv_cache.dtype == torch.float32 and c.kv_cache.abs().sum() == 0


def test_flat_arena_slot_count_need_not_be_a_block_multiple():
    c = make_cache(10)
    assert c.num_blocks == 3 and c.kv_flat.shape[2] == 12
    slots = np.arange(10)
    c.write(slots, np.zeros(10, dtype=np.int64), slots)
    read = c.read_flat([0], [10])
    assert torch.equal(read.kv[:, :, 0], c.kv_flat[:, :, :10])


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp8", torch.float8_e4m3fn), ("int8", torch.int8)],
)
def test_kv_dtypes(name, dtype):
    width = torch.empty(0, dtype=dtype).element_size()
    c = make_cache(16, spec=make_spec(name, width))
    assert c.kv_cache.dtype == dtype and c.nbytes == 2 * 2 * 16 * 2 * 8 * width
    slots = np.array([3, 9, 1])
    c.write(slots, np.zeros(3, dtype=np.int64), np.arange(3))
    assert torch.equal(c.kv_flat[:, :, slots].view(torch.int8), c._src[:, :, :3].view(torch.int8))


def test_paged_round_trip_through_hand_made_block_tables():
    c = make_cache(64)
    tables = [[5, 2, 9], [0, 14]]
    lens = [10, 6]
    written = []
    for seq_id, (table, n) in enumerate(zip(tables, lens)):
        slots = paged_slots(table, n)
        c.write(slots, np.full(n, seq_id), np.arange(n))
        written.append(c._src[:, :, :n].clone())  # [2, L, n, H, D] just stored
    read = c.read_paged([np.asarray(t) for t in tables], lens)
    assert read.kv.shape == (2, 2, 2, 12, 2, 8)  # padded to 3 blocks of 4
    assert read.seq_lens.tolist() == lens
    for b, n in enumerate(lens):
        assert torch.equal(read.kv[:, :, b, :n], written[b])
    assert torch.equal(read.k, read.kv[0]) and torch.equal(read.v, read.kv[1])


def test_flat_round_trip_reads_contiguous_slabs():
    c = make_cache(64)
    starts, lens = [40, 3], [7, 12]
    for seq_id, (start, n) in enumerate(zip(starts, lens)):
        c.write(np.arange(start, start + n), np.full(n, seq_id), np.arange(n))
    read = c.read_flat(starts, lens)
    assert read.kv.shape == (2, 2, 2, 12, 2, 8)
    for b, (start, n) in enumerate(zip(starts, lens)):
        assert torch.equal(read.kv[:, :, b, :n], c.kv_flat[:, :, start : start + n])
        assert torch.equal(read.kv[:, :, b, :n], kernels.slice_run(c.kv_flat, start, n))


@pytest.mark.parametrize("dtype,dtype_bytes", [("fp32", 4), ("bf16", 2), ("fp8", 1)])
def test_write_kernels_store_the_same_bytes(dtype, dtype_bytes):
    spec = make_spec(dtype, dtype_bytes, heads=3, head_dim=4)  # a 12-value row: no 8-byte word layout to lean on
    caches = {k: make_cache(32, spec=spec, write_kernel=k) for k in ("index_copy", "index_put", "rows")}
    assert make_cache(32, spec=spec).write_kernel == "rows"  # the CPU's default
    slots, run = np.array([31, 0, 17, 4, 5]), np.array([[6, 20], [7, 21], [8, 22]])  # a prefill; 3 decode steps of 2
    for c in caches.values():
        c.write(slots, np.zeros(5, dtype=np.int64), np.arange(5))
        c.write_steps(run, np.arange(2), np.arange(6).reshape(3, 2))
    pools = [c.kv_cache.view(torch.uint8) for c in caches.values()]
    assert pools[0].any() and all(torch.equal(pools[0], p) for p in pools[1:])
    unwritten = np.setdiff1d(np.arange(32), np.concatenate([slots, run.ravel()]))
    assert not caches["rows"].kv_flat.view(torch.uint8)[:, :, unwritten].any()  # nothing outside the slots moved


def test_the_rows_kernel_writes_numpy_rows_into_the_tensor_itself():
    c = make_cache(16)
    c.write(np.array([3]), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))
    src = c._write_source(1)  # [2, L, 1, H, D]: what was written
    assert torch.equal(c.kv_flat[:, :, 3], src[:, :, 0]) and not c.kv_flat[:, :, 2].any()


def test_a_cpu_pool_is_zeroed_contiguous_memory_of_its_shape():
    from kvsim.engine.tensors.device import zeros_pool

    for shape in [(2, 1, 3, 4, 2, 8), (2, 1, 1024, 16, 8, 64)]:  # under and over the 2 MiB huge-page size
        pool = zeros_pool(shape, torch.bfloat16, torch.device("cpu"))
        assert pool.shape == shape and pool.dtype == torch.bfloat16 and pool.is_contiguous() and not pool.any()
        pool.view(-1)[-1] = 1  # writable to its last element
        assert pool.sum() == 1


def test_index_put_write_kernel_stores_the_same_bytes():
    a, b = make_cache(32, write_kernel="index_copy"), make_cache(32, write_kernel="index_put")
    slots = np.array([31, 0, 17, 4, 5])
    for c in (a, b):
        c.write(slots, np.zeros(5, dtype=np.int64), np.arange(5))
    assert torch.equal(a.kv_cache, b.kv_cache)
    with pytest.raises(KvsimError, match="write_kernel"):
        make_cache(32, write_kernel="fastest")
    with pytest.raises(KvsimError, match="CUDA"):
        make_cache(32, write_kernel="triton")


def test_decode_over_gathered_pages_equals_sdpa_over_contiguous_tensor():
    c = make_cache(192, num_q_heads=4)  # grouped-query: 4 query heads over 2 kv heads
    tables, lens = [[7, 1, 30, 4, 12], [20, 3], [9]], [19, 8, 2]
    contiguous = []
    for seq_id, (table, n) in enumerate(zip(tables, lens)):
        c.write(paged_slots(table, n), np.full(n, seq_id), np.arange(n))
        contiguous.append(c._src[:, :, :n].clone())  # [2, L, n, H, D]
    read = c.read_paged([np.asarray(t) for t in tables], lens)
    q = torch.randn(2, 3, 4, 8)  # [L, B, Hq, D]
    out = c.decode_attention(read, q)
    assert out.shape == (2, 3, 4, 8)
    for layer in range(2):
        for b, n in enumerate(lens):
            k, v = contiguous[b][0, layer], contiguous[b][1, layer]  # (n, H, D)
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[layer, b][:, None], k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True
            )[:, 0]
            torch.testing.assert_close(out[layer, b], ref, rtol=1e-5, atol=1e-5)
    # the same tokens copied into flat slabs (past every block used above) give the same attention
    starts = [128, 150, 170]
    for table, start, n in zip(tables, starts, lens):
        src, dst = c._index(paged_slots(table, n)), c._index(np.arange(start, start + n))
        c.kv_flat[:, :, dst] = c.kv_flat[:, :, src]
    torch.testing.assert_close(c.decode_attention(c.read_flat(starts, lens), q), out)


def test_swap_out_and_in_to_other_slots_copies_data():
    c = make_cache(64)
    slots = paged_slots([3, 8], 6)
    c.write(slots, np.zeros(6, dtype=np.int64), np.arange(6))
    before = c.kv_flat[:, :, slots].clone()
    handle = c.swap_out(slots)
    assert handle.num_tokens == 6 and handle.kv.device.type == "cpu" and torch.equal(handle.kv, before)
    c.kv_flat[:, :, slots] = 0  # the freed blocks are reused by someone else
    assert torch.equal(handle.kv, before)  # a real copy, not a view
    new_slots = paged_slots([11, 0], 6)
    c.swap_in(handle, new_slots)
    assert torch.equal(c.kv_flat[:, :, new_slots], before)


def test_accounting_only_cache_is_a_no_op(monkeypatch):
    monkeypatch.setattr(cache_mod, "free_memory_bytes", lambda device: 0)  # never probed or refused
    c = make_cache(10**9, num_layers=0, integrity=True)
    assert not c.enabled and c.kv_cache is None and c.nbytes == 0
    slots = np.arange(4)
    c.write(slots, np.zeros(4, dtype=np.int64), slots)
    assert c.read_paged([np.array([0])], [4]) is None and c.read_flat([0], [4]) is None
    assert c.decode_attention(None) is None
    assert c.swap_out(slots) is None
    c.swap_in(None, slots)
    c.verify(0, slots, slots)  # nothing to check
    assert c.timer.step_times() == {} and c.timer.all_steps() == [{}]


def test_refuses_a_pool_larger_than_free_memory(monkeypatch):
    monkeypatch.setattr(cache_mod, "free_memory_bytes", lambda device: 10_000)
    with pytest.raises(KvsimError) as err:
        make_cache(64, num_layers=2)  # 2 * 2 * 64 * 2 * 8 * 4 = 16384 bytes
    message = str(err.value)
    assert "16.0 KiB" in message and "9.8 KiB" in message and "fewer layers (--layers)" in message and "--no-tensors" in message
    assert make_cache(64, num_layers=1).nbytes == 8192  # half the layers fit


def test_free_memory_probe_reports_host_ram():
    assert cache_mod.free_memory_bytes(torch.device("cpu")) > 2**20


def test_device_choices():
    assert make_cache(8, device="auto").device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(KvsimError, match="device"):
        make_cache(8, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(KvsimError, match="no CUDA device"):
            make_cache(8, device="cuda")


def test_timer_records_each_kind_per_step():
    c = make_cache(64)
    slots = np.arange(8)
    c.timer.new_step()
    c.write(slots, np.zeros(8, dtype=np.int64), slots)
    c.write(slots, np.zeros(8, dtype=np.int64), slots)
    c.decode_attention(c.read_paged([np.array([0, 1])], [8]))
    first = c.timer.step_times()
    assert set(first) == {"write", "read", "attention"} and all(us > 0 for us in first.values())
    c.timer.new_step()
    c.swap_in(c.swap_out(slots), slots + 16)
    assert set(c.timer.step_times()) == {"swap"}
    steps = c.timer.all_steps()
    assert len(steps) == 3 and steps[0] == {} and steps[1] == first


def test_timer_sums_measurements_of_one_kind():
    timer = StepTimer("cpu")
    with timer.measure("write"):
        pass
    one = timer.step_times()["write"]
    with timer.measure("write"):
        sum(range(20000))
    assert timer.step_times()["write"] > one
    disabled = StepTimer("cpu", enabled=False)
    with disabled.measure("read"):
        pass
    assert disabled.step_times() == {}


def test_indices_reach_cuda_from_pinned_memory_without_blocking(monkeypatch):
    # A host-to-device copy from pageable memory may wait for the stream's queued kernels; the step loop must not.
    c = make_cache(64)
    c.device = torch.device("cuda")  # only _index's choice is under test: the copy itself is faked below
    copies = []
    real_to = torch.Tensor.to

    def pin_memory(self):
        pinned = self.clone()
        pinned.pinned = True
        return pinned

    def to(self, *args, **kwargs):
        if args and str(args[0]) == "cuda":
            copies.append((getattr(self, "pinned", False), kwargs.get("non_blocking", False)))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    index = c._index(np.array([[3, 1], [2, 0]]))
    assert copies == [(True, True)]  # staged in pinned memory, copied without waiting
    assert index.dtype == torch.int64 and index.tolist() == [[3, 1], [2, 0]]


def test_swap_in_moves_the_swapped_kv_to_the_device_before_selecting_rows():
    # On CUDA the swap-out's device-to-host copy is asynchronous: the host must not read handle.kv (indexing it
    # there reads memory the copy may still be writing). swap_in's first use of it beyond views is the copy back.
    from torch.overrides import TorchFunctionMode

    c = make_cache(64)
    slots = paged_slots([3, 8, 5], 10)
    c.write(slots, np.zeros(10, dtype=np.int64), np.arange(10))
    swapped = slots.copy()
    swapped[:4] = -1  # a sliding window freed the first block: swap_in selects the rows it holds
    handle = c.swap_out(swapped)
    new_slots = paged_slots([0, 1, 2], 10)
    new_slots[:4] = -1
    base = handle.kv.untyped_storage().data_ptr()
    views = {"view", "reshape", "__get__", "untyped_storage", "data_ptr", "dim", "size", "element_size"}
    uses = []

    class Uses(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            touches = any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == base for a in args)
            if touches and name not in views:
                uses.append(name)
            return func(*args, **(kwargs or {}))

    with Uses():
        c.swap_in(handle, new_slots)
    assert uses and uses[0] == "to", uses
    assert torch.equal(c.kv_flat[:, :, 4:10], c.kv_flat[:, :, slots[4:]])  # and the rows it held landed


@pytest.mark.gpu
def test_cuda_round_trip_swap_and_timing():
    c = make_cache(256, device="cuda", spec=make_spec("bf16", 2))
    tables, lens = [[7, 1, 30], [20, 3]], [11, 8]
    for seq_id, (table, n) in enumerate(zip(tables, lens)):
        c.write(paged_slots(table, n), np.full(n, seq_id), np.arange(n))
    read = c.read_paged([np.asarray(t) for t in tables], lens)
    assert torch.equal(read.kv[:, :, 1, :8], c.kv_flat[:, :, paged_slots([20, 3], 8)])
    out = c.decode_attention(read)
    handle = c.swap_out(paged_slots([7, 1, 30], 11))
    assert handle.kv.is_pinned()
    c.swap_in(handle, np.arange(100, 111))
    torch.cuda.synchronize()
    assert torch.equal(c.kv_flat[:, :, 100:111], read.kv[:, :, 0, :11])
    assert torch.isfinite(out.float()).all()
    assert set(c.timer.step_times()) == {"write", "read", "attention", "swap"}


def test_swap_skips_positions_a_sliding_window_freed():
    c = make_cache(64)
    slots = paged_slots([3, 8, 5], 10)
    c.write(slots, np.zeros(10, dtype=np.int64), np.arange(10))
    swapped = slots.copy()
    swapped[:4] = -1  # block 3 fell out of the window and went back to the pool
    handle = c.swap_out(swapped)
    assert handle.num_tokens == 10 and handle.num_dropped == 4
    assert handle.kv[:, :, :4].abs().sum() == 0 and torch.equal(handle.kv[:, :, 4:], c.kv_flat[:, :, slots[4:]])
    new_slots = paged_slots([0, 1, 2], 10)
    new_slots[:4] = -1
    c.swap_in(handle, new_slots)
    assert torch.equal(c.kv_flat[:, :, 4:10], c.kv_flat[:, :, slots[4:]])
    assert c.kv_flat[:, :, :4].abs().sum() == 0  # nothing written where the slot is -1
    assert c.swap_out(np.array([-1, -1])).num_dropped == 2 and c.swap_out(slots).num_dropped == 0


def test_verify_skips_freed_positions():
    c = make_cache(64, integrity=True)
    slots = paged_slots([3, 8], 8)
    c.write(slots, np.zeros(8, dtype=np.int64), np.arange(8))
    slots[:4] = -1
    c.verify(0, slots, np.arange(8))
    c.verify(0, slots[:4], np.arange(4))  # nothing held: nothing to check
    with pytest.raises(AssertionError):
        c.verify(1, slots, np.arange(8))  # another request's values


# Run in a child process: Triton picks its interpreter when a kernel is defined (at import), from this variable.
_CACHE_TRITON_WRITES_ON_CPU = """
import numpy as np, torch
from kvsim.engine.tensors.cache import KVCache
from kvsim.size.kv_cache_spec import KVCacheSpec

spec = KVCacheSpec.uniform(num_layers=6, num_kv_heads=2, head_dim=8, block_size=4, dtype="bf16", dtype_bytes=2)
caches = {}
for kernel in ("triton", "index_copy"):
    c = caches[kernel] = KVCache(spec, 64, device="cpu", num_layers=3, seed=1)
    c.write_kernel = kernel  # CUDA's default kernel, forced onto CPU tensors (the interpreter runs it)
rng = np.random.default_rng(0)
slots, run = rng.permutation(64)[:10], rng.permutation(64)[:12].reshape(3, 4)  # a prefill, then 3 decode steps of 4
for c in caches.values():
    c.write(slots, np.zeros(10, dtype=np.int64), np.arange(10))
    c.write_steps(run, np.arange(4), np.arange(12).reshape(3, 4))  # the write buffer's strided slices
    c.write(slots[:3], np.zeros(3, dtype=np.int64), np.arange(3))  # a smaller write reuses the grown buffer
a, b = caches["triton"].kv_cache, caches["index_copy"].kv_cache
assert a.abs().sum() > 0 and torch.equal(a, b)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_cache_writes_through_the_triton_kernel_match_index_copy():
    # The replay's CUDA write path (KVCache.write / write_steps with the Triton scatter over its integer views
    # and strided write buffer), run by Triton's interpreter on CPU tensors.
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _CACHE_TRITON_WRITES_ON_CPU], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok"]
