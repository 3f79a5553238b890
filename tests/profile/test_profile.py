"""`kvsim profile`: the request-stream loop checked by hand on a fake device, and the command on CPU and CUDA."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from kvsim.engine.factory import AllocatorConfig, make_allocator
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.profile.stream import PagedPool, PerRequestTensors, replay_stream
from kvsim.workload.requests import RequestSpec

# One layer, one KV head of dim 1, bf16: 2 (K, V) x 2 bytes = 4 bytes per token.
BYTES_PER_TOKEN = 4


def spec(block_size: int = 2) -> KVCacheSpec:
    return KVCacheSpec.uniform(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size)


class FakeDevice:
    """A device of `limit` bytes whose `empty` raises torch's OOM error like the caching allocator would."""

    def __init__(self, limit: int):
        self.limit, self.used, self.calls = limit, 0, 0

    def empty(self, nbytes: int):
        self.calls += 1
        if self.used + nbytes > self.limit:
            raise torch.OutOfMemoryError(f"tried to allocate {nbytes} bytes")
        return _Buffer(self, nbytes)


class _Buffer:
    def __init__(self, device: FakeDevice, nbytes: int):
        self.device, self.nbytes = device, nbytes
        device.used += nbytes

    def __del__(self):
        self.device.used -= self.nbytes


def requests(*lengths: tuple[int, int]) -> list[RequestSpec]:
    return [RequestSpec(i, 0.0, prompt, out) for i, (prompt, out) in enumerate(lengths)]


def run(reqs, backend, **kw):
    options = dict(bytes_per_token=BYTES_PER_TOKEN, max_num_seqs=8, step_s=0.02, sample_every=1) | kw
    return replay_stream(reqs, backend, **options)


def test_per_request_tensors_count_admissions_before_the_first_oom():
    # oracle reserve: 3 + 3 - 1 = 5, 2 + 3 - 1 = 4 and 4 + 2 - 1 = 5 tokens = 20, 16 and 20 bytes on a 40-byte device
    device = FakeDevice(40)
    flat = make_allocator(AllocatorConfig("flat", reserve="oracle"), spec(), 400, max_model_len=100)
    rows, totals = run(requests((3, 3), (2, 3), (4, 2)), PerRequestTensors(flat, device.empty))
    # step 0: r0 and r1 fit (36 bytes), r2 raises OOM; step 1: both finish, nothing retried meanwhile; step 2: r2 runs
    assert totals["admitted_before_first_oom"] == 2 and totals["first_oom_step"] == 0
    assert (totals["ooms"], totals["admissions"], totals["finished"], totals["steps"]) == (1, 3, 3, 3)
    assert device.calls == 4  # one failed attempt, not one per blocked step
    assert totals["peak_running"] == 2 and totals["mean_running"] == pytest.approx(5 / 3)
    assert device.used == 0  # every tensor was freed
    assert [(r["step"], r["running"], r["waiting"], r["kv_in_use_bytes"]) for r in rows] == [
        (0, 2, 1, 36),  # sampled after the step's decode token
        (1, 0, 1, 0),
        (2, 0, 0, 0),
    ]
    # token bytes after step 0: r0 holds 3 + 1 tokens, r1 2 + 1
    assert rows[0]["token_bytes"] == (4 + 3) * BYTES_PER_TOKEN


def test_max_reserve_holds_max_model_len_per_request():
    device = FakeDevice(1000)
    flat = make_allocator(AllocatorConfig("flat", reserve="max"), spec(), 1000, max_model_len=100)
    rows, totals = run(requests((3, 3), (2, 3), (4, 2)), PerRequestTensors(flat, device.empty))
    assert rows[0]["kv_in_use_bytes"] == 2 * 100 * BYTES_PER_TOKEN  # 400 each: only two fit in 1000 bytes
    assert totals["admitted_before_first_oom"] == 2


def test_a_request_that_can_never_fit_is_rejected_not_waited_for():
    device = FakeDevice(10**6)
    flat = make_allocator(AllocatorConfig("flat", reserve="oracle"), spec(), 400, max_model_len=8)
    _, totals = run(requests((6, 5), (2, 1)), PerRequestTensors(flat, device.empty))  # 6 + 5 - 1 = 10 tokens > max_model_len 8
    assert (totals["rejected"], totals["finished"], totals["ooms"]) == (1, 1, 0)


