"""kvsim plan: the grid of deployments, the cheapest meeting the SLO per GPU and why the next smaller fails,
plan.json and its chart, and bad input as one line with exit code 2."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.deployment.plan import Plan, Slo, parse_slo, plan_tasks
from kvsim.errors import KvsimError


def write(tmp_path, count=120, rate=40.0):
    data = {
        "name": "plan", "seed": 0, "model": "qwen3-0.6b", "hardware": "h100-80gb", "kv_budget": "2GiB", "max_model_len": 4096,
        "requests": {"count": count, "arrival": {"process": "poisson", "rate": rate},
                     "prompt_tokens": {"dist": "constant", "value": 2000}, "output_tokens": {"dist": "constant", "value": 64}},
        "allocators": [{"kind": "paged", "block_size": 16}],
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_slo_parsing():
    assert parse_slo("ttft_p99=2s,tpot_p99=50ms").targets == (("ttft_p99_s", 2.0), ("tpot_p99_s", 0.05))
    with pytest.raises(KvsimError, match=r"--slo: unknown target 'ttft_p95'"):
        parse_slo("ttft_p95=1s")
    with pytest.raises(KvsimError, match=r"--slo: ttft_p99: 'fast' is not a duration"):
        parse_slo("ttft_p99=fast")


def test_the_cheapest_plan_and_the_next_smaller():
    slo = Slo((("ttft_p99_s", 1.0),))
    rows = [{"gpu": "h100", "tp": 1, "replicas": n, "gpus": n, "ttft_p99_s": t, "tpot_p99_s": 0.01, "error": None}
            for n, t in ((1, 9.0), (2, 3.0), (3, 0.8), (4, 0.5))]
    rows.append({"gpu": "h100", "tp": 2, "replicas": 2, "gpus": 4, "ttft_p99_s": 0.4, "tpot_p99_s": 0.01, "error": None})
    plan = Plan(slo, rows)
    assert (plan.cheapest("h100")["gpus"], plan.cheapest("h100")["tp"]) == (3, 1)
    assert plan.next_smaller("h100")["gpus"] == 2
    assert plan.slo.misses(plan.next_smaller("h100")) == ["ttft_p99 3.00 s > 1.00 s"]
    assert [p["meets_slo"] for p in plan.plans_json()] == [False, False, True, True, True]


def test_tp_that_divides_no_head_count_is_refused(tmp_path):
    with pytest.raises(KvsimError, match=r"--tp: .*tp 3"):
        plan_tasks(str(write(tmp_path)), model=None, gpus=["h100"], tps=[1, 3], replicas=[1], timing="roofline", router=None)


def test_a_model_that_fits_no_gpu_is_refused(tmp_path):
    path = write(tmp_path)
    data = yaml.safe_load(path.read_text())
    del data["kv_budget"]
    data["gpu_memory_utilization"] = 0.9
    path.write_text(yaml.safe_dump(data))
    tasks, skipped, _ = plan_tasks(str(path), model="llama-3.1-70b", gpus=["h100"], tps=[1, 2], replicas=[1, 2],
                                   timing="roofline", router=None)
    assert [t.tp for t in tasks] == [2, 2] and skipped[0].startswith("h100 tp 1")
    with pytest.raises(KvsimError, match=r"--tp: llama-3.1-70b fits no searched GPU"):
        plan_tasks(str(path), model="llama-3.1-70b", gpus=["l4"], tps=[1], replicas=[1], timing="roofline", router=None)


def test_plan_cli_finds_the_fewest_replicas_and_writes_plan_json(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["plan", str(write(tmp_path)), "--gpu", "h100", "--tp", "1", "--replicas", "1,2,4",
                                      "--slo", "ttft_p99=0.5s", "--timing", "roofline", "--workers", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plans = json.loads((out / "plan.json").read_text())["plans"]
    assert [p["replicas"] for p in plans] == [1, 2, 4]
    meets = [p["meets_slo"] for p in plans]
    assert meets == sorted(meets)  # more replicas never hurt here; the cheapest is the first that meets
    cheapest = plans[meets.index(True)]
    assert f"h100: {cheapest['replicas']} x tp 1 = {cheapest['gpus']} GPUs" in result.output
    assert (out / "plan.png").exists()
    assert {p["async_scheduling"] for p in plans} == {True}  # vllm serve's default: the file says nothing


def test_no_async_scheduling_runs_every_deployment_synchronously(tmp_path):
    args = dict(model=None, gpus=["h100"], tps=[1], replicas=[1], timing="roofline", router=None)
    tasks, _, _ = plan_tasks(str(write(tmp_path)), **args)
    assert "scheduler" not in tasks[0].workload  # the workload's own (async unless it says otherwise)
    tasks, _, _ = plan_tasks(str(write(tmp_path)), **args, async_scheduling=False)
    assert tasks[0].workload["scheduler"] == {"async_scheduling": False}
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["plan", str(write(tmp_path)), "--gpu", "h100", "--tp", "1", "--replicas", "1",
                                      "--slo", "ttft_p99=3600s", "--timing", "roofline", "--workers", "1", "--out", str(out),
                                      "-q", "--no-async-scheduling"])
    assert result.exit_code == 0, result.output
    assert [p["async_scheduling"] for p in json.loads((out / "plan.json").read_text())["plans"]] == [False]


def test_an_slo_nobody_meets_names_the_closest_and_exits_2(tmp_path):
    result = CliRunner().invoke(app, ["plan", str(write(tmp_path)), "--gpu", "h100", "--tp", "1", "--replicas", "1,2",
                                      "--slo", "ttft_p99=1ms", "--timing", "roofline", "--workers", "1", "--out", str(tmp_path / "o"), "-q"])
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert line.startswith("kvsim: error: --slo: no searched deployment meets ttft_p99 <= 1 ms; closest: 2 x h100 tp 1")


def test_unknown_router_and_roofline_refusal(tmp_path, monkeypatch):
    runner = CliRunner()
    bad = runner.invoke(app, ["plan", str(write(tmp_path)), "--router", "nearest", "--timing", "roofline"])
    assert bad.exit_code == 2 and "--router: unknown router policy 'nearest'" in bad.output

    def no_db(*args, **kwargs):
        raise KvsimError("no data for this GPU", field="hardware")

    monkeypatch.setattr("kvsim.clock.kernels_db.kernel_clock", no_db)
    refused = runner.invoke(app, ["plan", str(write(tmp_path)), "--gpu", "h100", "--tp", "1", "--replicas", "1"])
    assert refused.exit_code == 2
    assert "the kernels-db clock does not cover qwen3-0.6b on h100 at tp 1" in refused.output
    assert "--timing roofline" in refused.output
