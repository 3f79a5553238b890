"""Whole replays of tiny workloads: every request accounted for, preemption, determinism, tensors vs accounting."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from kvsim.replay.run import run_replay
from kvsim.replay.options import ReplayOptions
from kvsim.workload.spec import load_workload

BYTE_COLUMNS = (
    "token_states_bytes", "reservation_bytes", "internal_fragmentation_bytes",
    "external_fragmentation_bytes", "free_bytes", "shared_saved_bytes",
)

# A 2-layer model with 2 KV heads of 16: 256 bytes of KV per token, so tensors stay tiny and fast on a CPU.
TINY_MODEL = """\
{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
 "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 1000,
 "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}
"""
BPT = 256
TINY = """\
name: tiny
seed: 3
model: tiny-model.json
kv_dtype: bf16
hardware: h100-80gb
kv_budget: {budget}
max_model_len: 512
requests:
  count: {count}
  arrival: {{process: poisson, rate: 1.0e+7}}   # a burst: everything queues at once
  prompt_tokens: {{dist: uniform, min: 16, max: 160}}
  output_tokens: {{dist: uniform, min: 8, max: 200}}
  shared_prefix: {{groups: 2, tokens: 48, fraction: 0.5}}
allocators:
  - {{kind: flat, reserve: oracle}}
  - {{kind: paged, block_size: 16}}
  - {{kind: paged, block_size: 16, prefix_caching: true}}
scheduler: {{max_num_seqs: 16, max_num_batched_tokens: 256, preemption: {preemption}, swap_space: 1GiB}}
"""


def write_tiny(
    tmp_path: Path, *, budget_tokens: int = 1024, count: int = 24, preemption: str = "recompute", max_output: int = 200,
    async_scheduling: bool | None = None,
) -> Path:
    """The tiny workload; `async_scheduling` None leaves the file silent on it (async, vllm serve's default)."""
    (tmp_path / "tiny-model.json").write_text(TINY_MODEL)
    path = tmp_path / "tiny.yaml"
    text = TINY.format(budget=budget_tokens * BPT, count=count, preemption=preemption)
    if async_scheduling is not None:
        text = text.replace("swap_space: 1GiB}", f"swap_space: 1GiB, async_scheduling: {str(async_scheduling).lower()}}}")
    path.write_text(text.replace("max: 200}", f"max: {max_output}}}"))
    return path


def tiny_workload(tmp_path: Path, **kwargs):
    return load_workload(write_tiny(tmp_path, **kwargs))


def paired_runs(one, two) -> list:
    """The runs of two replays of one workload, pairwise; never an empty pairing (a loop over it proves nothing)."""
    assert len(one.runs) == len(two.runs) > 0
    return list(zip(one.runs, two.runs))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_request_finishes_and_the_budget_is_always_whole(tmp_path, async_scheduling):
    result = run_replay(tiny_workload(tmp_path, async_scheduling=async_scheduling), ReplayOptions(tensors=False), workers=1)
    assert result.workload.scheduler.async_scheduling is async_scheduling
    assert [run.label for run in result.runs] == ["flat-oracle", "paged-16", "paged-16+prefix"]
    for run in result.runs:
        assert not np.isnan(run.finished_s).any(), run.label
        assert all(reason is None for reason in run.rejected_reason)
        # Causality per request: arrival <= admission <= first token <= finish.
        assert (result.arrival_s <= run.admitted_s).all()
        assert (run.admitted_s < run.first_token_s).all() and (run.first_token_s <= run.finished_s).all()
        st = run.steps
        total = sum(st[c] for c in BYTE_COLUMNS[:5])
        assert (total == result.budget_bytes).all()
        # Rows tile the clock: each starts where the previous ended, and steps are numbered without gaps.
        ends = st["time_s"] + st["step_time_s"]
        assert (st["time_s"][1:] >= ends[:-1] - 1e-12).all()
        assert (st["step"][1:] == st["step"][:-1] + st["num_steps"][:-1]).all()
        # Every prompt token and every output token is computed (at least once).
        assert st["num_prefill_tokens"].sum() >= result.num_prompt_tokens.sum()
        # a prefill samples a request's first token, each decode step one more (none here is length-capped);
        # the prefill after a recompute preemption samples too, in place of a decode step
        decodes, preempted = st["num_decode_tokens"].sum(), st["num_preemptions"].sum()
        assert 0 <= (np.maximum(result.max_tokens, 1) - 1).sum() - decodes <= preempted


def test_paged_beats_flat_oracle_on_admission_under_a_tight_budget(tmp_path):
    result = run_replay(tiny_workload(tmp_path, budget_tokens=440, count=32), ReplayOptions(tensors=False), workers=1)
    flat, paged, prefix = result.runs
    assert paged.steps["num_running"].max() >= flat.steps["num_running"].max()
    assert flat.steps["num_preemptions"].sum() == 0  # a flat slab never grows
    assert paged.steps["num_preemptions"].sum() > 0
    assert prefix.prefix_hit_tokens > 0 and prefix.num_cached_tokens.sum() > 0


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_under_a_tight_budget_recovers(tmp_path, preemption, async_scheduling):
    workload = tiny_workload(tmp_path, budget_tokens=440, count=32, preemption=preemption, async_scheduling=async_scheduling)
    result = run_replay(workload, ReplayOptions(tensors=False), workers=1)
    paged = result.runs[1]
    assert paged.num_preemptions.sum() > 0
    assert not np.isnan(paged.finished_s).any()
    recomputed = paged.steps["num_prefill_tokens"].sum() - result.num_prompt_tokens.sum()
    if preemption == "swap":
        assert recomputed == 0
    else:
        assert recomputed > 0


def test_only_a_prompt_of_max_model_len_is_rejected_and_longer_outputs_are_capped(tmp_path):
    """As vLLM: a prompt of max_model_len (512) tokens or more is rejected with a reason; a request whose
    prompt + output would exceed it runs, its output capped at max_model_len - prompt."""
    path = write_tiny(tmp_path, count=24, budget_tokens=4096)
    path.write_text(path.read_text().replace("max: 160}", "max: 600}").replace("max: 200}", "max: 480}"))
    result = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1)
    too_long = result.num_prompt_tokens >= 512
    capped = ~too_long & (result.num_prompt_tokens + result.max_tokens > 512)
    assert too_long.any() and capped.any()
    for run in result.runs:
        reasons = np.array([r is not None for r in run.rejected_reason])
        assert (reasons == too_long).all()
        assert all("max_model_len 512" in r for r in run.rejected_reason if r is not None)
        assert np.isnan(run.finished_s[too_long]).all() and not np.isnan(run.finished_s[~too_long]).any()
        # decode tokens: every served request samples min(max_tokens, 512 - prompt) tokens, its prefill the first
        served = ~too_long
        outputs = np.minimum(result.max_tokens[served], 512 - result.num_prompt_tokens[served])
        decodes, preempted = run.steps["num_decode_tokens"].sum(), run.steps["num_preemptions"].sum()
        assert 0 <= (np.maximum(outputs, 1) - 1).sum() - decodes <= preempted


def test_parallel_workers_change_nothing(tmp_path):
    workload = tiny_workload(tmp_path, budget_tokens=440)
    one = run_replay(workload, ReplayOptions(tensors=False), workers=1)
    two = run_replay(workload, ReplayOptions(tensors=False), workers=2)
    for a, b in paired_runs(one, two):
        for name in a.steps:
            np.testing.assert_array_equal(a.steps[name], b.steps[name])
        np.testing.assert_array_equal(a.finished_s, b.finished_s)


SEEDED_GEMMA = """\
name: seeded
seed: 5
model: gemma-3-27b
kv_dtype: bf16
hardware: h100-80gb
kv_budget: 2GiB
max_model_len: 4096
requests:
  count: 40
  arrival: {process: poisson, rate: 50.0}
  prompt_tokens: {dist: uniform, min: 64, max: 3000}
  output_tokens: {dist: uniform, min: 8, max: 600}
  shared_prefix: {groups: 2, tokens: 1200, fraction: 0.7}
allocators:
  - {kind: paged, block_size: 16, prefix_caching: true}
scheduler: {max_num_seqs: 16, max_num_batched_tokens: 2048, preemption: recompute}
"""


def test_a_replay_is_the_same_under_any_hash_seed(tmp_path):
    """Block hashes are Python's hash() of token bytes, which PYTHONHASHSEED changes from process to process:
    replays in processes with different seeds (a uniform model and a mixed one, prefix caching on) write
    byte-identical reports."""
    import subprocess
    import sys

    write_tiny(tmp_path)
    (tmp_path / "seeded.yaml").write_text(SEEDED_GEMMA)
    root = Path(__file__).resolve().parents[2]
    for name in ("tiny", "seeded"):
        outs = []
        for seed in ("0", "12345"):
            out = tmp_path / f"{name}-{seed}"
            env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)}
            cmd = [sys.executable, "-m", "kvsim", "replay", str(tmp_path / f"{name}.yaml"), "--no-tensors", "-q", "--out", str(out)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            outs.append(out)
        for report in ("summary.csv", "requests.csv"):
            assert (outs[0] / report).read_bytes() == (outs[1] / report).read_bytes(), (name, report)
        assert (outs[0] / "steps.parquet").read_bytes() == (outs[1] / "steps.parquet").read_bytes(), name


def test_tensors_on_and_off_give_identical_byte_columns(tmp_path):
    workload = tiny_workload(tmp_path, budget_tokens=260, count=10, max_output=40)
    off = run_replay(workload, ReplayOptions(tensors=False), workers=1)
    on = run_replay(workload, ReplayOptions(tensors=True, device="cpu", read_every=1))
    assert on.device == "cpu"
    for a, b in paired_runs(off, on):
        for name in BYTE_COLUMNS + ("num_running", "num_steps", "num_prefill_tokens", "num_decode_tokens"):
            np.testing.assert_array_equal(a.steps[name], b.steps[name], err_msg=f"{a.label} {name}")
        assert np.isnan(a.steps["write_us"]).all()
        assert (b.steps["write_us"] > 0).all()  # every row writes new tokens
        decoding = b.steps["num_decode_tokens"] > 0
        assert (b.steps["read_us"][decoding] > 0).all() and np.isnan(b.steps["read_us"][~decoding]).all()
    assert any((run.steps["num_steps"] > 1).any() for run in on.runs)  # runs were executed step by step too


@pytest.mark.parametrize("read_every,async_scheduling", [(1, True), (10**6, True), (1, False)])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_integrity_holds_across_preemption_swap_and_prefix_sharing(tmp_path, preemption, read_every, async_scheduling):
    """Every decode reads back, through block tables or slabs, exactly what its own tokens wrote; with reads
    sampled (10**6: only the first decode step reads) the finish / swap-in / prefix-hit checks still pass; under
    async scheduling (the default) and the synchronous loop."""
    workload = tiny_workload(tmp_path, budget_tokens=260, count=10, max_output=40, preemption=preemption,
                             async_scheduling=async_scheduling)
    options = ReplayOptions(tensors=True, device="cpu", integrity=True, num_layers=2, read_every=read_every)
    result = run_replay(workload, options)
    paged, prefix = result.runs[1], result.runs[2]
    assert paged.num_preemptions.sum() > 0  # the checks did cover preemption ...
    assert prefix.prefix_hit_tokens > 0  # ... and shared prefix blocks


def test_measured_timing_drives_the_clock_with_kernel_times(tmp_path):
    workload = tiny_workload(tmp_path, count=6, max_output=30)
    result = run_replay(workload, ReplayOptions(tensors=True, device="cpu", timing="measured"))
    for run in result.runs:
        st = run.steps
        assert (st["num_steps"] == 1).all()  # no decode runs: each step has its own kernel times
        kernels = np.nan_to_num(st["write_us"]) + np.nan_to_num(st["read_us"]) + np.nan_to_num(st["attention_us"])
        scale = 2 / 1  # the model's attention layers over the one materialised
        assert st["step_time_s"] == pytest.approx(kernels * 1e-6 * scale, rel=1e-6, abs=1e-7)
        assert run.num_read_samples < (st["num_decode_tokens"] > 0).sum()  # reads sampled on a CPU ...
        decoding = st["num_decode_tokens"] > 0
        assert np.isfinite(st["read_us"][decoding]).all()  # ... and every decode step still has a read time


def test_measured_timing_scales_unsampled_reads_by_context_tokens(tmp_path):
    # A step without a read is given the last sampled read's µs per context token times its own tokens.
    from kvsim.replay.runner import ModelRunner

    workload = tiny_workload(tmp_path, count=3, max_output=30)
    result = run_replay(workload, ReplayOptions(tensors=True, device="cpu", timing="measured", read_every=7), workers=1)
    assert "reads timed every 7 decode steps" in result.note
    for run in result.runs:
        st = run.steps
        rows = np.flatnonzero(st["num_decode_tokens"] > 0)
        assert 0 < run.num_read_samples < len(rows)
        assert np.isfinite(st["read_us"][rows]).all() and (st["read_us"][rows] > 0).all()
    assert ModelRunner.__init__.__kwdefaults__["estimate_reads"] is False  # roofline replays never estimate


def test_options_that_need_tensors_say_so():
    from kvsim.errors import KvsimError

    with pytest.raises(KvsimError, match="--timing"):
        ReplayOptions(tensors=False, timing="measured")
    with pytest.raises(KvsimError, match="--integrity"):
        ReplayOptions(tensors=False, integrity=True)
    with pytest.raises(KvsimError, match="roofline, measured, kernels-db or auto"):
        ReplayOptions(timing="wall")
    with pytest.raises(KvsimError, match="--read-every"):
        ReplayOptions(read_every=0)
    assert ReplayOptions(timing="measured", read_every=2).read_every == 2  # steps between scaled from the last read


def test_integrity_catches_kv_swapped_back_into_the_wrong_slots(tmp_path, monkeypatch):
    """The check above can fail: swap KV back in reversed order and the next read of that request trips it."""
    from kvsim.engine.tensors.cache import KVCache

    original = KVCache.swap_in

    def reversed_swap_in(self, handle, slots):
        return original(self, handle, slots[::-1].copy())

    monkeypatch.setattr(KVCache, "swap_in", reversed_swap_in)
    workload = tiny_workload(tmp_path, budget_tokens=260, count=10, max_output=40, preemption="swap")
    with pytest.raises(AssertionError, match="integrity"):
        run_replay(workload, ReplayOptions(tensors=True, device="cpu", integrity=True, read_every=1))
    with pytest.raises(AssertionError, match=r"integrity: .*\(slot \d+\)"):  # no sampled read: the swap-in check
        run_replay(workload, ReplayOptions(tensors=True, device="cpu", integrity=True, read_every=10**6))


@pytest.mark.parametrize("fault", ["lost_write", "overwrite"])
def test_integrity_without_reads_still_catches_lost_and_overwritten_kv(tmp_path, monkeypatch, fault):
    """Reads sampled away entirely, integrity still sees a decode step whose write never happened, and KV
    overwritten behind a request's back (here: the whole pool zeroed whenever a request finishes)."""
    from kvsim.engine.tensors.cache import KVCache

    if fault == "lost_write":
        original = KVCache.write_steps

        def write_steps(self, slots, seq_ids, positions):
            return original(self, slots[:, 1:], seq_ids[1:], positions[:, 1:])  # one request's run is lost

        monkeypatch.setattr(KVCache, "write_steps", write_steps)
    else:
        monkeypatch.setattr(KVCache, "forget", lambda self, seq_id: self.kv_cache.zero_())
    workload = tiny_workload(tmp_path, budget_tokens=260, count=10, max_output=40)
    with pytest.raises(AssertionError, match="integrity"):
        run_replay(workload, ReplayOptions(tensors=True, device="cpu", integrity=True, read_every=10**6), workers=1)


@pytest.mark.parametrize("every", [1, 3, 40])
def test_reads_are_sampled_every_nth_decode_step_and_writes_every_step(tmp_path, every):
    """Decode steps 0, N, 2N, ... of each allocator read and attend (ceil(decode steps / N) samples);
    every row still writes; byte columns do not move."""
    workload = tiny_workload(tmp_path, count=12, max_output=60)
    off = run_replay(workload, ReplayOptions(tensors=False), workers=1)
    on = run_replay(workload, ReplayOptions(tensors=True, device="cpu", read_every=every))
    assert on.options.read_every == every
    for a, b in paired_runs(off, on):
        st = b.steps
        for name in BYTE_COLUMNS:
            np.testing.assert_array_equal(a.steps[name], st[name], err_msg=f"{a.label} {name}")
        decoding = st["num_decode_tokens"] > 0
        decode_steps = int(st["num_steps"][decoding].sum())
        assert b.num_read_samples == -(-decode_steps // every)
        assert (st["write_us"] > 0).all()
        # the rows holding a sampled step: decode step index d in [first, first + k) with d % every == 0
        first = np.cumsum(np.where(decoding, st["num_steps"], 0)) - np.where(decoding, st["num_steps"], 0)
        sampled = decoding & ((first + st["num_steps"] - 1) // every >= -(-first // every))
        assert (st["read_us"][sampled] > 0).all() and np.isnan(st["read_us"][~sampled]).all()
        assert (st["attention_us"][sampled] > 0).all() and np.isnan(st["attention_us"][~sampled]).all()


def test_no_tensors_never_imports_torch(tmp_path):
    import subprocess
    import sys

    path = write_tiny(tmp_path, count=4)
    code = (
        "import sys; from kvsim.replay.run import run_replay; from kvsim.replay.options import ReplayOptions; "
        "from kvsim.workload.spec import load_workload; "
        f"run_replay(load_workload({str(path)!r}), ReplayOptions(tensors=False)); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_auto_device_without_cuda_is_cpu_tensors_with_sampled_reads(tmp_path):
    from kvsim.replay.options import CPU_READ_EVERY

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("auto picks the GPU here")
    result = run_replay(tiny_workload(tmp_path, count=4), ReplayOptions(device="auto"))
    assert result.device == "cpu" and result.options.tensors and result.options.num_layers == 1
    assert result.options.read_every == CPU_READ_EVERY and f"every {CPU_READ_EVERY} decode steps" in result.note
    for run in result.runs:
        assert (run.steps["write_us"] > 0).all()
        assert run.num_read_samples == 1  # a tiny replay has fewer decode steps than CPU_READ_EVERY: step 0 only


@pytest.mark.gpu
def test_cuda_tensors_match_accounting_and_keep_integrity(tmp_path):
    workload = tiny_workload(tmp_path, budget_tokens=260, count=10, max_output=40, preemption="swap")
    off = run_replay(workload, ReplayOptions(tensors=False), workers=1)
    on = run_replay(workload, ReplayOptions(tensors=True, device="cuda", integrity=True))
    assert on.device.startswith("cuda")
    for a, b in paired_runs(off, on):
        for name in BYTE_COLUMNS:
            np.testing.assert_array_equal(a.steps[name], b.steps[name], err_msg=f"{a.label} {name}")
        assert (b.steps["write_us"] > 0).all()


@pytest.mark.parametrize(
    "old, new, message",
    [
        # the catalogue's errors named --model / --gpu / --memory, flags a workload user never typed
        ("model: tiny-model.json", "model: gpt-17", "tiny.yaml: model: unknown model 'gpt-17'"),
        ("model: tiny-model.json", "model: nope/config.json", "tiny.yaml: model: {dir}/nope/config.json: cannot read config"),
        ("hardware: h100-80gb", "hardware: tpu-v9", "tiny.yaml: hardware: unknown GPU 'tpu-v9' (known: h100-80gb"),
        ("kv_budget: 262144", "gpu_memory_utilization: 0.0000001",
         "tiny.yaml: gpu_memory_utilization: 85,029,158,912 B x 1e-07 = 8,503 B leaves no KV cache memory after"),
    ],
)
def test_unknown_model_hardware_and_no_room_name_the_workload_field(tmp_path, old, new, message):
    from kvsim.errors import KvsimError

    path = write_tiny(tmp_path)
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))
    with pytest.raises(KvsimError) as err:
        run_replay(load_workload(path), ReplayOptions(tensors=False))
    assert str(err.value).startswith(f"{path}: ") and message.format(dir=tmp_path) in str(err.value)
    assert "--" not in str(err.value).split("(")[0]  # no flag name before any hint


def test_a_mistyped_device_is_an_error_even_without_tensors():
    from kvsim.errors import KvsimError

    with pytest.raises(KvsimError, match=r"^--device: unknown device 'tpu' \(choose cpu, cuda, cuda:N or auto\)$"):
        ReplayOptions(device="tpu", tensors=False)
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        assert ReplayOptions(device=device, tensors=False).device == device


def test_layers_beyond_the_model_and_a_pool_too_big_for_memory_name_the_flag(tmp_path, monkeypatch):
    """--layers 1000 on a 2-layer model tried to allocate 1000 layers (and would time them as the model's 2);
    the free-memory refusal named `num_layers`, the cache's argument, not the flag."""
    from kvsim.engine.tensors import cache
    from kvsim.errors import KvsimError

    workload = tiny_workload(tmp_path, count=2)
    with pytest.raises(KvsimError, match=r"^--layers: \S+ has 2 attention layers; materialise at most that many, got 3$"):
        run_replay(workload, ReplayOptions(device="cpu", num_layers=3), workers=1)
    monkeypatch.setattr(cache, "free_memory_bytes", lambda device: 1000)
    with pytest.raises(KvsimError, match=r"^--layers: the KV pool needs .* but cpu has 1000 B free"):
        run_replay(workload, ReplayOptions(device="cpu", num_layers=2), workers=1)


SLIDING_MODEL = TINY_MODEL.replace('"model_type": "llama"', '"model_type": "mistral"').replace(
    '"torch_dtype"', '"sliding_window": 32, "torch_dtype"'
)


def test_integrity_holds_for_a_sliding_window_model_swapped_out_and_back(tmp_path):
    """Every layer slides (Mistral-style): blocks behind the window are freed while decoding, a swap-out drops
    them, and the swap-in's integrity check must cover the window only (it used to flag position 0)."""
    (tmp_path / "tiny-model.json").write_text(SLIDING_MODEL)
    text = TINY.format(budget=300 * BPT, count=10, preemption="swap").replace("max: 200}", "max: 160}")
    text = text.replace("  - {kind: paged, block_size: 16, prefix_caching: true}\n", "")
    text = text.replace("  shared_prefix: {groups: 2, tokens: 48, fraction: 0.5}\n", "")
    path = tmp_path / "sliding.yaml"
    path.write_text(text)
    options = ReplayOptions(tensors=True, device="cpu", integrity=True, num_layers=2, read_every=1)
    result = run_replay(load_workload(path), options)
    paged = result.runs[1]
    assert paged.num_preemptions.sum() > 0  # swaps happened, after the window had freed blocks
    assert all(reason is None for reason in paged.rejected_reason)


def test_async_scheduling_replays_every_request_with_intact_kv(tmp_path):
    """`scheduler: {async_scheduling: true}` (vLLM's AsyncScheduler): under pressure every request finishes,
    the KV written and read in the pool stays intact (integrity), and the budget always adds up."""
    path = write_tiny(tmp_path, budget_tokens=440, count=10)
    path.write_text(path.read_text().replace("swap_space: 1GiB}", "swap_space: 1GiB, async_scheduling: true}"))
    workload = load_workload(path)
    assert workload.scheduler.async_scheduling
    options = ReplayOptions(tensors=True, device="cpu", integrity=True, num_layers=1, read_every=50)
    result = run_replay(workload, options, workers=1)
    for run in result.runs:
        assert not np.isnan(run.finished_s).any(), run.label
        st = run.steps
        total = sum(st[c] for c in BYTE_COLUMNS[:5])
        assert (total == result.budget_bytes).all()
    assert sum(run.steps["num_preemptions"].sum() for run in result.runs) > 0


def test_prefill_saved_counts_first_admissions_and_the_hit_rate_every_admission(tmp_path):
    """Recompute preemptions re-admit requests that find their own blocks: the hit rate counts those lookups,
    the prefill saved only the prompt tokens served from the cache at each request's first admission."""
    result = run_replay(tiny_workload(tmp_path, budget_tokens=512, count=24), ReplayOptions(tensors=False), workers=1)
    prefix = next(r for r in result.runs if r.config.prefix_caching)
    assert prefix.steps["num_preemptions"].sum() > 0  # re-admissions happened
    from kvsim.replay.reports import summary_records

    rec = next(r for r in summary_records(result) if r["allocator"] == prefix.label)
    admitted = ~np.isnan(prefix.admitted_s)
    assert rec["prefill_tokens_saved"] == prefix.num_cached_tokens.sum() > 0
    assert rec["prefill_saved_pct"] == pytest.approx(100 * rec["prefill_tokens_saved"] / result.num_prompt_tokens[admitted].sum())
    # Every first-admission hit is whole shared-prefix blocks: 48 tokens = 3 blocks of 16, or none.
    assert set(prefix.num_cached_tokens[admitted].tolist()) <= {0, 16, 32, 48}
    # The hit tokens include the first admissions' and the re-admissions' own blocks.
    assert prefix.prefix_hit_tokens > rec["prefill_tokens_saved"]
    plain = next(r for r in summary_records(result) if r["allocator"] == "paged-16")
    assert plain["prefill_tokens_saved"] == 0 and plain["prefill_saved_pct"] == 0


def test_padding_reaches_the_steps_and_summary_of_a_mixed_model(tmp_path):
    """gemma-3-27b's paged pool pads (padding layers of its sliding groups): a share of internal fragmentation
    at every row, time-averaged in the summary; a flat slab and a one-group model have none."""
    from kvsim.replay.reports import summary_records

    path = Path(__file__).parents[2] / "workloads" / "sliding-window.yaml"
    result = run_replay(load_workload(path, limit=12), ReplayOptions(tensors=False), workers=1)
    recs = {r["allocator"]: r for r in summary_records(result)}
    for run in result.runs:
        st = run.steps
        assert (st["padding_bytes"] <= st["internal_fragmentation_bytes"]).all()
        dt = st["step_time_s"]
        expected = 100 * (st["padding_bytes"] * dt).sum() / dt.sum() / run.budget_bytes
        assert recs[run.label]["padding_pct"] == pytest.approx(expected)
    paged = next(r for r in result.runs if r.config.kind == "paged")
    assert paged.steps["padding_bytes"].max() > 0 and recs[paged.label]["padding_pct"] > 0
    assert all(recs[r.label]["padding_pct"] == 0 for r in result.runs if r.config.kind == "flat")
    tiny = run_replay(tiny_workload(tmp_path), ReplayOptions(tensors=False), workers=1)
    assert all((r.steps["padding_bytes"] == 0).all() for r in tiny.runs)


def test_a_max_model_len_past_the_models_own_is_refused_as_vllm_does(tmp_path):
    """vLLM refuses a max_model_len above the config's length; the replay used to size and run it silently."""
    from kvsim.errors import KvsimError

    path = write_tiny(tmp_path)
    path.write_text(path.read_text().replace("max_model_len: 512", "max_model_len: 4096"))
    with pytest.raises(KvsimError) as err:
        run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1)
    assert str(err.value) == f"{path}: max_model_len: 4,096 is more than tiny-model serves (2,048 tokens, from its config.json)"
    path.write_text(path.read_text().replace("max_model_len: 4096", "max_model_len: 2048"))  # its own length is fine
    assert run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1).runs


