"""`kvsim size` and `kvsim models` through the CLI: figures, JSON, and user errors as one line + exit 2."""

from __future__ import annotations

import json

import pytest

from kvsim.models.catalogue import model_names

from kvsim.size.sizing import cdiv

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
    # 73,525,117,503 B available (test_startup_memory_terms_sum_as_vllm_subtracts_them): // 114,688 = 641,088 tokens;
    # // 1,835,008 = 40,068 blocks / 2,560 per 40,960-token request = 15.65x
    assert "641,088" in out  # max tokens
    assert "requested: 79.19 GiB x 0.92" in out and "= Available KV cache memory" in out
    assert "GPU KV cache size: 641,088 tokens, Maximum concurrency for 40,960 tokens per request: 15.65x" in out


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
    s = out["startup"]
    budget = s["requested_memory_bytes"] - s["weights_bytes"] - s["activation_peak_bytes"] - s["non_torch_bytes"] - s["cudagraph_estimate_bytes"]
    assert s["requested_memory_bytes"] == -(-85029158912 * 92 // 100)  # ceil(total x 0.92), the memory CUDA reports
    assert out["kv_budget_bytes"] == s["available_kv_cache_memory_bytes"] == budget
    assert out["max_tokens"] == budget // 344064
    assert out["max_sequences"] == pytest.approx(budget / out["bytes_per_sequence"], abs=1e-4)


def test_memory_option_equals_the_gpu_memory(cli):
    by_gpu = run_json(cli, ["--model", "llama-3.1-8b", "--gpu", "h100-80gb"])
    by_memory = run_json(cli, ["--model", "llama-3.1-8b", "--memory", "85029158912"])  # what an H100 reports to CUDA
    assert by_gpu["kv_budget_bytes"] == by_memory["kv_budget_bytes"]
    decimal = run_json(cli, ["--model", "llama-3.1-8b", "--memory", "80GB"])["startup"]
    assert decimal["requested_memory_bytes"] == 73_600_000_000  # ceil(80e9 x 0.92)
    # the checkpoint's 16,060,522,496 B (its index's total_size) + the rotary cache, 131,072 positions x 128 x 2 B
    assert decimal["weights_bytes"] == 16060522496 + 131072 * 128 * 2


def test_tp_dtype_block_size_and_weight_dtype(cli):
    out = run_json(cli, ["--model", "llama-3.1-70b", "--tp", "8", "--kv-dtype", "fp8", "--block-size", "32",
                         "--gpu", "h100-80gb", "--weight-dtype", "fp8", "--utilization", "0.95"])
    assert out["kv_bytes_per_token"] == 80 * 2 * 1 * 128 * 1 == 20480
    assert out["block_bytes"] == 32 * 20480
    # per rank: embedding and lm_head 128,256 / 8 x 8,192 in bf16; per layer q + k + v (1,024 + 256 rows) and o, gate_up
    # (7,168 rows) and down, in fp8 with an fp32 scale per output row; norms; the rotary cache 131,072 x 128 x 2 B
    linear = 80 * ((1280 * 8192 + 1280 * 4) + (8192 * 1024 + 8192 * 4) + (7168 * 8192 + 7168 * 4) + (8192 * 3584 + 8192 * 4))
    assert out["weight_bytes"] == 2 * 16032 * 8192 * 2 + linear + 8192 * 161 * 2 + 131072 * 128 * 2
    assert out["startup"]["non_torch_bytes"] > 2 * GiB  # NCCL's buffers at tp > 1


@pytest.mark.parametrize("gpu, non_torch", [("h100-80gb", int(2.05 * GiB + 2 * 0.035 * GiB)), ("h200", int(2.05 * GiB + 2 * 0.035 * GiB)),
                                            ("rtx-4090", int(0.25 * GiB)), ("l40s", int(0.25 * GiB))])
def test_non_torch_memory_at_tp_2_follows_the_peer_link(cli, gpu, non_torch):
    """NVLink peers: NCCL's and the custom all-reduce's buffers (~2.1 GiB in H100 logs); PCIe alone: as one rank (0.25
    GiB logged on two RTX 4090s, kvsim/conformance/startup_logs/logs.yaml); one rank alone is 0.25 GiB on any GPU."""
    two = run_json(cli, ["--model", "qwen3-0.6b", "--tp", "2", "--gpu", gpu])["startup"]
    one = run_json(cli, ["--model", "qwen3-0.6b", "--gpu", gpu])["startup"]
    assert two["non_torch_bytes"] == non_torch
    assert one["non_torch_bytes"] == int(0.25 * GiB)


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
    assert len(rows) == len(model_names()) >= 40
    assert by_name["gemma-2-9b"]["layers"] == {"sliding(4096)": 21, "full": 21}
    assert by_name["llama-4-scout"]["layers"] == {"chunked(8192)": 36, "full": 12}
    assert by_name["nemotron-h-8b"]["layers"] == {"linear-state": 24, "none": 24, "full": 4}
    assert "chunked(8192)" in result.stdout  # the table shows each model's layer kinds
    assert by_name["qwen3-0.6b"]["kv_bytes_per_token_bf16"] == 114688
    assert (by_name["deepseek-v3"]["num_kv_heads"], by_name["deepseek-v3"]["head_dim"]) == (1, 576)


LLAMA_CONFIG = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256,
                "max_position_embeddings": 8192, "head_dim": 128}


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
        (["--model", "qwen3-32b", "--gpu", "l4"], "would not start"),
        (["--model", "llama-3.1-8b", "--gpu", "h1000"], "unknown GPU"),
        (["--model", "llama-3.1-8b", "--memory", "lots"], "--memory"),
        (["--model", "llama-3.1-8b", "--tp", "3"], "--tp 3 does not divide"),
        (["--model", "llama-3.1-8b", "--layout"], "--num-blocks"),
        (["--model", "llama-3.1-8b", "--num-blocks", "2", "--address", "0,0,2,0,0,0"], "block index 2 out of range"),
        ([], "exactly one of --model"),
        (["--model", "llama-3.1-8b", "--gpu", "h100", "--memory", "1GB"], "not both"),
        (["--model", "llama-3.1-8b", "--memory", "1e400GB"], "--memory: byte size must be finite"),
        (["--model", "llama-3.1-8b", "--utilization", "1.5"], "--gpu-memory-utilization: must be in (0, 1]"),
        (["--model", "qwen3-32b", "--gpu", "l4"], "--gpu: vLLM 0.33.0 would not start: 20.30 GiB requested"),
        (["--model", "llama-3.1-8b", "--max-num-seqs", "0"], "--max-num-seqs: must be a positive integer"),
        (["--model", "llama-3.1-8b", "--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--model", "llama-3.1-8b", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
        (["--config", "{dir}"], "cannot read config"),
        (["--config", "{list}"], "expected a JSON object"),
        (["--config", "{empty}"], "invalid JSON"),
        (["--model", "llama-3.1-8b", "--tp", "-2"], "--tp: must be a positive integer"),
        (["--model", "llama-3.1-8b", "--block-size", "0"], "--block-size"),
        (["--model", "llama-3.1-8b", "--context", "0"], "--context"),
        # an empty value was a TypeError (--model) or silently "not given" (--gpu: no start-up section; --weight-dtype: the default)
        (["--model", ""], "kvsim: error: --model: an empty value; give one, or leave the option out"),
        (["--model", "qwen3-0.6b", "--gpu", ""], "kvsim: error: --gpu: an empty value"),
        (["--model", "qwen3-0.6b", "--gpu", "h100-80gb", "--weight-dtype", ""], "kvsim: error: --weight-dtype: an empty value"),
        (["--model", "qwen3-0.6b", "--config", " "], "kvsim: error: --config: an empty value"),
        # int() of nan / inf was a ValueError / OverflowError traceback
        (["--config", "{llama}", "--gpu", "h100-80gb", "--params", "nan"], "--params: must be a positive, finite count, got nan"),
        (["--config", "{llama}", "--gpu", "h100-80gb", "--params", "inf"], "--params: must be a positive, finite count, got inf"),
        (["--config", "{llama}", "--params", "0"], "--params: must be a positive, finite count, got 0.0"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(cli, tmp_path, args, needle):
    args = [
        str(tmp_path) if a == "{dir}" else
        _config(tmp_path, "[1, 2]") if a == "{list}" else
        _config(tmp_path, "") if a == "{empty}" else
        _config(tmp_path, "{not json") if a == "{bad}" else
        _config(tmp_path, json.dumps(LLAMA_CONFIG)) if a == "{llama}" else
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
    # gemma-3-27b with a KV budget (vLLM's kv_cache_memory_bytes) of 23,290,718,720 B at 32,768 tokens; a block of one layer is
    # 16 x 2 x 16 x 128 x 2 = 131,072 B; vLLM groups 10 full + 52 sliding layers as 1 + 6 groups of 10
    args = ["size", "--model", "gemma-3-27b", "--kv-cache-memory", "23290718720", "--context", "32768"]
    out = cli(args).stdout
    # num_blocks = 23,290,718,720 // (131,072 x 10) = 17,769; async scheduling keeps 2 x 8,192 tokens in flight:
    # per request cdiv(32,768, 16) + 6 x (cdiv(1023 + 16,384, 16) + 1) = 2,048 + 6 x 1,089 = 8,582 blocks
    # tokens = int(17,769 / 8,582 x 32,768) = 67,846
    assert "GPU KV cache size: 67,846 tokens, Maximum concurrency for 32,768 tokens per request: 2.07x" in out
    assert "(max_num_batched_tokens 8,192, async scheduling)" in out and "6 sliding groups x 1,089 blocks" in out
    out = cli([*args, "--no-async-scheduling"]).stdout
    # one batch in flight: 2,048 + 6 x (cdiv(1023 + 8,192, 16) + 1) = 5,510 blocks
    assert "GPU KV cache size: 105,672 tokens, Maximum concurrency for 32,768 tokens per request: 3.22x" in out
    out = cli([*args, "--max-num-batched-tokens", "2048"]).stdout
    # 2,048 + 6 x (cdiv(1023 + 4,096, 16) + 1) = 2,048 + 6 x 321 = 3,974 blocks: 17,769 / 3,974 = 4.47
    assert "GPU KV cache size: 146,516 tokens, Maximum concurrency for 32,768 tokens per request: 4.47x" in out
    data = run_json(cli, ["--model", "gemma-3-27b", "--kv-cache-memory", "23290718720", "--context", "32768", "--no-async-scheduling"])
    assert (data["vllm_async_scheduling"], data["vllm_max_in_flight_tokens"], data["vllm_kv_cache_size_tokens"]) == (False, 8192, 105672)


def test_hybrid_vllm_settings_from_the_command_line(cli):
    # --kernel-block-size 32: block_size 32 x cdiv(274,432, 32 x 1,024) = 32 x 9 = 288; page 288 x 1,024 = 294,912 B
    # num_blocks 37,309,411,328 // (12 x 294,912) = 10,542
    # --mamba-cache-mode align: each state group takes 2 blocks: cdiv(262,144, 288) + 3 x 2 = 911 + 6 = 917;
    # 10,542 / 917 = 11.50; tokens int(10,542 / 917 x 262,144) = 3,013,655
    out = cli(["size", "-m", "qwen3-next-80b-a3b", "--kv-cache-memory", "37309411328", "--tp", "4", "--kernel-block-size", "32",
               "--mamba-cache-mode", "align"]).stdout  # fmt: skip
    assert "vLLM block_size for this model: 288 tokens (raised from --block-size 16, in multiples of 32" in out
    assert "attention kernel block 32 (--kernel-block-size), prefix caching on (mamba_cache_mode align" in out
    assert "GPU KV cache size: 3,013,655 tokens, Maximum concurrency for 262,144 tokens per request: 11.50x" in out
    assert "3 state groups x 2 blocks; 1 full group x 911 blocks = 917 blocks" in out
    for args, line in ((["--mamba-cache-mode", "all"], "--mamba-cache-mode: expected one of none, align, got 'all'"),
                       (["--kernel-block-size", "0"], "--kernel-block-size: must be a positive integer, got 0")):  # fmt: skip
        result = cli(["size", "-m", "qwen3-next-80b-a3b", *args])
        assert result.exit_code == 2 and result.output.strip() == f"kvsim: error: {line}"


def test_hybrid_state_model_prints_vllms_lines_and_its_raised_block_size(cli):
    # Was "not modelled" (kvsim's own estimate): vLLM's arithmetic is now followed for state layers too.
    # qwen3-next-80b-a3b at tp 4 with 37,309,411,328 B of KV cache: block_size 16 x cdiv(274,432, 16 x 1,024) = 272; num_blocks
    # 37,309,411,328 // (12 x 278,528) = 11,162; 11,162 / (964 + 3) = 11.54; tokens int(11.54... x 262,144)
    # (each step in tests/test_vllm_sizing.py)
    none = "--no-enable-prefix-caching"  # mamba_cache_mode none; vllm serve's default align is tested below
    out = cli(["size", "--model", "qwen3-next-80b-a3b", "--kv-cache-memory", "37309411328", "--tp", "4", none]).stdout
    assert "vLLM block_size for this model: 272 tokens (raised from --block-size 16" in out
    assert "state page padded to 278,528 B (+1.49%)" in out
    assert "block_size 272): GPU KV cache size: 3,025,906 tokens, Maximum concurrency for 262,144 tokens per request: 11.54x" in out
    assert "prefix caching off (mamba_cache_mode none" in out and "attention kernel block 16" in out
    assert "kvsim's own estimate, whole 16-token blocks" in out and "not modelled" not in out
    data = run_json(cli, ["--model", "qwen3-next-80b-a3b", "--kv-cache-memory", "56257837465", "--tp", "2", none])
    assert data["block_rounded_is_vllm_exact"] is True
    # tp 2: 2 (K, V) x 1 head x 256 x 2 B = 1,024 B per token per layer; state 1,097,728 / 2 = 548,864 B:
    # 16 x cdiv(548,864, 16,384) = 16 x 34 (33.5 rounds up) = 544; page 544 x 1,024 = 557,056 B
    # budget 56,257,837,465; num_blocks = 56,257,837,465 // (12 x 557,056) = 8,415
    assert (data["vllm_block_size"], data["vllm_state_page_bytes"], data["vllm_state_page_padded_bytes"]) == (544, 548864, 557056)
    # per request: cdiv(262,144, 544) = 482 + 3 state groups = 485 blocks
    assert data["vllm_num_gpu_blocks"] == 8415 and data["vllm_blocks_per_request"] == cdiv(262144, 544) + 3
    assert data["max_sequences_block_rounded"] == round(8415 / 485, 4) == 17.3505
    assert data["max_tokens_block_rounded"] == data["vllm_kv_cache_size_tokens"] == int(8415 / 485 * 262144) == 4548333
    assert run_json(cli, ["--model", "gemma-3-27b", "--gpu", "h200"])["block_rounded_is_vllm_exact"] is True


def test_a_block_size_too_small_for_the_state_is_raised_and_said_so(cli):
    # --block-size 32: vLLM aligns to max(16, 32) = 32: 32 x cdiv(274,432, 32 x 1,024) = 32 x 9 = 288
    out = cli(["size", "--model", "qwen3-next-80b-a3b", "--tp", "4", "--block-size", "32"]).stdout
    assert "vLLM block_size for this model: 288 tokens (raised from --block-size 32" in out
    assert "288 x 1,024 B = 294,912 B >= 274,432 B" in out
    # --block-size 512 already holds the state: kept, the state page padded up to 524,288 B
    out = cli(["size", "--model", "qwen3-next-80b-a3b", "--tp", "4", "--block-size", "512"]).stdout
    assert "vLLM block_size for this model: 512 tokens (--block-size 512 already holds one layer's state" in out
    assert run_json(cli, ["--model", "qwen3-next-80b-a3b", "--tp", "4", "--block-size", "512"])["vllm_block_size_raised"] is False


JAMBA_V01 = {  # ai21labs/Jamba-v0.1's config.json fields sizing reads (transformers JambaConfig defaults)
    "model_type": "jamba", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 262144, "torch_dtype": "bfloat16", "attn_layer_period": 8, "attn_layer_offset": 4,
    "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
}
BAMBA_9B = {  # ibm-ai-platform/Bamba-9B
    "model_type": "bamba", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 262144, "torch_dtype": "bfloat16", "attn_layer_indices": [9, 18, 27], "mamba_d_state": 128,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_n_groups": 1,
}


def test_jamba_and_bamba_configs_print_vllms_lines(cli, tmp_path):
    # Jamba-v0.1, tp 2, 25,709,411,328 B of KV cache: block 16 x cdiv(155,648, 32,768) = 80; num_blocks 25,709,411,328 // 163,840 // 4
    # = 39,229; 39,229 / (3,277 + 7) = 11.95; tokens int(11.95... x 262,144) = 3,131,439
    out = cli(["size", "--config", _config(tmp_path, json.dumps(JAMBA_V01)), "--kv-cache-memory", "25709411328", "--tp", "2",
               "--mamba-cache-mode", "none"]).stdout
    assert "vLLM block_size for this model: 80 tokens" in out and "(+5.26%)" in out
    assert "GPU KV cache size: 3,131,439 tokens, Maximum concurrency for 262,144 tokens per request: 11.95x" in out
    # Bamba-9B, tp 1, 4,096 tokens, 57,749,411,328 B of KV cache: block 16 x cdiv(2,147,840, 65,536) = 528; num_blocks 57,749,411,328
    # // (3 x 2,162,688) = 8,900; 8,900 / (8 + 10) = 494.44; tokens int(494.44... x 4,096) = 2,025,244
    out = cli(["size", "--config", _config(tmp_path, json.dumps(BAMBA_9B)), "--kv-cache-memory", "57749411328", "--context", "4096",
               "--mamba-cache-mode", "none"]).stdout
    assert "vLLM block_size for this model: 528 tokens" in out and "(+0.69%)" in out
    assert "GPU KV cache size: 2,025,244 tokens, Maximum concurrency for 4,096 tokens per request: 494.44x" in out


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


def test_vllm_settings_errors_and_a_refused_start_through_the_cli(cli):
    result = cli(["size", "-m", "qwen3-next-80b-a3b", "--mamba-cache-mode", "none", "--mamba-checkpoint-alignment", "64"])
    assert result.exit_code == 2
    assert result.output.strip() == "kvsim: error: --mamba-checkpoint-alignment: state checkpoints exist only with --mamba-cache-mode align"
    # llama-3.1-70b at tp 2 with 6 GiB of KV cache: 2,457 blocks of 2,621,440 B; one 131,072-token request needs 8,192
    result = cli(["size", "-m", "llama-3.1-70b", "--kv-cache-memory", "6GiB", "--tp", "2"])
    assert result.exit_code == 2 and "GPU KV cache size" in result.stdout
    # vLLM's start-up error, in one line: what one request needs (8,193 blocks with the null block), what is there,
    # and the largest max_model_len that starts: (2,457 - 1) x 16 = 39,296 tokens
    assert result.stderr.strip() == (
        "kvsim: error: --max-model-len: vLLM 0.33.0 would not start: one request of max_model_len 131,072 needs "
        "20.00 GiB of KV cache (8,192 blocks and the null block), and start-up leaves 6.00 GiB; the largest "
        "max_model_len that starts is 39,296 (lower --max-model-len, raise --gpu-memory-utilization, or add --tp)"
    )
    assert cli(["size", "-m", "llama-3.1-70b", "--kv-cache-memory", "6GiB", "--tp", "2", "--max-model-len", "39296"]).exit_code == 0
    assert cli(["size", "-m", "llama-3.1-70b", "--kv-cache-memory", "6GiB", "--tp", "2", "--max-model-len", "39297"]).exit_code == 2


def test_version_and_flags_without_a_type_in_help(cli):
    from kvsim import __version__

    result = cli(["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"kvsim {__version__}"
    help_text = cli(["replay", "--help"]).stdout
    assert "--no-tensors" in help_text and "<bool>" not in help_text and "<int>" in help_text


@pytest.mark.parametrize("value", ["0", "-5", "16"])
def test_plot_size_refuses_a_max_context_at_or_below_the_left_edge(cli, tmp_path, value):
    result = cli(["plot", "size", "-m", "qwen3-0.6b", "--max-context", value, "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--max-context: must be above the chart's left edge, 16 tokens" in result.stderr
    assert not list(tmp_path.iterdir())


def test_vllm_serve_flag_names_are_accepted(cli):
    ours = run_json(cli, ["-m", "qwen3-32b", "--tp", "2", "--gpu", "h100", "--utilization", "0.65", "--context", "8192",
                          "--kv-dtype", "fp8", "--max-num-seqs", "256", "--max-num-batched-tokens", "4096"])  # fmt: skip
    vllms = run_json(cli, ["-m", "qwen3-32b", "-tp", "2", "--gpu", "h100", "--gpu-memory-utilization", "0.65",
                           "--max-model-len", "8192", "--kv-cache-dtype", "fp8_e4m3", "--max-num-seqs", "256",
                           "--max-num-batched-tokens", "4096"])  # fmt: skip
    assert ours == vllms
    assert (ours["tp"], ours["kv_dtype"], ours["context_tokens"], ours["utilization"]) == (2, "fp8", 8192, 0.65)
    assert (ours["startup"]["max_num_seqs"], ours["startup"]["max_num_batched_tokens"]) == (256, 4096)
    longer = run_json(cli, ["-m", "qwen3-32b", "--tensor-parallel-size", "4", "--gpu", "h100"])
    assert longer["tp"] == 4 and longer["startup"]["max_num_seqs"] == 1024  # vllm serve's default on an H100
    hybrid = run_json(cli, ["-m", "qwen3-next-80b-a3b", "--tp", "4", "--enable-prefix-caching"])
    assert hybrid["vllm_mamba_cache_mode"] == "align"
    eager = run_json(cli, ["-m", "qwen3-8b", "--gpu", "h100", "--enforce-eager"])["startup"]
    assert eager["cudagraph_estimate_bytes"] == 0 and eager["num_cudagraphs"] == 0
    fixed = run_json(cli, ["-m", "qwen3-8b", "--gpu", "h100", "--kv-cache-memory", "20GiB"])
    assert fixed["kv_budget_bytes"] == 20 * GiB


def test_size_help_on_80_columns_keeps_every_option_name(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = cli(["size", "--help"]).stdout
    names = [line.split()[1] for line in out.splitlines() if line.startswith("│ -")]
    assert "--max-num-batched-tokens" in names and "--mamba-checkpoint-alignment" in names and "--kv-cache-memory" in names
    assert not any("…" in name for name in names)


def test_hybrid_models_default_to_vllm_serves_prefix_caching_per_gpu(cli):
    """vllm serve 0.33 turns prefix caching on for a hybrid model (mamba_cache_mode align), off for an
    attention-free one; a gated delta net on Hopper checkpoints its prefill every 64 tokens (FlashInfer)."""
    def settings(*args):
        data = run_json(cli, [*args])
        return data["vllm_mamba_cache_mode"], data.get("vllm_mamba_checkpoint_alignment"), data.get("vllm_mamba_defaults", "")

    for gpu, alignment in (("h100-80gb", 64), ("h200", 64), ("b200", 0), ("a100-80gb", 0)):
        mode, got, note = settings("-m", "qwen3-next-80b-a3b", "--tp", "4", "--gpu", gpu)
        assert (mode, got) == ("align", alignment) and f"on {gpu}" in note, (gpu, mode, got, note)
    # align with checkpoints: 3 state blocks a request, the block raised to lcm(16, 64) multiples (320 at tp 4)
    assert run_json(cli, ["-m", "qwen3-next-80b-a3b", "--tp", "4", "--gpu", "h100-80gb"])["vllm_block_size"] == 320
    assert settings("-m", "nemotron-h-8b", "--gpu", "h100-80gb")[:2] == ("align", 1)  # mamba2: a checkpoint block
    assert settings("-m", "jamba-v0.1")[:2] == ("align", 0)  # mamba1: none
    mode, _, note = settings("-m", "mamba-codestral-7b", "--gpu", "h100-80gb")
    assert mode == "none" and "attention-free" in note
    # a setting given is kept, and then nothing is said to be assumed
    assert settings("-m", "qwen3-next-80b-a3b", "--tp", "4", "--gpu", "h100-80gb", "--no-enable-prefix-caching") == ("none", 0, "")
    assert settings("-m", "qwen3-next-80b-a3b", "--tp", "4", "--gpu", "h100-80gb", "--mamba-checkpoint-alignment", "0") == ("align", 0, "")
    out = cli(["size", "-m", "qwen3-next-80b-a3b", "--tp", "4", "--gpu", "h200"]).stdout
    assert "assumed: vllm serve's defaults for a hybrid model on h200" in out


def test_kv_dtype_auto_takes_the_fp8_kv_cache_a_checkpoint_asks_for(cli, tmp_path):
    # vLLM sizes a ModelOpt checkpoint with an fp8 kv_cache_scheme in fp8 unless --kv-cache-dtype says otherwise:
    # half the bytes a token, twice the tokens; a bf16 guess would halve what fits
    auto = run_json(cli, ["--model", "laguna-xs.2-fp8"])
    bf16 = run_json(cli, ["--model", "laguna-xs.2-fp8", "--kv-dtype", "bf16"])
    assert (auto["kv_dtype"], bf16["kv_dtype"]) == ("fp8", "bf16")
    assert auto["kv_bytes_per_token"] * 2 == bf16["kv_bytes_per_token"] == 163840
    assert run_json(cli, ["--model", "qwen3-0.6b"])["kv_dtype"] == "bf16"  # no quantization_config: the model's
    result = cli(["size", "--model", "qwen3.5-122b-nvfp4", "--gpu", "b200"])
    assert result.exit_code == 0 and "KV cache, fp8" in result.stdout
    # an nvfp4 KV cache (packed, not modelled) is refused by name, unless another dtype is given
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
                                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                                "quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "NVFP4"}}))
    result = cli(["size", "--config", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = result.stderr.strip()
    assert "\n" not in line and "--kv-dtype" in line and "nvfp4 KV cache" in line and "quantization_config" in line
    assert run_json(cli, ["--config", str(path), "--kv-dtype", "fp8"])["kv_bytes_per_token"] == 32 * 8 * 128 * 2


def test_a_compressed_tensors_int_kv_scheme_is_refused_as_vllm_refuses_it(cli, tmp_path):
    # llm-compressor's int KV schemes: vLLM 0.33's Attention layer refuses them (validate_kv_cache_scheme) whatever
    # --kv-cache-dtype says; kvsim sized them as an fp8 cache, 64 KiB a token here
    scheme = {"num_bits": 4, "type": "int", "strategy": "tensor", "symmetric": True, "dynamic": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
                                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                                "quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}}))
    for extra in ([], ["--kv-dtype", "bf16"]):
        result = cli(["size", "--config", str(path), *extra])
        assert result.exit_code == 2 and "Traceback" not in result.output
        line = result.stderr.strip()
        assert "\n" not in line and f"{path}: quantization_config.kv_cache_scheme.type: vLLM 0.33 cannot load" in line


def test_a_bad_weight_dtype_names_its_flag(cli):
    result = cli(["size", "--model", "qwen3-0.6b", "--gpu", "h100-80gb", "--weight-dtype", "fp4"])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("kvsim: error: --weight-dtype: unknown dtype 'fp4'")  # it said "dtype:"


def test_an_fp32_kv_cache_is_vllms_only_with_fp32_weights(cli):
    # vLLM 0.33's --kv-cache-dtype has no float32: auto takes the model's dtype, fp32 only under --dtype float32
    args = ["size", "--model", "qwen3-0.6b", "--gpu", "h100-80gb", "--kv-dtype", "fp32"]
    result = cli(args)
    assert result.exit_code == 0 and "as vLLM 0.33.0 computes it" not in result.stdout
    assert "a what-if in vLLM 0.33.0's arithmetic, whose fp32 KV cache needs fp32 weights" in result.stdout
    assert "as vLLM 0.33.0 computes it" in cli([*args, "--weight-dtype", "fp32"]).stdout


def test_an_int8_kv_cache_is_a_what_if_not_vllms_figure(cli):
    # vLLM 0.33 has no plain int8 KV cache dtype (int8_per_token_head stores scales too): never "as vLLM computes it"
    result = cli(["size", "--model", "qwen3-0.6b", "--gpu", "h100-80gb", "--kv-dtype", "int8"])
    assert result.exit_code == 0 and "as vLLM 0.33.0 computes it" not in result.stdout
    assert "a what-if in vLLM 0.33.0's arithmetic, which has no plain int8 KV cache dtype" in result.stdout
    assert "as vLLM 0.33.0 computes it" in cli(["size", "--model", "qwen3-0.6b", "--gpu", "h100-80gb", "--kv-dtype", "fp8"]).stdout
