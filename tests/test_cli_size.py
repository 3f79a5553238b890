"""`kvsim size` and `kvsim models` through the CLI: figures, JSON, and user errors as one line + exit 2."""

from __future__ import annotations

import json

import pytest

GiB = 2**30


def run_json(cli, args):
    result = cli(["size", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_size_table_shows_the_figures_and_vllm_concurrency_line(cli):
    result = cli(["size", "--model", "qwen3-0.6b", "--gpu", "h100-80gb"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "114,688 B" in out and "1,835,008 B" in out  # per token, per block
    assert "663,690" in out  # max tokens
    assert "Maximum concurrency for 40,960 tokens per request: 16.20x" in out
    assert "GPU KV cache size: 663,680 tokens, Maximum concurrency for 40,960 tokens per request: 16.20x" in out


def test_size_table_labels_capped_and_uncapped(cli):
    result = cli(["size", "--model", "gemma-2-9b", "--memory", "80GiB"])
    assert result.exit_code == 0, result.output
    assert "capped" in result.stdout and "uncapped" in result.stdout
    assert "sliding(4096)" in result.stdout
    assert "704,643,072 B" in result.stdout  # the sliding cap per sequence


def test_size_json_keys_and_values(cli):
    out = run_json(cli, ["--model", "google/gemma-2-9b", "--context", "8192", "--gpu", "h100-80gb"])
    assert out["model"] == "gemma-2-9b" and out["kv_dtype"] == "bf16" and out["tp"] == 1
    assert out["kv_bytes_per_token"] == 344064
    assert out["full_attention_bytes_per_token"] == 172032
    assert out["sliding_window_bytes_per_token"] == 172032
    assert out["sliding_window_cap_bytes_per_sequence"] == 704643072
    assert out["state_bytes_per_sequence"] == 0
    assert out["block_size"] == 16 and out["block_bytes"] == 16 * 344064
    assert out["context_tokens"] == 8192
    assert out["bytes_per_sequence"] == 172032 * 8192 + 704643072
    assert out["bytes_per_sequence_uncapped"] == 344064 * 8192
    budget = int(80 * GiB * 0.9) - 2 * 9241705984
    assert out["kv_budget_bytes"] == budget
    assert out["max_tokens"] == budget // 344064
    assert out["max_sequences"] == pytest.approx(budget / out["bytes_per_sequence"], abs=1e-4)


def test_memory_option_equals_the_gpu_memory(cli):
    by_gpu = run_json(cli, ["--model", "llama-3.1-8b", "--gpu", "h100-80gb"])
    by_memory = run_json(cli, ["--model", "llama-3.1-8b", "--memory", "80GiB"])
    assert by_gpu["kv_budget_bytes"] == by_memory["kv_budget_bytes"]
    decimal = run_json(cli, ["--model", "llama-3.1-8b", "--memory", "80GB"])
    assert decimal["kv_budget_bytes"] == int(80e9 * 0.9) - 16060522496


def test_tp_dtype_block_size_and_weight_dtype(cli):
    out = run_json(cli, ["--model", "llama-3.1-70b", "--tp", "8", "--kv-dtype", "fp8", "--block-size", "32",
                         "--gpu", "h100-80gb", "--weight-dtype", "fp8", "--utilization", "0.95"])
    assert out["kv_bytes_per_token"] == 80 * 2 * 1 * 128 * 1 == 20480
    assert out["block_bytes"] == 32 * 20480
    assert out["weight_bytes"] == -(-70553706496 // 8)
    assert out["kv_budget_bytes"] == int(80 * GiB * 0.95) - (-(-70553706496 // 8))


def test_state_and_mla_through_the_cli(cli):
    assert run_json(cli, ["--model", "qwen3-next-80b-a3b"])["state_bytes_per_sequence"] == 39518208
    assert run_json(cli, ["--model", "deepseek-v3", "--tp", "8"])["kv_bytes_per_token"] == 70272


def test_config_path_and_params(cli, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                                "num_key_value_heads": 8, "max_position_embeddings": 8192}))
    out = run_json(cli, ["--config", str(path), "--memory", "24GiB", "--params", "8e9"])
    assert out["kv_bytes_per_token"] == 131072 and out["context_tokens"] == 8192
    assert out["weight_bytes"] == 16 * 10**9


def test_layout_and_address(cli):
    result = cli(["size", "--model", "llama-3.1-8b", "--layout", "--num-blocks", "1000", "--address", "1,31,999,15,7,127"])
    assert result.exit_code == 0, result.output
    assert "2,097,152,000 B" in result.stdout
    assert "byte offset: 2,097,151,998" in result.stdout
    out = run_json(cli, ["--model", "llama-3.1-8b", "--num-blocks", "10", "--address", "0,0,1,0,0,0"])
    assert out["pool_shape"] == [2, 32, 10, 16, 8, 128] and out["address_byte_offset"] == 16 * 8 * 128 * 2


def test_models_command(cli):
    result = cli(["models"])
    assert result.exit_code == 0, result.output
    assert "qwen3-0.6b" in result.stdout and "deepseek-v3" in result.stdout and "70,272" in result.stdout
    rows = json.loads(cli(["models", "--json"]).stdout)
    by_name = {r["name"]: r for r in rows}
    assert len(rows) == 18
    assert by_name["gemma-2-9b"]["layers"] == {"sliding(4096)": 21, "full": 21}
    assert by_name["qwen3-0.6b"]["kv_bytes_per_token_bf16"] == 114688
    assert (by_name["deepseek-v3"]["num_kv_heads"], by_name["deepseek-v3"]["head_dim"]) == (1, 576)


def _config(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "qwen3-0.5b"], "unknown model 'qwen3-0.5b'"),
        (["--config", "/nonexistent/config.json"], "cannot read config"),
        (["--config", "{bad}"], "invalid JSON"),
        (["--config", "{missing}"], "num_attention_heads"),
        (["--model", "llama-3.1-8b", "--kv-dtype", "fp4"], "--kv-dtype: unknown dtype 'fp4'"),
        (["--model", "qwen3-32b", "--gpu", "l4"], "do not fit"),
        (["--model", "llama-3.1-8b", "--gpu", "h1000"], "unknown GPU"),
        (["--model", "llama-3.1-8b", "--memory", "lots"], "--memory"),
        (["--model", "llama-3.1-8b", "--tp", "3"], "--tp 3 does not divide"),
        (["--model", "llama-3.1-8b", "--layout"], "--num-blocks"),
        (["--model", "llama-3.1-8b", "--num-blocks", "2", "--address", "0,0,2,0,0,0"], "block index 2 out of range"),
        ([], "exactly one of --model"),
        (["--model", "llama-3.1-8b", "--gpu", "h100", "--memory", "1GB"], "not both"),
        (["--model", "llama-3.1-8b", "--memory", "1e400GB"], "--memory: byte size must be finite"),
        (["--model", "llama-3.1-8b", "--utilization", "1.5"], "--utilization"),
        (["--model", "qwen3-32b", "--gpu", "l4"], "--gpu: weights"),
        (["--model", "llama-3.1-8b", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
        (["--config", "{dir}"], "cannot read config"),
        (["--config", "{list}"], "expected a JSON object"),
        (["--config", "{empty}"], "invalid JSON"),
        (["--model", "llama-3.1-8b", "--tp", "-2"], "--tp: must be a positive integer"),
        (["--model", "llama-3.1-8b", "--block-size", "0"], "--block-size"),
        (["--model", "llama-3.1-8b", "--context", "0"], "--context"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(cli, tmp_path, args, needle):
    args = [
        str(tmp_path) if a == "{dir}" else
        _config(tmp_path, "[1, 2]") if a == "{list}" else
        _config(tmp_path, "") if a == "{empty}" else
        _config(tmp_path, "{not json") if a == "{bad}" else
        _config(tmp_path, '{"num_hidden_layers": 2, "hidden_size": 64, "max_position_embeddings": 64}') if a == "{missing}" else a
        for a in args
    ]
    result = cli(["size", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsim: error: "), result.stderr
    assert needle in lines[0]
    assert result.stdout == ""


def test_missing_field_error_names_the_file(cli, tmp_path):
    path = _config(tmp_path, '{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}')
    result = cli(["size", "--config", path])
    assert result.exit_code == 2
    assert path in result.stderr and "max_position_embeddings" in result.stderr


def test_vllm_lines_for_a_sliding_model_follow_max_num_batched_tokens(cli):
    # gemma-3-27b on --memory 80GiB at 32,768 tokens: budget 23,290,718,720 B; a block of one layer is
    # 16 x 2 x 16 x 128 x 2 = 131,072 B; vLLM groups 10 full + 52 sliding layers as 1 + 6 groups of 10
    args = ["size", "--model", "gemma-3-27b", "--memory", "80GiB", "--context", "32768"]
    out = cli(args).stdout
    # num_blocks = 23,290,718,720 // (131,072 x 10) = 17,769; tokens = 17,769 // 7 x 16 = 40,608
    # per request: cdiv(32768, 16) + 6 x (cdiv(1023 + 8192, 16) + 1) = 2,048 + 6 x 577 = 5,510 blocks
    assert "GPU KV cache size: 40,608 tokens, Maximum concurrency for 32,768 tokens per request: 3.22x" in out
    out = cli([*args, "--max-num-batched-tokens", "2048"]).stdout
    # 2,048 + 6 x (cdiv(1023 + 2048, 16) + 1) = 2,048 + 6 x 193 = 3,206 blocks: 17,769 / 3,206 = 5.54
    assert "GPU KV cache size: 40,608 tokens, Maximum concurrency for 32,768 tokens per request: 5.54x" in out


def test_hybrid_state_model_says_its_block_figures_are_kvsims(cli):
    out = cli(["size", "--model", "qwen3-next-80b-a3b", "--gpu", "h200", "--tp", "2"]).stdout
    assert "not modelled" in out
    data = run_json(cli, ["--model", "qwen3-next-80b-a3b", "--gpu", "h200", "--tp", "2"])
    assert data["block_rounded_is_vllm_exact"] is False
    assert run_json(cli, ["--model", "gemma-3-27b", "--gpu", "h200"])["block_rounded_is_vllm_exact"] is True


def test_real_falcon_and_gemma3_configs_through_the_cli(cli, tmp_path):
    # the fields tiiuae/falcon-7b and google/gemma-3-27b-it ship (no max_position_embeddings in either)
    falcon = {"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71, "num_hidden_layers": 32,
              "num_kv_heads": 71, "multi_query": True, "new_decoder_architecture": False, "vocab_size": 65024}
    data = run_json(cli, ["--config", _config(tmp_path, json.dumps(falcon))])
    assert (data["kv_bytes_per_token"], data["context_tokens"]) == (2 * 32 * 1 * 64 * 2, 2048)
    gemma = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "head_dim": 128, "hidden_size": 5376,
             "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16, "sliding_window": 1024}}
    data = run_json(cli, ["--config", _config(tmp_path, json.dumps(gemma)), "--context", "4096"])
    assert data["layers"] == {"sliding(1024)": 52, "full": 10}
    assert data["bytes_per_sequence"] == 81920 * 4096 + 425984 * 1024
    assert all(isinstance(data[k], int) for k in ("kv_bytes_per_token", "block_bytes", "bytes_per_sequence"))


def test_models_table_on_an_80_column_terminal_keeps_kv_heads_and_head_dim(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = cli(["models"]).stdout
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out  # no header or cell cut short
    row = next(line for line in out.splitlines() if line.split() and line.split()[0] == "deepseek-v3")
    assert "1x576" in row and "70,272" in row
    row = next(line for line in out.splitlines() if line.split() and line.split()[0] == "gemma-3-27b")
    assert "16x128" in row
