"""`kvsim replay`'s settings over the workload file, under kvsim's names and vllm serve's; the file's aliases."""

from __future__ import annotations

import json

import pytest

from kvsim.errors import KvsimError
from kvsim.workload.spec import load_workload
from tests.replay.test_replay import BPT, write_tiny


def _replay(cli, path, tmp_path, *flags):
    result = cli(["replay", str(path), "--no-tensors", "--quiet", "--json", "--out", str(tmp_path / "o"), "--limit", "6", *flags])
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    return json.loads(result.stdout), meta


def test_vllm_serve_flags_set_the_workloads_fields(cli, tmp_path):
    path = write_tiny(tmp_path)
    records, meta = _replay(cli, path, tmp_path, "--gpu-memory-utilization", "0.02", "--max-model-len", "256",
                            "--kv-cache-dtype", "fp8", "--block-size", "32", "--max-num-seqs", "2",
                            "--max-num-batched-tokens", "64", "--enable-prefix-caching", "--hardware", "h200")
    # paged-16 and paged-16+prefix are one allocator once every paged one has prefix caching
    assert [r["allocator"] for r in records] == ["flat-oracle", "paged-32+prefix"]
    assert meta["hardware"] == "NVIDIA H200 SXM 141GB"
    assert meta["budget_bytes"] > 2**30  # 2% of an H200 less a tiny model's weights and vLLM's start-up, not the file's 1,024 tokens
    workload = load_workload(path)
    assert workload.kv_budget_bytes == 1024 * BPT and workload.max_model_len == 512  # the file is as it was


def test_kvsim_names_do_the_same(cli, tmp_path):
    path = write_tiny(tmp_path)
    serve, _ = _replay(cli, path, tmp_path, "--gpu-memory-utilization", "0.01", "--kv-cache-dtype", "fp8",
                       "--no-enable-prefix-caching", "--gpu", "h200")
    kvsim, _ = _replay(cli, path, tmp_path, "--utilization", "0.01", "--kv-dtype", "fp8", "--no-prefix-caching",
                       "--gpu", "h200")
    assert serve == kvsim and [r["allocator"] for r in kvsim] == ["flat-oracle", "paged-16"]


def test_model_override_takes_a_catalogue_name_or_a_config_path_from_the_working_directory(cli, tmp_path, monkeypatch):
    path = write_tiny(tmp_path)
    _, meta = _replay(cli, path, tmp_path, "--model", "qwen3-0.6b", "--gpu-memory-utilization", "0.1")
    assert meta["model"] == "qwen3-0.6b"
    monkeypatch.chdir(tmp_path)
    _, meta = _replay(cli, path, tmp_path, "-m", "tiny-model.json")
    assert meta["model"] != "qwen3-0.6b"


@pytest.mark.parametrize("flags,says", [
    (["--gpu", "tpu-v9"], "kvsim: error: --gpu: unknown GPU 'tpu-v9'"),
    (["--gpu-memory-utilization", "1.5"], "kvsim: error: --gpu-memory-utilization: must be <= 1"),
    (["--block-size", "0"], "kvsim: error: --block-size: must be >= 1"),
    (["--max-num-seqs", "0"], "kvsim: error: --max-num-seqs: must be >= 1"),
    (["--kv-cache-dtype", "fp9"], "kvsim: error: --kv-cache-dtype: unknown dtype 'fp9'"),
    (["--model", "no-such-model"], "kvsim: error: --model: unknown model 'no-such-model'"),
])
def test_a_bad_setting_names_the_flag_not_the_file(cli, tmp_path, flags, says):
    path = write_tiny(tmp_path)
    result = cli(["replay", str(path), "--no-tensors", "-q", "--out", str(tmp_path / "o"), *flags])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(says), lines


def test_the_file_takes_the_command_lines_names_for_hardware_and_utilization(tmp_path):
    path = write_tiny(tmp_path)
    text = path.read_text()
    budget = next(line for line in text.splitlines() if line.startswith("kv_budget:"))
    path.write_text(text.replace("hardware: h100-80gb", "gpu: h200").replace(budget, "utilization: 0.5"))
    workload = load_workload(path)
    assert workload.hardware == "h200" and workload.gpu_memory_utilization == 0.5 and workload.kv_budget_bytes is None
    path.write_text(text.replace("hardware: h100-80gb", "hardware: h100-80gb\ngpu: h200"))
    with pytest.raises(KvsimError, match="tiny.yaml: gpu: give hardware or gpu"):
        load_workload(path)


def test_progress_goes_to_stderr_and_the_table_to_stdout(cli, tmp_path):
    path = write_tiny(tmp_path)
    result = cli(["replay", str(path), "--no-tensors", "--out", str(tmp_path / "o"), "--limit", "6"])
    assert result.exit_code == 0, result.output
    assert "6/6 requests" in result.stderr and "6/6 requests" not in result.stdout
    assert "paged-16+prefix" in result.stdout


def test_async_scheduling_is_the_default_and_the_flag_or_the_file_keeps_the_synchronous_loop(cli, tmp_path):
    """meta.json and every summary row say which loop ran: async (vllm serve's default) unless
    `--no-async-scheduling` or the file's `scheduler: {async_scheduling: false}` says otherwise."""
    path = write_tiny(tmp_path)
    records, meta = _replay(cli, path, tmp_path)
    assert meta["async_scheduling"] is True and {r["async_scheduling"] for r in records} == {True}
    sync, meta = _replay(cli, path, tmp_path, "--no-async-scheduling")
    assert meta["async_scheduling"] is False and {r["async_scheduling"] for r in sync} == {False}
    assert sync != records  # the loop shows in the figures (finish times come a row later with async)
    path.write_text(path.read_text().replace("swap_space: 1GiB}", "swap_space: 1GiB, async_scheduling: false}"))
    in_file, meta = _replay(cli, path, tmp_path)
    assert meta["async_scheduling"] is False and in_file == sync
    forced, meta = _replay(cli, path, tmp_path, "--async-scheduling")
    assert meta["async_scheduling"] is True and forced == records
