"""Reports: hand-checked summary figures, file contents and columns, byte-identical summary.csv per seed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from kvsim.engine.factory import AllocatorConfig
from kvsim.replay.run import run_replay
from kvsim.replay.options import ReplayOptions
from kvsim.replay.records import STEP_COLUMNS, AllocatorRun, ReplayResult
from kvsim.replay.reports import requests_frame, summary_records, write_reports
from kvsim.workload.spec import SchedulerConfig, load_workload

from tests.replay.test_replay import write_tiny


def hand_result() -> ReplayResult:
    """Two rows over a 100-byte budget (1 s then 3 s), three requests (one rejected)."""
    steps = {name: np.zeros(2, dtype=np.int64 if code == "q" else np.float64) for name, code in STEP_COLUMNS}
    steps.update(
        step=np.array([0, 1]), num_steps=np.array([1, 4]), time_s=np.array([0.0, 1.0]), step_time_s=np.array([1.0, 3.0]),
        num_running=np.array([1, 3]), num_prefill_tokens=np.array([30, 0]), num_decode_tokens=np.array([0, 12]),
        token_states_bytes=np.array([10, 50]), reservation_bytes=np.array([20, 10]),
        internal_fragmentation_bytes=np.array([0, 20]), external_fragmentation_bytes=np.array([0, 0]),
        free_bytes=np.array([70, 20]), shared_saved_bytes=np.array([0, 8]), num_preemptions=np.array([0, 2]),
        padding_bytes=np.array([0, 12]), write_us=np.array([5.0, 100.0]), read_us=np.array([np.nan, 40.0]), attention_us=np.array([np.nan, np.nan]),
    )
    run = AllocatorRun(
        config=AllocatorConfig("paged", block_size=16, prefix_caching=True), label="paged-16+prefix", budget_bytes=100,
        steps=steps,
        admitted_s=np.array([0.0, 0.5, np.nan]), first_token_s=np.array([1.0, 2.0, np.nan]),
        finished_s=np.array([3.0, 4.0, np.nan]), num_preemptions=np.array([0, 2, 0]),
        num_cached_tokens=np.array([0, 16, 0]), rejected_reason=[None, None, "too long"],
        prefix_query_tokens=40, prefix_hit_tokens=10,
    )
    workload = SimpleNamespace(name="hand", seed=7, path=Path("hand.yaml"), sha256="ab" * 32, max_model_len=25, kv_dtype="bf16",
                               scheduler=SchedulerConfig())
    return ReplayResult(
        workload=workload, model_name="m", hardware_name="g", budget_bytes=100, device="none",
        options=ReplayOptions(tensors=False), arrival_s=np.array([0.0, 0.5, 0.7]),
        num_prompt_tokens=np.array([10, 20, 900]), max_tokens=np.array([4, 8, 1]), runs=[run],
    )


def test_summary_figures_by_hand():
    (rec,) = summary_records(hand_result())
    # Time-weighted over 1 s and 3 s, as % of 100 bytes: (10*1 + 50*3) / 4 = 40.
    assert rec["token_states_pct"] == pytest.approx(40.0)
    assert rec["reservation_pct"] == pytest.approx((20 + 30) / 4)
    assert rec["internal_fragmentation_pct"] == pytest.approx(60 / 4)
    assert rec["free_pct"] == pytest.approx((70 + 60) / 4)
    assert rec["shared_saved_pct"] == pytest.approx(24 / 4)
    assert rec["mean_running"] == pytest.approx((1 + 9) / 4) and rec["peak_running"] == 3
    assert rec["num_steps"] == 5 and rec["preemptions"] == 2
    assert rec["async_scheduling"] is True  # the loop that ran: a workload's default, vllm serve's
    assert rec["finished"] == 2 and rec["rejected"] == 1 and rec["sim_time_s"] == 4.0
    # Output tokens of finished requests: 4, and 8 capped at max_model_len 25 - prompt 20 = 5 (as vLLM caps it).
    assert rec["throughput_tokens_per_s"] == pytest.approx((4 + 5) / 4.0)
    assert rec["computed_tokens_per_s"] == pytest.approx(42 / 4.0)
    # TTFT 1.0 and 1.5; TPOT over the tokens after the first (vLLM's): (3-1)/(4-1) and (4-2)/(5-1).
    assert rec["ttft_p50_s"] == pytest.approx(1.25) and rec["ttft_p99_s"] == pytest.approx(1.0 + 0.5 * 0.99)
    assert rec["tpot_p50_s"] == pytest.approx((2 / 3 + 0.5) / 2)
    assert rec["prefix_hit_rate"] == pytest.approx(0.25)
    # Page padding, a part of internal fragmentation: (0*1 + 12*3) / 4 of 100 bytes.
    assert rec["padding_pct"] == pytest.approx(9.0) and rec["padding_pct"] <= rec["internal_fragmentation_pct"]
    # Prefill saved: 16 cached tokens at first admission of the admitted prompts' 10 + 20 (the rejected 900 not).
    assert rec["prefill_tokens_saved"] == 16 and rec["prefill_saved_pct"] == pytest.approx(100 * 16 / 30)
    # Kernel columns are per step; row 1 stands for 4 steps: writes [5, 100, 100, 100, 100], reads [40] x 4.
    assert rec["write_us_p50"] == 100.0 and rec["write_us_p90"] == 100.0 and rec["read_us_p50"] == 40.0
    assert math.isnan(rec["attention_us_p50"])


def test_requests_frame_columns_and_latencies():
    frame = requests_frame(hand_result())
    assert list(frame.columns) == [
        "allocator", "request_id", "arrival_s", "admitted_s", "first_token_s", "finished_s", "num_prompt_tokens",
        "max_tokens", "num_output_tokens", "num_preemptions", "num_cached_tokens", "ttft_s", "tpot_s", "rejected_reason",
    ]
    assert frame["ttft_s"].tolist()[:2] == [1.0, 1.5]
    assert frame["num_output_tokens"].tolist() == [4, 5, 0]  # capped by max_model_len; the rejected prompt has no room
    assert frame["tpot_s"].tolist()[:2] == pytest.approx([2 / 3, 0.5])
    assert frame["rejected_reason"].isna().tolist() == [True, True, False]
    assert frame["rejected_reason"].iloc[2] == "too long"


def test_write_reports_files(tmp_path):
    workload = load_workload(write_tiny(tmp_path, count=8))
    result = run_replay(workload, ReplayOptions(tensors=False), workers=1)
    paths = write_reports(result, tmp_path / "out", csv=True, command="kvsim replay tiny.yaml")
    steps = pd.read_parquet(paths.steps)
    assert list(steps.columns) == ["allocator"] + [name for name, _ in STEP_COLUMNS if not name.endswith("_us")]
    assert len(steps) == sum(len(run.steps["step"]) for run in result.runs)
    assert steps["token_states_bytes"].dtype == np.int64
    steps_csv = pd.read_csv(paths.steps_csv)
    assert (steps_csv["free_bytes"].to_numpy() == steps["free_bytes"].to_numpy()).all()
    requests = pd.read_csv(paths.requests)
    assert len(requests) == 8 * len(result.runs)
    summary = pd.read_csv(paths.summary_csv)
    assert summary["allocator"].tolist() == ["flat-oracle", "paged-16", "paged-16+prefix"]
    assert not any(c.endswith("_us_p50") for c in summary.columns)  # no wall-clock figure in summary.csv
    records = json.loads(paths.summary_json.read_text())
    assert [r["allocator"] for r in records] == summary["allocator"].tolist()
    assert not any(k.endswith("_us_p50") for k in records[0])  # measured times: kernels.json's, with tensors
    assert paths.kernels is None and not (tmp_path / "out" / "kernels.json").exists()
    assert "platform" not in paths.meta.read_text() and "platform" in json.loads(paths.host.read_text())
    meta = json.loads(paths.meta.read_text())
    assert meta["workload_sha256"] == workload.sha256 and meta["seed"] == 3 and meta["device"] == "none"
    assert meta["command"] == "kvsim replay tiny.yaml" and meta["kvsim_version"]
    assert meta["scheduler"] == "vLLM v1 0.33.0"  # the version whose scheduler the replay follows


def test_same_seed_gives_a_byte_identical_summary_csv(tmp_path):
    path = write_tiny(tmp_path, budget_tokens=440, count=16)
    outputs = []
    for run_dir, workers in (("a", 1), ("b", 2)):
        result = run_replay(load_workload(path), ReplayOptions(tensors=False), workers=workers)
        outputs.append(write_reports(result, tmp_path / run_dir).summary_csv.read_bytes())
    assert outputs[0] == outputs[1]
    other = run_replay(load_workload(path, seed=4), ReplayOptions(tensors=False), workers=1)
    assert write_reports(other, tmp_path / "c").summary_csv.read_bytes() != outputs[0]


def test_a_one_token_request_has_no_tpot():
    result = hand_result()
    result.max_tokens[0] = 1  # its only token is the first: no decode step to time
    frame = requests_frame(result)
    assert math.isnan(frame["tpot_s"].iloc[0]) and frame["tpot_s"].iloc[1] == pytest.approx(0.5)
    assert summary_records(result)[0]["tpot_p50_s"] == pytest.approx(0.5)  # the NaN is left out, not counted as 0
