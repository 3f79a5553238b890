"""kvsim plan: the grid of deployments, the cheapest meeting the SLO per GPU and why the next smaller fails,
plan.json and its chart, and bad input as one line with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.deployment.plan import Plan, Slo, parse_slo, plan_tasks
from kvsim.errors import KvsimError

REPO = Path(__file__).resolve().parents[2]


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
    with pytest.raises(KvsimError, match=r"--slo: ttft_p99 given twice"):  # plan.json kept only the second
        parse_slo("ttft_p99=2s,ttft_p99=300s")


def test_a_bad_trace_row_is_the_commands_error_before_any_deployment_runs(tmp_path):
    # it was each deployment's row error, then "--slo: no searched deployment meets ...", with plan.json written
    trace = tmp_path / "bad.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,10\n3.5,abc,10\n")
    result = CliRunner().invoke(app, ["plan", str(trace), "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--slo",
                                      "ttft_p99=2s", "--timing", "roofline", "--workers", "1", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert line == f"kvsim: error: {trace}: line 3, column num_prefill_tokens: expected a whole number from 1 to 16,777,216, got 'abc'"
    assert not (tmp_path / "o").exists()


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
    document = json.loads((out / "plan.json").read_text())
    plans = document["plans"]
    # the search stops at the first replica count that meets: the rest are listed as not replayed
    assert [p["meets_slo"] for p in plans] == [False] * (len(plans) - 1) + [True]
    cheapest = plans[-1]
    assert [p["replicas"] for p in plans] + [p["replicas"] for p in document["pruned"]] == [1, 2, 4]
    assert all(p["reason"] == f"more GPUs than the cheapest h100 plan ({cheapest['gpus']})" for p in document["pruned"])
    assert f"h100: {cheapest['replicas']} x tp 1 = {cheapest['gpus']} GPUs" in result.output
    assert (out / "plan.png").exists()
    full = CliRunner().invoke(app, ["plan", str(write(tmp_path)), "--gpu", "h100", "--tp", "1", "--replicas", "1,2,4",
                                    "--slo", "ttft_p99=0.5s", "--timing", "roofline", "--workers", "1", "--out",
                                    str(tmp_path / "full"), "--exhaustive"])
    assert full.exit_code == 0, full.output
    every = json.loads((tmp_path / "full" / "plan.json").read_text())
    assert [p["replicas"] for p in every["plans"]] == [1, 2, 4] and every["pruned"] == []
    assert {p["status"] for p in every["plans"]} == {"replayed"}
    assert min((p for p in every["plans"] if p["meets_slo"]), key=lambda p: p["gpus"]) == cheapest
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
    assert "certainly" not in line  # every replay was cut short; the largest was then replayed to its end


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


def mooncake_slice(tmp_path, count=200):
    """The first `count` requests of the shipped Mooncake slice on Llama-3.1-8B, as `kvsim plan` replays a trace."""
    data = {"name": "plan-mooncake", "model": "llama-3.1-8b", "gpu_memory_utilization": 0.9, "max_model_len": 131072,
            "requests": {"trace": {"path": str(REPO / "workloads" / "traces" / "mooncake-conversation-500.jsonl"), "limit": count}},
            "allocators": [{"kind": "paged", "block_size": 16, "prefix_caching": True}]}
    path = tmp_path / "mooncake.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("slo_text, cut_on, lines", [
    ("ttft_p99=5s", {"ttft_p99_s"}, ["h100: 2 x tp 2 = 4 GPUs (ttft_p99 3.20 s, tpot_p99 106 ms)",  # 4 x tp 1 meets too, at 4.55 s
                                     "  the next smaller, 1 x tp 2 = 2 GPUs, fails: ttft_p99 5.88 s > 5.00 s"]),
    ("ttft_p99=60s,tpot_p99=80ms", {"tpot_p99_s"},
     ["h100: 4 x tp 1 = 4 GPUs (ttft_p99 4.55 s, tpot_p99 74 ms)",
      "  the next smaller, 1 x tp 2 = 2 GPUs, fails: tpot_p99 100 ms > 80 ms"]),
], ids=["ttft", "ttft-and-tpot"])
def test_the_pruned_search_finds_the_exhaustive_searchs_plan(tmp_path, slo_text, cut_on, lines):
    """Every shortcut taken on a small trace (replays cut short on TTFT and on TPOT, a pool that cannot hold the
    longest request, a deployment not replayed), and the same cheapest plan, next smaller one and verdict as
    replaying everything. L4s hold 30k tokens of Llama-3.1-8B at tp 1, less than the slice's longest request
    (121k)."""
    from kvsim.deployment.plan import run_plan
    from kvsim.deployment.plan_view import verdict

    slo = parse_slo(slo_text)
    tasks, _, _ = plan_tasks(str(mooncake_slice(tmp_path)), model=None, gpus=["h100", "l4"], tps=[1, 2],
                             replicas=[1, 2, 4], timing="roofline", router=None)
    full = run_plan(tasks, slo, workers=1, ray=None, exhaustive=True)
    fast = run_plan(tasks, slo, workers=1, ray=None)
    assert len(full.rows) == len(tasks) and full.pruned == [] and not any(r["cut_short"] for r in full.rows)
    for gpu in ("h100", "l4"):
        assert fast.cheapest(gpu) == full.cheapest(gpu)
    # the next smaller: as many GPUs, and a miss; where two of that size were both cut short, either may be named
    smaller, whole = fast.next_smaller("h100"), full.next_smaller("h100")
    assert smaller["gpus"] == whole["gpus"] and not full.meets(next(r for r in full.rows if r["point"] == smaller["point"]))
    assert smaller == whole or smaller["cut_short"]
    assert verdict(full, ["h100"]) == lines and verdict(fast, ["h100"])[0] == lines[0]
    assert fast.cheapest("l4") is None
    by_point = {r["point"]: r for r in full.rows}
    for row in fast.rows:
        whole = by_point[row["point"]]
        if row["cut_short"]:  # the verdict was certain: the whole replay misses, above the bound it stopped at
            metric = row["cut_metric"]
            assert not full.meets(whole) and whole[metric] >= row[metric] > dict(slo.targets)[metric]
        elif row.get("never_fits"):
            assert (row["gpu"], row["tp"]) == ("l4", 1) and row["unfinished"] == whole["unfinished"] > 0
        else:
            assert row == whole
    assert cut_on <= {r["cut_metric"] for r in fast.rows if r["cut_short"]}
    assert sum(bool(r.get("never_fits")) for r in fast.rows) == 3
    assert [(p["gpu"], p["tp"], p["replicas"]) for p in fast.pruned] == [("h100", 2, 4)]


def test_the_watch_is_certain_exactly_when_the_percentile_must_exceed_the_target():
    """numpy's p99 of n values exceeds T once n - _lowest_index(99, n) of them do, whatever the others are."""
    import numpy as np

    from kvsim.deployment.slo_watch import SloWatch, _lowest_index

    for n in range(1, 400):
        k = n - _lowest_index(99, n)
        values = np.zeros(n)
        values[:k] = 1.0 + 1e-9
        assert np.percentile(values, 99) > 1.0
        if 99 * (n - 1) % 100:  # and no sooner, where the position has a fraction (else one value later, to be safe)
            values[k - 1] = 0.0
            assert np.percentile(values, 99) <= 1.0
    watch = SloWatch((("ttft_p99_s", 1.0), ("tpot_p99_s", 0.05)), np.zeros(100), np.full(100, 8))  # 100 - floor(98.01)
    assert watch.ttft[0][2] == watch.tpot[0][2] == 2
    watch.served[:99] = b"\x01" * 99
    assert not watch.certain_miss(5.0)  # one request late of 100: the p99 may still be under 1 s
    watch2 = SloWatch((("ttft_p99_s", 1.0),), np.zeros(100), np.full(100, 8))
    assert not watch2.certain_miss(1.0)  # waited exactly the target: not over it
    assert watch2.certain_miss(1.5) and (watch2.metric, watch2.lower_bound, watch2.cut_at_s) == ("ttft_p99_s", 1.5, 1.5)


