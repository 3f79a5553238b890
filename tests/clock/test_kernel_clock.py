"""The kernels-db clock: its step times against aiconfigurator's own estimates for the same shapes, its decode
runs against single steps, errors naming what the database lacks, and replays on it (skipped without the extra)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvsim.clock import kernels_db as kc
from kvsim.models.catalogue import resolve_model
from kvsim.errors import KvsimError
from kvsim.models.hardware import get_gpu

needs_db = pytest.mark.skipif(not kc.available(), reason="aiconfigurator-core (the perfdb extra) is not installed")


def test_closest_version_picks_the_nearest_release():
    assert kc.closest_version(["0.14.0", "0.24.0"], "0.33.0") == "0.24.0"
    assert kc.closest_version(["0.14.0", "0.24.0", "0.27.0"], "0.33.0") == "0.27.0"
    assert kc.closest_version(["0.30.0", "0.36.0"], "0.33.0") == "0.36.0"  # a tie goes to the newer
    assert kc.closest_version(["0.1.dev19262", "0.14.0"], "0.33.0") == "0.14.0"


def test_without_the_extra_the_error_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(kc, "available", lambda: False)
    with pytest.raises(KvsimError, match=r"pip install 'kvsim\[perfdb\]'"):
        kc.kernel_clock(resolve_model("llama-3.1-8b"), get_gpu("h100-80gb"))


def _seq(computed: int):
    return SimpleNamespace(num_computed_tokens=computed)


def _out(prefills=(), decodes=()):
    """A SchedulerOutput's shape: prefills as (seq, start, num), decodes as sequences."""
    return SimpleNamespace(prefills=[(None, s, n) for s, n in prefills], decodes=[_seq(c) for c in decodes])


@pytest.fixture(scope="module")
def llama():
    if not kc.available():
        pytest.skip("aiconfigurator-core (the perfdb extra) is not installed")
    return kc.kernel_clock(resolve_model("llama-3.1-8b"), get_gpu("h100-80gb"))


@needs_db
def test_picks_the_database_version_closest_to_the_followed_vllm(llama):
    assert llama.system == "h100_sxm"
    assert llama.vllm_version == kc.closest_version(kc.database_versions("h100_sxm"))
    assert f"vLLM {llama.vllm_version}" in llama.label


@needs_db
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_a_static_prefill_step_is_the_sdks_context_phase(llama, batch):
    """B prompts of 1024 tokens in one step take what the SDK's static mode says its context phase takes."""
    context_ms, _, _ = llama._handle.run_static(batch_size=batch, isl=1024, osl=2)
    assert llama.output_time(_out(prefills=[(0, 1024)] * batch)) == pytest.approx(context_ms * 1e-3, rel=1e-9)


@needs_db
def test_a_decode_step_is_the_sdks_generation_ops_at_that_shape(llama):
    """A decode-only step of 16 requests at 2047 computed tokens: every generation op at batch 16, s = 2048."""
    ops = llama._handle.evaluate_generation_ops(list(range(14)), batch_size=16, s=2048)
    assert len(ops) == 14 and ops[-1][0] == "generation_p2p"  # the whole op list of the Llama family
    expected = sum(op[1] for op in ops) * 1e-3
    assert llama.output_time(_out(decodes=[2047] * 16)) == pytest.approx(expected, rel=1e-9)


@needs_db
def test_attention_grows_with_context_and_gemms_with_tokens(llama):
    short, long = llama.output_time(_out(decodes=[100] * 8)), llama.output_time(_out(decodes=[8000] * 8))
    assert long > short
    assert llama.prefill_shared_ms(4096, 1) > 3 * llama.prefill_shared_ms(1024, 1)  # compute-bound GEMMs
    # Two different chunks cost their own attention each; the same chunk twice is one batched query.
    mixed = llama.output_time(_out(prefills=[(0, 512), (512, 512)], decodes=[300]))
    assert mixed > llama.output_time(_out(prefills=[(0, 512)], decodes=[300]))


