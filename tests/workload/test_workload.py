"""Workload YAML: the shipped files load, every field is validated and every error names file and field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from kvsim.engine.factory import AllocatorConfig
from kvsim.errors import KvsimError
from kvsim.workload.spec import Deployment, SchedulerConfig, SyntheticRequests, TraceRequests, load_workload

WORKLOADS = sorted((REPO / "workloads").glob("*.yaml"))

BASE = {
    "name": "t",
    "seed": 0,
    "model": "qwen3-0.6b",
    "kv_dtype": "bf16",
    "hardware": "h100-80gb",
    "kv_budget": "4GiB",
    "max_model_len": 4096,
    "requests": {
        "count": 10,
        "arrival": {"process": "poisson", "rate": 10.0},
        "prompt_tokens": {"dist": "lognormal", "mean": 512, "sigma": 0.8, "min": 8, "max": 3072},
        "output_tokens": {"dist": "uniform", "min": 16, "max": 1024},
    },
    "allocators": [{"kind": "flat", "reserve": "max"}, {"kind": "paged", "block_size": 16}],
}


def write(tmp_path: Path, data: dict | str, name: str = "w.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def with_change(path: str, value) -> dict:
    """BASE with the field at dotted `path` set to `value` (or removed when value is ...)."""
    data = yaml.safe_load(yaml.safe_dump(BASE))
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return data


def test_every_workload_is_shipped():
    names = {p.stem for p in WORKLOADS}
    expected = {"poisson", "sharegpt-like", "alpaca-like", "shared-prefix", "bursty", "long-context",
                "sliding-window", "block-sizes", "trace"}
    assert expected <= names


@pytest.mark.parametrize("path", WORKLOADS, ids=lambda p: p.stem)
def test_shipped_workload_loads(path, tmp_path):
    trace = None
    if path.stem == "trace":
        trace = tmp_path / "t.csv"
        trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n")
    w = load_workload(path, trace=str(trace) if trace else None)
    assert w.name == path.stem and w.path == path and len(w.sha256) == 64
    assert w.allocators and (w.kv_budget_bytes is None) != (w.gpu_memory_utilization is None)
    # The names the replay will resolve exist in the catalogues (this module itself never checks them).
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu

    assert resolve_model(w.model) and get_gpu(w.hardware)


ISSUE_EXAMPLE = """\
name: poisson                # report folder name
seed: 0
model: qwen3-0.6b            # catalogue name, HF id, or a config.json path
kv_dtype: bf16
hardware: h100-80gb          # for the time model
kv_budget: 4GiB              # or: gpu_memory_utilization: 0.9 (weights subtracted)
max_model_len: 4096
requests:
  count: 2000                # or duration_s
  arrival: {process: poisson, rate: 10.0}          # gamma {rate, cv}; constant; burst {size, every_s}
  prompt_tokens: {dist: lognormal, mean: 512, sigma: 0.8, min: 8, max: 3072}
  output_tokens: {dist: uniform, min: 16, max: 1024} # constant, uniform, normal, lognormal, zipf, empirical
  shared_prefix: {groups: 4, tokens: 256, fraction: 0.5}   # optional
  # or instead of the above: trace: path/to/file.csv (+ optional time_scale, limit)
allocators:
  - {kind: flat, reserve: max}
  - {kind: flat, reserve: pow2}
  - {kind: flat, reserve: oracle}
  - {kind: paged, block_size: 16}
  - {kind: paged, block_size: 16, prefix_caching: true}