def test_the_request_check_reads_the_stream_without_refusing_a_deployment_it_would_skip(tmp_path):
    # a workload valid at tp 2 only (ep 2 spans every tp rank) still plans, and a null kv_dtype is vllm serve's auto
    path = write(tmp_path, count=20)
    data = yaml.safe_load(path.read_text())
    data.update(model="qwen3-30b-a3b", kv_budget="4GiB", kv_dtype=None, deployment={"ep": 2})
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["plan", str(path), "--gpu", "h100-80gb", "--tp", "1,2", "--replicas", "1", "--slo",
                                      "ttft_p99=1000s", "--workers", "1", "--out", str(tmp_path / "o")])  # ep: kernels-db
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert "tp 2" in result.output and plan["plans"]


def test_a_model_path_in_the_workload_is_the_files_as_replay_reads_it(tmp_path, monkeypatch):
    # plan read it against the current directory ("m.json: cannot read config"); replay against the file's folder
    from tests.replay.test_replay import TINY_MODEL

    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "m.json").write_text(TINY_MODEL)
    path = write(sub, count=10)
    data = yaml.safe_load(path.read_text())
    data.update(model="m.json", kv_budget="64MiB", max_model_len=2048)
    path.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["plan", "sub/plan.yaml", "--gpu", "h100-80gb", "--tp", "1", "--replicas", "1", "--slo",
                                      "ttft_p99=1000s", "--timing", "roofline", "--workers", "1", "--out", str(tmp_path / "o"), "-q"])
    assert result.exit_code == 0, result.output