def test_an_oom_on_an_idle_device_rejects_the_request():
    # the flat budget admits 3 + 2 - 1 = 4 tokens, 16 bytes; the device holds 12: the first request can never be
    # allocated; the second (1 + 1 - 1 = 1 token) finishes at its prefill
    device = FakeDevice(12)
    flat = make_allocator(AllocatorConfig("flat", reserve="oracle"), spec(), 400, max_model_len=100)
    _, totals = run(requests((3, 2), (1, 1)), PerRequestTensors(flat, device.empty))
    assert (totals["ooms"], totals["rejected"], totals["finished"]) == (1, 1, 1)
    assert totals["admitted_before_first_oom"] == 0


def test_paged_pool_preempts_instead_of_failing_allocations():
    # 48 bytes of 8-byte blocks (block_size 2) = 6 blocks, 5 usable (block 0 is the null block), no watermark
    device = FakeDevice(48)
    paged = make_allocator(AllocatorConfig("paged", block_size=2, watermark=0.0), spec(), 48, max_model_len=100)
    backend = PagedPool(paged, 48, device.empty)
    assert device.used == 48 and device.calls == 1  # the whole budget, once
    rows, totals = run(requests((3, 4), (3, 3)), backend)  # KV for 3 + 4 - 1 = 6 and 3 + 3 - 1 = 5 tokens
    # step 0: both admitted with 2 blocks each, both grow to 4 tokens in place;
    # step 1: r0 takes the last block, r1 cannot grow -> preempted (recompute 4 tokens);
    # step 2: r1 re-admitted (2 blocks), r0 finishes but frees only after the step, so r1 is preempted again;
    # step 3: r1 re-admitted, grows into a third block, finishes.
    assert (totals["preemptions"], totals["admissions"], totals["finished"], totals["steps"]) == (2, 4, 2, 4)
    assert totals["ooms"] == 0 and totals["admitted_before_first_oom"] is None
    assert [r["kv_in_use_bytes"] for r in rows] == [4 * 8, 3 * 8, 0, 0]
    assert paged.num_free_blocks == 5 and device.calls == 1