@needs_db
@pytest.mark.parametrize("num_seqs,ctx_each,steps", [(1, 10, 1), (4, 500, 2), (32, 1000, 97), (128, 3000, 256)])
def test_a_decode_run_is_the_sum_of_its_steps(llama, num_seqs, ctx_each, steps):
    """The closed-form run (Simpson over attention) against stepping one decode at a time: within 0.1%."""
    stepped = sum(llama.output_time(_out(decodes=[ctx_each + j] * num_seqs)) for j in range(steps))
    assert llama.decode_run(num_seqs, ctx_each * num_seqs, steps) == pytest.approx(stepped, rel=1e-3)


@needs_db
def test_decode_steps_before_stops_at_the_next_arrival(llama):
    one = llama.decode_run(8, 8 * 100, 1)
    k, total = llama.decode_steps_before(8, 8 * 100, 256, time_left=10.5 * one)
    assert llama.decode_run(8, 800, k - 1) < 10.5 * one <= llama.decode_run(8, 800, k)  # step k-1 starts in time
    assert total == llama.decode_run(8, 800, k)
    assert llama.decode_steps_before(8, 800, 256, time_left=np.inf)[0] == 256


@needs_db
def test_what_the_database_lacks_is_a_one_line_error():
    with pytest.raises(KvsimError, match="A100 40GB.*not in aiconfigurator-core's database") as exc:
        kc.kernel_clock(resolve_model("llama-3.1-8b"), get_gpu("a100-40gb"))
    assert "\n" not in str(exc.value)
    with pytest.raises(KvsimError, match="no model config for Qwen/Qwen3-Next-80B-A3B"):
        kc.kernel_clock(resolve_model("qwen3-next-80b-a3b"), get_gpu("h100-80gb"))


@needs_db
@pytest.mark.parametrize("hardware", ["h100-80gb", "h200", "b200", "l40s", "a100-80gb"])
def test_every_mapped_gpu_has_a_clock(hardware):
    clock = kc.kernel_clock(resolve_model("qwen3-0.6b"), get_gpu(hardware))
    assert clock.system == kc.SYSTEMS[hardware]
    assert 0 < clock.decode_run(8, 8 * 512, 1) < 1.0


TINY_MODEL = """\
name: kdb
seed: 1
model: qwen3-0.6b
kv_dtype: bf16
hardware: {hardware}
kv_budget: 512MiB
max_model_len: 2048
requests:
  count: 120
  arrival: {{process: poisson, rate: 40.0}}
  prompt_tokens: {{dist: uniform, min: 16, max: 900}}
  output_tokens: {{dist: uniform, min: 4, max: 300}}
allocators:
  - {{kind: flat, reserve: max}}
  - {{kind: paged, block_size: 16}}
scheduler: {{max_num_seqs: 32, max_num_batched_tokens: 1024, preemption: recompute}}
"""


def _workload(tmp_path, hardware="h100-80gb"):
    from kvsim.workload.spec import load_workload

    path = tmp_path / "kdb.yaml"
    path.write_text(TINY_MODEL.format(hardware=hardware))
    return load_workload(path)


@needs_db
def test_a_replay_on_the_clock_is_deterministic_and_named(tmp_path):
    from kvsim.replay.run import run_replay
    from kvsim.replay.options import ReplayOptions
    from kvsim.replay.reports import meta, summary_frame

    workload = _workload(tmp_path)
    options = ReplayOptions(tensors=False, timing="kernels-db")
    first, second = run_replay(workload, options, workers=1), run_replay(workload, options, workers=2)
    assert summary_frame(first).equals(summary_frame(second))
    assert meta(first)["clock"].startswith("kernels-db (aiconfigurator-core") and "h100_sxm" in meta(first)["clock"]
    roofline = run_replay(workload, ReplayOptions(tensors=False), workers=1)
    assert meta(roofline)["clock"] == "roofline"
    for run, fast in zip(first.runs, roofline.runs):  # every request finishes on either clock
        assert np.isfinite(run.finished_s).all() and np.isfinite(fast.finished_s).all()
        assert run.steps["step_time_s"].sum() != pytest.approx(fast.steps["step_time_s"].sum())


