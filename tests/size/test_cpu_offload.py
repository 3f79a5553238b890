"""`kvsim size --cpu-offload`: vLLM 0.33.0's CPU tier, hand-computed, through the CLI, and its user errors."""

from __future__ import annotations

import json

import pytest

from kvsim.errors import KvsimError
from kvsim.models.catalogue import resolve_model
from kvsim.size.cpu_offload import model_cpu_offload, parse_offloading_size
from kvsim.size.report import size_report
from kvsim.size.vllm import VllmSettings

GiB = 2**30


def tier(model: str, cpu_bytes: int, *, tp: int = 1, cpu_block_size: int | None = None, **settings):
    report = size_report(resolve_model(model), tp=tp, settings=VllmSettings(**settings))
    return model_cpu_offload(report, cpu_bytes, cpu_block_size=cpu_block_size)


def test_uniform_model_one_gpu_block_per_cpu_block():
    # llama-3.1-8b: 32 layers x 16 tokens x (K+V) 2 x 8 heads x 128 x 2 B = 2 MiB a block, already page-aligned
    t = tier("llama-3.1-8b", 100 * GiB)
    assert (t.cpu_block_size, t.blocks_per_chunk, t.chunk_bytes_aligned) == (16, 1, 2 * 2**20)
    assert t.num_cpu_blocks == 51_200 and t.cpu_offload_bytes == 100 * GiB
    # a request of 131,072 tokens: 8,192 chunks; the tier: 51,200 x 131,072 // 8,192 tokens
    assert (t.chunks_per_request, t.kv_cache_size_tokens) == (8192, 819_200)


def test_chunk_of_several_gpu_blocks_and_tp_ranks_each_storing_their_slice():
    # llama-3.1-70b at tp 8: a rank's block is 80 layers x 16 x 2 x 1 head x 128 x 2 B = 655,360 B; a 64-token
    # chunk of all 8 ranks: 4 x 8 x 655,360 = 20,971,520 B; 512 GiB of it: 26,214 chunks (26,214.4)
    t = tier("llama-3.1-70b", 512 * GiB, tp=8, cpu_block_size=64)
    assert (t.cpu_block_size, t.blocks_per_chunk, t.chunk_bytes_aligned) == (64, 4, 20_971_520)
    assert t.chunk_bytes_per_rank == 20_971_520 // 8
    assert t.num_cpu_blocks == 26_214


def test_sliding_window_groups_keep_their_window_of_chunks():
    # gemma-3-27b at tp 2: 6 sliding(1024) groups + 1 full group of 10 layers; a rank's block: 10 layers x 16 x 2 x
    # 8 heads x 128 x 2 B = 655,360 B; 64 GiB / (2 x 655,360) = 52,428 chunks; a 131,072-token request stores
    # 8,192 full chunks + 6 x 1024/16 window chunks
    t = tier("gemma-3-27b", 64 * GiB, tp=2)
    assert t.num_cpu_blocks == 52_428
    assert [g.window_chunks for g in t.groups] == [64] * 6 + [None]
    assert t.chunks_per_request == 8192 + 6 * 64
    assert t.kv_cache_size_tokens == 52_428 * 131_072 // (8192 + 384)


def test_page_padding_of_an_unaligned_chunk():
    # gpt-oss-120b at tp 2: 18 layers... a chunk of 2 x 294,912 = 589,824 B is 144 host pages exactly; a sliding
    # window of 128 tokens keeps cdiv(128, 16) = 8 chunks a group
    t = tier("gpt-oss-120b", 100 * GiB, tp=2)
    assert t.chunk_bytes_aligned % 4096 == 0 and t.chunk_bytes_aligned >= t.chunk_bytes
    assert {g.window_chunks for g in t.groups if g.kind == "sliding"} == {8}
    odd = tier("qwen3-0.6b", GiB, cpu_block_size=16)
    assert odd.chunk_bytes == 28 * 16 * 2 * 8 * 128 * 2 and odd.chunk_bytes_aligned == odd.chunk_bytes


def test_hybrid_state_groups_store_one_chunk_and_need_align_mode():
    t = tier("qwen3-next-80b-a3b", 64 * GiB, tp=4, mamba_cache_mode="align")
    assert [g.window_chunks for g in t.groups if g.kind == "state"] == [1, 1, 1]
    assert t.cpu_block_size == t.groups[0].tokens_per_block  # the raised hybrid block
    with pytest.raises(KvsimError, match="--mamba-cache-mode align"):
        tier("qwen3-next-80b-a3b", 64 * GiB, tp=4)


def test_mla_at_tp_stores_one_replicated_copy():
    one = tier("deepseek-v3", 200 * GiB, tp=1)
    eight = tier("deepseek-v3", 200 * GiB, tp=8)
    assert eight.num_copies == 1 and eight.chunk_bytes == one.chunk_bytes  # not 8 copies of the latent
    assert eight.num_cpu_blocks == one.num_cpu_blocks


def test_a_cpu_block_not_a_multiple_of_the_gpu_block_names_the_flag():
    with pytest.raises(KvsimError, match="multiple of the GPU block") as exc:
        tier("llama-3.1-8b", GiB, cpu_block_size=24)
    assert exc.value.field == "--cpu-block-size"


def test_kv_offloading_size_is_gib_as_vllm_serve_takes_it():
    assert parse_offloading_size("64", field="--kv-offloading-size") == 64 * GiB
    assert parse_offloading_size("0.5", field="--kv-offloading-size") == GiB // 2
    for bad in ("64GiB", "0", "-1", "inf"):
        with pytest.raises(KvsimError):
            parse_offloading_size(bad, field="--kv-offloading-size")


def test_cli_json_keys_and_both_flag_names_agree(cli):
    a = cli(["size", "-m", "llama-3.1-8b", "--cpu-offload", "100GiB", "--json"])
    b = cli(["size", "-m", "llama-3.1-8b", "--kv-offloading-size", "100", "--json"])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert (ja["vllm_num_cpu_blocks"], ja["cpu_offload_bytes"], ja["cpu_block_size"]) == (51_200, 100 * GiB, 16)
    assert {k: v for k, v in ja.items() if k.startswith("cpu")} == {k: v for k, v in jb.items() if k.startswith("cpu")}


def test_cli_table_lines(cli):
    r = cli(["size", "-m", "llama-3.1-8b", "--cpu-offload", "100GiB"])
    assert r.exit_code == 0, r.output
    assert "num_cpu_blocks: 51,200" in r.stdout and "CPU KV cache size: 819,200 tokens" in r.stdout


@pytest.mark.parametrize("args, field", [
    (["--cpu-offload", "100GiB", "--kv-offloading-size", "100"], "--kv-offloading-size"),
    (["--cpu-block-size", "64"], "--cpu-block-size"),
    (["--cpu-offload", "lots"], "--cpu-offload"),
    (["-m", "qwen3-next-80b-a3b", "--cpu-offload", "1GiB", "--no-enable-prefix-caching"], "--mamba-cache-mode"),
])
def test_cli_bad_offload_settings_are_one_line(cli, args, field):
    if "-m" not in args:
        args = ["-m", "llama-3.1-8b", *args]
    r = cli(["size", *args])
    assert r.exit_code == 2
    assert field in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