def test_prefix_caching_on_a_mixed_model_replays_where_modelled_and_is_refused_naming_file_and_allocator_where_not(tmp_path):
    """Sliding-window groups cache prefixes (gpt-oss), state groups in mamba_cache_mode align (qwen3-next);
    chunked-local groups do not yet (llama-4-scout): refused before anything runs, naming the file and the
    allocator, with the engine's own reason (it was `prefix_caching: ...`)."""
    from kvsim.errors import KvsimError

    path = write_tiny(tmp_path)
    text = path.read_text().replace(f"kv_budget: {1024 * BPT}", "kv_budget: 1GiB")
    path.write_text(text.replace("model: tiny-model.json", "model: gpt-oss-120b"))
    runs = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1).runs
    assert [run.label for run in runs][2].endswith("+prefix") and runs[2].prefix_query_tokens > 0
    text = text.replace("{kind: paged, block_size: 16}", "{kind: paged, block_size: 16, prefix_caching: false}")
    path.write_text(text.replace("model: tiny-model.json", "model: qwen3-next-80b-a3b"))
    runs = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1).runs
    assert [run.label for run in runs][1:] == ["paged-16", "paged-16+prefix"] and runs[2].prefix_query_tokens > 0
    path.write_text(text.replace("model: tiny-model.json", "model: llama-4-scout"))
    with pytest.raises(KvsimError) as err:
        run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1)
    assert str(err.value) == (f"{path}: allocators[2].prefix_caching: llama-4-scout: prefix caching is not modelled for "
                              "models with chunked layer groups (chunked-local hits are not built); "
                              "drop prefix_caching for it")