def test_profile_on_cpu_says_it_needs_cuda_in_one_line(cli):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = cli(["profile", "workloads/poisson.yaml"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA device" in lines[0]


@pytest.mark.parametrize(
    ("args", "field"),
    [(["--settings", ""], "--settings"), (["--settings", "default,huge"], "--settings"), (["--block-size", "0"], "--block-size")],
)
def test_profile_rejects_bad_options_in_one_line_before_looking_for_cuda(cli, args, field):
    result = cli(["profile", "workloads/poisson.yaml", *args])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], result.output


TINY_WORKLOAD = """
name: tiny-profile
seed: 1
model: qwen3-0.6b
kv_dtype: bf16
hardware: h100-80gb
kv_budget: 512MiB
max_model_len: 2048
requests:
  count: 60
  arrival: {process: poisson, rate: 200.0}
  prompt_tokens: {dist: uniform, min: 64, max: 1024}
  output_tokens: {dist: uniform, min: 16, max: 256}
allocators:
  - {kind: paged, block_size: 16}
"""


def test_each_child_gets_its_allocator_settings_under_both_variable_names():
    from kvsim.profile.run import child_env

    inherited = {"PATH": "/bin", "PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "x"}
    # newer torch reads PYTORCH_ALLOC_CONF first: an inherited one would turn the default run into an expandable one
    assert child_env("default", inherited) == {"PATH": "/bin"}
    env = child_env("expandable", {"PATH": "/bin", "PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert env == {"PATH": "/bin", "PYTORCH_ALLOC_CONF": "expandable_segments:True",
                   "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # fmt: skip


class FakeCudaAllocator:
    """torch.cuda as the profile's child uses it, on the CPU: `torch.empty(n, device="cuda")` counts n bytes
    against the memory fraction and raises torch's OOM error past it; memory_stats has torch's documented keys."""

    TOTAL = 80 * 2**30

    def __init__(self):
        self.fraction, self.allocated, self.peak, self.ooms, self.history = 1.0, 0, 0, 0, []

    def install(self, monkeypatch):
        import weakref

        real_empty = torch.empty

        def empty(*size, device=None, **kwargs):
            if str(device) != "cuda":
                return real_empty(*size, device=device, **kwargs)
            (nbytes,) = size
            if self.allocated + nbytes > self.fraction * self.TOTAL:
                self.ooms += 1
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")
            self.allocated += nbytes
            self.peak = max(self.peak, self.allocated)
            tensor = real_empty(0, dtype=torch.uint8)
            weakref.finalize(tensor, self._free, nbytes)
            return tensor

        def set_fraction(fraction, device=None):
            assert isinstance(fraction, float) and 0 <= fraction <= 1
            self.fraction = fraction

        props = type("Props", (), {"total_memory": self.TOTAL, "name": "Fake GPU"})()
        for name, value in dict(is_available=lambda: True, get_device_properties=lambda device=None: props,
                                set_per_process_memory_fraction=set_fraction, memory_stats=self.memory_stats,
                                get_device_name=lambda device=None: "Fake GPU 80GB").items():  # fmt: skip
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **kw: self.history.append((a, kw)))
        monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: Path(path).write_bytes(b"snapshot"))
        monkeypatch.setattr(torch, "empty", empty)

    def _free(self, nbytes):
        self.allocated -= nbytes

    def memory_stats(self, device=None) -> dict:
        stats = {}
        for family in ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                       "active_bytes", "inactive_split_bytes", "requested_bytes"):  # fmt: skip
            for pool in ("all", "large_pool", "small_pool"):
                for metric in ("current", "peak", "allocated", "freed"):
                    stats[f"{family}.{pool}.{metric}"] = 0
        for pool in ("all", "large_pool"):
            for family in ("allocated_bytes", "reserved_bytes", "requested_bytes"):
                stats[f"{family}.{pool}.current"], stats[f"{family}.{pool}.peak"] = self.allocated, self.peak
        stats.update(num_alloc_retries=self.ooms, num_ooms=self.ooms, num_sync_all_streams=0, num_device_alloc=0,
                     num_device_free=0, max_split_size=-1)  # fmt: skip
        return stats


def test_profile_runs_its_children_end_to_end_on_a_fake_cuda(tmp_path, monkeypatch):
    # The parent and each child (run in-process here) on a fake CUDA: the job JSON, the allocator settings
    # handed down, the memory-stat keys, the totals, the CSVs, the chart and the snapshots all exercised.
    import json
    import subprocess

    import matplotlib.pyplot  # noqa: F401  (imported before subprocess.run is faked: a first import runs fc-list)

    import kvsim.profile.run as profile

    gpu = FakeCudaAllocator()
    gpu.install(monkeypatch)
    envs = []

    def run(argv, env, capture_output, text):
        assert argv[1:3] == ["-m", "kvsim.profile.run"]
        envs.append({k: env.get(k) for k in profile.ALLOC_CONF_VARS})
        gpu.fraction, gpu.allocated, gpu.peak, gpu.ooms = 1.0, 0, 0, 0  # a fresh process
        profile._run_job(json.loads(argv[3]))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(profile.subprocess, "run", run)
    path = tmp_path / "tiny.yaml"
    path.write_text(textwrap.dedent(TINY_WORKLOAD))
    timeline, summary, out = profile.run_profile(path, reserve="max", out_dir=tmp_path / "out", snapshot=True)
    assert envs == [{"PYTORCH_ALLOC_CONF": None, "PYTORCH_CUDA_ALLOC_CONF": None}] * 2 + [
        {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}] * 2
    assert (summary["status"] == "ok").all(), summary["status"].tolist()
    assert list(summary["mode"]) == ["per-request", "paged-pool"] * 2 and (summary["device"] == "Fake GPU 80GB").all()
    per_request, paged = summary[summary["mode"] == "per-request"], summary[summary["mode"] == "paged-pool"]
    # 2048 tokens x 114688 B = 224 MiB per request under a 512 MiB (+2 MiB) fraction: two fit, the third raises
    assert (per_request["admitted_before_first_oom"] == 2).all() and (per_request["torch_num_ooms"] >= 1).all()
    assert (paged["ooms"] == 0).all() and (paged["finished"] == 60).all()
    assert (paged["peak_reserved_bytes"] == 512 * 2**20).all()
    assert {"memory_allocated", "memory_reserved", "inactive_split_bytes", "num_alloc_retries", "num_ooms"} <= set(timeline)
    assert (out / "timeline.csv").is_file() and (out / "summary.csv").is_file() and (out / "memory.png").is_file()
    assert sorted(p.name for p in out.glob("snapshot-*.pickle")) == [
        f"snapshot-{s}-{m}.pickle" for s in ("default", "expandable") for m in ("paged-pool", "per-request")]
    assert gpu.history[-1] == ((), {"enabled": None})  # recording stopped after each dump


def test_a_memory_stat_torch_does_not_have_fails_the_child_instead_of_reading_zero(tmp_path, monkeypatch):
    import json
    import subprocess

    import matplotlib.pyplot  # noqa: F401  (imported before subprocess.run is faked: a first import runs fc-list)

    import kvsim.profile.run as profile

    gpu = FakeCudaAllocator()
    gpu.install(monkeypatch)
    monkeypatch.setitem(profile.TORCH_STATS, "num_ooms", "num_oom_errors")  # a renamed key
    failures = []

    def run(argv, env, capture_output, text):
        gpu.fraction, gpu.allocated, gpu.peak, gpu.ooms = 1.0, 0, 0, 0  # a fresh process
        try:
            profile._run_job(json.loads(argv[3]))
        except KeyError as exc:
            failures.append(exc)
            return subprocess.CompletedProcess(argv, 1, "", f"KeyError: {exc}")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(profile.subprocess, "run", run)
    path = tmp_path / "tiny.yaml"
    path.write_text(textwrap.dedent(TINY_WORKLOAD))
    _, summary, _ = profile.run_profile(path, settings=("default",), out_dir=tmp_path / "out")
    assert len(failures) == 2 and summary["status"].str.contains("num_oom_errors").all()


@pytest.mark.gpu
def test_profile_on_cuda_runs_both_modes_under_both_settings(tmp_path):
    from kvsim.profile.run import run_profile

    path = tmp_path / "tiny.yaml"
    path.write_text(textwrap.dedent(TINY_WORKLOAD))
    timeline, summary, out = run_profile(path, reserve="max", out_dir=tmp_path / "out", snapshot=True)
    assert (summary["status"] == "ok").all(), summary["status"].tolist()
    assert len(summary) == 4 and (out / "timeline.csv").is_file() and (out / "memory.png").is_file()
    assert len(list(out.glob("snapshot-*.pickle"))) == 4
    per_request = summary[summary["mode"] == "per-request"]
    paged = summary[summary["mode"] == "paged-pool"]
    # 2048 tokens x 114688 B = 224 MiB per request: only two fit in 512 MiB, so the third raised OOM
    assert (per_request["admitted_before_first_oom"] == 2).all() and (per_request["torch_num_ooms"] >= 1).all()
    assert (paged["ooms"] == 0).all() and (paged["finished"] == 60).all()
    # reserved memory stays within the budget plus one rounding unit: 2 MiB blocks by default; expandable segments
    # map the large pool in 20 MiB pages (the memory fraction is checked before the rounding)
    slack = summary["setting"].map({"default": 2 * 2**20, "expandable": 20 * 2**20})
    assert (summary["peak_reserved_bytes"] <= 512 * 2**20 + slack).all(), summary[["setting", "mode", "peak_reserved_bytes"]]


def test_the_summary_table_fits_80_columns_with_every_figure():
    # A piped log is 80 columns wide: the four runs' figures must all show whole, never cut to "…".
    import pandas as pd
    from rich.console import Console

    from kvsim.profile.run import profile_table

    run = dict(admitted_before_first_oom=9.0, ooms=1974, num_alloc_retries=1974, preemptions=0, peak_running=9,
               mean_running=8.953, peak_reserved_bytes=4227858432, peak_inactive_split_bytes=0, sim_time_s=2298.94)
    pool = dict(run, admitted_before_first_oom=float("nan"), ooms=0, num_alloc_retries=0, preemptions=1903,
                peak_running=68, mean_running=42.62, peak_reserved_bytes=4294967296, sim_time_s=483.82)
    summary = pd.DataFrame([dict(setting=s, mode=m, status="ok", **r) for s in ("default", "expandable")
                            for m, r in (("per-request", run), ("paged-pool", pool))])
    summary.loc[3, "status"] = "error: CUDA out of memory"
    console = Console(width=80, record=True)
    console.print(profile_table(summary))
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    lines = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]] for line in text.splitlines()
             if line.startswith("│")}
    assert lines["admitted before OOM"] == ["9", "no OOM", "9", "-"]
    assert lines["OOMs"] == ["1974", "0", "1974", "-"] and lines["preemptions"] == ["0", "1903", "0", "-"]
    assert lines["peak reserved"] == ["3.9 GiB", "4.0 GiB", "3.9 GiB", "-"]
    assert lines["sim time (s)"] == ["2299", "484", "2299", "-"] and lines["mean running"][:2] == ["9.0", "42.6"]
    assert lines["status"][:3] == ["ok", "ok", "ok"] and "error: CUDA" in lines["status"][3]  # a failed run says why
    assert text.count("expandable") == 2 and text.count("paged-pool") == 2