scheduler: {max_num_seqs: 256, max_num_batched_tokens: 8192, preemption: recompute, watermark: 0.01}
"""


def test_the_issue_example_loads_as_written(tmp_path):
    w = load_workload(write(tmp_path, ISSUE_EXAMPLE, "issue.yaml"))
    assert (w.name, w.seed, w.model, w.kv_dtype, w.hardware) == ("poisson", 0, "qwen3-0.6b", "bf16", "h100-80gb")
    assert w.kv_budget_bytes == 4 * 2**30 and w.gpu_memory_utilization is None and w.max_model_len == 4096
    r = w.requests
    assert isinstance(r, SyntheticRequests) and r.count == 2000 and r.duration_s is None
    assert (r.arrival.process, r.arrival.rate) == ("poisson", 10.0)
    assert (r.prompt_tokens.dist, r.prompt_tokens.mean, r.prompt_tokens.sigma) == ("lognormal", 512, 0.8)
    assert (r.prompt_tokens.min, r.prompt_tokens.max) == (8, 3072)
    assert (r.output_tokens.dist, r.output_tokens.min, r.output_tokens.max) == ("uniform", 16, 1024)
    assert (r.shared_prefix.groups, r.shared_prefix.tokens, r.shared_prefix.fraction) == (4, 256, 0.5)
    # its watermark 0.01 is not vLLM's default 0, so the paged labels name it
    assert [a.label for a in w.allocators] == ["flat-max", "flat-pow2", "flat-oracle", "paged-16-wm0.01", "paged-16-wm0.01+prefix"]
    assert w.scheduler == SchedulerConfig(256, 8192, "recompute", 0.01)


def test_shipped_poisson_is_the_issue_example_at_a_higher_rate(tmp_path):
    shipped = load_workload(REPO / "workloads" / "poisson.yaml")
    issue = load_workload(write(tmp_path, ISSUE_EXAMPLE, "issue.yaml"))
    assert shipped.requests.arrival.rate == 50.0
    same_rate = dataclasses.replace(shipped.requests, arrival=issue.requests.arrival)
    assert same_rate == issue.requests
    # ... and at vLLM's default watermark, 0
    issue_allocators = tuple(dataclasses.replace(a, watermark=0.0) for a in issue.allocators)
    issue_scheduler = dataclasses.replace(issue.scheduler, watermark=0.0)
    assert (shipped.allocators, shipped.scheduler, shipped.kv_budget_bytes) == (issue_allocators, issue_scheduler, issue.kv_budget_bytes)


def test_allocator_watermark_comes_from_the_scheduler_unless_set(tmp_path):
    data = with_change("scheduler", {"watermark": 0.05, "swap_space": "1GiB", "preemption": "swap"})
    data["allocators"] = [{"kind": "paged", "block_size": 8}, {"kind": "paged", "block_size": 32, "watermark": 0.0},
                          {"kind": "flat", "reserve": "oracle", "placement": "buddy"}]
    w = load_workload(write(tmp_path, data))
    assert w.allocators == (
        AllocatorConfig("paged", block_size=8, watermark=0.05),
        AllocatorConfig("paged", block_size=32, watermark=0.0),
        AllocatorConfig("flat", reserve="oracle", placement="buddy"),
    )
    assert w.scheduler.swap_space_bytes == 2**30 and w.scheduler.preemption == "swap"
    assert w.scheduler.max_num_seqs == 256  # defaults fill what is not given
    no_swap = load_workload(write(tmp_path, with_change("scheduler", {"swap_space": 0, "preemption": "swap"}), "no-swap.yaml"))
    assert no_swap.scheduler.swap_space_bytes == 0  # allowed: swap preemption then always recomputes


def test_overrides_seed_limit_and_defaults(tmp_path):
    data = with_change("seed", ...)
    del data["name"]
    w = load_workload(write(tmp_path, data, "my-job.yaml"), seed=7, limit=3)
    assert w.name == "my-job" and w.seed == 7 and w.requests.limit == 3
    assert load_workload(write(tmp_path, data, "my-job.yaml")).seed == 0


def test_gpu_memory_utilization_instead_of_budget(tmp_path):
    data = with_change("kv_budget", ...)
    data["gpu_memory_utilization"] = 0.9
    w = load_workload(write(tmp_path, data))
    assert w.kv_budget_bytes is None and w.gpu_memory_utilization == 0.9


def test_model_config_path_is_relative_to_the_yaml(tmp_path):
    (tmp_path / "sub").mkdir()
    w = load_workload(write(tmp_path / "sub", with_change("model", "../configs/config.json")))
    assert w.model == str((tmp_path / "configs" / "config.json").resolve())


def test_trace_forms(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n")
    short = with_change("requests", {"trace": "t.csv", "time_scale": 0.5, "limit": 9})
    assert load_workload(write(tmp_path, short)).requests == TraceRequests(trace, 0.5, 9)
    nested = with_change("requests", {"trace": {"path": "t.csv", "time_scale": 2}})
    assert load_workload(write(tmp_path, nested)).requests == TraceRequests(trace, 2.0, None)
    # --trace replaces a synthetic request stream, and fills a null path
    assert load_workload(write(tmp_path, BASE), trace=str(trace)).requests == TraceRequests(trace)
    null = with_change("requests", {"trace": {"path": None, "time_scale": 3.0}})
    assert load_workload(write(tmp_path, null), trace=str(trace), limit=4).requests == TraceRequests(trace, 3.0, 4)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("requests.arrival.rate", 0, "requests.arrival.rate: must be > 0"),
        ("requests.arrival.rate", "fast", "requests.arrival.rate: must be a number"),
        ("requests.arrival.process", "weibull", "requests.arrival.process: must be one of poisson"),
        ("requests.arrival.cv", 2.0, "requests.arrival: unknown field(s) cv"),
        ("requests.prompt_tokens.dist", "pareto", "requests.prompt_tokens.dist: must be one of constant"),
        ("requests.prompt_tokens.sigma", ..., "requests.prompt_tokens.sigma: is required"),
        ("requests.prompt_tokens.min", 0, "requests.prompt_tokens.min: must be >= 1"),
        ("requests.output_tokens.max", 8, "requests.output_tokens.max: must be >= 16"),
        ("requests.output_tokens.max", ..., "requests.output_tokens.max: is required"),
        ("requests.output_tokens", {"dist": "constant", "value": 4, "min": 8}, "requests.output_tokens.value: must be >= 8"),
        ("requests.output_tokens", {"dist": "constant", "value": 40, "max": 8}, "requests.output_tokens.value: must be <= max (8)"),
        ("requests.output_tokens", {"dist": "normal", "mean": 40, "sigma": 8}, "requests.output_tokens.std: is required (given here: dist, mean, sigma)"),
        ("requests.count", 2.5, "requests.count: must be a whole number"),
        ("requests.count", ..., "requests.count: give exactly one of count"),
        ("requests.shared_prefix", {"groups": 2, "tokens": 4096, "fraction": 0.5}, "requests.shared_prefix.tokens: must be < max_model_len"),
        ("requests.shared_prefix", {"groups": 2, "tokens": 8, "fraction": 1.5}, "requests.shared_prefix.fraction: must be <= 1"),
        ("requests.prompt_tokn", {}, "requests: unknown field(s) prompt_tokn"),
        ("kv_dtype", "fp64", "kv_dtype: unknown dtype 'fp64'"),
        ("kv_budget", "lots", "kv_budget: expected a byte size"),
        ("kv_budget", "0GiB", "kv_budget: byte size must be positive"),
        ("scheduler", {"swap_space": -1}, "scheduler.swap_space: byte size must be >= 0"),
        ("gpu_memory_utilization", 0.9, "kv_budget: give exactly one of kv_budget"),
        ("max_model_len", -1, "max_model_len: must be >= 1"),
        ("model", "", "model: must be a non-empty string"),
        ("hardware", ..., "hardware: is required"),
        ("name", "a/b", "name: must be a plain folder name"),
        ("seed", True, "seed: must be a whole number"),
        ("scheduler", {"preemption": "drop"}, "scheduler.preemption: must be one of recompute, swap"),
        ("scheduler", {"watermark": 1.0}, "scheduler.watermark: must be < 1"),
        ("scheduler", {"max_num_seqs": 0}, "scheduler.max_num_seqs: must be >= 1"),
        ("scheduler", {"max_num_seq": 8}, "scheduler: unknown field(s) max_num_seq"),
        ("allocators", [], "allocators: must be a non-empty list"),
        ("allocators", [{"kind": "buddy"}], "allocators[0].kind: must be one of flat, paged"),
        ("allocators", [{"kind": "paged", "block_size": 0}], "allocators[0].block_size: must be >= 1"),
        ("allocators", [{"kind": "flat", "prefix_caching": True}], "allocators[0]: unknown field(s) prefix_caching"),
        ("allocators", [{"kind": "paged", "reserve": "max"}], "allocators[0]: unknown field(s) reserve"),
        ("allocators", [{"kind": "paged", "prefix_caching": "yes"}], "allocators[0].prefix_caching: must be true or false"),
        ("allocators", [{"kind": "paged"}, {"kind": "paged", "block_size": 16}], "allocators[1]: duplicates an earlier allocator (paged-16)"),
        ("requests", {"trace": {"path": None}}, "requests.trace.path: no trace file here: give one with --trace FILE"),
        ("requests", {"trace": "missing.csv"}, "requests.trace: trace file not found"),
        ("requests", {"trace": "missing.csv", "time_scale": 0}, "requests.time_scale: must be > 0"),
        ("typo_field", 1, "unknown field(s) typo_field"),
        ("deployment", {"tp": 0}, "deployment.tp: must be >= 1"),
        ("deployment", {"tp": 1.5}, "deployment.tp: must be a whole number"),
        ("deployment", {"tp": 4, "ep": 2}, "deployment.ep: must be 1 or tp (4)"),
        ("deployment", {"tp": 2, "pp": 2}, "deployment: unknown field(s) pp"),
    ],
)
def test_each_error_names_file_and_field(tmp_path, field, value, message):
    path = write(tmp_path, with_change(field, value))
    with pytest.raises(KvsimError) as err:
        load_workload(path)
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_empirical_lengths_inline_and_from_file(tmp_path):
    (tmp_path / "lengths.txt").write_text("# prompt lengths\n100\n200, 3\n\n")
    data = with_change("requests.prompt_tokens", {"dist": "empirical", "file": "lengths.txt"})
    assert load_workload(write(tmp_path, data)).requests.prompt_tokens.values == (100, 200)
    assert load_workload(write(tmp_path, data)).requests.prompt_tokens.weights == (1.0, 3.0)
    bad = with_change("requests.prompt_tokens", {"dist": "empirical", "values": [1, 2], "weights": [1]})
    with pytest.raises(KvsimError, match="requests.prompt_tokens.weights: has 1 entries but values has 2"):
        load_workload(write(tmp_path, bad))
    (tmp_path / "bad.txt").write_text("100\nabc\n")
    data = with_change("requests.prompt_tokens", {"dist": "empirical", "file": "bad.txt"})
    with pytest.raises(KvsimError, match=r"bad.txt: line 2: expected 'length'"):
        load_workload(write(tmp_path, data))


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: [unclosed\n", "not valid YAML: "),
        ("name: a\n  seed: 1\n", "not valid YAML: "),
        ("- just\n- a list\n", "expected a mapping of fields"),
    ],
)
def test_malformed_yaml_is_one_clear_line(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(KvsimError) as err:
        load_workload(path)
    assert str(err.value).startswith(f"{path}: {message}") and "\n" not in str(err.value)


def test_numbers_written_the_yaml_1_1_way_are_accepted(tmp_path):
    # PyYAML reads 1e-2 and 2e3 as strings; they are still numbers to a user.
    text = yaml.safe_dump(with_change("scheduler", {"watermark": "1e-2"}))
    w = load_workload(write(tmp_path, text.replace("count: 10", "count: 2e3")))
    assert w.scheduler.watermark == 0.01 and w.requests.count == 2000


def test_missing_file_and_bad_overrides(tmp_path):
    with pytest.raises(KvsimError, match="nope.yaml: cannot read workload"):
        load_workload(tmp_path / "nope.yaml")
    path = write(tmp_path, BASE)
    with pytest.raises(KvsimError, match="--limit: must be a whole number >= 1"):
        load_workload(path, limit=0)
    with pytest.raises(KvsimError, match="--trace: trace file not found"):
        load_workload(path, trace=str(tmp_path / "none.csv"))


def test_list_items_are_named_by_index(tmp_path):
    bad = with_change("requests.prompt_tokens", {"dist": "empirical", "values": [10, "x"]})
    with pytest.raises(KvsimError, match=r"w.yaml: requests.prompt_tokens.values\[1\]: must be a whole number, got 'x'$"):
        load_workload(write(tmp_path, bad))
    bad = with_change("requests.prompt_tokens", {"dist": "empirical", "values": [10, 20], "weights": [1, -1]})
    with pytest.raises(KvsimError, match=r"requests.prompt_tokens.weights\[1\]: must be >= 0, got -1$"):
        load_workload(write(tmp_path, bad))


@pytest.mark.parametrize(
    "field, value, message",
    [
        # each was a traceback (numpy MemoryError, int64 overflow or a failed assert) before the bounds
        ("requests.count", 10**12, "requests.count: must be <= 10,000,000, got 1000000000000"),
        ("requests.count", 1e30, "requests.count: must be <= 10,000,000"),
        ("requests.count", 10**400, "requests.count: must be a whole number"),
        ("requests.shared_prefix", {"groups": 10**30, "tokens": 16, "fraction": 0.5}, "requests.shared_prefix.groups: must be <= 10,000,000"),
        ("requests.prompt_tokens", {"dist": "constant", "value": 10**30}, "requests.prompt_tokens.value: must be <= 16,777,216"),
        ("requests.prompt_tokens", {"dist": "zipf", "exponent": 1.1, "max": 10**12}, "requests.prompt_tokens.max: must be <= 16,777,216"),
        ("requests.prompt_tokens", {"dist": "empirical", "values": [10, 2**40]}, "requests.prompt_tokens.values[1]: must be <= 16,777,216"),
        ("requests.arrival", {"process": "gamma", "rate": 10, "cv": 1e-300}, "requests.arrival.cv: must be >= 1e-06, got 1e-300"),
        ("requests.arrival", {"process": "gamma", "rate": 10, "cv": 1e7}, "requests.arrival.cv: must be <= 1,000,000"),
        # arrivals past 1e9 s: an OverflowError (rate 1e-307, every_s 1e307), an AssertionError (gamma), or at rate
        # 1e-15 arrivals near 1e16 s, whose 2 s resolution swallowed every step: TTFT and TPOT p50 read 0
        ("requests.arrival", {"process": "poisson", "rate": 1e-307}, "requests.arrival.rate: 1e-307 requests/s puts "
         "the second request at 1e+307 s, past 1e+09 s, the latest arrival kvsim replays (beyond it a double does not "
         "resolve a step's time)"),
        ("requests.arrival", {"process": "burst", "size": 5, "every_s": 1e307}, "requests.arrival.every_s: 1e+307 s puts the second burst at 1e+307 s, past 1e+09 s"),
        ("requests.arrival", {"process": "gamma", "rate": 1e-307, "cv": 1e6}, "requests.arrival.rate: 1e-307 requests/s puts the second request"),
        ("requests.arrival", {"process": "poisson", "rate": 1e-15}, "requests.arrival.rate: 1e-15 requests/s puts the second request at 1e+15 s"),
        # 10 requests: the last one at 9 / rate, 9 // size x every_s
        ("requests.arrival", {"process": "poisson", "rate": 8e-9}, "requests.arrival.rate: 8e-09 requests/s puts the last of 10 requests at 1.12e+09 s on average, past 1e+09 s"),
        ("requests.arrival", {"process": "constant", "rate": 8e-9}, "requests.arrival.rate: 8e-09 requests/s puts the last of 10 requests at 1.12e+09 s, past"),
        ("requests.arrival", {"process": "burst", "size": 2, "every_s": 3e8}, "requests.arrival.every_s: 3e+08 s puts the last of 10 requests at 1.2e+09 s, past"),
    ],
)
def test_sizes_beyond_what_a_replay_can_hold_are_errors(tmp_path, field, value, message):
    path = write(tmp_path, with_change(field, value))
    with pytest.raises(KvsimError) as err:
        load_workload(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_a_duration_that_would_draw_too_many_requests_is_an_error(tmp_path):
    data = with_change("requests.count", ...)
    data["requests"]["duration_s"] = 1e12  # 10^13 arrivals at 10/s: was a 364 TiB numpy allocation
    with pytest.raises(KvsimError, match=r"requests.duration_s: 1e\+12 s at 10 requests/s is more than 10,000,000"):
        load_workload(write(tmp_path, data))
    data["requests"]["duration_s"] = 100.0
    assert load_workload(write(tmp_path, data)).requests.duration_s == 100.0


def test_arrivals_up_to_1e9_s_are_kept_and_a_draw_past_it_is_an_error(tmp_path):
    from kvsim.workload.requests import generate_requests

    # the last of 10 requests at exactly 1e9 s (9 // 2 = 4 bursts after the first)
    burst = generate_requests(load_workload(write(tmp_path, with_change("requests.arrival", {"process": "burst", "size": 2, "every_s": 2.5e8}))))
    assert [r.arrival_time for r in burst][-2:] == [1e9, 1e9]
    with pytest.raises(KvsimError, match=r"requests.duration_s: 2e\+09 s is past 1e\+09 s"):
        load_workload(write(tmp_path, {**BASE, "requests": {**with_change("requests.count", ...)["requests"], "duration_s": 2e9,
                                                            "arrival": {"process": "poisson", "rate": 1e-3}}}))
    # gamma's mean is within the bound, but a cv of 1000 makes rare gaps huge: seed 88 draws 2.45e11 s
    data = with_change("requests.arrival", {"process": "gamma", "rate": 1e-6, "cv": 1000})
    data["requests"]["count"] = 1000
    path = write(tmp_path, data)
    assert generate_requests(load_workload(path, seed=87))[-1].arrival_time < 1e9
    with pytest.raises(KvsimError) as err:
        generate_requests(load_workload(path, seed=88))
    assert str(err.value) == (f"{path}: requests.arrival.cv: seed 88 draws the last arrival at 2.45e+11 s, past 1e+09 s, "
                              "the latest arrival kvsim replays (a higher rate or a lower cv keeps the stream within it)")


def test_a_seed_beyond_2_to_the_53_is_kept_exactly(tmp_path):
    # Read through a float, 2**70 + 1 became 2**70: two different seeds gave the same stream.
    assert load_workload(write(tmp_path, with_change("seed", 2**70 + 1))).seed == 2**70 + 1


def test_unbounded_length_tails_stay_within_max_tokens(tmp_path):
    """A lognormal or normal without `max` and a huge mean overflowed int64 into negative lengths."""
    from kvsim.workload.distributions import MAX_TOKENS
    from kvsim.workload.requests import generate_requests

    data = with_change("requests.prompt_tokens", {"dist": "lognormal", "mean": 1e300, "sigma": 1})
    data["requests"]["output_tokens"] = {"dist": "normal", "mean": 1e30, "std": 1}
    requests = generate_requests(load_workload(write(tmp_path, data)))
    assert len(requests) == 10
    assert all(r.num_prompt_tokens == MAX_TOKENS and r.max_tokens == MAX_TOKENS for r in requests)


def test_an_unknown_top_level_key_is_named_before_what_it_hides(tmp_path):
    # `kv_budgett:` was reported as "give exactly one of kv_budget and gpu_memory_utilization".
    text = (REPO / "workloads" / "poisson.yaml").read_text().replace("kv_budget: 4GiB", "kv_budgett: 4GiB")
    path = tmp_path / "typo.yaml"
    path.write_text(text)
    with pytest.raises(KvsimError, match=r"unknown field\(s\) kv_budgett \(did you mean kv_budget\?\)") as err:
        load_workload(path)
    assert str(err.value).startswith(f"{path}: unknown field")


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_an_empty_workload_says_it_is_empty(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(KvsimError, match=r"empty\.yaml: the workload file is empty"):
        load_workload(path)


def test_deployment_defaults_to_one_gpu_and_reads_tp_and_ep(tmp_path):
    assert load_workload(write(tmp_path, BASE)).deployment == Deployment(tp=1, ep=1)
    assert load_workload(write(tmp_path, with_change("deployment", {"tp": 4}))).deployment == Deployment(tp=4, ep=1)
    assert load_workload(write(tmp_path, with_change("deployment", {"tp": 8, "ep": 8}))).deployment == Deployment(8, 8)


def test_prefix_cache_retention_interval_defaults_to_vllms_0_null_is_dense_and_bad_values_name_the_field(tmp_path):
    data = with_change("scheduler", {})
    data["allocators"] = [
        {"kind": "paged", "block_size": 16, "prefix_caching": True},
        {"kind": "paged", "block_size": 16, "prefix_caching": True, "prefix_cache_retention_interval": None},
        {"kind": "paged", "block_size": 16, "prefix_caching": True, "prefix_cache_retention_interval": 64},
    ]
    w = load_workload(write(tmp_path, data))
    assert [a.prefix_cache_retention_interval for a in w.allocators] == [0, None, 64]
    assert [a.label for a in w.allocators] == ["paged-16+prefix", "paged-16+prefix-dense", "paged-16+prefix-r64"]
    for bad, says in ((24, "multiple of the block size"), (-16, ">= 0"), ("dense", "number")):
        data["allocators"] = [{"kind": "paged", "block_size": 16, "prefix_cache_retention_interval": bad}]
        with pytest.raises(KvsimError, match=r"w\.yaml: allocators\[0\]\.prefix_cache_retention_interval") as err:
            load_workload(write(tmp_path, data))
        assert says in str(err.value) or bad == "dense", str(err.value)


def test_async_scheduling_is_on_unless_the_file_turns_it_off(tmp_path):
    """vllm serve 0.33 schedules asynchronously by default (`--async-scheduling`); a workload does too, and
    `scheduler: {async_scheduling: false}` keeps the synchronous loop."""
    assert load_workload(write(tmp_path, BASE)).scheduler.async_scheduling is True
    assert SchedulerConfig().async_scheduling is True
    assert load_workload(write(tmp_path, with_change("scheduler", {"max_num_seqs": 8}))).scheduler.async_scheduling is True
    sync = load_workload(write(tmp_path, with_change("scheduler", {"async_scheduling": False})))
    assert sync.scheduler.async_scheduling is False and sync.scheduler.max_num_seqs == 256
    with pytest.raises(KvsimError, match="scheduler.async_scheduling"):
        load_workload(write(tmp_path, with_change("scheduler", {"async_scheduling": "sometimes"})))


def test_prefix_caching_left_out_is_vllm_serves_and_mamba_cache_mode_is_its_vllm_name(tmp_path):
    """Absent, `prefix_caching` is None (vllm serve's default for the model, resolved by the replay);
    `mamba_cache_mode` align / none is prefix caching on / off, and contradicting `prefix_caching` is refused."""
    data = with_change("scheduler", {"watermark": 0.0})
    data["allocators"] = [{"kind": "paged"}, {"kind": "paged", "mamba_cache_mode": "none"},
                          {"kind": "paged", "block_size": 32, "mamba_cache_mode": "align", "mamba_checkpoint_alignment": 64}]
    w = load_workload(write(tmp_path, data))
    assert [(a.prefix_caching, a.mamba_checkpoint_alignment) for a in w.allocators] == [(None, None), (False, None), (True, 64)]
    data["allocators"] = [{"kind": "paged", "mamba_cache_mode": "none", "prefix_caching": True}]
    with pytest.raises(KvsimError, match=r"allocators\[0\]\.mamba_cache_mode: none contradicts prefix_caching: true"):
        load_workload(write(tmp_path, data))