def test_a_hybrid_model_replays_with_vllm_serves_prefix_caching_unless_the_file_turns_it_off(tmp_path):
    """vllm serve runs a hybrid model with prefix caching (mamba_cache_mode align); a workload that leaves
    `prefix_caching` out gets it, and two allocators that vllm serve's defaults make the same are refused."""
    from kvsim.errors import KvsimError

    path = write_tiny(tmp_path)
    text = path.read_text().replace(f"kv_budget: {1024 * BPT}", "kv_budget: 1GiB").replace("model: tiny-model.json", "model: qwen3-next-80b-a3b")
    path.write_text(text)
    with pytest.raises(KvsimError) as err:
        run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1)
    assert str(err.value) == (f"{path}: allocators[2]: is allocators[1] (paged-16+prefix) under vllm serve's defaults for "
                              "qwen3-next-80b-a3b (prefix caching on for a hybrid model): set prefix_caching on one of them")
    path.write_text(text.replace("  - {kind: paged, block_size: 16, prefix_caching: true}\n", ""))
    runs = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1).runs
    assert [run.label for run in runs] == ["flat-oracle", "paged-16+prefix"] and runs[1].prefix_query_tokens > 0


def test_mamba_cache_mode_on_a_model_without_state_layers_is_refused_not_read_as_prefix_caching(tmp_path):
    """vLLM ignores mamba_cache_mode where no layer keeps a state; kvsim read align as prefix caching on there."""
    from kvsim.errors import KvsimError

    path = write_tiny(tmp_path)
    text = path.read_text().replace("  - {kind: paged, block_size: 16, prefix_caching: true}\n", "")
    path.write_text(text.replace("{kind: paged, block_size: 16}", "{kind: paged, block_size: 16, mamba_cache_mode: align}"))
    with pytest.raises(KvsimError) as err:
        run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1)
    assert str(err.value) == (f"{path}: allocators[1].mamba_cache_mode: tiny-model has no state layers (mamba, gated "
                              "delta net), and vLLM ignores the mode there: set prefix_caching instead")
    hybrid = text.replace(f"kv_budget: {1024 * BPT}", "kv_budget: 1GiB").replace("model: tiny-model.json", "model: qwen3-next-80b-a3b")
    path.write_text(hybrid.replace("{kind: paged, block_size: 16}", "{kind: paged, block_size: 16, mamba_cache_mode: none}"))
    runs = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1).runs
    assert [run.label for run in runs] == ["flat-oracle", "paged-16"]  # where it applies, it is read as before


