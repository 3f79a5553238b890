"""A replay at tensor parallelism: one rank's pool and budget as `kvsim size --tp` sizes them, vLLM's rules for
tp against the heads as one-line errors naming file and field, --tp overriding the workload, tp in the reports."""

from __future__ import annotations

import json

import pytest
import yaml

from kvsim.errors import KvsimError
from kvsim.models.catalogue import resolve_model
from kvsim.models.hardware import get_gpu
from kvsim.replay.options import ReplayContext, ReplayOptions
from kvsim.replay.run import run_replay
from kvsim.size.report import size_report
from kvsim.size.sizing import kv_cache_spec
from kvsim.workload.spec import SchedulerConfig, load_workload


def write(tmp_path, model="qwen3-32b", deployment=None, **extra):
    data = {
        "name": "tp", "model": model, "hardware": "h100-80gb", "gpu_memory_utilization": 0.9, "max_model_len": 4096,
        "requests": {"count": 12, "arrival": {"process": "poisson", "rate": 20.0},
                     "prompt_tokens": {"dist": "constant", "value": 700}, "output_tokens": {"dist": "constant", "value": 40}},
        "allocators": [{"kind": "paged", "block_size": 16}],
        **extra,
    }
    if deployment is not None:
        data["deployment"] = deployment
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("tp", [2, 4])
def test_the_budget_and_pool_are_one_ranks_as_kvsim_size_tp_has_them(tmp_path, tp):
    model, gpu = resolve_model("qwen3-32b"), get_gpu("h100-80gb")
    result = run_replay(load_workload(write(tmp_path, deployment={"tp": tp})), ReplayOptions(tensors=False), workers=1)
    size = size_report(model, tp=tp, memory_bytes=gpu.memory_bytes, gpu_name=gpu.name, utilization=0.9)
    assert result.budget_bytes == size.capacity.kv_budget_bytes
    assert result.tp == tp and result.runs[0].budget_bytes == size.capacity.kv_budget_bytes
    # 8 KV heads split over tp ranks: 64 layers x K and V x 8/tp heads x 128 x 2 bytes per token and rank.
    assert kv_cache_spec(model, tp=tp).bytes_per_token == 64 * 2 * (8 // tp) * 128 * 2


def test_more_ranks_decode_faster_on_the_roofline(tmp_path):
    runs = {tp: run_replay(load_workload(write(tmp_path)), ReplayOptions(tensors=False, tp=tp), workers=1) for tp in (1, 2, 8)}
    step = {tp: r.runs[0].steps["step_time_s"].sum() for tp, r in runs.items()}
    assert step[1] > step[2] > step[8]


def test_kv_heads_are_replicated_and_mla_kept_whole_past_their_count():
    # Qwen3-30B-A3B has 4 KV heads: at tp 8 each rank holds one (replicated twice); DeepSeek-V3's MLA latent is
    # replicated on every rank whatever tp.
    qwen = resolve_model("qwen3-30b-a3b")
    ctx = ReplayContext(qwen, "bf16", 8 << 30, 4096, None, SchedulerConfig(), 0, tp=8)
    assert ctx.spec(16).bytes_per_token == 48 * 2 * 1 * 128 * 2
    deepseek = resolve_model("deepseek-v3")
    assert ReplayContext(deepseek, "bf16", 8 << 30, 4096, None, SchedulerConfig(), 0, tp=8).spec(16).bytes_per_token == \
        kv_cache_spec(deepseek).bytes_per_token


def test_a_mixed_models_groups_are_sized_per_rank():
    """Gemma-3-27B (sliding + full, 16 KV heads): at tp 2 every group's page is half tp 1's."""
    model = resolve_model("gemma-3-27b")
    pools = [ReplayContext(model, "bf16", 8 << 30, 4096, None, SchedulerConfig(), 0, tp=tp).spec(16).pool for tp in (1, 2)]
    assert pools[0] is not None and pools[1] is not None
    assert [g.page_bytes for g in pools[1].groups] == [g.page_bytes // 2 for g in pools[0].groups]


def test_a_tp_that_does_not_suit_the_heads_names_the_file_and_field(tmp_path):
    path = write(tmp_path, deployment={"tp": 3})
    with pytest.raises(KvsimError) as exc:
        run_replay(load_workload(path), ReplayOptions(tensors=False))
    assert str(exc.value) == f"{path}: deployment.tp: tp 3 does not divide num_attention_heads 64 of qwen3-32b"
    with pytest.raises(KvsimError, match=r"^--tp: tp 3 does not divide num_attention_heads 64"):
        run_replay(load_workload(write(tmp_path)), ReplayOptions(tensors=False, tp=3))
    # Llama-3.1-70B: 64 heads, 8 KV heads; tp 16 divides the heads and replicates each KV head on 2 ranks (it
    # loads in vLLM); the heads are vLLM's first check, so a tp that splits neither is named for the heads.
    ok = run_replay(load_workload(write(tmp_path, model="llama-3.1-70b", kv_budget="4GiB", gpu_memory_utilization=None,
                                        deployment={"tp": 16})), ReplayOptions(tensors=False), workers=1)
    assert ok.tp == 16 and ok.runs[0].finished_s.size == 12


def test_expert_parallelism_needs_the_kernels_db_clock(tmp_path):
    path = write(tmp_path, model="qwen3-30b-a3b", deployment={"tp": 2, "ep": 2})
    with pytest.raises(KvsimError, match=r"w.yaml: deployment.ep: ep 2 needs the kernels-db clock"):
        run_replay(load_workload(path), ReplayOptions(tensors=False))


def test_cli_tp_overrides_the_workload_and_reports_say_tp(cli, tmp_path):
    path = write(tmp_path, deployment={"tp": 2})
    out = tmp_path / "o"
    result = cli(["replay", str(path), "--no-tensors", "--out", str(out), "--tp", "4"])
    assert result.exit_code == 0, result.output
    assert "tp 4, KV budget" in " ".join(result.output.split()) and "per rank" in result.output
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tp"] == 4 and meta["ep"] == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary[0]["tp"] == 4 and summary[0]["budget_bytes"] == meta["budget_bytes"]
    bad = cli(["replay", str(path), "--no-tensors", "--out", str(tmp_path / "b"), "--tp", "5"])
    assert bad.exit_code == 2 and bad.output.strip().splitlines() == ["kvsim: error: --tp: tp 5 does not divide num_attention_heads 64 of qwen3-32b"]
    for spelling in ("--tensor-parallel-size", "-tp"):  # vllm serve's spellings of the flag
        alias = cli(["replay", str(path), "--no-tensors", "--quiet", "--json", "--out", str(tmp_path / "a"), spelling, "8"])
        assert alias.exit_code == 0 and json.loads(alias.stdout)[0]["tp"] == 8, alias.output
    zero = cli(["replay", str(path), "--no-tensors", "--out", str(tmp_path / "z"), "--tp", "0"])
    assert zero.exit_code == 2 and "--tp: must be >= 1, got 0" in zero.output


def test_kv_heads_neither_split_nor_replicated_evenly_are_refused(tmp_path):
    """12 query heads, 4 KV heads: tp 6 divides the heads but would give ranks 2/3 of a KV head (vLLM will not load it)."""
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 768,
              "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 2048,
              "vocab_size": 32000, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = write(tmp_path, model="config.json", deployment={"tp": 6})
    with pytest.raises(KvsimError) as exc:
        run_replay(load_workload(path), ReplayOptions(tensors=False))
    assert str(exc.value).startswith(f"{path}: deployment.tp: tp 6 neither divides nor is a multiple of the 4 KV heads")
    assert run_replay(load_workload(write(tmp_path, model="config.json", deployment={"tp": 12}, kv_budget="256MiB",
                                          gpu_memory_utilization=None)),
                      ReplayOptions(tensors=False), workers=1).tp == 12  # 4 KV heads, each on 3 ranks


@pytest.mark.skipif(not __import__("kvsim.clock.kernels_db", fromlist=["available"]).available(),
                    reason="aiconfigurator-core (the perfdb extra) is not installed")
def test_ep_on_the_kernels_db_clock_and_its_errors(tmp_path):
    path = write(tmp_path, model="qwen3-30b-a3b", deployment={"tp": 2, "ep": 2})
    result = run_replay(load_workload(path), ReplayOptions(tensors=False, timing="kernels-db"), workers=1)
    assert result.ep == 2 and result.clock.endswith(", tp 2, ep 2)")
    with pytest.raises(KvsimError, match=r"w.yaml: deployment.ep: ep 2 with tp 4: vLLM's expert parallelism spans"):
        run_replay(load_workload(path), ReplayOptions(tensors=False, timing="kernels-db", tp=4))  # the file's ep, --tp 4
    with pytest.raises(KvsimError, match=r"^--ep: ep 4 with tp 2: vLLM's expert parallelism spans every tp rank"):
        run_replay(load_workload(path), ReplayOptions(tensors=False, timing="kernels-db", ep=4))
    dense = write(tmp_path, deployment={"tp": 2, "ep": 2})
    with pytest.raises(KvsimError, match=r"w.yaml: deployment.ep: ep 2: qwen3-32b has no experts to split"):
        run_replay(load_workload(dense), ReplayOptions(tensors=False, timing="kernels-db"))
