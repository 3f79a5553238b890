"""A fleet of engines behind a router: each replica is the replay's engine on its own requests (replayed alone,
a replica's stream gives the same steps), the policies route as they say, the reports add up, bad input is one
line naming the field."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.deployment.fleet import replay_fleet
from kvsim.deployment.prefix_hashes import prompt_block_hashes
from kvsim.deployment.reports import write_fleet_reports
from kvsim.deployment.streams import replica_streams
from kvsim.errors import KvsimError
from kvsim.replay.loop import replay_allocator
from kvsim.replay.options import ReplayOptions
from kvsim.replay.run import resolve_replay, run_replay
from kvsim.workload.spec import Router, load_workload

OPTIONS = ReplayOptions(tensors=False)


def write(tmp_path, *, replicas=4, router=None, count=240, rate=60.0, groups=6, prefix_caching=True, budget="160MiB",
          async_scheduling=None):
    data = {
        "name": "fleet", "seed": 3, "model": "qwen3-0.6b", "hardware": "h100-80gb", "kv_budget": budget,
        "max_model_len": 4096,
        "requests": {"count": count, "arrival": {"process": "poisson", "rate": rate},
                     "prompt_tokens": {"dist": "lognormal", "mean": 900, "sigma": 0.5, "min": 64, "max": 3000},
                     "output_tokens": {"dist": "uniform", "min": 8, "max": 200},
                     "shared_prefix": {"groups": groups, "tokens": 512, "fraction": 0.8}},
        "allocators": [{"kind": "paged", "block_size": 16, "prefix_caching": prefix_caching}],
        "deployment": {"replicas": replicas},
    }
    if router is not None:
        data["router"] = router
    if async_scheduling is not None:
        data["scheduler"] = {"async_scheduling": async_scheduling}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "prefix-approx", "prefix-precise"])
def test_a_replicas_stream_replayed_alone_takes_the_steps_it_took_in_the_fleet(tmp_path, policy, async_scheduling):
    workload = load_workload(write(tmp_path, router={"policy": policy}, async_scheduling=async_scheduling))
    assert workload.scheduler.async_scheduling is async_scheduling
    fleet = replay_fleet(workload, OPTIONS)
    (run,) = fleet.fleets
    _, ctx, requests, options = resolve_replay(workload, OPTIONS)
    _, streams = replica_streams(workload)
    assert sum(len(s) for s in streams) == len(requests)
    for k, rep in enumerate(run.replicas):
        mine = np.flatnonzero(run.replica_of == k)
        assert [requests[i].request_id for i in mine] == [r.request_id for r in streams[k]]
        alone = replay_allocator(workload.allocators[0], streams[k], ctx, options)
        assert int(alone.steps["num_steps"].sum()) == int(rep.steps["num_steps"].sum()) > 0
        for name in ("admitted_s", "first_token_s", "finished_s"):
            np.testing.assert_allclose(getattr(alone, name), getattr(rep, name)[mine], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(alone.num_cached_tokens, rep.num_cached_tokens[mine])
        np.testing.assert_array_equal(alone.num_preemptions, rep.num_preemptions[mine])
        assert np.isnan(np.delete(rep.finished_s, mine)).all()  # nothing else ran there


def test_one_replica_is_the_replay(tmp_path):
    workload = load_workload(write(tmp_path, replicas=1))
    fleet = replay_fleet(workload, OPTIONS)
    (solo,) = run_replay(workload, OPTIONS, workers=1).runs
    dep = fleet.fleets[0].deployment
    np.testing.assert_array_equal(dep.finished_s, solo.finished_s)
    np.testing.assert_array_equal(dep.num_cached_tokens, solo.num_cached_tokens)
    assert (fleet.fleets[0].replica_of == 0).all()


def test_round_robin_takes_turns_and_random_is_seeded(tmp_path):
    workload = load_workload(write(tmp_path, count=40))
    rr = replay_fleet(workload, OPTIONS, router=Router(policy="round-robin")).fleets[0].replica_of
    assert rr.tolist() == [i % 4 for i in range(40)]
    a = replay_fleet(workload, OPTIONS, router=Router(policy="random", seed=1)).fleets[0].replica_of
    b = replay_fleet(workload, OPTIONS, router=Router(policy="random", seed=1)).fleets[0].replica_of
    c = replay_fleet(workload, OPTIONS, router=Router(policy="random", seed=2)).fleets[0].replica_of
    assert a.tolist() == b.tolist() != c.tolist()
    assert set(a.tolist()) == {0, 1, 2, 3}


def test_least_loaded_sends_a_burst_to_every_replica_in_turn(tmp_path):
    """Four requests at once: each finds the others' replicas holding one, so each takes an empty one."""
    workload = load_workload(write(tmp_path, count=8, rate=1e6))
    replica_of = replay_fleet(workload, OPTIONS, router=Router(policy="least-loaded")).fleets[0].replica_of
    assert sorted(replica_of[:4].tolist()) == [0, 1, 2, 3]
    assert np.bincount(replica_of, minlength=4).tolist() == [2, 2, 2, 2]