def test_a_config_without_a_parameter_count_is_refused_without_pointing_at_a_flag_replay_lacks(tmp_path):
    """The size command's advice ("give --params") was passed on to a workload, which has no such option."""
    from kvsim.errors import KvsimError

    path = write_tiny(tmp_path)
    config = tmp_path / "tiny-model.json"
    config.write_text(config.read_text().replace('"vocab_size": 1000,', ""))
    with pytest.raises(KvsimError) as err:
        run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1)
    assert str(err.value) == (
        f"{path}: model: {config}: the parameter count of tiny-model is unknown, and the replay's clock needs its weight "
        "bytes (a workload has no --params): use a catalogue model, or for a plain decoder give the config.json "
        "vocab_size and intermediate_size to count them from"
    )


@pytest.mark.parametrize("model", ["tiny", "sliding"])
@pytest.mark.parametrize("rate", ["1.0e+7", "3.0e+3"])
def test_async_decode_runs_give_the_step_by_step_replay(tmp_path, monkeypatch, rate, model):
    """Async scheduling: the replay with decode runs (one step in flight) and the one stepping each decode agree on
    every request's admission, first token and finish (to float rounding of the run times), preemptions and cached
    tokens, and on the steps; arrivals come during runs (3,000/s: a run stops before the step that would admit one,
    and the step after the run sees it) or all at once (a burst). A sliding-window model frees blocks while it
    decodes: a queue head that failed to fit may fit a step later, so no run waits it out."""
    from kvsim.replay.sched.scheduler import Scheduler

    path = write_tiny(tmp_path, budget_tokens=440, count=24)
    if model == "sliding":
        (tmp_path / "tiny-model.json").write_text(SLIDING_MODEL)
    text = path.read_text().replace("swap_space: 1GiB}", "swap_space: 1GiB, async_scheduling: true}")
    path.write_text(text.replace("rate: 1.0e+7", f"rate: {rate}"))
    workload = load_workload(path)
    with_runs = run_replay(workload, ReplayOptions(tensors=False), workers=1)
    monkeypatch.setattr(Scheduler, "_extend_async_decode_run", lambda *args: None)
    stepped = run_replay(workload, ReplayOptions(tensors=False), workers=1)
    for a, b in zip(with_runs.runs, stepped.runs):
        runs = not (model == "sliding" and "prefix" in a.label)  # a window's prefix caching steps one by one
        assert (a.steps["num_steps"] > 1).any() == runs and (b.steps["num_steps"] == 1).all(), a.label
        assert a.steps["num_steps"].sum() == b.steps["num_steps"].sum(), a.label
        for name in ("admitted_s", "first_token_s", "finished_s"):
            np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-9, err_msg=f"{a.label} {name}")
        np.testing.assert_array_equal(a.num_preemptions, b.num_preemptions)
        np.testing.assert_array_equal(a.num_cached_tokens, b.num_cached_tokens)
        assert (a.prefix_hit_tokens, a.prefix_query_tokens) == (b.prefix_hit_tokens, b.prefix_query_tokens)
    if rate == "1.0e+7" and model == "tiny":
        assert sum(run.num_preemptions.sum() for run in stepped.runs) > 0


