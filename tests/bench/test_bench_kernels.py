"""`kvsim bench kernels`: byte counts by hand, paged FlexAttention against SDPA, the CSV a tiny CPU run writes."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from kvsim.bench import flex_paged
from kvsim.bench.kernel_problem import KernelShape, model_shape, random_block_tables, slot_mapping
from kvsim.bench.kernel_timing import measure
from kvsim.bench.kernels import COLUMNS, bench_kernels
from kvsim.bench.kernels_view import parse_sizes
from kvsim.engine.tensors import kernels
from kvsim.errors import KvsimError

# Llama 3.1 8B: 32 query heads, 8 KV heads of 128, bf16: one token of one layer is 2 * 8 * 128 * 2 = 4096 bytes.
LLAMA = KernelShape("llama-3.1-8b", num_kv_heads=8, num_q_heads=32, head_dim=128, kv_dtype="bf16", dtype_bytes=2)


def test_model_shape_reads_the_catalogue():
    assert model_shape("llama-3.1-8b") == LLAMA
    qwen = model_shape("Qwen/Qwen3-0.6B", "fp32")
    assert (qwen.num_kv_heads, qwen.num_q_heads, qwen.head_dim, qwen.dtype_bytes) == (8, 16, 128, 4)
    mla = model_shape("deepseek-v3")  # one latent "head" of kv_lora_rank 512 + rope 64
    assert (mla.num_kv_heads, mla.head_dim) == (1, 576)


def test_model_shape_rejects_dtypes_the_kernels_cannot_compute_in():
    with pytest.raises(KvsimError, match="--kv-dtype"):
        model_shape("llama-3.1-8b", "fp8")


def test_algorithmic_bytes_by_hand():
    assert LLAMA.kv_bytes(1) == 4096
    # a scatter reads and writes 100 tokens of K/V and reads 100 int64 slots
    assert LLAMA.write_bytes(100) == 2 * 409_600 + 800
    # decode, batch 2 x 256 tokens: 512 tokens of K/V, plus q in and out: 2 * (2 * 32 * 128 * 2) bytes
    assert LLAMA.decode_bytes(2, 256) == 2_097_152 + 32_768
    assert LLAMA.decode_bytes(2, 256, index_bytes=64) == 2_097_152 + 32_768 + 64


def test_slot_mapping_by_hand():
    tables = torch.tensor([[2, 0], [1, 3]])  # block size 2, 3 tokens each
    assert slot_mapping(tables, 3, 2).tolist() == [4, 5, 0, 2, 3, 6]


def test_random_block_tables_use_every_block_once():
    tables = random_block_tables(3, 50, 16, torch.Generator().manual_seed(1))  # 4 blocks per sequence
    assert tables.shape == (3, 4)
    assert sorted(tables.flatten().tolist()) == list(range(12))


def test_parse_sizes():
    assert parse_sizes("8, 16,32", "--block-sizes") == (8, 16, 32)
    assert parse_sizes(None, "--batch-sizes") is None
    for bad in ("8,x", "0", ""):
        with pytest.raises(KvsimError, match="--block-sizes"):
            parse_sizes(bad, "--block-sizes")


def test_measure_on_cpu_repeats_until_a_fifth_of_a_second():
    import time

    fast = measure(lambda: torch.ones(1000).sum(), torch.device("cpu"), reps=7)
    assert fast.reps > 7  # fast calls repeat until they span 0.2 s (or 1000 calls)
    assert 0 < fast.p20_us <= fast.median_us <= fast.p80_us
    slow = measure(lambda: time.sleep(0.08), torch.device("cpu"), reps=2)
    assert slow.reps == 3  # 2 x 80 ms < 0.2 s: one more
    assert 80_000 <= slow.p20_us <= slow.median_us <= slow.p80_us


class FakeCuda:
    """CUDA events on a fake clock: a kernel call takes `call_ms`, an L2 flush `flush_ms`; logs what ran."""

    def __init__(self, call_ms: float, flush_ms: float = 0.1):
        self.clock, self.call_ms, self.flush_ms, self.log, self.syncs = 0.0, call_ms, flush_ms, [], 0

    def install(self, monkeypatch):
        from kvsim.bench import kernel_timing

        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.time = None

            def record(self):
                self.time = fake.clock
                fake.log.append("event")

            def elapsed_time(self, end):
                return end.time - self.time

        class Flush:
            def zero_(self):
                fake.clock += fake.flush_ms
                fake.log.append("flush")

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: setattr(fake, "syncs", fake.syncs + 1))
        monkeypatch.setattr(kernel_timing, "_flush_buffer", lambda device: Flush())

    def kernel(self):
        self.clock += self.call_ms
        self.log.append("call")


def test_measure_on_cuda_warms_up_then_flushes_the_l2_before_every_timed_call(monkeypatch):
    from kvsim.bench import kernel_timing

    gpu = FakeCuda(call_ms=0.5)
    gpu.install(monkeypatch)
    timing = measure(gpu.kernel, torch.device("cuda"), reps=10)
    # 5 calls estimate 0.5 ms a call; WARMUP_MS of calls; then calls until they span REPEAT_MS, each flushed first
    warmup = int(kernel_timing.WARMUP_MS / 0.5)
    assert timing.reps == int(kernel_timing.REPEAT_MS / 0.5) == 200
    assert gpu.log[: 2 + 5 + warmup] == ["event", *["call"] * 5, "event", *["call"] * warmup]
    assert gpu.log[2 + 5 + warmup :] == ["flush", "event", "call", "event"] * timing.reps
    assert timing.median_us == pytest.approx(500) and timing.p20_us == pytest.approx(500)
    assert gpu.syncs == 2  # the estimate, then all the timed calls at once
    slow = FakeCuda(call_ms=40.0)
    slow.install(monkeypatch)
    assert measure(slow.kernel, torch.device("cuda"), reps=10).reps == 10  # at least `reps`
    assert slow.log.count("call") == 5 + 0 + 10  # 25 ms of warm-up is less than one 40 ms call


def test_compiled_flex_attention_specialises_the_batch(monkeypatch):
    # Inductor's flex-decoding kernel needs a static batch; automatic dynamic shapes would make it symbolic at
    # the second batch size, and CUDA would fall back to a kernel that rejects small KV blocks.
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([x for x in example_inputs if isinstance(x, torch.SymInt)
                       or (isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape))])  # fmt: skip
        return gm.forward

    attend = flex_paged.compile_flex_attention(backend)
    for batch in (2, 3, 5):
        pool, tables, seq_lens, q, ref = _paged_problem(4, [6] * batch)
        mask = flex_paged.decode_block_mask(tables, seq_lens, 4, pool.shape[1] * 4)
        k, v = flex_paged.pool_as_sequence(pool[0]), flex_paged.pool_as_sequence(pool[1])
        torch.testing.assert_close(attend(q, k, v, block_mask=mask, enable_gqa=True), ref, atol=1e-5, rtol=1e-5)
    assert len(graphs) == 3 and graphs == [[], [], []]  # one static graph per batch size, no symbolic sizes


def test_which_block_sizes_compiled_flex_attention_takes_on_cuda():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    skip = flex_paged.unsupported_block_size(8, torch.bfloat16, cuda, compiled=True)
    assert skip.startswith("skipped:") and ">= 16" in skip and "bfloat16" in skip
    for bs in (16, 32, 64, 128, 256):
        assert flex_paged.unsupported_block_size(bs, torch.bfloat16, cuda, compiled=True) is None
        assert flex_paged.unsupported_block_size(bs, torch.float16, cuda, compiled=True) is None
    assert flex_paged.unsupported_block_size(24, torch.bfloat16, cuda, compiled=True) is not None  # not a power of 2
    assert flex_paged.unsupported_block_size(8, torch.float32, cuda, compiled=True) is None  # fp32 dots reduce over 8
    assert flex_paged.unsupported_block_size(4, torch.float32, cuda, compiled=True) is not None
    # eager FlexAttention and the CPU kernels take any block size
    assert flex_paged.unsupported_block_size(8, torch.bfloat16, cuda, compiled=False) is None
    assert flex_paged.unsupported_block_size(1, torch.bfloat16, cpu, compiled=True) is None


def test_pool_split_kv_gives_each_sequence_the_split_of_a_contiguous_cache(monkeypatch):
    class Props:
        multi_processor_count = 132  # H100 SXM

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    cuda = torch.device("cuda")
    # batch 8 x 8 KV heads: Inductor splits each sequence 132 // 64 * 2 = 4 ways over a contiguous cache; the
    # pool holds 8 sequences' blocks, so 4 x 8 splits give each sequence the same 4 tiles
    assert flex_paged.pool_split_kv(8, 8, 8 * 2048, 2048, cuda) == 32
    assert flex_paged.pool_split_kv(8, 8, 8 * 2048 + 48, 2048, cuda) == 36  # spare blocks: one more tile's worth
    assert flex_paged.pool_split_kv(64, 8, 64 * 2048, 2048, cuda) is None  # one split each anyway: the default
    assert flex_paged.pool_split_kv(8, 8, 8 * 2048, 2048, torch.device("cpu")) is None


def _paged_problem(block_size: int, seq_lens: list[int], *, num_q_heads=4, num_kv_heads=2, head_dim=16, device="cpu"):
    """Random K/V scattered into a shuffled pool (plus spare blocks), and the per-sequence reference output."""
    gen = torch.Generator().manual_seed(block_size)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold garbage that must never be read
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int64)
    used = 0
    for b, m in enumerate(blocks_per_seq):
        tables[b, :m] = perm[used : used + m]
        used += m
    pool = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 100  # garbage everywhere
    q = torch.randn(len(seq_lens), num_q_heads, 1, head_dim, generator=gen)
    refs = []
    for b, n in enumerate(seq_lens):
        kv = torch.randn(2, n, num_kv_heads, head_dim, generator=gen)
        slots = slot_mapping(tables[b : b + 1, : blocks_per_seq[b]], n, block_size)
        pool.view(2, -1, num_kv_heads, head_dim)[:, slots] = kv
        k, v = kv[0].transpose(0, 1)[None], kv[1].transpose(0, 1)[None]  # (1, H, n, D)
        refs.append(F.scaled_dot_product_attention(q[b : b + 1], k, v, enable_gqa=True))
    to = dict(device=device)
    return pool.to(**to), tables.to(**to), torch.tensor(seq_lens, **to), q.to(**to), torch.cat(refs).to(**to)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_flex_attention_equals_contiguous_sdpa(block_size):
    # lengths: shorter than a block, an exact multiple, one past a multiple, and a longer one
    pool, tables, seq_lens, q, ref = _paged_problem(block_size, [3, 2 * block_size, 2 * block_size + 1, 37])
    mask = flex_paged.decode_block_mask(tables, seq_lens, block_size, pool.shape[1] * block_size)
    out = flex_paged.flex_decode(q, flex_paged.pool_as_sequence(pool[0]), flex_paged.pool_as_sequence(pool[1]), mask, compiled=False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [8, 64])
def test_compiled_paged_flex_attention_equals_sdpa_on_cpu(block_size):
    # The compiled kernel takes the block lists (full blocks skip mask_mod), unlike eager: the path the GPU
    # bench times. Inductor compiles FlexAttention for CPU too, so its block-list logic is checked here.
    pool, tables, seq_lens, q, ref = _paged_problem(block_size, [3, 2 * block_size, 300], head_dim=64)
    mask = flex_paged.decode_block_mask(tables, seq_lens, block_size, pool.shape[1] * block_size)
    out = flex_paged.flex_decode(q, flex_paged.pool_as_sequence(pool[0]), flex_paged.pool_as_sequence(pool[1]), mask, compiled=True)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_paged_flex_attention_reads_a_block_two_sequences_share():
    # prefix caching: both sequences start with physical block 2; the inverse table is per sequence
    gen = torch.Generator().manual_seed(3)
    block_size, tables, seq_lens = 4, torch.tensor([[2, 0], [2, 1]]), torch.tensor([7, 8])
    pool = torch.randn(2, 3, block_size, 2, 16, generator=gen)  # (K/V, blocks, block_size, H, D)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    ref = torch.cat([
        F.scaled_dot_product_attention(q[b : b + 1], *(pool[i][tables[b]].reshape(-1, 2, 16)[:n].transpose(0, 1)[None] for i in (0, 1)),
                                       enable_gqa=True)
        for b, n in enumerate(seq_lens.tolist())
    ])  # fmt: skip
    mask = flex_paged.decode_block_mask(tables, seq_lens, block_size, 3 * block_size)
    out = flex_paged.flex_decode(q, flex_paged.pool_as_sequence(pool[0]), flex_paged.pool_as_sequence(pool[1]), mask, compiled=False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_gather_then_sdpa_equals_contiguous_sdpa():
    pool, tables, seq_lens, q, ref = _paged_problem(4, [3, 8, 9, 37])
    kv = kernels.gather_paged(pool[:, None], tables)  # [2, 1, B, M * 4, H, D]
    out = kernels.decode_attention(q[:, :, 0], kv[0, 0], kv[1, 0], seq_lens)
    torch.testing.assert_close(out[:, :, None], ref, atol=1e-5, rtol=1e-5)


def test_block_mask_lists_full_blocks_and_one_partial_block():
    tables = torch.tensor([[5, 2, 7], [1, 0, 0]])
    mask = flex_paged.decode_block_mask(tables, torch.tensor([9, 8]), 4, 32)  # 9 = 2 full + 1; 8 = 2 full
    assert mask.full_kv_num_blocks.flatten().tolist() == [2, 2]
    assert mask.full_kv_indices[:, 0, 0, :2].tolist() == [[5, 2], [1, 0]]
    assert mask.kv_num_blocks.flatten().tolist() == [1, 0]
    assert int(mask.kv_indices[0, 0, 0, 0]) == 7


def test_tiny_cpu_run_writes_the_csv(tmp_path):
    frame, path = bench_kernels(
        "llama-3.1-8b", block_sizes=(4, 8), batch_sizes=(2,), context_lens=(12,), device="cpu", reps=1, out_dir=tmp_path
    )
    assert path == tmp_path / "kernels-cpu.csv"
    csv = pd.read_csv(path)
    assert list(csv.columns) == COLUMNS
    # 3 rows per case (copy, read, sdpa) + per block size 4 writes + 3 decodes; block 8 does not divide 12,
    # so its contiguous FlexAttention control is skipped, with a reason
    assert len(csv) == 3 + 2 * 7
    assert (csv["device"].str.startswith("cpu")).all() and (csv["torch_version"] == torch.__version__).all()
    by = {(r.kernel, None if pd.isna(r.block_size) else int(r.block_size)): r for r in csv.itertuples()}
    kv = 2 * 24 * 8 * 128 * 2  # 2 x 12 tokens of K and V, 8 heads of 128, bf16
    assert by["copy", None].bytes == 2 * kv and by["read", None].bytes == kv
    assert by["index_copy", 4].bytes == by["rows", 4].bytes == 2 * kv + 8 * 24
    assert by["sdpa_contiguous", None].bytes == kv + 2 * 2 * 32 * 128 * 2
    # gather reads the (2, 3) int64 block table at block 4; FlexAttention its int32 copy
    assert by["gather_sdpa", 4].bytes == kv + 2 * 2 * 32 * 128 * 2 + 2 * 3 * 8
    assert by["flex_paged", 4].bytes == kv + 2 * 2 * 32 * 128 * 2 + 2 * 3 * 4
    assert by["triton", 4].status.startswith("skipped")
    assert by["flex_contiguous", 8].status.startswith("skipped")
    ok = csv[csv["status"] == "ok"]
    assert len(ok) == len(csv) - 3  # two triton rows and one control skipped, nothing failed
    assert (ok[ok["op"] == "write"]["max_abs_err"] == 0).all()  # the scatter wrote every token exactly
    assert (ok[ok["op"] == "decode"]["max_abs_err"] < 0.05).all()  # bf16 attention agrees with the baseline
    # writes are judged against the copy, decodes against the read-only reduction measured in the same run
    copy_bw, read_bw = by["copy", None].bandwidth_gbps, by["read", None].bandwidth_gbps
    assert by["copy", None].pct_of_roofline == pytest.approx(100) and by["read", None].roofline_gbps == read_bw
    assert by["index_put", 8].roofline_gbps == copy_bw and by["flex_paged", 8].roofline_gbps == read_bw
    assert by["index_put", 8].pct_of_roofline == pytest.approx(100 * by["index_put", 8].bandwidth_gbps / copy_bw)
    bw = ok["bytes"] / (ok["median_us"] * 1e-6) / 1e9
    assert (abs(bw - ok["bandwidth_gbps"]) <= 1e-9 * bw).all()


def test_a_block_size_flex_attention_cannot_tile_is_skipped_with_its_reason(tmp_path, monkeypatch):
    blocks = []
    real = flex_paged.flex_decode
    monkeypatch.setattr(flex_paged, "flex_decode", lambda q, k, v, m, **kw: blocks.append(m.BLOCK_SIZE[1]) or real(q, k, v, m, **kw))
    monkeypatch.setattr(flex_paged, "unsupported_block_size", lambda bs, *a: "skipped: too small" if bs == 4 else None)
    frame, _ = bench_kernels("llama-3.1-8b", block_sizes=(4, 8), batch_sizes=(2,), context_lens=(16,), device="cpu",
                             reps=1, out_dir=tmp_path)  # fmt: skip
    flex = frame[frame["kernel"].str.startswith("flex")].set_index(["kernel", "block_size"])["status"]
    assert flex[("flex_paged", 4)] == flex[("flex_contiguous", 4)] == "skipped: too small"
    assert flex[("flex_paged", 8)] == flex[("flex_contiguous", 8)] == "ok"
    assert blocks and set(blocks) == {8}  # nothing ran FlexAttention over 4-token blocks


def test_each_block_sizes_pool_is_freed_before_the_next_is_allocated(tmp_path, monkeypatch):
    import weakref

    from kvsim.bench import kernels as bench

    pools, real = [], bench._new_pool

    def new_pool(*args):
        assert all(ref() is None for ref in pools), "the previous block size's pool is still alive"
        pool = real(*args)
        pools.append(weakref.ref(pool))
        return pool

    monkeypatch.setattr(bench, "_new_pool", new_pool)
    bench_kernels("llama-3.1-8b", block_sizes=(4, 8, 16), batch_sizes=(1,), context_lens=(16,), device="cpu", reps=1,
                  out_dir=tmp_path)  # fmt: skip
    assert len(pools) == 3


def test_the_csv_holds_every_finished_case_when_a_later_one_fails(tmp_path, monkeypatch):
    from kvsim.bench import kernels as bench

    real, seen = bench.bench_case, []

    def bench_case(shape, batch, context_len, *args, **kwargs):
        if batch == 3:
            raise KeyboardInterrupt  # a time limit's signal, say
        return real(shape, batch, context_len, *args, **kwargs)

    monkeypatch.setattr(bench, "bench_case", bench_case)
    with pytest.raises(KeyboardInterrupt):
        bench_kernels("llama-3.1-8b", block_sizes=(4,), batch_sizes=(1, 2, 3), context_lens=(8,), device="cpu", reps=1,
                      out_dir=tmp_path, progress=seen.append)  # fmt: skip
    csv = pd.read_csv(tmp_path / "kernels-cpu.csv")
    assert sorted(set(csv["batch_size"])) == [1, 2] and list(csv.columns) == COLUMNS
    assert seen[:2] == ["batch 1, context 8, block 4", "batch 2, context 8, block 4"]


def test_cli_rejects_bad_sizes_in_one_line(cli):
    result = cli(["bench", "kernels", "--batch-sizes", "two"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["kvsim: error: --batch-sizes: expected comma-separated whole numbers like 8,16,32, got 'two'"]
    result = cli(["bench", "kernels", "--device", "tpu"])  # named "device:" before, not the flag
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["kvsim: error: --device: unknown device 'tpu' (choose cpu, cuda, cuda:N or auto)"]


def test_cli_cpu_run_says_its_numbers_are_not_gpu_numbers(cli, tmp_path):
    result = cli(["bench", "kernels", "-m", "qwen3-0.6b", "--block-sizes", "16", "--batch-sizes", "1", "--context-lens", "16",
                  "--reps", "1", "--device", "cpu", "--out", str(tmp_path)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "not GPU numbers" in result.output
    assert "paged*" in result.output and "contig*" in result.output and "evaluates its mask over every block of the pool" in result.output
    assert "sdpa vs gather:" in result.output
    assert "s] benchmarking kernels: batch 1, context 16, block 16" in result.output  # no terminal: a line per step
    assert (tmp_path / "kernels-cpu.csv").is_file()


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 128])
def test_compiled_paged_flex_attention_equals_sdpa_on_cuda(block_size):
    pool, tables, seq_lens, q, ref = _paged_problem(block_size, [3, 2 * block_size, 300], head_dim=64, device="cuda")
    mask = flex_paged.decode_block_mask(tables, seq_lens, block_size, pool.shape[1] * block_size)
    k, v = flex_paged.pool_as_sequence(pool[0]), flex_paged.pool_as_sequence(pool[1])
    split = flex_paged.pool_split_kv(len(seq_lens), k.shape[1], k.shape[2], 300, q.device)
    assert split is not None and split > 1  # batch 3 x 2 heads: the pool's split spreads each sequence out
    for split_kv in (None, split):  # Inductor's own split, and the one the bench gives the paged pool
        out = flex_paged.flex_decode(q, k, v, mask, compiled=True, split_kv=split_kv)
        torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)  # TF32 dots; a masking bug reads x100 garbage


@pytest.mark.gpu
def test_tiny_cuda_run_times_every_kernel(tmp_path):
    frame, _ = bench_kernels(
        "llama-3.1-8b", block_sizes=(16, 64), batch_sizes=(4,), context_lens=(1024,), device="cuda", out_dir=tmp_path
    )
    on_cpu_only = frame["kernel"] == "rows"  # numpy's row copies: skipped on CUDA, with the reason
    assert (frame[on_cpu_only]["status"] == "skipped: numpy's row copies run on the CPU").all()
    timed = frame[~on_cpu_only]
    assert len(timed) and (timed["status"] == "ok").all(), timed[timed["status"] != "ok"][["kernel", "block_size", "status"]]
    assert (timed[timed["op"] == "write"]["max_abs_err"] == 0).all()
    assert frame["flex_compiled"].all() and frame["l2_flushed"].all()


def test_the_kernel_tables_cut_no_header_or_number_at_80_columns(tmp_path):
    from rich.console import Console

    from kvsim.bench.kernels_view import render_table

    frame, _ = bench_kernels(
        "llama-3.1-8b", block_sizes=(4, 256), batch_sizes=(2,), context_lens=(12,), device="cpu", reps=1, out_dir=tmp_path
    )
    frame.loc[frame["kernel"] == "flex_paged", "median_us"] = 123456.0  # a six-digit time still fits whole
    console = Console(width=80, record=True)
    render_table(frame, console)
    text = console.export_text()
    assert "…" not in text and "..." not in text
    for word in ("context", "index_copy", "contig*", "paged/", "best %", "123456"):
        assert word in text, word
    assert max(len(line) for line in text.splitlines()) <= 80