@needs_db
def test_auto_falls_back_to_the_roofline_and_says_why(tmp_path):
    from kvsim.replay.run import run_replay
    from kvsim.replay.options import ReplayOptions

    workload = _workload(tmp_path, hardware="mi300x")
    with pytest.raises(KvsimError, match=r"kdb.yaml: hardware: AMD Instinct MI300X: not in aiconfigurator"):
        run_replay(workload, ReplayOptions(tensors=False, timing="kernels-db"))
    result = run_replay(workload, ReplayOptions(tensors=False, timing="auto"), workers=1)
    assert result.clock == "roofline (kernels-db does not apply)"
    assert "roofline clock: the kernels-db clock does not apply" in result.note and "MI300X" in result.note


def test_size_imports_no_database_unless_the_step_time_is_asked_for():
    from test_import_time import HEAVY, imported_modules

    modules, proc = imported_modules(["-m", "kvsim", "size", "-m", "qwen3-0.6b", "--gpu", "h100-80gb"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not modules & {*HEAVY, "aiconfigurator_core", "scipy"}, modules & {*HEAVY, "aiconfigurator_core", "scipy"}


@needs_db
def test_size_step_time_line(cli, llama):
    result = cli(["size", "-m", "llama-3.1-8b", "--gpu", "h100-80gb", "--context", "4096", "--step-time"])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("decode step at "))
    num_seqs = int(line.split()[3].replace(",", ""))
    assert num_seqs > 100  # ~70 GiB of KV at 128 KiB/token over 4,096 tokens: 114 requests
    expected_ms = llama.decode_run(num_seqs, num_seqs * 4095, 1) * 1e3
    assert f"{expected_ms:.2f} ms" in line and "h100_sxm" in line
    result = cli(["size", "-m", "llama-3.1-8b", "--memory", "80GiB", "--step-time"])
    assert result.exit_code == 2 and "--step-time: needs --gpu" in result.output


@needs_db
def test_an_fp8_kv_cache_takes_the_databases_fp8_attention(llama):
    fp8 = kc.kernel_clock(resolve_model("llama-3.1-8b"), get_gpu("h100-80gb"), kv_dtype="fp8")
    assert fp8.decode_attention_ms(64, 4096) < 0.8 * llama.decode_attention_ms(64, 4096)  # half the bytes to read
    assert fp8.decode_shared_ms(64) == llama.decode_shared_ms(64)  # the GEMMs do not change
    with pytest.raises(KvsimError, match="kv_dtype: the database times no attention kernel with a fp32 KV cache"):
        kc.kernel_clock(resolve_model("llama-3.1-8b"), get_gpu("h100-80gb"), kv_dtype="fp32")
    with pytest.raises(KvsimError, match=r"a100_sxm: aiconfigurator-core cannot time it \(PerfDataNotAvailableError"):
        kc.kernel_clock(resolve_model("llama-3.1-8b"), get_gpu("a100-80gb"), kv_dtype="fp8")


@needs_db
def test_the_latency_chart_names_the_clock(tmp_path):
    pytest.importorskip("matplotlib")
    from kvsim.plots.latency import latency
    from kvsim.plots.report import load_report
    from kvsim.replay.run import run_replay
    from kvsim.replay.options import ReplayOptions
    from kvsim.replay.reports import write_reports

    result = run_replay(_workload(tmp_path), ReplayOptions(tensors=False, timing="kernels-db"), workers=1)
    write_reports(result, tmp_path / "out", command="test")
    fig = latency(load_report(tmp_path / "out"))
    assert fig.kvsim_subtitle.endswith(f" · clock {result.clock}") and "h100_sxm, vLLM " in result.clock


@needs_db
def test_size_step_time_errors_name_the_flag(cli):
    result = cli(["size", "-m", "llama-3.1-8b", "--gpu", "l4", "--context", "4096", "--step-time"])
    assert result.exit_code == 2 and "--gpu: NVIDIA L4: not in aiconfigurator-core's database" in result.output
    result = cli(["size", "-m", "llama-3.1-8b", "--gpu", "h100-80gb", "--kv-dtype", "fp32", "--step-time"])
    assert result.exit_code == 2 and "--kv-dtype: the database times no attention kernel with a fp32" in result.output