def test_the_heap_before_a_replay_is_frozen_while_it_runs_and_handed_back_after(tmp_path):
    """The collector's full passes skip what was alive before the replays (modules, the request stream); a freeze
    the caller made is its own, left in force."""
    import gc

    workload = tiny_workload(tmp_path, count=4)
    seen = []
    run_replay(workload, ReplayOptions(tensors=False), workers=1, progress=lambda *_: seen.append(gc.get_freeze_count()))
    assert seen and min(seen) > 0 and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        run_replay(workload, ReplayOptions(tensors=False), workers=1)
        assert gc.get_freeze_count() > 0  # not handed back by the replay (frozen objects freed since leave the count)
    finally:
        gc.unfreeze()


def test_a_workload_without_kv_dtype_takes_vllm_serves_auto(tmp_path, cli):
    # auto: the model's dtype, or the fp8 KV cache a checkpoint's quantization_config asks for (vLLM 0.33)
    path = write_tiny(tmp_path)
    path.write_text(path.read_text().replace("kv_dtype: bf16\n", ""))
    plain = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1)
    assert plain.workload.kv_dtype == "bf16"  # torch_dtype bfloat16
    config = json.loads(TINY_MODEL)
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    (tmp_path / "tiny-model.json").write_text(json.dumps(config))
    fp8 = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1)
    assert fp8.workload.kv_dtype == "fp8"
    # the same budget holds twice the tokens: more requests run at once in the paged pool
    assert max(fp8.runs[1].steps["num_running"]) > max(plain.runs[1].steps["num_running"])
    assert run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1).workload.kv_dtype == "fp8"
    # an nvfp4 KV cache is refused by name, with the file and its field
    config["quantization_config"]["kv_cache_quant_algo"] = "NVFP4"
    (tmp_path / "tiny-model.json").write_text(json.dumps(config))
    result = cli(["replay", str(path), "--no-tensors", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith(f"kvsim: error: {path}: kv_dtype: ") and "nvfp4 KV cache" in line
    # an explicit kv_dtype wins, as vLLM's --kv-cache-dtype does
    path.write_text(path.read_text().replace("hardware:", "kv_dtype: bf16\nhardware:"))
    assert run_replay(load_workload(path), ReplayOptions(tensors=False), workers=1).workload.kv_dtype == "bf16"