def test_the_routers_hashes_are_the_engines(tmp_path):
    """A request's prompt block hashes are what the replica cached: after one request of a group finishes,
    the next of its group finds its whole shared prefix in that replica's table."""
    workload = load_workload(write(tmp_path, replicas=2, count=2, rate=1e-3, groups=1))
    fleet = replay_fleet(workload, OPTIONS, router=Router(policy="prefix-precise"))
    requests, first, second = fleet.requests, fleet.requests[0], fleet.requests[1]
    assert first.prefix_group == second.prefix_group == 0
    h1, h2 = (prompt_block_hashes(r, workload.seed, 16) for r in (first, second))
    assert h1[:32] == h2[:32] and h1[32] != h2[32]  # 512 shared tokens: 32 blocks of 16
    replica_of = fleet.fleets[0].replica_of
    assert replica_of[0] == replica_of[1]  # the second went where its prefix was cached
    assert fleet.fleets[0].deployment.num_cached_tokens[1] == 512 == requests[1].num_prefix_tokens


def test_prefix_routing_hits_more_than_round_robin_and_stays_under_the_unbounded_cache(tmp_path):
    path = write(tmp_path, count=400, rate=80.0, groups=24, budget="600MiB")
    from kvsim.deployment.reports import fleet_records

    rates = {}
    for policy in ("round-robin", "prefix-precise", "prefix-approx"):
        fleet = replay_fleet(load_workload(path), OPTIONS, router=Router(policy=policy))
        dep = [r for r in fleet_records(fleet) if r["replica"] == "all"][0]
        assert dep["fleet_hit_rate"] <= dep["hit_rate_ideal"] + 1e-12
        assert 0 < dep["hit_rate_bound"] <= dep["hit_rate_ideal"]
        rates[policy] = dep["fleet_hit_rate"]
    assert rates["prefix-precise"] > rates["round-robin"] + 0.05
    assert rates["prefix-approx"] > rates["round-robin"] + 0.05


def test_reports_have_a_row_per_replica_and_the_replica_of_every_request(tmp_path):
    workload = load_workload(write(tmp_path, count=60))
    fleet = replay_fleet(workload, OPTIONS, router=Router(policy="least-loaded"))
    written = write_fleet_reports(fleet, tmp_path / "out")
    summary = pd.read_csv(written["paths"]["summary.csv"])
    assert summary["replica"].astype(str).tolist() == ["0", "1", "2", "3", "all"]
    assert summary["num_requests"].tolist()[:4] == np.bincount(fleet.fleets[0].replica_of, minlength=4).tolist()
    assert summary["num_requests"].iloc[4] == 60 == summary["finished"].iloc[4] + summary["rejected"].iloc[4]
    assert summary["finished"].iloc[4] == summary["finished"].iloc[:4].sum()
    assert summary["gpus"].iloc[4] == 4
    requests = pd.read_csv(written["paths"]["requests.csv"])
    assert requests["replica"].tolist() == fleet.fleets[0].replica_of.tolist()
    steps = pd.read_parquet(written["paths"]["steps.parquet"])
    assert sorted(steps["replica"].unique().tolist()) == [0, 1, 2, 3]
    imbalance = summary["load_imbalance"].iloc[4]
    assert 1.0 <= imbalance < 4.0


def test_an_unknown_policy_or_weight_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(KvsimError, match=r"fleet.yaml: router.policy: must be one of random, round-robin"):
        load_workload(write(tmp_path, router={"policy": "nearest"}))
    with pytest.raises(KvsimError, match=r"fleet.yaml: router: unknown field"):
        load_workload(write(tmp_path, router={"policy": "prefix-precise", "overlap_weight": 2}))
    with pytest.raises(KvsimError, match=r"fleet.yaml: deployment.replicas: must be >= 1"):
        load_workload(write(tmp_path, replicas=0))


def test_cli_replays_a_fleet_and_refuses_an_unknown_router(tmp_path):
    path = write(tmp_path, count=30)
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(app, ["replay", str(path), "--no-tensors", "--router", "round-robin", "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert (out / "summary.csv").exists() and (out / "fleet-paged-16+prefix.png").exists()
    bad = runner.invoke(app, ["replay", str(path), "--no-tensors", "--router", "nearest", "--out", str(out)])
    assert bad.exit_code == 2
    assert bad.output.strip().splitlines() == ["kvsim: error: --router: unknown router policy 'nearest'; choose from "
                                               "random, round-robin, least-loaded, prefix-approx, prefix-precise"]


def test_cli_refuses_zero_replicas_and_one_replica_is_the_plain_replay(tmp_path):
    path = write(tmp_path, count=20)
    runner = CliRunner()
    bad = runner.invoke(app, ["replay", str(path), "--no-tensors", "--replicas", "0", "--out", str(tmp_path / "o")])
    assert bad.exit_code == 2 and bad.output.strip() == "kvsim: error: --replicas: must be >= 1, got 0"
    one = runner.invoke(app, ["replay", str(path), "--no-tensors", "--replicas", "1", "--out", str(tmp_path / "one"), "-q"])
    assert one.exit_code == 0, one.output
    assert "replica" not in pd.read_csv(tmp_path / "one" / "summary.csv").columns


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_watch_that_never_calls_a_miss_leaves_the_fleet_as_it_was_and_one_that_does_stops_it(tmp_path, async_scheduling):
    """`kvsim plan`'s watch: the rows after the last arrival run one at a time in time order instead of each
    replica to its end, which changes nothing; a target every request misses stops the replay early."""
    from kvsim.deployment.fleet import replay_config
    from kvsim.deployment.slo_watch import SloWatch
    from kvsim.replay.reports import output_tokens

    workload = load_workload(write(tmp_path, router={"policy": "prefix-precise"}, async_scheduling=async_scheduling,
                                   budget="320MiB", rate=200.0))
    result, ctx, requests, options = resolve_replay(workload, OPTIONS)
    config = workload.allocators[0]
    plain = replay_config(config, requests, ctx, options, 4, workload.router)
    watch = SloWatch((("ttft_p99_s", 1e6), ("tpot_p99_s", 1e6)), result.arrival_s, output_tokens(result))
    watched = replay_config(config, requests, ctx, options, 4, workload.router, watch=watch)
    assert watch.cut_at_s is None and watch.served == bytearray([1]) * len(requests)  # every request was served
    np.testing.assert_array_equal(plain.replica_of, watched.replica_of)
    for a, b in zip(plain.replicas, watched.replicas):
        for name in ("admitted_s", "first_token_s", "finished_s", "num_cached_tokens", "num_preemptions"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert a.steps.keys() == b.steps.keys()
        for name in a.steps:
            np.testing.assert_array_equal(a.steps[name], b.steps[name])
    ttft = plain.deployment.first_token_s - result.arrival_s
    target = float(np.percentile(ttft, 50)) / 2  # half the requests wait longer: a certain miss before the end
    strict = SloWatch((("ttft_p99_s", target),), result.arrival_s, output_tokens(result))
    assert replay_config(config, requests, ctx, options, 4, workload.router, watch=strict) is None
    assert strict.metric == "ttft_p99_s" and target < strict.lower_bound <= float(np.percentile(ttft, 99))
    assert strict.cut_at_s < float(np.nanmax(plain.deployment.finished_s))
    tpot = (plain.deployment.finished_s - plain.deployment.first_token_s) / (output_tokens(result) - 1)
    target = float(np.nanpercentile(tpot, 50)) / 2
    by_tpot = SloWatch((("ttft_p99_s", 1e6), ("tpot_p99_s", target)), result.arrival_s, output_tokens(result))
    assert replay_config(config, requests, ctx, options, 4, workload.router, watch=by_tpot) is None
    assert by_tpot.metric == "tpot_p99_s" and target < by_tpot.lower_bound <= float(np.nanpercentile(tpot, 99))
    assert by_tpot.cut_at_s < float(np.nanmax(plain.deployment.finished_s))
